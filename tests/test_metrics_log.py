"""metrics.jsonl and loss.png (acco/metrics.py): a log that a kill or a full disk cut short mid-line
still resumes and plots; a run's eval losses are drawn where they are, also a single one (a short
run's only evaluation), which a dashed line alone would not show; the console prints the last
update whatever log_step."""

from __future__ import annotations

import json
import re

import matplotlib.figure
import pytest
import torch

from acco.engine import UpdateRecord
from acco.messages import size_text
from acco.metrics import RunLog, _truncate_after, plot_runs, read_metrics


def test_a_log_cut_short_mid_line_resumes_and_reads(tmp_path):
    log = tmp_path / "metrics.jsonl"
    rows = [{"type": "train", "step": s, "loss": 1.0} for s in range(1, 5)]
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    log.write_text(whole + json.dumps({"type": "train", "step": 5})[:9])  # update 5's line, cut short
    assert [e["step"] for e in read_metrics(tmp_path)[0]] == [1, 2, 3, 4]
    _truncate_after(log, 3)  # a resume from update 3
    assert log.read_text() == "".join(json.dumps(r) + "\n" for r in rows[:3])
    log.write_text(whole.replace('"step": 2,', '"step": 2'))  # damaged inside: said, not dropped
    with pytest.raises(ValueError, match="metrics.jsonl: line 2 is not a JSON record"):
        _truncate_after(log, 3)


def test_a_single_evaluation_is_drawn_as_a_point(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"type": "train", "step": s, "samples": 4 * s, "loss": 3.0 - 0.1 * s, "wall_time": 0.5 * s}
            for s in range(1, 5)]  # fmt: skip
    rows.append({"type": "eval", "step": 4, "samples": 16, "eval_loss": 2.7})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    plot_runs({"acco": run}, tmp_path / "loss.png")
    by_samples, by_time = figures[0].axes
    for ax, x in ((by_samples, 16), (by_time, 2.0)):
        (evals,) = [line for line in ax.get_lines() if line.get_label() == "acco eval"]
        assert list(evals.get_xdata()) == [x] and list(evals.get_ydata()) == [2.7]
        assert evals.get_marker() not in (None, "None", "", " ")  # a point, not an invisible line


@pytest.mark.parametrize("updates, printed", [(7, [1, 3, 6, 7]), (6, [1, 3, 6])])
def test_the_console_prints_every_log_step_and_the_last_update(tmp_path, capsys, updates, printed):
    log = RunLog(str(tmp_path), rank=0, world_size=1, tokens_per_micro_batch=8, log_every=3)
    log.start_progress(2 * updates)  # not a terminal (captured): a line first, then plain lines
    for step in range(1, updates + 1):
        log.update(UpdateRecord(step=step, committed_micro_batches=2 * step, loss=1.0, lr=1e-3,
                                micro_batches=[2], wall_time=float(step)))
    log.close(log.summary("ddp", torch.device("cpu")))
    out = capsys.readouterr().out
    assert out.startswith(f"training: 1 worker(s), 8 tokens per micro-batch, a budget of {2 * updates} "
                          "micro-batches; a line every 3 updates\n")
    lines = [line.split() for line in out.splitlines() if line.startswith("step")]
    assert [int(words[1]) for words in lines] == printed
    assert (size_text(2.49e9), size_text(0.07e9), size_text(3.2e6)) == ("2.49 GB", "70.0 MB", "3.2 MB")


@pytest.mark.parametrize("async_save", [True, False])
def test_an_updates_line_comes_before_its_evaluation_and_its_checkpoint(tmp_path, capsys, async_save):
    """The last update (8) is not a log step: its line is printed before the final evaluation's
    and the final checkpoint's, not after them with the run's summary; an evaluation inside the run
    (update 3) gets its update's line first too."""
    from trainer_helpers import tiny_args, tiny_data, tiny_model

    from acco.trainer import DecoupledTrainer

    args = tiny_args("ddp", tmp_path / "run", nb_steps_tot=16, eval=True, eval_step=3, save_step=0,
                     log_step=5, async_save=async_save)  # fmt: skip
    DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train()
    said = [(m.group(1).split()[0], int(m.group(2))) for line in capsys.readouterr().out.splitlines()
            if (m := re.match(r"(step|eval  step|checkpoint)[ -]+(\d+)", line))]  # fmt: skip
    assert said == [("step", 1), ("step", 3), ("eval", 3), ("step", 5), ("step", 6), ("eval", 6),
                    ("step", 8), ("eval", 8), ("checkpoint", 8)]  # fmt: skip
