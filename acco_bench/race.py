"""``acco-bench race``: the wall-clock time every method needs to reach ddp's loss.

On the emulated cluster of ``acco-bench cluster`` (:class:`~acco_bench.network.Network`, the same
workers through :func:`~acco_bench.workers.run_workers`), in the paper's setting (acco, dpu and wp
keep accumulating micro-batches while their round runs: ``accumulate_while_waiting``, up to
``accumulate_cap``; the ``-uncapped`` variants without it):

1. ddp trains to its budget (``nb_steps_tot`` micro-batches over all workers); its final eval loss
   is the **target**;
2. every other method trains until an evaluation is at or below the target
   (``train.stop_at_eval_loss``), or stops at twice ddp's samples.

Every method evaluates every ``eval_step`` updates on the same eval batches. The crossing is
interpolated linearly (in loss) between the last evaluation above the target and the first at or
below it, in training time and in samples; ``crossing_bracket`` says how far apart those two
evaluations were, relative to the crossing time: the crossing is known to within it.

**Training time** is the engine's wall clock (from the start of training, after the set-up of
every rank) minus the seconds spent in earlier evaluations (each logged as ``eval_s``): an
evaluation runs between two updates with no comm round in flight, so it adds to the clock without
overlapping anything, and methods with more updates would otherwise pay for more evaluations.

**LR schedule**: constant after a linear warm-up by default. The schedule is a function of samples
seen, and its decay ends at a run's ``nb_steps_tot``: ddp's budget for ddp, the cap for the others.
A decaying schedule would therefore differ between ddp and the others (ending it at ddp's budget
instead would stop every method from moving past it, and the cap would mean nothing).
``--scheduler cosine`` or ``linear`` runs it anyway, with that caveat.

**A machine whose speed moves** between two methods' runs would make the ratios measure it: each
run's compute per micro-batch is checked against the runs before it and the calibration's probes,
a method off by more than 1.25x runs once more (``--retry-disturbed``), and one that stays off is
flagged ``drifted`` in bench.json and race.md (:mod:`acco_bench.drift`).

**Bytes sent per worker** are measured: the tx byte counter of each emulated host's link, read
before and after the run (every packet: the gradients and parameters, the rendezvous, the
evaluations' all-reduce, TCP/IP headers). On loopback there is no per-worker link: not measured.
On emulated nodes (``--nodes R --workers-per-node S``) a host's link carries its S workers' traffic
to the other nodes: **node_link_bytes_per_update** is those counters summed over the nodes, per
committed update (and ``node_link_bytes_per_node_per_update`` per node); the per-worker fields are
then None. ``X-nodes`` runs X's race settings with ``train.rounds=nodes``, X itself the flat ring.
**State bytes per worker** are the engine's ``state_bytes()`` on rank 0, as the trainer records it
in summary.json.
"""

from __future__ import annotations

import collections
import functools
import json
import shutil
import statistics
from dataclasses import replace
from pathlib import Path

from acco_bench import BenchError, drift
from acco_bench.analysis import node_link_fields, read_jsonl
from acco_bench.cluster import RETRY_PAUSE_S, machine_description
from acco_bench.network import Network
from acco_bench.race_report import plot_race, race_markdown, write_race_report  # noqa: F401 (re-exported)
from acco_bench.settings import BenchSettings, split_nodes
from acco_bench.workers import LoadMeter, check_worker_available, run_workers, worker_command

REFERENCE = "ddp"
RACE_METHODS = ("ddp", "torch-ddp", "acco", "diloco", "streaming-diloco")
# ddp's budget in micro-batches over all workers, per worker: the defaults' 60 updates of 4
# micro-batches on every worker, whatever the number of workers (480 at 2, 960 at 2 x 2), so a race
# on more workers trains as many updates (and DiLoCo syncs as often) as on 2, not half as many
RACE_BUDGET_PER_WORKER = 240
CAP_FACTOR = 2  # the other methods stop at this many times ddp's samples
# Per-method settings for the race's short runs (60 ddp updates), chosen by measurement
# (BENCHMARKS.md): DiLoCo's sync period from the H sweep (the configs' 50 suits long runs, here it
# would sync twice), torch-ddp's buckets from the bucket_cap_mb sweep (4 buckets or more on the
# 0.9M-parameter model: 7-10% faster per update than one). A key given with --override wins.
RACE_METHOD_DEFAULTS = {
    "diloco": {"train.sync_every": "10"},
    "streaming-diloco": {
        "train.sync_every": "20",
        "train.num_fragments": "4",
        "train.fragment_sync_delay": "1",
    },
    "torch-ddp": {"train.bucket_cap_mb": "1"},
}


# --------------------------------------------------------------------------------------------
# the curves and their crossing of the target


def crossing(points: list[tuple[float, float, float]], target: float) -> dict | None:
    """Where a curve of (training time s, samples, eval loss), in training order, first reaches
    ``target``: linearly interpolated in loss between the last point above it and the first at or
    below it. ``bracket_s`` is the time between those two evaluations (0 when the first point is
    already at the target). None when no point reaches it."""
    for i, (t, s, loss) in enumerate(points):
        if loss > target:
            continue
        if i == 0:
            return {"time_s": t, "samples": s, "bracket_s": 0.0, "bracket_samples": 0.0, "eval_index": 0}
        t0, s0, l0 = points[i - 1]
        frac = (l0 - target) / (l0 - loss)  # l0 > target >= loss, so 0 < frac <= 1
        return {"time_s": t0 + frac * (t - t0), "samples": s0 + frac * (s - s0), "bracket_s": t - t0,
                "bracket_samples": s - s0, "eval_index": i}
    return None


def eval_curve(run_dir: Path, batch_size: int) -> list[dict]:
    """A run's evaluations: update, samples (sequences, all workers), eval loss, and the training
    time at that update (its wall time minus the seconds of the evaluations before it)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    wall = {r["step"]: r["wall_time"] for r in rows if r.get("type") == "train"}
    curve, eval_s = [], 0.0
    for r in rows:
        if r.get("type") != "eval" or r["step"] not in wall:
            continue
        curve.append(
            {
                "step": r["step"],
                "samples": r["samples"] * batch_size,
                "eval_loss": r["eval_loss"],
                "time_s": wall[r["step"]] - eval_s,
                "wall_s": wall[r["step"]],
                "eval_s": r.get("eval_s"),
            }
        )
        eval_s += r.get("eval_s") or 0.0
    return curve


def eval_interval(curve: list[dict]) -> dict:
    """Median training seconds and samples between two evaluations, and an evaluation's seconds."""
    dt = [b["time_s"] - a["time_s"] for a, b in zip(curve, curve[1:])]
    ds = [b["samples"] - a["samples"] for a, b in zip(curve, curve[1:])]
    es = [c["eval_s"] for c in curve if c.get("eval_s") is not None]
    return {
        "median_s": statistics.median(dt) if dt else None,
        "median_samples": statistics.median(ds) if ds else None,
        "eval_s_median": statistics.median(es) if es else None,
        "evaluations": len(curve),
    }


def add_targets(methods: dict, target: float) -> None:
    """Each method's time and samples to the target, and the ratios to ddp's (in place)."""
    for res in methods.values():
        if "error" in res:
            continue
        hit = crossing([(c["time_s"], c["samples"], c["eval_loss"]) for c in res["eval_curve"]], target)
        res["reached_target"] = hit is not None
        res["time_to_target_s"] = hit["time_s"] if hit else None
        res["samples_to_target"] = hit["samples"] if hit else None
        res["crossing_bracket_s"] = hit["bracket_s"] if hit else None
        res["crossing_bracket"] = hit["bracket_s"] / hit["time_s"] if hit and hit["time_s"] > 0 else None
    ref = methods.get(REFERENCE) or {}
    for res in methods.values():
        if "error" in res:
            continue
        for key, out in (
            ("time_to_target_s", "time_to_target_vs_ddp"),
            ("samples_to_target", "samples_to_target_vs_ddp"),
        ):
            res[out] = res[key] / ref[key] if res.get(key) is not None and ref.get(key) else None


# --------------------------------------------------------------------------------------------
# the race


def _has_key(extra, key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in extra)


def method_defaults(method: str) -> dict[str, str]:
    """A method's race settings (RACE_METHOD_DEFAULTS): X-nodes has X's."""
    return RACE_METHOD_DEFAULTS.get(split_nodes(method)[0], {})


def race_overrides(settings: BenchSettings, budget: int, scheduler: str, eval_batches: int,
                   target: float | None, method: str = REFERENCE) -> tuple[str, ...]:
    """The race's own Hydra overrides for one method (a key the user set with --override wins)."""
    ours = {"train.scheduler_name": scheduler, "train.warmup": str(budget // 10),
            "train.max_eval_batches": str(eval_batches), **method_defaults(method)}
    if target is not None:
        ours["train.stop_at_eval_loss"] = repr(float(target))
    return tuple(f"{k}={v}" for k, v in ours.items() if not _has_key(settings.extra, k)) + tuple(
        settings.extra
    )


def _method_result(run_dir: Path, s: BenchSettings, wall: float, load: dict, sent: list[int] | None) -> dict:
    """A race run's figures from its folder; ``sent``: each host's tx bytes over the run."""
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    )
    curve = eval_curve(run_dir, s.batch_size)
    if not curve:
        raise BenchError(f"{run_dir}: no evaluation in metrics.jsonl")
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("type") == "train"]
    train_s = curve[-1]["time_s"]
    samples = train[-1]["samples"] * s.batch_size
    timers = (
        [json.loads(x) for x in (run_dir / "workers" / "rank0.jsonl").read_text().splitlines() if x.strip()]
        if (run_dir / "workers" / "rank0.jsonl").exists()
        else []
    )

    def median(key):
        xs = [r[key] for r in timers[1:] if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    per_worker = sent if s.workers_per_node == 1 else None  # one link per worker only then
    return {
        "final_eval_loss": curve[-1]["eval_loss"],
        "samples": samples,
        "updates": len(train),
        "training_time_s": train_s,
        "samples_per_training_s": samples / train_s if train_s > 0 else None,
        "stopped_at_target": summary.get("stopped_at_eval_loss"),
        "bytes_sent_per_worker": per_worker,
        "bytes_sent_per_worker_mean": statistics.fmean(per_worker) if per_worker else None,
        "bytes_sent_per_sample": statistics.fmean(per_worker) / samples if per_worker and samples else None,
        **node_link_fields(sent, len(train)),
        "state_bytes_per_worker": summary.get("state_bytes"),
        "compute_s_per_update": median("compute_s"),
        "comm_s_per_update": median("comm_s"),
        "wait_s_per_update": median("wait_s"),
        "compute_s_per_micro_batch": drift.compute_per_micro_batch(run_dir),  # rank 0's (drift.py)
        # acco: e per worker while the estimate round runs, per update (auto moves it)
        "estimate_micro_batches": dict(
            sorted(
                collections.Counter(
                    r["estimate_micro_batches"] for r in timers if r.get("estimate_micro_batches") is not None
                ).items()
            )
        ),
        "eval_interval": eval_interval(curve),
        "eval_curve": curve,
        "harness_wall_s": wall,
        "load": load,
        # every worker's CPU seconds by thread role (the training thread's includes its set-up and
        # evaluations) over the micro-batches all workers computed: what a round costs beside them
        "cpu_s_per_micro_batch": {role: cpu / max(1, train[-1]["samples"])
                                  for role, cpu in load.get("worker_cpu_s", {}).items()},
        "run_dir": str(run_dir),
    }


def _run_once(s: BenchSettings, method: str, run_dir: Path, net: Network, log) -> dict:
    """One run of ``method`` in a clean ``run_dir``, with its load and the bytes on each link."""
    if run_dir.exists():  # the trainer appends to metrics.jsonl: start clean
        shutil.rmtree(run_dir)
    load = LoadMeter()
    before = net.tx_bytes()
    exit_error = None
    try:
        wall = run_workers(s, method, run_dir, net, load)
    except BenchError as e:
        if not (run_dir / "summary.json").exists():
            raise
        # Training finished (rank 0 wrote summary.json) and a worker failed on its way out: the
        # figures are whole; the failure is recorded with them.
        exit_error, wall = str(e), None
        log(f"[acco-bench] {method}: a worker failed after training finished: {e.args[0].splitlines()[0]}")
    after = net.tx_bytes()
    sent = [b - a for a, b in zip(before, after)] if before is not None else None
    res = _method_result(run_dir, s, wall, load.result(), sent)
    if exit_error:
        res["worker_exit_error"] = exit_error
    return res


def run_race(settings: BenchSettings, out: Path, scheduler: str = "constant", eval_batches: int = 8,
             log=print) -> dict:
    """ddp to its budget, then every other method to ddp's final eval loss or twice ddp's samples;
    writes ``out/bench.json``, ``out/race.md`` and ``out/race.png``. A method that fails is recorded
    with its error and the others still run; ddp's failure stops the race (no target). With
    ``settings.comm_share`` the rate is calibrated first, on the race's own hosts (comm_share.py)."""
    from acco_bench import comm_share
    from acco_bench.analysis import method_metrics

    _check_race(settings)
    out.mkdir(parents=True, exist_ok=True)
    order = [REFERENCE, *(m for m in settings.methods if m != REFERENCE)]
    budget = settings.nb_steps_tot
    methods: dict[str, dict] = {}
    target, calibration, measured = None, None, None
    probe_values: list[float | None] = []  # ddp's compute per micro-batch in the calibration
    accepted: list[float | None] = []  # the same, of every checked method run so far (drift.py)
    share = settings.comm_share
    bw = None if share is not None else settings.bandwidth
    with Network(settings.hosts, bw, settings.latency, settings.loopback, settings.workers_per_node) as net:
        if share is not None:
            calibration = comm_share.calibrate(settings, net, share, out / "calibration", log)
            settings = replace(settings, bandwidth=calibration["rate"])
            probe_values = [p.get("compute_s_per_micro_batch")
                            for p in (calibration["unshaped"], *calibration["probes"])]
        log(f"[acco-bench] race: {net.note}")
        for method in order:
            ref = method == REFERENCE
            s = replace(
                settings,
                nb_steps_tot=budget if ref else CAP_FACTOR * budget,
                extra=race_overrides(
                    settings, budget, scheduler, eval_batches, None if ref else target, method
                ),
            )
            run_dir = out / method
            log(f"[acco-bench] {method}: " + (f"to its budget, {budget} micro-batches" if ref else
                f"to eval loss {target:.4f} or {s.nb_steps_tot} micro-batches"))
            try:
                once = functools.partial(_run_once, s, method, run_dir, net, log)
                methods[method] = drift.run_until_undisturbed(once, method, probe_values + accepted,
                                                              settings.retry_disturbed, RETRY_PAUSE_S, log)
            except BenchError as e:
                log(f"[acco-bench] {method} FAILED: {e}")
                methods[method] = {"error": str(e)}
                if ref:
                    break
                continue
            if drift.checked(method):
                accepted.append(methods[method]["compute_s_per_micro_batch"])
            if ref:
                target = methods[method]["final_eval_loss"]
                m = method_metrics(run_dir, s)  # the share as the calibration measures it
                measured = comm_share.share_of(m["compute_s_per_update"], m["comm_s_per_update"])
                log(f"[acco-bench] target: ddp's final eval loss {target:.4f}; ddp's comm share "
                    + (f"{measured:.2f}" if measured is not None else "-")
                    + (f" (asked {share:.2f})" if share is not None else ""))
            add_targets({method: methods[method]}, target)
            _say_reached(method, methods[method], target, log)
        network = net.describe()
    if target is not None:
        add_targets(methods, target)
    compute_ref = drift.mark(methods, probe_values)
    if warned := drift.warning(methods):
        log(f"[acco-bench] {warned} (race.md)")
    race = {
        "config": _race_config(settings, order, scheduler, eval_batches, network),
        **comm_share.share_fields(share, measured, network["bandwidth"], calibration),
        "target_eval_loss": target,
        "compute_reference_s_per_micro_batch": compute_ref,
        "methods": methods,
    }
    (out / "bench.json").write_text(json.dumps(race, indent=2, default=str) + "\n")
    write_race_report(race, out)
    return race


def _check_race(settings: BenchSettings) -> None:
    """What the race needs before anything runs: valid settings, ddp (its loss is the target), an
    eval step, and a worker command."""
    settings.validate()
    if REFERENCE not in settings.methods:
        raise BenchError(f"the race needs {REFERENCE} in --methods: its final eval loss is the target")
    if not settings.eval_step:
        raise BenchError("the race needs an eval step (--eval-step >= 1)")
    check_worker_available()


def _say_reached(method: str, r: dict, target: float, log) -> None:
    log(
        f"[acco-bench] {method}: "
        + (
            f"reached {target:.4f} after {r['time_to_target_s']:.1f} s of training, "
            f"{r['samples_to_target']:.0f} samples"
            if r["reached_target"]
            else f"did not reach {target:.4f} in {r['samples']} samples "
            f"({r['training_time_s']:.1f} s)"
        )
    )


def _race_config(settings: BenchSettings, order: list[str], scheduler: str, eval_batches: int,
                 network: dict) -> dict:
    """bench.json's config: the settings (rate as calibrated), the budget and cap, the schedule, the
    network, the machine and the worker command."""
    budget = settings.nb_steps_tot
    return {
        **settings.describe(),
        "methods": order,
        "budget_micro_batches": budget,
        "cap_micro_batches": CAP_FACTOR * budget,
        "scheduler": scheduler,
        "warmup": budget // 10,
        "eval_batches_per_worker": eval_batches,
        "network": network,
        "machine": machine_description(),
        "worker_command": worker_command(),
        "method_settings": {m: method_defaults(m) for m in order if method_defaults(m)},
    }
