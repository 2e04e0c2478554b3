"""A machine whose speed moves during a race (acco_bench/drift.py): rank 0's compute per micro-batch,
the reference and the flag, the re-run of a drifted method inside a race (its workers replaced by a
fake that writes what real ones write), and the calibration's third probe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acco_bench import comm_share, drift, race
from acco_bench.network import parse_rate
from acco_bench.settings import BenchSettings


def _write_timers(run_dir: Path, computes: list[float], micro_batches) -> None:
    (run_dir / "workers").mkdir(parents=True, exist_ok=True)
    rows = [{"step": i + 1, "compute_s": c, "comm_s": 0.1, "wait_s": 0.0, "micro_batches": micro_batches}
            for i, c in enumerate(computes)]
    (run_dir / "workers" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compute_per_micro_batch_is_rank_zeros_median_without_the_first_update(tmp_path):
    # first update 9 s (set-up); then 1.0, 1.6, 1.2 s over rank 0's 4 micro-batches (rank 1 has 8)
    _write_timers(tmp_path / "a", [9.0, 1.0, 1.6, 1.2], [4, 8])
    assert drift.compute_per_micro_batch(tmp_path / "a") == pytest.approx(0.3)
    _write_timers(tmp_path / "b", [9.0, 0.5, 0.7, 0.6], 2)  # a plain count
    assert drift.compute_per_micro_batch(tmp_path / "b") == pytest.approx(0.3)
    assert drift.compute_per_micro_batch(tmp_path / "missing") is None


def test_the_reference_flags_a_method_off_it_and_leaves_torch_ddp_alone():
    methods = {
        "ddp": {"compute_s_per_micro_batch": 0.20},
        "acco": {"compute_s_per_micro_batch": 0.22},
        "diloco": {"compute_s_per_micro_batch": 0.30},  # 1.36x the reference: the machine slowed down
        "torch-ddp": {"compute_s_per_micro_batch": 0.40},  # its compute holds its all-reduce
        "wp": {"error": "failed"},
    }
    ref = drift.mark(methods, [0.21, 0.21])  # the calibration's probes vote too
    assert ref == pytest.approx(0.21)
    assert [n for n in methods if methods[n].get("drifted")] == ["diloco"]
    assert methods["acco"]["compute_vs_reference"] == pytest.approx(0.22 / 0.21)
    assert methods["torch-ddp"]["drifted"] is None and "drifted" not in methods["wp"]
    assert drift.drifted(0.21 * 1.24, 0.21) is False and drift.drifted(0.21 / 1.26, 0.21) is True


def test_a_run_is_disturbed_by_load_or_by_drift():
    quiet = {"load": {"other_cpu_cores": 0.01}}
    assert drift.disturbance("acco", {**quiet, "compute_s_per_micro_batch": 0.3}, [0.2, 0.21]) is not None
    assert drift.disturbance("acco", {**quiet, "compute_s_per_micro_batch": 0.22}, [0.2, 0.21]) is None
    assert drift.disturbance("torch-ddp", {**quiet, "compute_s_per_micro_batch": 0.4}, [0.2]) is None
    # sharded inside the node: FSDP2's collectives run inside its forward and backward
    assert drift.disturbance("acco-sharded-nodes", {**quiet, "compute_s_per_micro_batch": 0.4}, [0.2]) is None
    assert drift.disturbance("ddp", {**quiet, "compute_s_per_micro_batch": 0.4}, []) is None  # nothing before
    busy = {"load": {"other_cpu_cores": 0.6}, "compute_s_per_micro_batch": 0.2}
    assert "0.60 CPU cores" in drift.disturbance("acco", busy, [0.2])


class _QuietLoad:
    def sample(self, *a):
        pass

    def result(self):
        return {"other_cpu_cores": 0.0}


def _fake_workers(monkeypatch, module, computes: dict[str, list[float]]) -> list[str]:
    """Replace ``module``'s workers by files as real ones write them: rank 0 computes
    ``computes[method][i]`` seconds per micro-batch in the method's i-th run (2 per update)."""
    calls = []

    def fake_workers(s, method, run_dir, net, load=None):
        calls.append(method)
        c = computes[method][sum(m == method for m in calls) - 1]
        _write_timers(run_dir, [5.0] + [c * 2] * 4, [2, 2])
        rows = [{"type": "train", "step": i, "samples": 4 * i, "loss": 5.0, "wall_time": float(i),
                 "compute_s": c * 2, "comm_s": 0.1, "wait_s": 0.0, "micro_batches": [2, 2]}
                for i in range(1, 6)]
        rows.append({"type": "eval", "step": 5, "samples": 20, "eval_loss": 4.0, "eval_s": 0.1})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / "summary.json").write_text(json.dumps({"state_bytes": 1}))
        return 5.0

    monkeypatch.setattr(module, "run_workers", fake_workers)
    monkeypatch.setattr(module, "LoadMeter", _QuietLoad)
    monkeypatch.setattr(module, "check_worker_available", lambda: None)
    monkeypatch.setattr(module, "RETRY_PAUSE_S", 0.0)
    return calls


def test_a_drifted_method_runs_again_and_one_that_stays_drifted_is_flagged(tmp_path, monkeypatch):
    """Real race code around fake workers: acco's first run computes 2x slower than ddp (run again,
    the second kept), diloco's both runs (kept, flagged in bench.json and race.md), torch-ddp 2x
    (its compute holds its comm: never re-run)."""
    computes = {"ddp": [0.2], "acco": [0.4, 0.21], "diloco": [0.5, 0.5], "torch-ddp": [0.4]}
    calls = _fake_workers(monkeypatch, race, computes)
    s = BenchSettings(methods=("ddp", "acco", "diloco", "torch-ddp"), loopback=True, eval_step=1,
                      nb_steps_tot=20, retry_disturbed=1)
    logs = []
    bench = race.run_race(s, tmp_path, log=logs.append)
    assert calls == ["ddp", "acco", "acco", "diloco", "diloco", "torch-ddp"]
    m = bench["methods"]
    assert m["acco"]["compute_s_per_micro_batch"] == pytest.approx(0.21)
    assert m["acco"]["disturbed_attempts"] == 1
    assert m["acco"]["drifted"] is False and m["ddp"]["disturbed_attempts"] == 0
    assert m["diloco"]["drifted"] is True and m["diloco"]["disturbed_attempts"] == 1
    assert m["torch-ddp"]["drifted"] is None and m["torch-ddp"]["disturbed_attempts"] == 0
    assert json.loads((tmp_path / "bench.json").read_text())["methods"]["diloco"]["drifted"] is True
    warning = [x for x in (tmp_path / "race.md").read_text().splitlines() if "WARNING" in x]
    assert len(warning) == 1 and "diloco" in warning[0] and "acco" not in warning[0]
    assert any("running it again (1/1)" in x and x.startswith("[acco-bench] acco")
               and x.endswith("(--retry-disturbed 0: never)") for x in logs)
    # a race from before the check: `acco-bench report` finds the figures in the run folders
    from acco_bench.rerender import rerender_dir

    old = json.loads((tmp_path / "bench.json").read_text())
    for r in old["methods"].values():
        for key in ("compute_s_per_micro_batch", "compute_vs_reference", "drifted"):
            r.pop(key)
    (tmp_path / "bench.json").write_text(json.dumps(old))
    warning = [x for x in rerender_dir(tmp_path).splitlines() if "WARNING" in x]
    assert len(warning) == 1 and "diloco" in warning[0] and "acco" not in warning[0]
    # with no retry: acco kept at its drifted first run, and flagged (diloco steady this time)
    calls.clear()
    computes["diloco"] = [0.2]
    s = BenchSettings(**{**s.__dict__, "retry_disturbed": 0})
    bench = race.run_race(s, tmp_path / "b", log=logs.append)
    assert calls == ["ddp", "acco", "diloco", "torch-ddp"]
    assert [n for n, r in bench["methods"].items() if r.get("drifted")] == ["acco"]


def test_the_calibration_runs_a_third_probe_when_the_first_two_disagree(monkeypatch, tmp_path):
    """ddp's compute 0.50 s unshaped, 0.80 s in the shaped probe (60% apart: the machine's speed
    moved), 0.52 s in a third: the rate is set from their median, 0.52 s, not from the mean 0.65 s."""
    m0, bits, share = 0.03, 12e6, 0.4
    computes = iter([0.50, 0.80, 0.52])

    def fake_probe(settings, net, bandwidth, out, log=print, name=None):
        net.set_bandwidth(bandwidth)
        c = next(computes)
        if bandwidth is None:
            return {"bandwidth": None, "compute_s": c, "comm_s": m0, "bytes_per_update": 10e6 / 8}
        comm = m0 + bits / parse_rate(bandwidth)
        return {"bandwidth": bandwidth, "compute_s": c, "comm_s": comm, "name": name}

    class Net:
        cluster = object()

        def __init__(self):
            self.rates = []

        def set_bandwidth(self, rate):
            self.rates.append(rate)

    monkeypatch.setattr(comm_share, "probe", fake_probe)
    net = Net()
    cal = comm_share.calibrate(None, net, share, tmp_path, log=lambda *a: None)
    assert len(cal["probes"]) == 2 and cal["probes"][-1]["name"] == "third"
    assert cal["compute_s"] == pytest.approx(0.52)
    assert cal["rate"] == comm_share.tc_rate(bits / (0.4 / 0.6 * 0.52 - m0)) == net.rates[-1]
    assert net.rates[2] == comm_share.tc_rate(bits / (0.4 / 0.6 * 0.65 - m0))  # the third probe's rate
    assert comm_share.probes_disagree(0.50, 0.57) is False and comm_share.probes_disagree(0.50, 0.58) is True


def test_the_cluster_reruns_a_drifted_method_and_flags_one_that_stays(tmp_path, monkeypatch):
    """``acco-bench cluster`` through the same check: acco slow once (run again), dpu slow twice
    (flagged in bench.json and bench.md)."""
    from acco_bench import cluster

    calls = _fake_workers(monkeypatch, cluster, {"ddp": [0.2], "acco": [0.4, 0.2], "dpu": [0.45, 0.45],
                                                 "wp": [0.21]})
    s = BenchSettings(methods=("ddp", "acco", "dpu", "wp"), loopback=True, nb_steps_tot=20, retry_disturbed=1)
    bench = cluster.run_bench(s, tmp_path, log=lambda *a: None)
    assert calls == ["ddp", "acco", "acco", "dpu", "dpu", "wp"]
    m = bench["methods"]
    assert m["acco"]["disturbed_attempts"] == 1 and m["acco"]["drifted"] is False
    assert m["dpu"]["drifted"] is True and m["wp"]["drifted"] is False
    assert bench["compute_reference_s_per_micro_batch"] == pytest.approx(0.205)
    warning = [x for x in (tmp_path / "bench.md").read_text().splitlines() if "WARNING" in x]
    assert len(warning) == 1 and "dpu" in warning[0] and "acco" not in warning[0].split("micro-batch")[0]
    # `acco-bench report` recomputes the figures from the run folders and keeps what was measured
    # only while the methods ran (their drift, retries, loads)
    from acco_bench.rerender import rerender_dir

    before = json.loads((tmp_path / "bench.json").read_text())["methods"]
    assert [x for x in rerender_dir(tmp_path).splitlines() if "WARNING" in x] == warning
    after = json.loads((tmp_path / "bench.json").read_text())["methods"]
    for name, measured in before.items():
        assert set(measured) <= set(after[name]), (name, set(measured) - set(after[name]))
        for key in ("drifted", "disturbed_attempts", "compute_s_per_micro_batch", "compute_vs_reference"):
            assert after[name][key] == measured[key], (name, key)


def test_the_clusters_median_repetition_is_chosen_among_the_undrifted(tmp_path, monkeypatch):
    """``--repeats 3`` with acco's second repetition computing 2x slower and no retry left: the
    figures come from a steady repetition, the drifted one listed beside them."""
    from acco_bench import cluster

    _fake_workers(monkeypatch, cluster, {"ddp": [0.2, 0.2, 0.2], "acco": [0.2, 0.45, 0.21]})
    s = BenchSettings(methods=("ddp", "acco"), loopback=True, nb_steps_tot=20, repeats=3, retry_disturbed=0)
    bench = cluster.run_bench(s, tmp_path, log=lambda *a: None)
    acco = bench["methods"]["acco"]
    assert acco["repeats_used"] == 2 and acco["compute_s_per_micro_batch"] < 0.3
    assert [bool(r["disturbed"]) for r in acco["repeats"]] == [False, True, False]
    assert acco["drifted"] is False
