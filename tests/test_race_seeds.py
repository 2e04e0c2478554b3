"""acco-bench race --seeds: one race per seed, each method's median and range over the seeds, and
a method ahead of another only where the ranges do not overlap."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from acco_bench import BenchError, race_seeds
from acco_bench.cli import main
from acco_bench.settings import BenchSettings


def _race(seed: int, times: dict[str, float | None], **config) -> dict:
    """A finished race's bench.json as run_race writes it, with the fields the summary reads."""
    methods = {"ddp": {"time_to_target_vs_ddp": 1.0, "samples_to_target_vs_ddp": 1.0,
                       "compute_s_per_micro_batch": 0.2, "cpu_s_per_micro_batch": {"training": 0.15}}}
    for name, t in times.items():
        methods[name] = ({"time_to_target_vs_ddp": t, "samples_to_target_vs_ddp": 1.1, "drifted": False,
                          "compute_s_per_micro_batch": 0.2 * (1 + seed / 10),
                          "cpu_s_per_micro_batch": {"training": 0.1, "comm": 0.001 * (1 + seed)}}
                         if t is not None else {"time_to_target_vs_ddp": None, "reached_target": False})
    cfg = {"seed": seed, "hosts": 2, "methods": ["ddp", *times], "budget_micro_batches": 480,
           "accumulate_while_waiting": False, "bandwidth": f"{50 + seed}mbit", **config}
    return {"config": cfg, "comm_share_asked": 0.3, "comm_share_measured": 0.29 + seed / 100,
            "rate_mbit_s": 50.0 + seed, "target_eval_loss": 1.0 + seed / 100, "methods": methods}


def _write(out: Path, race: dict) -> None:
    d = out / f"seed-{race['config']['seed']}"
    d.mkdir(parents=True)
    (d / "bench.json").write_text(json.dumps(race))


def test_median_range_and_verdicts_over_the_seeds(tmp_path):
    times = {0: (0.70, 0.80), 1: (0.86, 0.83), 2: (0.71, 0.75), 3: (0.73, 1.23), 4: (0.68, 0.78)}
    for seed, (acco, streaming) in times.items():
        times_now = {"acco-int8-auto": acco, "streaming-diloco": streaming, "diloco": 1.2 + seed / 10}
        _write(tmp_path, _race(seed, times_now))
    summary = race_seeds.write_summary(tmp_path)
    acco = summary["methods"]["acco-int8-auto"]
    assert acco["time_vs_ddp_median"] == pytest.approx(0.71)
    assert acco["time_vs_ddp_range"] == pytest.approx([0.68, 0.86])
    assert summary["methods"]["streaming-diloco"]["time_vs_ddp_median"] == pytest.approx(0.80)
    assert acco["compute_vs_ddp_median"] == pytest.approx(1.2)
    assert acco["compute_vs_ddp_range"] == pytest.approx([1.0, 1.4])
    verdicts = {(v["method"], v["other"]): v["verdict"] for v in summary["verdicts"]}
    # ranges 0.68-0.86 and 0.75-1.23 overlap: a tie, although acco's median is lower
    assert verdicts["acco-int8-auto", "streaming-diloco"] == "a tie"
    assert verdicts["ddp", "acco-int8-auto"] == "behind"
    assert verdicts["ddp", "diloco"] == "ahead"
    assert verdicts["acco-int8-auto", "diloco"] == "ahead"
    md = (tmp_path / "seeds.md").read_text()
    assert "0.71x (0.68x to 0.86x)" in md and "0.29-0.33" in md and "**ahead**" in md
    assert "1.20x (1.00x to 1.40x)" in md
    # the comm thread's CPU per micro-batch, the median over seeds (1-5 ms); ddp has none
    assert acco["cpu_ms_per_micro_batch"] == pytest.approx({"training": 100.0, "comm": 3.0})
    assert "| acco-int8-auto | 100.0 | 3.0 | - | - | - |" in md and "| ddp | 150.0 | - |" in md


def test_a_seed_that_does_not_reach_the_loss_counts_as_slower_than_any(tmp_path):
    for seed, t in enumerate([0.9, None, 0.95]):
        _write(tmp_path, _race(seed, {"acco": t}))
    m = race_seeds.write_summary(tmp_path)["methods"]["acco"]
    assert m["not_reached"] == 1 and m["time_vs_ddp_median"] == pytest.approx(0.95)
    assert math.isinf(m["time_vs_ddp_range"][1])
    assert "0.95x (0.90x to not reached)" in (tmp_path / "seeds.md").read_text()
    assert race_seeds.verdict([0.9, math.inf], [1.0, 1.0]) == "a tie"


def test_races_of_other_settings_are_not_seeds_of_one_row(tmp_path):
    _write(tmp_path, _race(0, {"acco": 0.8}))
    _write(tmp_path, _race(1, {"acco": 0.8}, accumulate_while_waiting=True))
    with pytest.raises(BenchError, match="seed 1's race differs from seed 0's in accumulate_while_waiting"):
        race_seeds.load_races(tmp_path)


def _planned(settings: BenchSettings, seed: int, acco: float) -> dict:
    """A finished race of ``settings`` (its row's keys as run_race writes them) and acco's time."""
    race = _race(seed, {"acco": acco})
    race["config"] = {**race_seeds.planned_race(settings, "constant")["config"], "seed": seed}
    race["comm_share_asked"] = settings.comm_share
    return race


def test_a_finished_seed_is_kept_and_the_others_are_raced(tmp_path, monkeypatch):
    settings = BenchSettings(methods=("ddp", "acco"))
    _write(tmp_path, _planned(settings, 0, 0.8))
    raced = []

    def fake_race(settings, out, scheduler, eval_batches, log):
        raced.append(settings.seed)
        _write(tmp_path, _planned(settings, settings.seed, 0.7))
        return {}

    monkeypatch.setattr("acco_bench.race.run_race", fake_race)
    summary = race_seeds.run_seeds(settings, [0, 2], tmp_path, "constant", 8, log=lambda *_: None)
    assert raced == [2] and summary["seeds"] == [0, 2]
    assert summary["methods"]["acco"]["time_vs_ddp"] == pytest.approx([0.8, 0.7])


def test_a_seed_folder_of_other_settings_is_refused_before_any_race(tmp_path, monkeypatch):
    _write(tmp_path, _planned(BenchSettings(methods=("ddp", "acco")), 0, 0.8))
    monkeypatch.setattr("acco_bench.race.run_race", lambda *a, **k: pytest.fail("raced"))
    other = BenchSettings(methods=("ddp", "acco", "diloco"))
    with pytest.raises(BenchError, match="seed-0 holds a race that differs from these settings in methods"):
        race_seeds.run_seeds(other, [0, 1], tmp_path, "constant", 8, log=lambda *_: None)


def test_report_summarizes_a_folder_of_seeds_again(tmp_path, capsys):
    _write(tmp_path, _race(3, {"acco": 0.8}))
    assert main(["report", str(tmp_path)]) == 0
    assert "race over 1 seeds (3)" in capsys.readouterr().out


def test_seed_and_seeds_exclude_each_other(tmp_path, capsys):
    assert main(["race", "--seed", "1", "--seeds", "0,1", "--loopback", "--out", str(tmp_path)]) == 2
    assert "--seed and --seeds exclude each other" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv, said", [
    (["race", "--seeds", "0,one"], "--seeds takes integers (0,1,2), got '0,one'"),
    (["convergence", "--seeds", "0,1.5"], "--seeds takes integers (0,1), got '0,1.5'"),
    (["convergence", "--batch-sizes", "1,two"], "--batch-sizes takes integers"),
    (["lr-sweep", "--learning-rates", "1e-3,fast"], "--learning-rates takes numbers"),
    (["lr-sweep", "--extra-seeds", "x"], "--extra-seeds takes integers"),
])
def test_every_list_flag_fails_with_one_line(argv, said, tmp_path, capsys):
    """acco-bench's comma-separated flags parse through one type: a bad item is one line, exit 2,
    before anything runs (convergence's --seeds was a traceback)."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and said in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
