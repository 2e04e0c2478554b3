"""acco-bench: every subcommand runs on a tiny setting and writes outputs that parse (map and the
bounds per acco variant: tests/test_bench_bounds.py).

These are not timed tests: they check the harness (processes, namespaces, files, tables, plots),
not the figures. The emulated-cluster tests need root and iproute2 and are skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acco_bench import BenchError
from acco_bench.analysis import add_comparisons, method_metrics
from acco_bench.cli import main
from acco_bench.network import Network, namespaces
from acco_bench.settings import BenchSettings
from acco_bench.workers import WORKER_ENV, run_workers

REASON = namespaces.netns_unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")

# A very small run: 2 workers, a 1-layer model, 16 micro-batches over both workers.
TINY = [
    "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--batch-size", "4", "--max-length", "32",
    "--grad-accum", "2", "--nb-steps-tot", "16", "--timeout", "150", "--retry-disturbed", "0",
    "--override", "data.n_docs=300", "--override", "model.vocab_size=512",
]
FIELDS = ("step_time_s", "samples_per_s", "tokens_per_s", "compute_s_per_update", "comm_s_per_update",
          "overlap_efficiency", "final_eval_loss", "peak_rss_mb", "micro_batches_per_update_by_worker")


def _check_bench(out: Path, methods: list[str], kind: str) -> dict:
    bench = json.loads((out / "bench.json").read_text())
    assert bench["config"]["network"]["kind"] == kind
    assert list(bench["methods"]) == methods
    for name in methods:
        res = bench["methods"][name]
        assert "error" not in res, res.get("error")
        for key in FIELDS:
            assert key in res, (name, key)
        assert res["step_time_s"] > 0 and res["samples_per_s"] > 0
        assert len(res["micro_batches_per_update_by_worker"]) == 2
        assert res["final_eval_loss"] is not None
    md = (out / "bench.md").read_text()
    for name in methods:
        assert f"| {name} |" in md
    if "ddp" in methods:
        assert bench["methods"]["ddp"]["speedup_step_vs_ddp"] == pytest.approx(1.0)
        assert "ideal_overlap" in bench["bounds"]
    assert (out / "step_time.png").stat().st_size > 0
    return bench


@pytest.mark.slow
def test_cluster_loopback(tmp_path):
    out = tmp_path / "cluster"
    code = main(["cluster", "--loopback", "--methods", "ddp,acco", "--out", str(out), *TINY])
    assert code == 0
    bench = _check_bench(out, ["ddp", "acco"], "loopback")
    assert bench["config"]["grad_accum_per_method"] == {"ddp": 2, "acco": 1}
    # every rank wrote its own timers
    assert sorted(p.name for p in (out / "acco" / "workers").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]


@needs_netns
@pytest.mark.slow
def test_sweep_on_namespaces(tmp_path):
    """Two sweep points on emulated hosts: one shaped, one unshaped; nothing left behind. (One
    method per point keeps the test short; the comparisons are checked on loopback above.)"""
    out = tmp_path / "sweep"
    code = main(["sweep", "--bandwidths", "1000mbit,unshaped", "--methods", "acco", "--out", str(out), *TINY])
    assert code == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert [p["label"] for p in sweep["points"]] == ["1000mbit", "unshaped"]
    shaped, unshaped = sweep["points"]
    assert shaped["network"]["kind"] == "netns" and shaped["network"]["bandwidth"] == "1000mbit"
    assert unshaped["network"]["kind"] == "netns" and unshaped["network"]["bandwidth"] is None
    assert "tbf" in shaped["network"]["note"] or "netem" in shaped["network"]["note"]
    assert shaped["methods"]["acco"]["step_time_s"] > 0
    _check_bench(out / "1000mbit", ["acco"], "netns")
    assert "| 1000mbit |" in (out / "sweep.md").read_text()
    assert (out / "sweep_speedup.png").stat().st_size > 0
    # none of this process's namespaces is left (other processes may be running their own)
    assert namespaces.list_namespaces(f"{namespaces.DEFAULT_PREFIX}{os.getpid()}-") == []


@pytest.mark.slow
def test_convergence_one_seed(tmp_path):
    out = tmp_path / "conv"
    code = main(["convergence", "--data", "synthetic", "--seeds", "0", "--methods", "ddp,acco",
                 "--eval-step", "1", "--closeness-steps", "1,2", "--out", str(out), *TINY])
    assert code == 0
    conv = json.loads((out / "convergence.json").read_text())
    for m in ("ddp", "acco"):
        assert conv["final_eval_loss"][m]["n"] == 1
        curve = conv["curves"][m]["0"]
        assert len(curve) >= 2 and all(loss > 0 for _, loss in curve)
    assert conv["curves"]["ddp"]["0"][-1][0] == conv["curves"]["acco"]["0"][-1][0]  # same samples
    uc = conv["update_closeness"]
    assert "error" not in uc, uc
    assert [p["after_steps"] for p in uc["points"]] == [1, 2]
    for p in uc["points"]:
        assert 0 <= p["brief"] <= 1 and 0 <= p["algorithm"] <= 1 and 0 <= p["noise"] <= 1
    md = (out / "convergence.md").read_text()
    assert "| acco |" in md and "Update closeness" in md


@pytest.mark.slow
def test_lr_sweep_and_its_reference_check(tmp_path):
    """Two learning rates, ddp and the lean acco variant; the plain reference (no engine code)
    gives the engine's training losses update by update."""
    out = tmp_path / "lrs"
    code = main(["lr-sweep", "--learning-rates", "3e-3,6e-3", "--methods", "ddp,acco-lean", "--seeds", "0",
                 "--extra-seeds", "", "--reference-updates", "3", "--out", str(out), *TINY])
    assert code == 0
    sweep = json.loads((out / "lr_sweep.json").read_text())
    table = sweep["summary"]["table"]
    assert set(table) == {"ddp", "acco-lean"} and set(table["ddp"]) == {"0.003", "0.006"}
    assert all(s["n"] == 1 and s["mean"] > 0 for by_lr in table.values() for s in by_lr.values())
    assert sweep["summary"]["best"]["ddp"]["learning_rate"] in (3e-3, 6e-3)
    check = sweep["reference_check"]["methods"]
    assert set(check) == {"ddp", "acco-lean"}
    for method, result in check.items():
        assert len(result["engine"]) == len(result["reference"]) == 3, method
        assert result["max_abs_diff"] < 1e-4, (method, result)
    assert check["acco-lean"]["estimate"] == "lean"  # the reference ran the variant the engine ran
    md = (out / "lr_sweep.md").read_text()
    assert "| acco-lean |" in md and "Reference check" in md and (out / "final_loss_vs_lr.png").exists()
    # The same settings again, one learning rate more: only that one runs, the sweep grows.
    done = out / "lr-0.003" / "seed0" / "ddp" / "metrics.jsonl"
    stamp = done.stat().st_mtime_ns
    code = main(["lr-sweep", "--learning-rates", "1.5e-3,3e-3", "--methods", "ddp,acco-lean", "--seeds", "0",
                 "--extra-seeds", "", "--reference-updates", "0", "--out", str(out), *TINY])
    assert code == 0
    sweep = json.loads((out / "lr_sweep.json").read_text())
    assert set(sweep["summary"]["table"]["ddp"]) == {"0.0015", "0.003", "0.006"}
    assert done.stat().st_mtime_ns == stamp


def test_lr_sweep_summary_pairs_seeds_and_finds_half_the_best():
    from acco_bench.lr_sweep import nearest, summarize

    def run(loss):
        return {"final_eval_loss": loss}

    runs = {"0.001": {"ddp": {"0": run(3.0), "1": run(3.2)}, "acco": {"0": run(3.1), "1": run(3.1)}},
            "0.002": {"ddp": {"0": run(2.0), "1": run(2.2)}, "acco": {"0": run(2.2), "1": run(2.4)}},
            "0.004": {"ddp": {"0": run(2.5)}, "acco": {"0": run(2.0)}}}
    summary = summarize(runs, [1e-3, 2e-3, 4e-3], ("ddp", "acco"))
    assert summary["best"]["ddp"] == {"learning_rate": 2e-3, "final_eval_loss": 2.1}
    assert summary["best"]["acco"]["learning_rate"] == 4e-3
    assert summary["table"]["ddp"]["0.002"]["n"] == 2
    gap = summary["gaps"]["acco"]
    assert gap["ddp_best"]["ratio_to_ddp"] == pytest.approx(4.6 / 4.2)
    assert gap["half_ddp_best"]["learning_rate"] == 1e-3
    assert gap["half_ddp_best"]["ratio_to_ddp"] == pytest.approx(1.0)
    assert nearest([7.5e-4, 1.5e-3, 3e-3], 4.5e-3 / 2) == 3e-3


def test_estimate_stability_limits():
    """The linearised recurrences behind acco_estimate=lean: the paper's estimate loop diverges
    from a preconditioned curvature of 2 / (1 - beta1), the lean one from 3 / (1 - beta1), AdamW
    itself from 2 (1 + beta1) / (1 - beta1)."""
    from acco_bench.reference import stability_limit

    assert stability_limit(0.9, lean=None) == pytest.approx(38.0)
    assert stability_limit(0.9, lean=0.0) == pytest.approx(20.0)
    assert stability_limit(0.9, lean=0.5) == pytest.approx(30.0)
    assert stability_limit(0.8, lean=0.0) == pytest.approx(10.0)


@pytest.mark.slow
def test_gpu_without_cuda_exits_cleanly(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the gpu benchmark would really run")
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "-m", "acco_bench.cli", "gpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "SKIPPED" in proc.stderr and "CUDA" in proc.stderr
    assert json.loads((out / "gpu.json").read_text())["skipped"] is True
    proc = subprocess.run(
        [sys.executable, "-m", "acco_bench.cli", "gpu", "--require-cuda", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3


def test_gpu_variants_and_plain_fused_adamw_loop_on_the_cpu(tmp_path):
    """acco-bench gpu's code path with --device cpu and the tiny model: the engine against the
    plain fused-AdamW loop (bf16 parameters, and fp32 under bf16 autocast), each also with gradient
    checkpointing (-gc), which recomputes the same arithmetic: the same losses."""
    from bench_helpers import TINY_ON_CPU, one_thread

    out = tmp_path / "gpu"
    variants = ["engine-acco", "plain-bf16", "plain-autocast", "engine-acco-gc", "plain-bf16-gc"]
    with one_thread():
        assert main([*TINY_ON_CPU, "--variants", ",".join(variants), "--out", str(out)]) == 0
    result = json.loads((out / "gpu.json").read_text())
    assert result["device"] == "cpu" and list(result["variants"]) == variants
    for name, r in result["variants"].items():
        assert r["tokens_per_s"] > 0 and r["updates_timed"] == 2 and r["mfu"] is None, name
        assert r["gradient_checkpointing"] is name.endswith("-gc"), name
        assert r.get("fused_adamw", name.startswith("plain-")) is name.startswith("plain-"), name
    v = result["variants"]
    assert v["engine-acco-gc"]["final_loss"] == pytest.approx(v["engine-acco"]["final_loss"], rel=1e-3)
    assert v["plain-bf16-gc"]["final_loss"] == pytest.approx(v["plain-bf16"]["final_loss"], rel=1e-3)
    assert result["ratio_engine-acco-gc_over_plain-bf16-gc"] > 0
    assert "| plain-bf16-gc |" in (out / "gpu.md").read_text()
    # The state each holds, which the GPU run's peak memory is checked against (docs/algorithm.md,
    # bytes per parameter): the plain loop 8 in bf16 (parameters, gradients, moments), 16 in fp32;
    # acco at W = 1, bf16: 6 model-sized and 24 shard-sized (its flat buffers padded a little)
    from acco.models import build_model
    from acco_bench.settings import model_settings

    n = sum(p.numel() for p in build_model(model_settings("tiny"), vocab_size=2048).parameters())
    assert v["plain-bf16"]["state_mb"] * 2**20 == 8 * n and v["plain-autocast"]["state_mb"] * 2**20 == 16 * n
    assert v["engine-acco"]["state_mb"] * 2**20 == pytest.approx(30 * n, rel=0.01)
    assert result["memory_accounting"] == {}  # peak memory is measured on CUDA only


def test_memory_accounting_sets_the_peak_difference_against_the_state_difference():
    """The issue's GPU run: 6.8 against 3.8 GB peak, acco 34 bytes per parameter against 8 at 124.4M."""
    from acco_bench.gpu import memory_accounting

    p = 124_412_160 / 2**20
    v = {"engine-acco": {"peak_gpu_mem_mb": 6.8e9 / 2**20, "state_mb": 34 * p},
         "plain-bf16": {"peak_gpu_mem_mb": 3.8e9 / 2**20, "state_mb": 8 * p},
         "plain-bf16-compiled": {"peak_gpu_mem_mb": 3000.0, "state_mb": 8 * p}}  # fmt: skip
    m = memory_accounting(v)  # engine-acco-compiled not run: no pair for it
    assert list(m) == ["engine-acco_over_plain-bf16"]
    assert m["engine-acco_over_plain-bf16"]["state_difference_mb"] == pytest.approx(26 * p)
    assert 0.9 <= m["engine-acco_over_plain-bf16"]["ratio"] <= 1.1
    assert memory_accounting({k: dict(r, peak_gpu_mem_mb=None) for k, r in v.items()}) == {}  # the CPU


# ---- no workers: argument checks and the arithmetic of the report -------------------------------


def test_bad_arguments_fail_with_one_line(tmp_path, capsys):
    assert main(["cluster", "--loopback", "--grad-accum", "3", "--out", str(tmp_path)]) == 2
    assert "--grad-accum must be even" in capsys.readouterr().err
    assert main(["cluster", "--loopback", "--slow-worker", "5:2", "--out", str(tmp_path)]) == 2
    assert "--slow-worker rank 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cluster", "--methods", "ddp,zero3"])
    capsys.readouterr()
    # a worker config that cannot run (a misspelt key; a key of acco's given to ddp): before any run
    out = tmp_path / "never"
    for override, said in (("train.batch_sise=2", "unknown config key 'train.batch_sise'"),
                           ("train.estimate_comm=int8", "train.estimate_comm=int8 applies to acco's estimate "
                                                        "round only")):  # fmt: skip
        cmd = ["cluster", "--loopback", "--methods", "ddp,acco", "--override", override, "--out", str(out)]
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"acco-bench: ddp's workers cannot run: {said}"), err
        assert err.count("\n") == 1 and not out.exists(), err
    assert main(["faults", "--override", "train.lr=1", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("acco-bench: the job cannot run: unknown config key 'train.lr'")
    for bad, said in (("--params=-5", "--params takes a model (llama-13b, llama-7b, gpt-neo-2.7b, "
                                      "gpt-neo-125m) or a parameter count above 0 such as 13e9, got '-5'"),
                      ("--compute-s=nan", "--compute-s must be a finite number above 0, got nan"),
                      ("--comm-s=inf", "--comm-s must be a finite number 0 or more, got inf")):  # fmt: skip
        assert main(["map", "--compute-s", "1", "--comm-s", "0.5", bad]) == 2
        assert capsys.readouterr().err == f"acco-bench: {said}\n"
    for broken in ("{bad", "{}"):  # `report` on a bench.json that is not a result: one line, exit 2
        (tmp_path / "bench.json").write_text(broken)
        assert main(["report", str(tmp_path)]) == 2
        assert capsys.readouterr().err.startswith(f"acco-bench: {tmp_path}: not a finished acco-bench result")


def test_without_namespaces_it_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(
        namespaces, "netns_unavailable_reason", lambda: "Network namespaces need root (test)."
    )
    assert main(["cluster", "--methods", "ddp", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "need root" in err and "--loopback" in err


def test_metrics_and_comparisons_from_timers(tmp_path):
    """method_metrics reads the trainer's files: medians, critical-path compute, smallest comm."""
    settings = BenchSettings(hosts=2, batch_size=4, max_length=8)
    run = tmp_path / "run"
    (run / "workers").mkdir(parents=True)
    lines = []
    for step in range(1, 6):
        lines.append({"type": "train", "step": step, "samples": 4 * step, "tokens": 4 * step * 32,
                      "loss": 1.0, "lr": 1e-3, "wall_time": 1.0 * step, "compute_s": 0.6, "wait_s": 0.4,
                      "comm_s": 0.4, "micro_batches": [2, 2]})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    for rank, (c, m) in enumerate(((0.6, 0.4), (0.5, 0.45))):
        rows = [
            {"step": s, "compute_s": c, "wait_s": m, "comm_s": m, "micro_batches": [2, 2]}
            for s in range(1, 6)
        ]
        (run / "workers" / f"rank{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "summary.json").write_text(json.dumps({"final_eval_loss": 2.5, "peak_rss_mb": 10.0}))
    res = method_metrics(run, settings)
    assert res["step_time_s"] == pytest.approx(1.0)
    assert res["compute_s_per_update"] == pytest.approx(0.6)  # the slowest worker
    assert res["comm_s_per_update"] == pytest.approx(0.4)  # the smallest over workers
    assert res["overlap_efficiency"] == pytest.approx(0.6)
    assert res["samples_per_s"] == pytest.approx(16.0)  # 4 micro-batches of 4 sequences per second
    assert res["tokens_per_s"] == pytest.approx(16.0 * 8)
    assert res["micro_batches_per_update_by_worker"] == [2, 2]
    # the CPU's process memory under its own name, never read as the GPU's
    assert res["peak_rss_mb"] == 10.0 and res["peak_gpu_mem_mb"] is None
    methods = {"ddp": dict(res), "acco": dict(res, step_time_s=0.5, samples_per_s=32.0)}
    out = add_comparisons(methods)
    assert out["bounds"]["ideal_overlap"] == pytest.approx(1.0 / 0.6)
    assert out["bounds"]["ideal_acco"] == pytest.approx(1.0 / 0.8)
    assert methods["acco"]["speedup_step_vs_ddp"] == pytest.approx(2.0)
    assert methods["acco"]["speedup_samples_vs_ddp"] == pytest.approx(2.0)


def test_timeout_kills_the_workers(tmp_path, monkeypatch):
    """A worker that never finishes is killed at the timeout, with a clear error."""
    script = tmp_path / "hang.py"
    script.write_text("import time\nwhile True: time.sleep(1)\n")
    monkeypatch.setenv(WORKER_ENV, f"{sys.executable} {script}")
    settings = BenchSettings(hosts=2, loopback=True, timeout_s=1.5, methods=("ddp",))
    with Network(2, None, None, loopback=True) as net:
        with pytest.raises(BenchError, match="timed out"):
            run_workers(settings, "ddp", tmp_path / "ddp", net)
    for log in (tmp_path / "ddp" / "logs").iterdir():
        assert log.exists()
    # nothing of ours still runs that script
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(script) not in ps
    assert os.environ.get(WORKER_ENV)  # monkeypatch restores it afterwards


def test_batch_size_settings_keep_the_samples():
    from acco_bench.convergence import batch_size_settings

    s = BenchSettings(nb_steps_tot=100, batch_size=8, eval_step=10, grad_accum=4)
    one = batch_size_settings(s, 1)
    assert (one.batch_size, one.nb_steps_tot, one.eval_step, one.grad_accum) == (1, 800, 80, 4)
    assert batch_size_settings(s, 8) == s
    with pytest.raises(BenchError, match="does not divide"):
        batch_size_settings(s, 3)


@pytest.mark.slow
def test_convergence_at_small_batch_sizes(tmp_path):
    out = tmp_path / "bs"
    code = main(["convergence", "--data", "synthetic", "--seeds", "0", "--methods", "ddp,acco",
                 "--eval-step", "2", "--batch-sizes", "2,4", "--out", str(out), *TINY])
    assert code == 0
    table = json.loads((out / "batch_sizes.json").read_text())
    assert list(table["sizes"]) == ["2", "4"] and table["config"]["samples"] == 16 * 4
    assert table["sizes"]["2"]["nb_steps_tot"] == 32 and table["sizes"]["2"]["eval_step"] == 4
    for b in ("2", "4"):
        conv = json.loads((out / f"bs{b}" / "convergence.json").read_text())
        assert conv["config"]["batch_size"] == int(b)
        # the last evaluation of every method at the same samples (sequences), whatever the size
        assert conv["curves"]["ddp"]["0"][-1][0] == conv["curves"]["acco"]["0"][-1][0] == 64
        assert table["sizes"][b]["final_eval_loss"]["acco"]["paired_diff_vs_ddp"]["n"] == 1
    md = (out / "batch_sizes.md").read_text()
    assert "| 2 | 32 |" in md and "| 4 | 16 |" in md
    assert main(["convergence", "--batch-sizes", "3", "--data", "synthetic", "--out", str(out), *TINY]) == 2


def test_gpu_refuses_an_unknown_variant_before_running_any_and_reports_as_it_goes(tmp_path, monkeypatch):
    """A typo in --variants is one line and exit 2 before anything runs (not after minutes of
    compiling on a lent GPU); each variant's figures are written as soon as it is measured, so a run
    cut short by a time limit keeps what it measured."""
    import acco_bench.gpu

    out = tmp_path / "gpu"
    tiny = ["gpu", "--device", "cpu", "--model", "tiny", "--batch-size", "2", "--max-length", "16",
            "--steps", "2", "--warmup", "1", "--out", str(out)]  # fmt: skip
    ran = []
    monkeypatch.setattr(acco_bench.gpu, "run_engine", lambda *a, **k: ran.append(a) or {})
    assert main([*tiny, "--variants", "engine-acco,plain-bf17-compiled"]) == 2
    # and before the no-CUDA skip and the processes of --nproc
    assert main(["gpu", "--variants", "engine-acco-compild", "--nproc", "2", "--out", str(out)]) == 2
    assert ran == [] and not out.exists()

    monkeypatch.undo()

    def cut_short(*a, **k):  # what `timeout`'s signal does to the process mid-variant
        raise KeyboardInterrupt

    monkeypatch.setattr(acco_bench.gpu, "run_plain", cut_short)
    assert main([*tiny, "--variants", "engine-acco,plain-bf16"]) == 130
    result = json.loads((out / "gpu.json").read_text())
    assert list(result["variants"]) == ["engine-acco"]
    assert result["variants"]["engine-acco"]["tokens_per_s"] > 0
    assert "| engine-acco |" in (out / "gpu.md").read_text()
