"""The figures of a benchmark run, read from the files its workers wrote: :func:`method_metrics`
(one method's run: step time, compute and comm per update, throughput), :func:`combine_repeats`
(the repetition that stands for a method) and :func:`add_comparisons` (speedups over ddp and
torch-ddp, overlap bounds, time to a target loss)."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from pathlib import Path

from acco_bench import BenchError
from acco_bench.acco_bound import acco_formula, acco_update_time, method_acco_spec
from acco_bench.settings import BenchSettings, split_nodes

COMM_MEASURES = {
    "ddp": "time inside the comm round (reduce-scatter, optimizer step, all-gather), computation waiting",
    "torch-ddp": "ZeroRedundancyOptimizer's step and parameter broadcast only: DDP's bucketed all-reduce "
                 "runs inside backward and is counted in compute_s_per_update",
    "acco": "the comm thread's busy time for both rounds of an update (estimate and update)",
    "overlapped": "the comm thread's busy time for the update's round",
}
BUSY_CORES = 0.15  # other processes' CPU use (cores) above which a run is flagged as disturbed


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


def summary_stats(values: list[float]) -> dict:
    """n, the values, mean, std, min and max of the finite values (None and nan/inf left out)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"n": 0, "values": []}
    return {
        "n": len(values),
        "values": values,
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def nodes_comm(settings: BenchSettings | None, method: str, c: float, m: float) -> float:
    """ddp's comm M per update (the flat ring's) as ``method``'s rounds would take it: on emulated nodes
    an X-nodes method's two-level rounds send (R-1)/R of the payload through the node links instead of
    (W-1)/W (acco_bench/map_bounds.py's round_comm)."""
    from acco_bench.map_bounds import Case, round_comm

    if settings is None or not split_nodes(method)[1]:
        return m
    k = Case(c=c, m=m, workers=settings.workers, workers_per_node=settings.workers_per_node, rounds="nodes")
    return round_comm(k)[0]


def node_link_fields(sent: list[int] | None, updates: int) -> dict:
    """The bytes through the links between hosts (nodes), measured: ``sent`` is each host's tx
    counter over a method's run (every packet that left the host's namespace: the rounds, the
    evaluations' all-reduce, the rendezvous, TCP/IP headers; the traffic between the workers of one
    host stays inside it), per committed update over all links and per node. None on loopback."""
    if sent is None or not updates:
        return {"node_link_bytes": sent, "node_link_bytes_per_update": None,
                "node_link_bytes_per_node_per_update": None}
    total = sum(sent) / updates
    return {"node_link_bytes": sent, "node_link_bytes_per_update": total,
            "node_link_bytes_per_node_per_update": total / len(sent)}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def own_micro_batches(value, rank: int):
    """A worker file's micro_batches: its own count, or the per-worker list."""
    if isinstance(value, list):
        return value[rank] if rank < len(value) else None
    return value


def method_metrics(run_dir: Path, settings: BenchSettings, skip: int = 1) -> dict:
    """The figures of one method's run, from its own timers.

    - ``step_time_s``: median seconds between consecutive updates (rank 0's wall clock);
    - ``compute_s_per_update``: median over updates of the slowest worker's compute time (the
      critical path);
    - ``comm_s_per_update``: median over updates of the smallest comm time over workers: ddp's
      time inside its comm round, an overlapped method's comm-thread busy time (acco: both
      rounds); the worker that reached the round last waited least in it, so its figure is the
      round itself rather than the wait for a slower worker;
    - ``overlap_efficiency`` = max(compute, comm) / step_time;
    - ``samples_per_s``, ``tokens_per_s``: steady state, between the end of update ``skip`` and
      the last (the first update holds connection set-up and acco's non-overlapped warm start);
      the whole run's figures from ``summary.json`` are kept as ``*_overall``.

    The first ``skip`` updates are left out of the medians when at least ``skip + 2`` exist.
    """
    summary, train, evals, workers = _read_run(run_dir)
    if len(train) < skip + 2:
        skip = 0
    steady = train[skip:]
    steps = [r["step"] for r in steady]

    def per_update(key: str, reduce):
        vals = []
        for s in steps:
            xs = [w[s][key] for w in workers.values() if s in w and w[s].get(key) is not None]
            if xs:
                vals.append(reduce(xs))
        if not vals:  # no worker files: rank 0's own record
            vals = [r.get(key) for r in steady]
        return _median(vals)

    step_time = _step_time(train, skip, summary)
    compute = per_update("compute_s", max)
    comm = per_update("comm_s", min)
    wait = per_update("wait_s", statistics.mean)
    eff = max(compute, comm) / step_time if step_time and compute is not None and comm is not None else None

    # The trainer counts micro-batches in "samples"; here a sample is a sequence.
    seq = settings.batch_size
    first = train[skip - 1] if skip > 0 else {"wall_time": 0.0, "samples": 0}
    last = train[-1]
    span = last["wall_time"] - first["wall_time"]
    samples_ps = (last["samples"] - first["samples"]) * seq / span if span > 0 else None
    tokens_ps = samples_ps * settings.max_length if samples_ps is not None else None
    by_worker = _by_worker(workers, steady, steps, settings, span, summary)
    mb_by_worker, per_worker_sps, per_worker_timers = by_worker
    final_eval = summary.get("final_eval_loss")
    if final_eval is None and evals:
        final_eval = evals[-1].get("eval_loss")
    return {
        "step_time_s": step_time,
        "samples_per_s": samples_ps,
        "tokens_per_s": tokens_ps,
        "compute_s_per_update": compute,
        "comm_s_per_update": comm,
        # what comm_s_per_update measures, per method (torch-ddp's all-reduce runs inside backward)
        "comm_s_measures": COMM_MEASURES.get(summary.get("method"), COMM_MEASURES["overlapped"]),
        "wait_s_per_update": wait,
        "overlap_efficiency": eff,
        "final_eval_loss": final_eval,
        "peak_rss_mb": summary.get("peak_rss_mb"),  # the CPU's peak resident memory, per process
        "peak_gpu_mem_mb": summary.get("peak_gpu_mem_mb"),  # the GPU allocator's peak
        "micro_batches_per_update_by_worker": mb_by_worker,
        "samples_per_s_by_worker": per_worker_sps,
        "timers_by_worker": per_worker_timers,
        "updates": len(train),
        "updates_in_medians": len(steady),
        "samples": last.get("samples", 0) * seq,  # sequences over all workers
        "micro_batches_total": last.get("samples"),
        "final_train_loss": last.get("loss"),
        "wall_time_s": summary.get("wall_time_s", last["wall_time"]),
        "samples_per_s_overall": summary["samples_per_s"] * seq if summary.get("samples_per_s") else None,
        "tokens_per_s_overall": summary.get("tokens_per_s"),
        "summary": summary,
        # [wall_time_s, samples (sequences), training loss] per update, for time-to-loss figures
        "curve": [[r["wall_time"], r["samples"] * seq, r["loss"]] for r in train],
    }


def _read_run(run_dir: Path) -> tuple[dict, list[dict], list[dict], dict[int, dict]]:
    """A run folder's summary.json, rank 0's train and eval records, and each worker's records by
    update (workers/rank*.jsonl)."""
    summary = {}
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in metrics if r.get("type") == "train"]
    evals = [r for r in metrics if r.get("type") == "eval"]
    workers = {}
    for path in sorted((run_dir / "workers").glob("rank*.jsonl")):
        with contextlib.suppress(ValueError):
            workers[int(path.stem[4:])] = {r["step"]: r for r in read_jsonl(path) if "step" in r}
    if not train:
        raise BenchError(f"{run_dir}: no training records in metrics.jsonl")
    return summary, train, evals, workers


def _step_time(train: list[dict], skip: int, summary: dict) -> float | None:
    """The median seconds between consecutive updates after the first `skip` (rank 0's clock)."""
    walls = [r["wall_time"] for r in train]
    diffs = [b - a for a, b in zip(walls[skip:], walls[skip + 1:])] if len(train) > 1 else []
    if skip == 0 and walls:
        diffs = [walls[0]] + diffs
    return _median(diffs) if diffs else summary.get("step_time_s")


def _by_worker(workers: dict, steady: list[dict], steps: list[int], settings: BenchSettings, span: float,
               summary: dict) -> tuple[list | None, list | None, dict]:
    """Each worker's micro-batches per update, samples per second over the steady span, and median
    timers."""
    mbs = [r.get("micro_batches") for r in steady if isinstance(r.get("micro_batches"), list)]
    n_workers = len(mbs[0]) if mbs else settings.workers
    mb_by_worker = ([statistics.mean(m[i] for m in mbs) for i in range(n_workers)] if mbs
                    else summary.get("micro_batches_per_update_by_worker"))
    # per-worker throughput: that worker's samples per second over the steady span
    per_worker_sps = None
    if mbs and span > 0:
        per_worker_sps = [sum(m[i] for m in mbs) * settings.batch_size / span for i in range(n_workers)]
    per_worker_timers = {}
    for rank, w in sorted(workers.items()):
        rows = [w[s] for s in steps if s in w]
        counts = [own_micro_batches(r.get("micro_batches"), rank) for r in rows]
        per_worker_timers[str(rank)] = {
            "compute_s_per_update": _median(r.get("compute_s") for r in rows),
            "wait_s_per_update": _median(r.get("wait_s") for r in rows),
            "comm_s_per_update": _median(r.get("comm_s") for r in rows),
            "micro_batches_per_update": (statistics.mean(counts) if counts and None not in counts else None),
        }
    return mb_by_worker, per_worker_sps, per_worker_timers


def combine_repeats(results: list[dict]) -> dict:
    """One method's repetitions: the figures of the repetition with the median step time (so they
    stay consistent with each other), chosen among the undisturbed repetitions when there are any
    (other processes below BUSY_CORES, and not kept disturbed by drift.run_until_undisturbed: a
    machine whose speed moved), every repetition's step time and samples/s alongside."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[-1]
    if len(results) == 1:
        return ok[0]
    quiet = [r for r in ok if not r.get("disturbed")
             and ((r.get("load") or {}).get("other_cpu_cores") or 0.0) <= BUSY_CORES]
    pool = sorted(quiet or ok, key=lambda r: r["step_time_s"] or float("inf"))
    chosen = dict(pool[(len(pool) - 1) // 2])
    chosen["repeats"] = [
        {
            k: r.get(k)
            for k in (
                "step_time_s",
                "samples_per_s",
                "compute_s_per_update",
                "comm_s_per_update",
                "load",
                "error",
                "disturbed",
                "run_dir",
            )
        }
        for r in results
    ]
    chosen["repeats_used"] = len(pool)
    return chosen


def _running_mean(xs: list[float], k: int = 3) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def add_comparisons(methods: dict, settings: BenchSettings | None = None) -> dict:
    """Speedups of every method over ddp and torch-ddp (ratios of the same run), and the overlap
    bounds computed from ddp's own compute C and comm M.

    - ``speedup_step_vs_X`` = step_time(X) / step_time(method) (same effective batch);
    - ``speedup_samples_vs_X`` = samples/s(method) / samples/s(X) (what to compare when the batch
      per update varies, with ``--accumulate-while-waiting`` or a slow worker);
    - ``ideal_overlap`` = (C+M)/max(C,M): the bound for a method that overlaps one comm round per
      update (dpu, wp); ``ideal_acco`` = (C+M)/max(C,2M): plain acco's, TWO full rounds per update
      (an estimate round and an update round, each moving the whole gradient and parameter vector),
      so its bound is lower once M > C/2;
    - every acco variant's own bound, from the overrides its workers ran with (``settings``; None:
      the defaults): ``bound_speedup`` = (C+M) / ``acco_update_time`` (its estimate round in full or
      int8, its split of the update's micro-batches), ``fraction_of_bound`` = its measured speedup
      over ddp (per update; samples/s with accumulate_while_waiting) / ``bound_speedup``, with
      ``bound_formula``, ``bound_terms`` and ``bound_spec`` (M's latency part unknown: taken as 0,
      so an int8 estimate round's bound is optimistic).
    """
    out = {"bounds": {}}
    ddp = methods.get("ddp")
    if ddp and ddp.get("compute_s_per_update") and ddp.get("comm_s_per_update") is not None:
        c, m = ddp["compute_s_per_update"], ddp["comm_s_per_update"]
        out["bounds"] = {
            "ddp_compute_s": c,
            "ddp_comm_s": m,
            "ddp_comm_fraction": m / (c + m) if c + m > 0 else None,
            "ideal_overlap": (c + m) / max(c, m),
            "ideal_acco": (c + m) / max(c, 2 * m),
        }
    # Time to reach a target training loss: the loss every method reaches (the highest of their final
    # losses, each the mean of its last 3 updates), first crossed by a 3-update running mean.
    finals = {n: _running_mean([c[2] for c in r["curve"]])[-1] for n, r in methods.items()
              if "error" not in r and r.get("curve")}
    if finals:
        target = max(finals.values())
        out["target_train_loss"] = target
        for n in finals:
            curve = methods[n]["curve"]
            smooth = _running_mean([c[2] for c in curve])
            hit = next((i for i, v in enumerate(smooth) if v <= target), None)
            methods[n]["time_to_target_loss_s"] = curve[hit][0] if hit is not None else None
            methods[n]["samples_to_target_loss"] = curve[hit][1] if hit is not None else None
    for name, res in methods.items():
        if "error" in res:
            continue
        for ref in ("ddp", "torch-ddp"):
            base = methods.get(ref)
            if not base or "error" in base:
                continue
            if res.get("step_time_s") and base.get("step_time_s"):
                res[f"speedup_step_vs_{ref}"] = base["step_time_s"] / res["step_time_s"]
            if res.get("samples_per_s") and base.get("samples_per_s"):
                res[f"speedup_samples_vs_{ref}"] = res["samples_per_s"] / base["samples_per_s"]
        b = out["bounds"]
        spec = method_acco_spec(settings or BenchSettings(), name)
        if b and res.get("speedup_step_vs_ddp"):
            res["fraction_of_ideal_overlap"] = res["speedup_step_vs_ddp"] / b["ideal_overlap"]
            # plain acco's two full rounds
            if spec and spec["estimate_comm"] == "full" and spec["split"] is None:
                res["fraction_of_ideal_acco"] = res["speedup_step_vs_ddp"] / b["ideal_acco"]
        if b and spec:
            c, m = b["ddp_compute_s"], b["ddp_comm_s"]
            res["bound_speedup"] = (c + m) / acco_update_time(c, nodes_comm(settings, name, c, m), **spec)
            res["bound_formula"], res["bound_terms"] = acco_formula(spec)
            res["bound_spec"] = spec
            measured = res.get("speedup_samples_vs_ddp" if spec["accumulate"] else "speedup_step_vs_ddp")
            res["fraction_of_bound"] = measured / res["bound_speedup"] if measured else None
    return out
