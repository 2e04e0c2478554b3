"""acco-bench race: the crossing of a target by an eval-loss curve, bench.json's keys, the trainer's
stop at a target loss, and a tiny race on loopback (namespaces where they exist)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from trainer_helpers import SMALL, small_run

from acco.data import load_tokenizer, synthetic_corpus
from acco.models import build_model
from acco.trainer import DecoupledTrainer
from acco_bench import race
from acco_bench.cli import main
from acco_bench.network import namespaces
from acco_bench.settings import DEMO_ACCO, DEMO_COMM_SHARE, BenchSettings


def _trainer(tmp_path, **overrides) -> DecoupledTrainer:
    docs = synthetic_corpus(200)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=300)
    model = build_model(SMALL, vocab_size=len(tokenizer), max_length=32)
    args = small_run(tmp_path, **{"nb_steps_tot": 12, "eval_step": 2, **overrides})
    return DecoupledTrainer(
        model=model, processing_class=tokenizer, train_dataset=docs, args=OmegaConf.create(args)
    )


def _evals(tmp_path) -> list[dict]:
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["type"] == "eval"]


def test_trainer_stops_at_the_first_evaluation_at_or_below_the_target(tmp_path):
    summary = _trainer(tmp_path, stop_at_eval_loss=1e6).train()  # any loss is below: stop at the first
    assert summary["updates"] == 2 and summary["stopped_at_eval_loss"] is True
    evals = _evals(tmp_path)
    assert [e["step"] for e in evals] == [2]  # no second evaluation after the stop
    assert evals[0]["eval_s"] > 0


def test_trainer_without_a_reachable_target_runs_its_budget(tmp_path):
    summary = _trainer(tmp_path, stop_at_eval_loss=0.0).train()
    assert summary["updates"] == 12 and summary["stopped_at_eval_loss"] is False
    assert [e["step"] for e in _evals(tmp_path)] == [2, 4, 6, 8, 10, 12]
    assert math.isfinite(summary["final_eval_loss"])


@pytest.mark.parametrize("target", [float("nan"), float("inf"), -0.5])  # -0.5: a loss never reaches it
def test_stop_at_eval_loss_must_be_a_reachable_loss(tmp_path, target):
    from acco.engine import ConfigError

    with pytest.raises(ConfigError, match="stop_at_eval_loss"):
        _trainer(tmp_path, stop_at_eval_loss=target)


# --------------------------------------------------------------------------------------------
# the crossing and bench.json, from synthetic curves


def test_crossing_is_interpolated_between_the_two_evaluations_around_the_target():
    curve = [(1.0, 100, 5.0), (2.0, 200, 4.0), (4.0, 400, 3.0), (5.0, 500, 2.5)]
    hit = race.crossing(curve, 3.5)
    # halfway in loss between (2 s, 4.0) and (4 s, 3.0)
    assert hit["time_s"] == pytest.approx(3.0) and hit["samples"] == pytest.approx(300)
    assert hit["bracket_s"] == pytest.approx(2.0) and hit["eval_index"] == 2
    assert race.crossing(curve, 3.0)["time_s"] == pytest.approx(4.0)  # exactly on a point
    assert race.crossing(curve, 2.0) is None  # never reached
    assert race.crossing(curve, 6.0) == {
        "time_s": 1.0,
        "samples": 100,
        "bracket_s": 0.0,
        "bracket_samples": 0.0,
        "eval_index": 0,
    }


def test_crossing_takes_the_first_one_on_a_noisy_curve():
    curve = [(1.0, 1, 5.0), (2.0, 2, 3.0), (3.0, 3, 4.0), (4.0, 4, 2.0)]
    assert race.crossing(curve, 3.5)["time_s"] == pytest.approx(1.75)


def _write_run(run_dir: Path, walls: list[float], evals: dict[int, tuple[float, float]]) -> None:
    """metrics.jsonl of a run: one update per wall time, evaluations {step: (loss, eval_s)}."""
    run_dir.mkdir(parents=True)
    lines = []
    for step, wall in enumerate(walls, 1):
        lines.append({"type": "train", "step": step, "samples": 4 * step, "loss": 5.0, "wall_time": wall})
        if step in evals:
            loss, eval_s = evals[step]
            lines.append(
                {"type": "eval", "step": step, "samples": 4 * step, "eval_loss": loss, "eval_s": eval_s}
            )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_training_time_leaves_out_the_evaluations(tmp_path):
    # updates take 1 s of training; every evaluation (after updates 2 and 4) takes 0.5 s more
    _write_run(tmp_path / "run", [1.0, 2.0, 3.5, 4.5, 6.0], {2: (4.0, 0.5), 4: (3.0, 0.5), 5: (2.0, 0.5)})
    curve = race.eval_curve(tmp_path / "run", batch_size=2)
    assert [c["time_s"] for c in curve] == pytest.approx([2.0, 4.0, 5.0])
    assert [c["samples"] for c in curve] == [16, 32, 40]  # micro-batches x sequences per micro-batch
    interval = race.eval_interval(curve)
    assert interval["median_s"] == pytest.approx(1.5) and interval["eval_s_median"] == pytest.approx(0.5)


def test_targets_and_ratios_to_ddp():
    def run(points):
        return {"eval_curve": [{"time_s": t, "samples": s, "eval_loss": loss} for t, s, loss in points]}

    methods = {"ddp": run([(10, 100, 4.0), (20, 200, 3.0)]), "acco": run([(5, 150, 4.0), (10, 250, 3.0)]),
               "wp": run([(10, 100, 4.0), (40, 400, 3.5)]), "dpu": {"error": "failed"}}
    race.add_targets(methods, 3.0)
    assert methods["ddp"]["time_to_target_s"] == 20 and methods["ddp"]["time_to_target_vs_ddp"] == 1.0
    assert methods["acco"]["time_to_target_s"] == 10 and methods["acco"]["time_to_target_vs_ddp"] == 0.5
    assert methods["acco"]["samples_to_target_vs_ddp"] == pytest.approx(1.25)
    assert methods["wp"]["time_to_target_s"] is None and methods["wp"]["reached_target"] is False
    assert methods["wp"]["time_to_target_vs_ddp"] is None
    assert "time_to_target_s" not in methods["dpu"]


def test_race_overrides_leave_the_users_keys_alone():
    s = BenchSettings(extra=("train.scheduler_name=cosine",))
    o = race.race_overrides(s, 400, "constant", 8, 3.25)
    assert o.count("train.scheduler_name=cosine") == 1 and not any(
        x == "train.scheduler_name=constant" for x in o
    )
    assert "train.warmup=40" in o and "train.max_eval_batches=8" in o and "train.stop_at_eval_loss=3.25" in o
    assert not any(
        "stop_at_eval_loss" in x for x in race.race_overrides(BenchSettings(), 400, "constant", 8, None)
    )
    diloco = race.race_overrides(BenchSettings(), 400, "constant", 8, 3.25, "diloco")
    assert "train.sync_every=10" in diloco and not any("sync_every" in x for x in o)
    mine = race.race_overrides(
        BenchSettings(extra=("train.sync_every=7",)), 400, "constant", 8, 3.25, "diloco"
    )
    assert [x for x in mine if "sync_every" in x] == ["train.sync_every=7"]  # the user's value wins


# --------------------------------------------------------------------------------------------
# tiny races

TINY = [
    "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--batch-size", "4", "--max-length", "32",
    "--grad-accum", "2", "--nb-steps-tot", "16", "--timeout", "150", "--eval-step", "1",
    "--eval-batches", "2", "--override", "data.n_docs=300", "--override", "model.vocab_size=512",
    "--retry-disturbed", "0",  # a tiny model on a loaded machine drifts (re-runs: test_bench_drift.py)
]


def _check_race(out: Path, methods: list[str], kind: str) -> dict:
    bench = json.loads((out / "bench.json").read_text())
    assert bench["config"]["network"]["kind"] == kind and bench["config"]["accumulate_while_waiting"] is True
    assert list(bench["methods"]) == methods
    target = bench["target_eval_loss"]
    assert target == bench["methods"]["ddp"]["final_eval_loss"]
    for name in methods:
        r = bench["methods"][name]
        assert "error" not in r, r.get("error")
        for key in (
            "time_to_target_s",
            "samples_to_target",
            "bytes_sent_per_worker",
            "state_bytes_per_worker",
            "eval_interval",
            "eval_curve",
            "crossing_bracket",
        ):
            assert key in r, (name, key)
        if r["time_to_target_s"] is None:  # never reached: ran to twice ddp's samples
            assert r["samples"] >= 2 * bench["methods"]["ddp"]["samples"]
        else:
            assert 0 < r["time_to_target_s"] <= r["training_time_s"] + 1e-9
            assert min(c["eval_loss"] for c in r["eval_curve"]) <= target
    ddp = bench["methods"]["ddp"]
    assert ddp["samples"] == 16 * 4 and ddp["time_to_target_s"] is not None
    assert (out / "race.png").stat().st_size > 0 and "| acco |" in (out / "race.md").read_text()
    return bench


@pytest.mark.slow
def test_race_on_loopback(tmp_path):
    out = tmp_path / "race"
    assert main(["race", "--loopback", "--methods", "acco,ddp", "--out", str(out), *TINY]) == 0
    bench = _check_race(out, ["ddp", "acco"], "loopback")  # ddp runs first: it sets the target
    assert bench["methods"]["acco"]["bytes_sent_per_worker"] is None  # no per-worker link on loopback
    # every worker's CPU by thread: acco's comm thread is seen and told apart, ddp has none
    assert "comm" in bench["methods"]["acco"]["cpu_s_per_micro_batch"]
    assert "comm" not in bench["methods"]["ddp"]["cpu_s_per_micro_batch"]
    assert bench["methods"]["ddp"]["cpu_s_per_micro_batch"]["training"] > 0
    if bench["methods"]["acco"]["time_to_target_s"] is not None:
        assert bench["methods"]["acco"]["stopped_at_target"] is True
    assert main(["report", str(out)]) == 0  # re-rendered as a race


@pytest.mark.skipif(namespaces.netns_unavailable_reason() is not None, reason="no network namespaces")
@pytest.mark.slow
def test_race_on_namespaces_counts_the_bytes_on_the_links(tmp_path):
    out = tmp_path / "race"
    assert main(["race", "--methods", "ddp,acco", "--bandwidth", "1000mbit", "--out", str(out), *TINY]) == 0
    bench = _check_race(out, ["ddp", "acco"], "netns")
    for name in ("ddp", "acco"):
        sent = bench["methods"][name]["bytes_sent_per_worker"]
        assert len(sent) == 2 and all(b > 0 for b in sent), sent  # each host's own link
        assert bench["methods"][name]["bytes_sent_per_worker_mean"] == pytest.approx(sum(sent) / 2)
    # none of this process's namespaces is left (other processes may be running their own)
    assert namespaces.list_namespaces(f"{namespaces.DEFAULT_PREFIX}{os.getpid()}-") == []


def test_race_needs_ddp_and_known_methods(tmp_path, capsys):
    assert main(["race", "--loopback", "--methods", "acco", "--out", str(tmp_path)]) == 2
    assert "needs ddp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["race", "--loopback", "--methods", "ddp,adam", "--out", str(tmp_path)])
    assert "unknown method(s) adam" in capsys.readouterr().err
    assert main(["race", "--loopback", "--repeats", "2", "--out", str(tmp_path)]) == 2


def test_demo_on_loopback_says_it_cannot_show_the_gain(tmp_path, capsys, monkeypatch):
    """The demo is a thin call of the race (tested above on real processes): its settings and
    what it prints, with the race itself replaced by a canned result."""
    from acco_bench import demo

    seen = {}

    def fake_race(settings, out):
        seen["settings"] = settings
        run = {"time_to_target_s": 10.0, "samples_to_target": 64.0, "bytes_sent_per_worker_mean": None}
        return {
            "target_eval_loss": 3.5,
            "comm_share_asked": settings.comm_share,
            "comm_share_measured": 0.42 if settings.comm_share else None,
            "rate": "61234kbit" if settings.comm_share else None,
            "methods": {"ddp": dict(run), DEMO_ACCO: dict(run, time_to_target_s=9.0)},
        }

    monkeypatch.setattr(demo, "run_race", fake_race)
    assert demo.main(["--loopback", "--out", str(tmp_path / "demo"), "train.max_length=32"]) == 0
    s = seen["settings"]
    assert s.methods == ("ddp", DEMO_ACCO) and s.loopback and s.bandwidth is None and s.comm_share is None
    assert s.accumulate_while_waiting is False and s.grad_accum == 6  # the same fixed batch for both
    assert s.nb_steps_tot == 240 and s.probe_updates == 5  # 2.5 minutes with the calibration, 2 cores
    # half the recipe's LR over 6 warm-up updates (smooth curves), then the user's overrides
    assert s.extra == ("train.learning_rate=1.5e-3", "train.warmup=72", "train.max_length=32")
    demo.main(["--loopback", "--out", str(tmp_path / "demo"), "train.learning_rate=3e-3"])
    assert seen["settings"].extra == ("train.warmup=72", "train.learning_rate=3e-3")  # the user's wins
    out = capsys.readouterr().out
    assert "on loopback (--loopback)" in out and "cannot show the gain" in out
    assert f"{DEMO_ACCO} reached ddp's final eval loss in 0.90x ddp's training time" in out
    # on emulated hosts: the comm share by default, and the share and rate it chose printed
    monkeypatch.setattr(demo, "netns_unavailable_reason", lambda: None)
    assert demo.main(["--out", str(tmp_path / "demo")]) == 0
    s = seen["settings"]
    assert s.comm_share == DEMO_COMM_SHARE and s.bandwidth is None and not s.loopback
    out = capsys.readouterr().out
    assert "61.2 Mbit/s, chosen for a comm share of 0.40" in out and "measured in the race: 0.42" in out
    assert "(1.11x sooner)" in out
