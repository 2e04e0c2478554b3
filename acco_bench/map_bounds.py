"""The bounds ``acco-bench map`` draws (map.py has the rest): seconds per ddp-sized batch for every
method from ddp's compute C and comm M per update (``bounds``), the speedups over ddp, the memory per
worker in bytes per parameter (docs/algorithm.md's table, "Memory per worker") and the winner among
the methods that fit.

On nodes of S workers (``Case.workers_per_node``) M is the flat ring's, whose slowest links are the
ones between nodes: ranked node by node, each node's link carries one ring edge, (W - 1) / W of the
payload per reduce-scatter and per all-gather. The two-level rounds (``Case.rounds`` "nodes",
acco/engine/nodes.py) send (R - 1) / R there: ``round_comm`` scales M's bandwidth part by that
ratio and its latency part by the outer ring's steps, (R - 1) / (W - 1), the inner level on the
node's fast links taken as free."""

from __future__ import annotations

from dataclasses import dataclass, replace

from acco_bench.acco_bound import acco_update_time

# backward's share of a micro-batch's compute (2 of the 6 N FLOPs per token are forward)
BACKWARD_SHARE = 2 / 3
METHODS = (
    "ddp",
    "torch-ddp",
    "dpu",
    "wp",
    "acco",
    "acco-int8",
    "acco-int8-even",
    "diloco",
    "streaming-diloco",
)
# methods whose committed update is the exact mean of the gradients of ddp's batch (acco: half of
# them at the estimate); dpu/wp are one update stale, diloco takes local steps
FOLLOW_DDP = ("ddp", "torch-ddp", "acco", "acco-int8", "acco-int8-even")


@dataclass
class Case:
    """ddp's compute ``c`` and comm ``m`` (s per update) and what the bounds need besides."""

    c: float
    m: float
    workers: int = 2
    elem_bytes: int = 4  # ddp's wire: 4 in fp32, 2 in bf16 (mixed precision)
    grad_accum: int = 4  # ddp's micro-batches per worker per update
    buckets: int = 1  # torch-ddp's DDP buckets
    sync_every: int = 10  # diloco's H
    s_sync_every: int = 20  # streaming-diloco's H
    fragments: int = 4  # streaming-diloco's F
    fragment_delay: int = 1  # streaming-diloco's tau (inner steps a fragment's all-reduce overlaps)
    latency_s: float = 0.0  # the part of m that is latency (does not shrink with the bytes)
    accumulate: bool = False  # overlapped methods keep computing while a round runs (samples/s)
    workers_per_node: int = 1  # S: the W workers are W / S nodes of S, ranked node by node
    rounds: str = "flat"  # the engine's methods' rounds: "flat" (m is this ring's) or "nodes" (two-level)


# the map's methods whose rounds have a two-level form (torch-ddp's all-reduce is torch's, flat)
TWO_LEVEL = tuple(n for n in METHODS if n != "torch-ddp")


def slow_link_share(workers: int, workers_per_node: int, rounds: str = "flat") -> float:
    """The share of a round's payload each node sends through its link to the other nodes, per
    reduce-scatter (and per all-gather): the flat ring (W - 1) / W, the two-level rounds (R - 1) / R;
    0 on one node."""
    nodes = workers // workers_per_node
    n = nodes if rounds == "nodes" else workers
    return 0.0 if nodes < 2 else (n - 1) / n


def round_comm(k: Case) -> tuple[float, float]:
    """(M, its latency part) of k's layout: k.m and k.latency_s on the flat ring; with the two-level
    rounds the bandwidth part scaled by (R - 1) / R over (W - 1) / W, the latency part by the outer
    ring's steps, (R - 1) / (W - 1)."""
    w, s = k.workers, k.workers_per_node
    if k.rounds == "flat" or s in (1, w):
        return k.m, k.latency_s
    r = w // s
    lat = k.latency_s * (r - 1) / (w - 1)
    scale = slow_link_share(w, s, "nodes") / slow_link_share(w, s, "flat")
    return (k.m - k.latency_s) * scale + lat, lat


def two_level(k: Case) -> Case:
    """k with the two-level rounds (its m still the flat ring's: ``bounds`` scales it)."""
    return replace(k, rounds="nodes")


def bounds(k: Case) -> dict[str, float]:
    """Lower bounds on seconds per ddp-sized batch (one update; for diloco one inner step), each
    method's rounds on k's layout (``round_comm``; torch-ddp always on the flat ring)."""
    c, m = k.c, k.m
    flat_m = m
    m, latency = round_comm(k)
    # the int8 estimate round
    int8 = dict(estimate_comm="int8", elem_bytes=k.elem_bytes, latency_s=latency)
    # torch-ddp: DDP's all-reduce (ddp's bytes, M) overlaps the backward of the last micro-batch
    # only (the others run under no_sync), its last bucket starts when backward ends; then
    # ZeroRedundancyOptimizer broadcasts the fp32 parameters (half a ring round of 4-byte elements)
    last = flat_m / k.buckets
    hidden = BACKWARD_SHARE * c / k.grad_accum
    bcast = flat_m / 2 * 4 / k.elem_bytes
    t = {
        "ddp": c + m,
        "torch-ddp": c + max(0.0, flat_m - last - hidden) + last + bcast,
        "dpu": max(c, m),
        "wp": max(c, m),
        "acco": acco_update_time(c, m),  # two full rounds: max(C, 2M)
        # micro-batches split between the rounds by their durations: max(C, M_est + M)
        "acco-int8": acco_update_time(c, m, split="auto", **int8),
        "acco-int8-even": acco_update_time(c, m, **int8),  # half the batch in each round
        "diloco": c + m / k.sync_every,
        "streaming-diloco": c
        + k.fragments * max(0.0, m / k.fragments - k.fragment_delay * c) / k.s_sync_every,
    }
    if k.accumulate:  # the overlapped methods never wait: their samples/s is bound by compute alone
        for name in ("dpu", "wp", "acco", "acco-int8", "acco-int8-even"):
            t[name] = c
    return t


def speedups(k: Case) -> dict[str, float]:
    """Over ddp on the flat ring (C + M, the ddp a benchmark measures), whatever k's rounds."""
    t = bounds(k)
    return {n: (k.c + k.m) / v for n, v in t.items()}


# docs/algorithm.md, "Memory per worker": bytes per parameter (model-sized, shard-sized / W) in
# (bf16 mixed precision, fp32); acco-int8 adds two packed int8 buffers (2) and an fp32 shard (4 / W).
def memory_bytes(method: str, workers: int, elem_bytes: int = 2, fragments: int = 4) -> float:
    f = 1 / fragments
    # acco's trial-step workspace is counted as 4 per shard element, its most: above 12.6M elements
    # per shard it is a fixed 48 MiB on a GPU (docs/algorithm.md, "Memory per worker"); the
    # decoupled methods' rows are the engine's state_bytes (tests/test_bench_bounds.py)
    table = {  # method: ((model bf16, shard bf16), (model fp32, shard fp32))
        "ddp": ((4, 16), (8, 16)), "torch-ddp": ((8, 8), (8, 8)), "dpu": ((6, 16), (12, 16)),
        "wp": ((6, 20), (12, 20)), "acco": ((6, 24), (12, 24)), "acco-int8": ((8, 28), (14, 28)),
        "acco-int8-even": ((8, 28), (14, 28)), "diloco": ((34, 2), (36, 4)),
        "streaming-diloco": ((28 + 6 * f, 2 * f), (28 + 8 * f, 4 * f)),
    }
    model, shard = table[method][0 if elem_bytes == 2 else 1]
    return model + shard / workers


def winner(times: dict[str, float], mem: dict[str, float], candidates, tol: float = 0.01) -> str | None:
    """The fastest candidate; within ``tol`` of it, the one needing the least memory."""
    cands = [n for n in candidates if n in times]
    if not cands:
        return None
    best = min(times[n] for n in cands)
    return min((n for n in cands if times[n] <= best * (1 + tol)), key=lambda n: (mem[n], times[n]))
