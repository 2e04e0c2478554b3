"""A machine whose speed moved during a benchmark: each method's compute per micro-batch against the others'.

``race`` and ``cluster`` compare methods that ran one after the other, minutes apart. On a shared
VM the cores' speed can move by 1.4-1.8x between two runs with no load visible inside the VM
(BENCHMARKS.md 5.2: no other process, no steal time), and a ratio of two runs then measures the
machine, not the methods. Every method but torch-ddp computes the same forward and backward per
micro-batch (on a steady machine within 0.94-1.16x of their race's median, acco's comm thread
taking a little of the cores), so rank 0's median compute per micro-batch should agree across
them. The **reference** is the median of those medians and of ddp's in the calibration's probes;
a run off the reference of the runs before it by more than :data:`DRIFT` either way runs again
(``--retry-disturbed``, as a run under other processes' load does), and a method still off the
whole run's reference is flagged **drifted** in bench.json and in race.md or bench.md.

torch-ddp is left out: its bucketed all-reduce runs inside backward, so its compute holds its comm
(1.1-1.9x ddp's measured); so are torch-hsdp and the methods sharded inside the node (FSDP2's
collectives inside forward and backward). Rank 0 is used throughout, so ``--slow-worker 1:F``
changes nothing here and ``--slow-worker 0:F`` slows every method alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from acco_bench.analysis import BUSY_CORES, own_micro_batches, read_jsonl

DRIFT = 1.25  # compute per micro-batch this far from the reference (either way): drifted
# methods whose compute_s includes comm (torch-hsdp: FSDP's gathers and reduce-scatters run inside
# forward and backward)
COMPUTE_HOLDS_COMM = frozenset({"torch-ddp", "torch-hsdp"})


def compute_per_micro_batch(run_dir: Path, rank: int = 0, skip: int = 1) -> float | None:
    """Median over updates of a worker's compute seconds over its own micro-batches (the first
    ``skip`` updates left out: set-up, warm start)."""
    rows = read_jsonl(Path(run_dir) / "workers" / f"rank{rank}.jsonl")
    xs = []
    for r in rows[skip:] if len(rows) > skip + 1 else rows:
        n = own_micro_batches(r.get("micro_batches"), rank)
        if r.get("compute_s") is not None and n:
            xs.append(r["compute_s"] / n)
    return statistics.median(xs) if xs else None


def checked(method: str) -> bool:
    """Whether a method computes the same forward and backward as ddp: not those whose compute holds
    comm, nor one sharded inside the node (its forward and backward all-gather and reduce-scatter
    each block inside the node: `-sharded`, with or without `-nodes`)."""
    from acco_bench.settings import split_nodes

    return method not in COMPUTE_HOLDS_COMM and not split_nodes(method)[0].endswith("-sharded")


def reference(values: list[float | None]) -> float | None:
    xs = [x for x in values if x]
    return statistics.median(xs) if xs else None


def ratio(value: float | None, ref: float | None) -> float | None:
    return value / ref if value and ref else None


def drifted(value: float | None, ref: float | None) -> bool:
    r = ratio(value, ref)
    return r is not None and max(r, 1 / r) > DRIFT


def disturbance(method: str, result: dict, earlier: list[float | None]) -> str | None:
    """Why a run of ``method`` should run again, or None: other processes' load during it, or
    its compute per micro-batch off the reference of the ``earlier`` runs (the calibration's probes
    and the methods already run)."""
    other = (result.get("load") or {}).get("other_cpu_cores") or 0.0
    if other > BUSY_CORES:
        return f"other processes used {other:.2f} CPU cores during its run"
    ref, value = reference(earlier), result.get("compute_s_per_micro_batch")
    if checked(method) and drifted(value, ref):
        return (f"it computed {value * 1e3:.0f} ms per micro-batch against {ref * 1e3:.0f} ms in the runs "
                f"before it ({value / ref:.2f}x: the machine's speed moved)")
    return None


def mark(methods: dict, probe_values: list[float | None]) -> float | None:
    """Set ``compute_vs_reference`` and ``drifted`` on every checked method's result (from its
    ``compute_s_per_micro_batch``) against the reference of the whole race; return the reference."""
    ok = {n: r for n, r in methods.items() if "error" not in r}
    runs = [r.get("compute_s_per_micro_batch") for n, r in ok.items() if checked(n)]
    ref = reference([*probe_values, *runs])
    for name, r in ok.items():
        if checked(name):
            r["compute_vs_reference"] = ratio(r.get("compute_s_per_micro_batch"), ref)
            r["drifted"] = drifted(r.get("compute_s_per_micro_batch"), ref)
        else:
            r["compute_vs_reference"], r["drifted"] = None, None
    return ref


def recheck(race: dict) -> None:
    """Fill in the compute per micro-batch from the run folders where a race's bench.json lacks it
    (races run before this check existed), then mark the race (``acco-bench report``)."""
    cal = race.get("calibration") or {}
    probes = [p for p in (cal.get("unshaped"), *(cal.get("probes") or [])) if p]
    for r in [*probes, *race["methods"].values()]:
        if r.get("compute_s_per_micro_batch") is None and r.get("run_dir"):
            r["compute_s_per_micro_batch"] = compute_per_micro_batch(Path(r["run_dir"]))
    probe_values = [p.get("compute_s_per_micro_batch") for p in probes]
    race["compute_reference_s_per_micro_batch"] = mark(race["methods"], probe_values)


def run_until_undisturbed(run: Callable[[], dict], method: str, earlier: list[float | None], retries: int,
                          pause_s: float, log) -> dict:
    """``run()`` (one run of ``method``: its result with ``load`` and ``compute_s_per_micro_batch``)
    again, ``pause_s`` apart, while :func:`disturbance` finds a reason, at most ``retries`` more
    times (``--retry-disturbed``); the last result, with ``disturbed_attempts`` and ``disturbed``
    (why it is still disturbed, or None). A failed run (BenchError) propagates."""
    attempts = 0
    while True:
        res = run()
        why = disturbance(method, res, earlier)
        if why is None or attempts >= retries:
            break
        attempts += 1
        log(f"[acco-bench] {method}: {why}; running it again ({attempts}/{retries}) after {pause_s:.0f} s "
            "(--retry-disturbed 0: never)")
        time.sleep(pause_s)
    if why:
        log(f"[acco-bench] {method}: WARNING: {why} (kept: no retry left)")
    return {**res, "disturbed_attempts": attempts, "disturbed": why}


def warning(methods: dict) -> str | None:
    """One sentence naming the drifted methods (None when there is none)."""
    names = [n for n, r in methods.items() if r.get("drifted")]
    if not names:
        return None
    return (f"WARNING: {', '.join(names)} computed more than {DRIFT:g}x away from the reference per "
            "micro-batch: the machine's speed moved, and their figures do not compare with the others'")
