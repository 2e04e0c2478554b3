"""``acco-bench cluster`` and ``acco-bench sweep``: the methods side by side on an emulated cluster.

Each of N emulated hosts (:class:`~acco_bench.network.EmulatedCluster`: a network namespace whose
link is shaped with ``tc``) runs one training worker (``--nodes R --workers-per-node S``: S workers
per host, unshaped between them, each method's ``node_link_bytes_per_update`` measured on the
hosts' links), ``python -m acco.cli train=METHOD ...`` with
torchrun's variables set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` = host 0's address, ...), so
the gradients and parameters of every comm round cross the shaped links as real gloo traffic. The
methods run one after the other on one cluster with identical settings (model, data, seed,
samples, effective batch), each bounded in time; every worker writes its own per-update timers
(``workers/rank{r}.jsonl``) and rank 0 the run's ``metrics.jsonl`` and ``summary.json``, from
which :func:`~acco_bench.analysis.method_metrics` derives the figures of ``bench.json``.

Where namespaces cannot be made (not root, no iproute2, no shaping qdisc) the harness says why and
stops, unless ``--loopback`` asks for unshaped local processes on 127.0.0.1. Kernels without
``netem`` shape the rate with ``tbf`` and add the latency with :mod:`acco_bench.network.delayline` (the
outputs say which).

Effective batch: ``grad_accum`` is the number of micro-batches per worker and per optimizer update
for ddp, torch-ddp, dpu and wp; acco runs ``grad_accum / 2`` per round, since one acco update takes
two rounds (the paper's Table 5: acco 2 against ddp 4).

This module runs the benchmark: every method in turn (:func:`run_bench`), each one's workers
started by :func:`acco_bench.workers.run_workers`, and the sweeps by rate (:func:`run_sweep`) and by
comm share (:func:`run_share_sweep`, each point calibrated by :mod:`acco_bench.comm_share`). A
run's settings are in :mod:`acco_bench.settings`, the network its workers start on in
:mod:`acco_bench.network`, and the figures read from their files in :mod:`acco_bench.analysis`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from acco_bench import BenchError, drift
from acco_bench.analysis import add_comparisons, combine_repeats, method_metrics, node_link_fields
from acco_bench.network import Network, parse_rate
from acco_bench.settings import BenchSettings
from acco_bench.workers import LoadMeter, check_worker_available, run_workers, worker_command

RETRY_PAUSE_S = 20.0


def _run_once(settings: BenchSettings, method: str, run_dir: Path, net: Network) -> dict:
    """One run of ``method`` in a clean ``run_dir``: its figures, load and compute per micro-batch."""
    if run_dir.exists():  # the trainer appends to metrics.jsonl: start clean
        shutil.rmtree(run_dir)
    load = LoadMeter()
    before = net.tx_bytes()
    wall = run_workers(settings, method, run_dir, net, load)
    after = net.tx_bytes()
    res = method_metrics(run_dir, settings)
    sent = [b - a for a, b in zip(before, after)] if before is not None else None
    res.update(node_link_fields(sent, res["updates"]))
    res.update(harness_wall_s=wall, load=load.result(), run_dir=str(run_dir),
               compute_s_per_micro_batch=drift.compute_per_micro_batch(run_dir))
    return res


def run_bench(settings: BenchSettings, out: Path, net: Network | None = None, log=print,
              calibration: dict | None = None) -> dict:
    """Run every method of ``settings`` on ``net`` (made and torn down here when None) and write
    ``out/bench.json``, ``out/bench.md`` and the plots. Returns the bench.json content. A method
    that fails or times out is recorded with its error and the others still run. With
    ``settings.comm_share`` the rate is calibrated first (acco_bench/comm_share.py), unless
    ``calibration`` says how ``net`` was set already."""
    from acco_bench import comm_share, report

    settings.validate()
    check_worker_available()
    out.mkdir(parents=True, exist_ok=True)
    own = net is None
    if own:
        bw = None if settings.comm_share is not None else settings.bandwidth
        net = Network(settings.hosts, bw, settings.latency, settings.loopback, settings.workers_per_node)
    try:
        if settings.comm_share is not None and calibration is None:
            calibration = comm_share.calibrate(settings, net, settings.comm_share, out / "calibration", log)
            settings = replace(settings, bandwidth=calibration["rate"])
        log(f"[acco-bench] {net.note}")
        # ddp's compute per micro-batch in the calibration's probes, then every checked run's (drift.py)
        probe_values = [p.get("compute_s_per_micro_batch")
                        for p in ((calibration["unshaped"], *calibration["probes"]) if calibration else ())]
        accepted: list[float | None] = []
        runs: dict[str, list[dict]] = {m: [] for m in settings.methods}
        for rep in range(settings.repeats):
            for method in settings.methods:
                run_dir = out / method if settings.repeats == 1 else out / method / f"rep{rep}"
                log(
                    "[acco-bench] "
                    f"{method}{f' (repeat {rep + 1}/{settings.repeats})' if settings.repeats > 1 else ''}: "
                    f"{settings.workers} workers, {settings.grad_accum_for(method)} micro-batches per "
                    f"{'round' if method == 'acco' else 'update'} of "
                    f"{settings.batch_size}x{settings.max_length} tokens, "
                    f"nb_steps_tot={settings.nb_steps_tot}"
                )
                try:
                    once = functools.partial(_run_once, settings, method, run_dir, net)
                    res = drift.run_until_undisturbed(once, method, probe_values + accepted,
                                                      settings.retry_disturbed, RETRY_PAUSE_S, log)
                except BenchError as e:
                    log(f"[acco-bench] {method} FAILED: {e}")
                    res = {"error": str(e)}
                runs[method].append(res)
                if "error" not in res:  # a disturbed run kept was named by run_until_undisturbed
                    if drift.checked(method):
                        accepted.append(res["compute_s_per_micro_batch"])
                    log(
                        f"[acco-bench] {method}: step {res['step_time_s']:.3f} s, compute "
                        f"{res['compute_s_per_update']:.3f} s, comm {res['comm_s_per_update']:.3f} s, "
                        f"overlap eff. {res['overlap_efficiency']:.2f}, {res['samples_per_s']:.1f} samples/s"
                    )
        methods = {m: combine_repeats(rs) for m, rs in runs.items()}
        compute_ref = drift.mark(methods, probe_values)
        if warned := drift.warning(methods):
            log(f"[acco-bench] {warned} (bench.md)")
        comparisons = add_comparisons(methods, settings)
        shares = comm_share.share_fields(settings.comm_share, comm_share.ddp_share(methods), net.bandwidth,
                                         calibration)
        bench = {
            "config": {**settings.describe(), "network": net.describe(),
                       "machine": machine_description(), "worker_command": worker_command()},
            **shares,
            "compute_reference_s_per_micro_batch": compute_ref,
            "methods": methods,
            **comparisons,
        }
    finally:
        if own:
            net.close()
    (out / "bench.json").write_text(json.dumps(bench, indent=2, default=str) + "\n")
    report.write_bench_report(bench, out)
    return bench


def rerender(out: Path) -> dict:
    """Recompute ``out/bench.json``'s figures from the run folders it lists (after a change to the
    analysis) and write bench.json, bench.md and the plots again; what was measured only while it
    ran (loads, drift, retries) is kept."""
    from acco_bench import report

    bench = json.loads((out / "bench.json").read_text())
    cfg = dict(bench["config"])
    keys = {f for f in BenchSettings.__dataclass_fields__}
    settings = BenchSettings(**{k: v for k, v in cfg.items() if k in keys})
    settings.methods = tuple(cfg["methods"])
    methods = {}
    for name, old in bench["methods"].items():
        if "error" in old:
            methods[name] = old
            continue
        reps = old.get("repeats") or [old]
        dirs = sorted((out / name).glob("rep*")) or [out / name]
        results = []
        for i, d in enumerate(dirs):
            rep = reps[i] if i < len(reps) else {}
            # what was measured while it ran (load, drift, retries) is kept; the rest recomputed
            res = {**rep, **method_metrics(d, settings)}
            res["run_dir"] = str(d)
            res["load"] = rep.get("load") or old.get("load")
            results.append(res)
        methods[name] = combine_repeats(results)
        for key, value in old.items():  # the same for what the run added beside the repetitions
            methods[name].setdefault(key, value)
    bench["methods"] = methods
    bench.update(add_comparisons(methods, settings))
    (out / "bench.json").write_text(json.dumps(bench, indent=2, default=str) + "\n")
    report.write_bench_report(bench, out)
    return bench


def machine_description() -> dict:
    import platform

    try:
        import torch

        tv = torch.__version__
    except ImportError:  # pragma: no cover
        tv = None
    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu_model": model, "torch": tv, "python": platform.python_version(),
            "platform": platform.platform(), "backend": "gloo"}


# --------------------------------------------------------------------------------------------
# the sweep


def sweep_label(bw: str | None) -> str:
    return "unshaped" if bw is None else bw


def run_sweep(settings: BenchSettings, bandwidths: Sequence[str | None], out: Path, log=print) -> dict:
    """One :func:`run_bench` per bandwidth (``None``: unshaped veth links; on loopback when
    namespaces are unavailable and ``settings.loopback``), then ``sweep.json``, ``sweep.md`` and
    the speedup plot."""
    settings.validate()
    check_worker_available()
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for bw in bandwidths:
        label = sweep_label(bw)
        if settings.loopback and bw is not None:
            log(f"[acco-bench] sweep: {label} skipped: --loopback cannot shape links")
            continue
        s = BenchSettings(**{**asdict(settings), "bandwidth": bw})
        s.methods = tuple(settings.methods)
        s.slow_worker = settings.slow_worker
        log(f"[acco-bench] sweep point {label}")
        bench = run_bench(s, out / label.replace("/", "_"), log=log)
        points.append({"label": label, "bandwidth": bw,
                       "bandwidth_bps": parse_rate(bw) if bw else None, "bench": bench})
    return write_sweep(settings, [sweep_label(b) for b in bandwidths], points, out)


def write_sweep(settings: BenchSettings, labels: list[str], points: list[dict], out: Path) -> dict:
    """``sweep.json``, ``sweep.md`` and the speedup plot of the points of a sweep (one bench.json each)."""
    from acco_bench import report

    sweep = {
        "config": {
            **settings.describe(),
            "bandwidths": labels,
            "machine": machine_description(),
        },
        "points": [
            {
                "label": p["label"],
                "bandwidth_bps": p["bandwidth_bps"],
                **{k: p["bench"].get(k) for k in ("comm_share_asked", "comm_share_measured", "rate")},
                "network": p["bench"]["config"]["network"],
                "bounds": p["bench"].get("bounds", {}),
                "methods": {
                    m: {k: v for k, v in r.items() if k not in ("summary", "timers_by_worker")}
                    for m, r in p["bench"]["methods"].items()
                },
            }
            for p in points
        ],
    }
    (out / "sweep.json").write_text(json.dumps(sweep, indent=2, default=str) + "\n")
    report.write_sweep_report(sweep, out)
    return sweep


def run_share_sweep(settings, shares, out: Path, log=print) -> dict:
    """``acco-bench sweep --comm-shares``: one calibration and one :func:`run_bench` per share, on one
    network (its unshaped probe shared), then ``sweep.json``, ``sweep.md`` and the plots."""
    from acco_bench.comm_share import calibrate, check_share, rate_label

    settings.validate()
    for s in shares:
        check_share(s)
    if settings.loopback:
        raise BenchError("--comm-shares needs emulated hosts: on loopback there is no link to set")
    check_worker_available()
    out.mkdir(parents=True, exist_ok=True)
    points = []
    with Network(settings.hosts, None, settings.latency, settings.loopback, settings.workers_per_node) as net:
        base = None
        for share in shares:
            label = f"share {share:.2f}"
            cal = calibrate(settings, net, share, out / "calibration", log, unshaped=base)
            base = cal["unshaped"]
            s = replace(settings, bandwidth=cal["rate"], comm_share=share)
            log(f"[acco-bench] sweep point {label}: {rate_label(cal['rate'])}")
            bench = run_bench(s, out / f"share-{share:.2f}", net=net, log=log, calibration=cal)
            points.append({"label": label, "bandwidth": cal["rate"], "bandwidth_bps": parse_rate(cal["rate"]),
                           "bench": bench})
    return write_sweep(settings, [p["label"] for p in points], points, out)
