"""Each method's default configuration (acco/conf/train/<method>.yaml, the tiny model on the
synthetic data), as the command line runs it on 2 workers, resumed from a middle checkpoint: the
resumed run's every later update and evaluation equal the uninterrupted run's bit for bit, and its
line says "resuming exactly", wherever the batch is fixed (EngineConfig.fixed_batch: train=acco's
one micro-batch per round under accumulate_cap 1.5, ddp, torch-ddp, torch-hsdp, diloco, streaming-diloco).
dpu and wp's defaults let a round's 2 micro-batches grow to 3 as timing allows: their line says
the resume is not exact and why, and the run goes on from the checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from distributed import run_cli

# method: (budget in micro-batches over both workers, save_step, the checkpoint resumed). 4
# micro-batches an update (an inner step for diloco): 16 updates; diloco's 60 inner steps cross
# its sync at 50 (streaming-diloco's fragments sync at 12, 25, 37 and 50) after checkpoint-20.
CASES = {
    "acco": (64, 4, 8),
    "ddp": (64, 4, 8),
    "torch-ddp": (64, 4, 8),
    "torch-hsdp": (64, 4, 8),
    "dpu": (64, 4, 8),
    "wp": (64, 4, 8),
    "diloco": (240, 20, 20),
    "streaming-diloco": (240, 20, 20),
}
TIMED = ("dpu", "wp")  # micro-batches per round follow timing: not a fixed batch


def _metrics(out: Path) -> tuple[dict, dict, dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = {x["step"]: x["loss"] for x in lines if x["type"] == "train"}
    counts = {x["step"]: x["micro_batches"] for x in lines if x["type"] == "train"}
    evals = {x["step"]: x["eval_loss"] for x in lines if x["type"] == "eval"}
    return train, evals, counts


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # the tokenizer and token streams, made once


def _run_and_resume(method: str, root: Path, cache: Path) -> tuple[str, Path, Path]:
    budget, save_step, resume_at = CASES[method]

    def overrides(out: Path, *more: str) -> list[str]:
        return [f"train={method}", f"train.nb_steps_tot={budget}", f"train.save_step={save_step}",
                f"train.output_dir={out}", f"train.cache_dir={cache}", *more]  # fmt: skip

    run_cli(overrides(root / "uninterrupted"), 2, root / "uninterrupted.out")
    resumed = root / "resumed"
    resumed.mkdir()
    shutil.copytree(root / "uninterrupted" / f"checkpoint-{resume_at}", resumed / f"checkpoint-{resume_at}")
    said = run_cli(overrides(resumed, "train.resume_from_checkpoint=latest"), 2, root / "resumed.out")
    return said, root / "uninterrupted", resumed


def _check(method: str, root: Path, cache: Path) -> None:
    said, reference, resumed = _run_and_resume(method, root, cache)
    resume_at = CASES[method][2]
    ref_train, ref_evals, ref_counts = _metrics(reference)
    train, evals, counts = _metrics(resumed)
    line = next(x for x in said.splitlines() if x.startswith("resuming"))
    if method in TIMED:  # the updates' batches, and so their number, follow timing in both runs
        assert line.startswith(f"resuming from {resumed / f'checkpoint-{resume_at}'} (update {resume_at}, ")
        assert "not exactly: micro-batches per round follow timing here (train.accumulate_cap=1.5 lets a " \
               "round's train.n_grad_accumulation=2 grow to 3)" in line, line  # fmt: skip
        assert min(train) == resume_at + 1 and all(2 <= n <= 3 for c in counts.values() for n in c), counts
        # it goes on from the checkpoint's loss (about 6.1), not from the initial parameters' (6.66
        # at update 1), to about the uninterrupted run's final loss
        assert train[resume_at + 1] < ref_train[resume_at] + 0.1, (train, ref_train)
        assert evals[max(evals)] == pytest.approx(ref_evals[max(ref_evals)], rel=0.05), (evals, ref_evals)
        return
    later = sorted(s for s in ref_train if s > resume_at)
    assert len(later) >= 8 and sorted(train) == later, (sorted(ref_train), sorted(train))
    assert line == f"resuming exactly from {resumed / f'checkpoint-{resume_at}'} (update {resume_at}, " \
                   f"{resume_at * 4} micro-batches)"  # fmt: skip
    assert counts == {s: ref_counts[s] for s in later}
    assert train == {s: ref_train[s] for s in later}  # fp32 on the CPU: bit-equal
    assert evals == {s: ref_evals[s] for s in ref_evals if s > resume_at}


def test_the_default_acco_run_resumes_exactly(tmp_path, cache):
    """The README's own commands: `python main.py train.save_step=N`, then the same with
    train.resume_from_checkpoint=latest. The accumulator (the next round's micro-batch, computed at
    acco's estimate while the last round ran) is saved: computed again at the committed parameters
    it gave other gradients, and every later loss differed."""
    _check("acco", tmp_path, cache)


@pytest.mark.slow  # two CLI jobs per method (the fast tier runs acco's)
@pytest.mark.parametrize("method", [m for m in CASES if m != "acco"])
def test_every_default_configuration_resumes_as_its_line_says(method, tmp_path, cache):
    _check(method, tmp_path, cache)


def test_a_checkpoint_without_the_accumulator_is_not_resumed_exactly_whatever_the_batch(tmp_path, capsys):
    """A checkpoint of a batch that followed timing (acco capped at 2 x 1, or one written before the
    default's accumulator was kept) resumed as train=acco's fixed default: the pending micro-batches
    are computed again, and the line says so rather than "exactly"."""
    from trainer_helpers import tiny_args, tiny_data, tiny_model

    from acco import checkpoint
    from acco.trainer import DecoupledTrainer

    timed = dict(n_grad_accumulation=1, accumulate_while_waiting=True, accumulate_cap=2)
    args = tiny_args("acco", tmp_path / "timed", nb_steps_tot=12, **timed)
    DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train()
    saved = tmp_path / "timed" / "checkpoint-2"
    state = checkpoint.load_worker(saved, 0, 1)["engine"]
    pending = state["dropped_micro_batches"]
    assert state["accumulator"] is None and pending >= 1, pending
    shutil.copytree(saved, tmp_path / "fixed" / "checkpoint-2")
    capsys.readouterr()
    args = tiny_args("acco", tmp_path / "fixed", nb_steps_tot=16, **{**timed, "accumulate_cap": 1.5})
    resumed = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args)
    resumed.train(resume_from_checkpoint=True)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resuming"))
    assert line.startswith(f"resuming from {tmp_path / 'fixed' / 'checkpoint-2'} (update 2, "), line
    assert line.endswith(
        "not exactly: the checkpoint holds no accumulated gradients (its batch followed timing), so this "
        f"worker's {pending} pending micro-batch(es) are computed again at the committed parameters"
    ), line
