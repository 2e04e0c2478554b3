"""``acco-bench map``: where each method wins, from ddp's compute C and comm M per update.

Nothing is run: every figure is a bound computed from C and M (seconds per update of ddp: its
compute, and its comm round, a ring reduce-scatter + all-gather of the whole model), then

1. checked against the per-update speedups measured in BENCHMARKS.md (``MEASURED`` below, each
   row with the section it comes from): measured speedup / bound, per method;
2. computed for the paper's settings (GPT-Neo 125M and 2.7B on A100s) with C from the FLOPs per
   token, an assumed peak and MFU, and M from the bytes of the ring over an assumed bus bandwidth
   and latency;
3. computed for the user's own C and M: read from a ddp run's folder (``--from``: ``from_run``),
   given as ``--compute-s`` and ``--comm-s``, or ``--bench`` a ``bench.json`` / ``sweep.json`` of
   ``acco-bench cluster`` / ``sweep``.

The user's figures are printed first; the check against BENCHMARKS.md and the paper's settings
only with ``--tables`` (or when no figures of the user's are given), and are always in map.json.

The formulas are map_bounds.py's ``bounds`` (acco's, every variant's, ``acco_bound.acco_update_time``,
which ``acco-bench cluster`` uses too); the assumptions are written into the output (``assumptions``).
Memory per worker is docs/algorithm.md's table ("Memory per worker"), bytes per parameter, in the
bounds' winners; ``--params`` adds the memory per GPU counted by every engine itself on a model of
that size built on the meta device (memory_map.py), both layouts.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

import yaml

from acco.run_folder import list_checkpoints
from acco_bench import BenchError, memory_map
from acco_bench.acco_bound import INT8_BLOCK, acco_update_time, bench_settings, method_acco_spec
from acco_bench.map_bounds import (
    BACKWARD_SHARE,
    FOLLOW_DDP,
    METHODS,
    TWO_LEVEL,
    Case,
    bounds,
    memory_bytes,
    round_comm,
    slow_link_share,
    speedups,
    two_level,
    winner,
)
from acco_bench.settings import base_method, split_nodes

# ----------------------------------------------------------------------- measured (BENCHMARKS.md)

# fp32, 4 micro-batches, DDP's 25 MiB: 1 bucket
_SEC1 = dict(workers=2, elem_bytes=4, grad_accum=4, buckets=1)
# ddp's C, M (s per update) and every method's measured speedup over ddp, as printed there
MEASURED = [
    dict(source="§1 table (1 ms)", link="100mbit", c=0.393, m=0.296, case=_SEC1,
         speedup={"torch-ddp": 0.69, "dpu": 1.68, "wp": 1.66, "acco": 1.13}),
    dict(source="§1 profile (--sched batch)", link="100mbit", c=0.397, m=0.308, case=_SEC1,
         speedup={"torch-ddp": 0.71, "dpu": 1.66, "wp": 1.65, "acco": 1.08}),
    *[dict(source="§2 sweep", link=link, c=c, m=m, case=_SEC1,
           speedup=dict(zip(("torch-ddp", "dpu", "wp", "acco"), s))) for link, c, m, s in (
        ("50mbit", 0.398, 0.619, (0.62, 1.59, 1.61, 0.79)),
        ("200mbit", 0.407, 0.157, (0.80, 1.15, 1.28, 1.06)),
        ("1000mbit", 0.388, 0.034, (0.75, 0.96, 1.02, 1.00)),
        ("unshaped", 0.406, 0.009, (0.84, 0.75, 0.94, 1.01)))],
    *[dict(source="§2 sweep (--sched batch)", link=link, c=c, m=m, case=_SEC1,
           speedup=dict(zip(("torch-ddp", "dpu", "wp", "acco"), s))) for link, c, m, s in (
        ("50mbit", 0.535, 0.620, (0.69, 1.79, 1.78, 0.90)),
        ("200mbit", 0.402, 0.156, (0.73, 1.06, 1.05, 0.99)),
        ("1000mbit", 0.472, 0.032, (0.98, 1.21, 1.06, 0.95)),
        ("unshaped", 0.415, 0.006, (0.92, 0.91, 0.89, 0.96)))],
    # §5 race, 100 Mbit/s, the paper's setting (accumulating): samples / training time over ddp's
    # 3840 / 39.5 s; torch-ddp at bucket_cap_mb=1 (4 buckets, §1.1), diloco H 10, streaming H 20, F 4,
    # tau 1
    dict(source="§5 race (accumulating; samples/s)", link="100mbit", c=0.337, m=0.300,
         case=dict(_SEC1, buckets=4, accumulate=True),
         speedup={n: round(s / t / (3840 / 39.5), 2) for n, s, t in (
             ("torch-ddp", 3840, 48.8), ("acco", 7736, 46.1), ("diloco", 4480, 27.9),
             ("streaming-diloco", 4224, 22.8))}),
    # §5.1 cluster, 100 Mbit/s, fixed batch: acco's int8 estimate round, even split, 1 of 4, by durations
    dict(source="§5.1 cluster (int8 estimate)", link="100mbit", c=0.420, m=0.296, case=_SEC1,
         acco={"acco-int8-e1": dict(estimate_comm="int8", split=1, micro_batches=4)},
         speedup={"acco": 1.17, "acco-int8-even": 1.34, "acco-int8-e1": 1.56, "acco-int8": 1.59}),
    *[dict(source="§5.1 cluster (int8 estimate)", link=link, c=c, m=m, case=_SEC1,
           speedup=dict(zip(("acco", "acco-int8-even", "acco-int8"), s))) for link, c, m, s in (
        ("50mbit", 0.469, 0.586, (0.88, 1.26, 1.30)), ("200mbit", 0.419, 0.153, (1.27, 1.28, 1.25)))],
]  # fmt: skip


def check_rows(extra: list[dict] | None = None) -> list[dict]:
    rows = []
    for meas in MEASURED + (extra or []):
        k = Case(c=meas["c"], m=meas["m"], **meas["case"])
        b = speedups(k)
        m, latency = round_comm(k)
        for n, spec in (meas.get("acco") or {}).items():  # a bench's acco variants: each its own bound
            b[n] = (k.c + k.m) / acco_update_time(k.c, m, latency_s=latency, **spec)
        rows.append({"source": meas["source"], "link": meas["link"], "c": k.c, "m": k.m,
                     "methods": {n: {"measured": s, "bound": b[n], "ratio": s / b[n]}
                                 for n, s in meas["speedup"].items()}})
    return rows


def from_bench_json(path: Path) -> list[dict]:
    """Measured rows from an ``acco-bench cluster`` bench.json or a ``sweep`` sweep.json (or a
    folder holding one)."""
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in ("bench.json", "sweep.json") if (path / name).is_file()]
        if not found:
            run = " (a training run's folder: --from)" if (path / "metrics.jsonl").exists() else ""
            raise BenchError(f"--bench {path} is a folder with no bench.json or sweep.json: --bench takes "
                             f"acco-bench cluster's bench.json or sweep's sweep.json{run}")
        path = found[0]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"--bench {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    cfg = data.get("config", {})
    points = data.get("points") or [
        {
            "label": (cfg.get("network") or {}).get("label", Path(path).parent.name),
            "bounds": data.get("bounds") or {},
            "methods": data.get("methods") or {},
        }
    ]
    acc = bool(cfg.get("accumulate_while_waiting"))
    settings, plain = bench_settings(cfg), bench_settings({**cfg, "extra": ()})
    key = "speedup_samples_vs_ddp" if acc else "speedup_step_vs_ddp"
    per_node = int(cfg.get("workers_per_node") or 1)
    case = dict(workers=int(cfg.get("hosts", 2)) * per_node, workers_per_node=per_node,
                elem_bytes=2 if cfg.get("mixed_precision") else 4, grad_accum=int(cfg.get("grad_accum", 4)),
                accumulate=acc)
    rows = []
    for p in points:
        b = p.get("bounds") or {}
        if b.get("ddp_compute_s") is None or b.get("ddp_comm_s") is None:
            raise BenchError(f"--bench {path}: no ddp compute/comm figures (run it with ddp among --methods)")
        by_h: dict[tuple, dict] = {(): {}}  # diloco variants (diloco-h20) get a row with their own H
        specs = {}  # acco and its variants: their own bound from the overrides their workers got
        for full, r in (p.get("methods") or {}).items():
            name, nodes = split_nodes(full)  # X-nodes: X's bound on the two-level rounds, a row of its own
            base, h = base_method(name), name.rpartition("-h")[2]
            if base not in METHODS or full == "ddp" or not isinstance(r, dict) or not r.get(key):
                continue
            if base == "acco":
                spec = method_acco_spec(settings, name)
                split = {None: "even", "auto": "auto"}.get(
                    spec["split"], f"{spec['split']}/{spec['micro_batches']}"
                )
                base = (
                    name
                    if spec == method_acco_spec(plain, name)
                    else f"{name} [{spec['estimate_comm']}, {split}]"
                )
                specs[base] = spec
            hk = (("sync_every" if base == "diloco" else "s_sync_every", int(h)),) \
                if name != base and "diloco" in base and h.isdigit() else ()
            hk += (("rounds", "nodes"),) if nodes else ()
            by_h.setdefault(hk, {})[base] = r[key]
        for hk, sp in by_h.items():
            if sp:
                rows.append(
                    dict(
                        source=str(path)
                        + "".join(
                            " (two-level rounds)" if n == "rounds"
                            else f" ({'diloco' if n == 'sync_every' else 'streaming'} H {v})" for n, v in hk
                        ),
                        link=str(p.get("label")),
                        c=b["ddp_compute_s"],
                        m=b["ddp_comm_s"],
                        case={**case, **dict(hk)},
                        speedup=sp,
                        acco=specs,
                    )
                )
    return rows


# ----------------------------------------------------------------------- a training run's figures


def _json_lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise BenchError(f"--from: {path}: cannot read it ({e})") from None


def from_run(run_dir: Path) -> dict:
    """ddp's C and M from the folder of a ddp run (``python main.py train=ddp``, or a
    DecoupledTrainer's output_dir): the medians of ``compute_s`` and ``comm_s`` in its
    metrics.jsonl over the updates after the first (warm start, first collectives: as summary.json's
    per-update figures), the workers and method (summary.json, else the newest checkpoint's
    meta.json), precision and micro-batches per update (config.yaml's train group, else that
    meta.json's), the parameters (that meta.json's: None without a checkpoint)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise BenchError(f"--from {run_dir}: no such folder (a training run's train.output_dir)")
    if not (run_dir / "metrics.jsonl").is_file():
        raise BenchError(f"--from {run_dir}: no metrics.jsonl: not the folder of a training run "
                         "(train.output_dir of python main.py train=ddp ...)")
    updates = [e for e in _json_lines(run_dir / "metrics.jsonl") if e.get("type") == "train"]
    if not updates:
        raise BenchError(f"--from {run_dir}: metrics.jsonl holds no update yet")
    checkpoints = list_checkpoints(run_dir)
    meta = json.loads((checkpoints[-1] / "meta.json").read_text()) if checkpoints else {}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    config_path = run_dir / "config.yaml"
    train = yaml.safe_load(config_path.read_text())["train"] if config_path.is_file() else meta.get("train")
    method = summary.get("method", meta.get("method"))
    workers = summary.get("world_size", meta.get("world_size"))
    if method is None or workers is None or not train:
        raise BenchError(f"--from {run_dir}: neither summary.json and config.yaml nor a checkpoint say the "
                         "run's method and workers")
    if method != "ddp":
        raise BenchError(f"--from {run_dir}: the run is {method}'s; the bounds start from ddp's compute and "
                         "comm per update: give the folder of a train=ddp run on the same model and machines")
    steady = updates[1:] or updates
    return {"run_dir": str(run_dir), "updates": len(updates), "workers": int(workers),
            "compute_s": statistics.median(u["compute_s"] for u in steady),
            "comm_s": statistics.median(u["comm_s"] for u in steady),
            "params": int(meta["numel"]) if meta.get("numel") else None,
            "dtype": "bf16" if train.get("use_mixed_precision") else "fp32",
            "grad_accum": int(train.get("n_grad_accumulation") or 1)}  # fmt: skip


# ----------------------------------------------------------------------- the paper's settings

# acco/conf/model/gptneo-*.yaml
GPT_NEO = {"125M": dict(d=768, layers=12, vocab=50257, positions=1024),
           "2.7B": dict(d=2560, layers=32, vocab=50257, positions=2048)}  # fmt: skip
# model, micro-batch sequences x tokens per GPU, ddp's micro-batches per update (train/ddp*.yaml), W
PAPER = [
    dict(name="GPT-Neo 125M, 24 x 1024 per GPU, 8 GPUs", model="125M", batch=24, seq=1024, grad_accum=2,
         workers=8),
    dict(name="GPT-Neo 125M, 24 x 1024 per GPU, 32 GPUs", model="125M", batch=24, seq=1024, grad_accum=2,
         workers=32),
    dict(name="GPT-Neo 2.7B, 4 x 512 per GPU, 16 GPUs (2 nodes)", model="2.7B", batch=4, seq=512,
         grad_accum=4, workers=16),
]  # fmt: skip


def gpt_neo_params(d: int, layers: int, vocab: int, positions: int) -> tuple[int, int]:
    """(all parameters, those in matmuls): tied token embedding, position embedding, per layer q/k/v
    (no bias), out projection, 4d MLP, two LayerNorms; a final LayerNorm."""
    per_layer = 12 * d * d + 10 * d
    total = vocab * d + positions * d + layers * per_layer + 2 * d
    return total, total - positions * d  # the position embedding is a lookup only


def flops_per_token(d: int, layers: int, vocab: int, positions: int, seq: int) -> float:
    """6 N + 12 L H Q T (acco.models.flops_per_token, written out; H Q = d)."""
    return 6.0 * gpt_neo_params(d, layers, vocab, positions)[1] + 12.0 * layers * d * seq


def paper_case(setting: dict, gbit: float, a) -> tuple[Case, dict]:
    dims = GPT_NEO[setting["model"]]
    params = gpt_neo_params(**dims)[0]
    tokens = setting["grad_accum"] * setting["batch"] * setting["seq"]
    fpt = flops_per_token(**dims, seq=setting["seq"])
    c = tokens * fpt / (a.peak_tflops * 1e12 * a.mfu)
    w = setting["workers"]
    lat = 2 * (w - 1) * a.latency_us * 1e-6  # ring reduce-scatter + all-gather: 2 (W - 1) steps
    m = 2 * (w - 1) / w * params * 2 / (gbit * 1e9 / 8) + lat  # bf16 on the wire
    buckets = a.buckets or math.ceil(params * 4 / (25 * 2**20))  # DDP's 25 MiB buckets of fp32 gradients
    k = Case(c=c, m=m, workers=w, elem_bytes=2, grad_accum=setting["grad_accum"], buckets=buckets,
             sync_every=a.sync_every, s_sync_every=a.s_sync_every, fragments=a.fragments,
             fragment_delay=a.fragment_delay, latency_s=lat)
    return k, {"params": params, "tokens_per_gpu_per_update": tokens, "flops_per_token": fpt}


def summarize(k: Case, params: int | None, gpu_gib: float | None) -> dict:
    t = bounds(k)
    mem = {n: memory_bytes(n, k.workers, k.elem_bytes, k.fragments) for n in METHODS}
    gib = {n: mem[n] * params / 2**30 for n in METHODS} if params else None
    fits = [n for n in METHODS if not (gib and gpu_gib) or gib[n] <= gpu_gib]
    out = {"case": asdict(k), "time_s": t, "speedup": {n: t["ddp"] / v for n, v in t.items()},
           "bytes_per_param": mem, "gib_per_gpu": gib, "fits": fits,
           "winner_follow_ddp": winner(t, mem, [n for n in FOLLOW_DDP if n in fits]),
           "winner_all": winner(t, mem, fits)}
    if k.workers_per_node > 1:
        out["nodes"] = nodes_summary(k, params, mem, fits)
    return out


def nodes_summary(k: Case, params: int | None, mem: dict, fits: list[str]) -> dict:
    """The two-level rounds beside the flat ring on k's nodes: the share of the payload on each node's
    slow link per reduce-scatter (and per all-gather), in bytes with ``params``, and every method's
    bound with them (speedups over ddp on the flat ring)."""
    w, s = k.workers, k.workers_per_node
    nodes = two_level(k)
    t = {n: v for n, v in bounds(nodes).items() if n in TWO_LEVEL}
    share = {"flat": slow_link_share(w, s, "flat"), "nodes": slow_link_share(w, s, "nodes")}
    payload = params * k.elem_bytes if params else None
    cands = [n for n in t if n in fits]
    return {"nodes": w // s, "workers_per_node": s, "slow_link_share": share,
            "slow_link_bytes_per_collective": {r: v * payload for r, v in share.items()} if payload else None,
            "comm_s": round_comm(nodes)[0], "time_s": t,
            "speedup": {n: (k.c + k.m) / v for n, v in t.items()},
            "winner_follow_ddp": winner(t, mem, [n for n in FOLLOW_DDP if n in cands]),
            "winner_all": winner(t, mem, cands)}


# ----------------------------------------------------------------------- output


def assumptions(a) -> list[str]:
    return [
        "Bounds are seconds per ddp-sized batch (one update; diloco: one inner step), from ddp's compute C "
        "and comm M per update; comm time is taken to scale with the bytes (the latency part, where given, "
        "does not).",
        "ddp: C + M. dpu, wp: max(C, M). acco: max(C, 2M) (two full rounds per update).",
        f"acco-int8 (estimate_comm: int8): max(C, M_est + M), M_est = M x (1 + 4/{INT8_BLOCK}) / e (int8 + "
        "an fp32 scale per block, e = 4 bytes in fp32, 2 in bf16: 0.2505 M / 0.501 M), with the "
        "micro-batches split between the rounds by their durations (estimate_micro_batches: auto); "
        "acco-int8-even: max(C/2, M_est) + max(C/2, M), the even split (estimate_micro_batches: null) with a "
        "fixed batch; with e of the 2k micro-batches per update during the estimate round "
        "(estimate_micro_batches): max(eC/2k, M_est) + max((2k-e)C/2k, M). A --bench run's acco variants "
        "each get the bound of the overrides they ran with.",
        f"torch-ddp: C + max(0, M - M/B - {BACKWARD_SHARE:.2f} C/k) + M/B + (M/2)(4/e): DDP's all-reduce "
        "(ddp's bytes) overlaps only the last of k micro-batches' backward (2/3 of its compute), the last of "
        "B buckets cannot overlap, then ZeroRedundancyOptimizer broadcasts the fp32 parameters (half a round "
        "of 4-byte elements).",
        "diloco: C + M/H (the whole model all-reduced every H inner steps, blocking). streaming-diloco: "
        "C + F max(0, M/F - tau C) / H (F fragments, each all-reduce overlapping tau inner steps). Per inner "
        "step; not counted: the extra samples diloco needs to reach ddp's loss (1.10-1.31x, "
        "BENCHMARKS.md, \"DiLoCo's sync period H\").",
        "With accumulation (§5 race) the overlapped methods never wait: their samples/s bound is (C + M) / "
        "C.",
        "Memory: docs/algorithm.md's bytes per parameter (model-sized + shard-sized / W), activations "
        "excluded; acco-int8 adds 2 + 4/W.",
        "Paper settings: C = tokens per GPU per update x FLOPs per token / (peak x MFU), peak "
        f"{a.peak_tflops:g} TFLOP/s (A100 dense bf16), MFU {a.mfu:g}, FLOPs per token 6N + 12 L d T "
        "(acco.models.flops_per_token); M = 2 (W-1)/W x P x 2 bytes (bf16) / bus bandwidth + 2 (W-1) x "
        f"{a.latency_us:g} us, the bus bandwidth "
        "being the link rate (the ring's slowest link, between nodes); ddp's micro-batches per update as "
        "train/ddp.yaml (2) and ddp-ft.yaml (4); torch-ddp B = fp32 gradients / 25 MiB; diloco "
        f"H {a.sync_every}, streaming H {a.s_sync_every}, F {a.fragments}, tau {a.fragment_delay}; a method "
        f"fits when its state is at most {a.gpu_gib:g} GiB per GPU (A100 80 GB).",
        "On nodes (--workers-per-node S, R = W / S nodes, ranked node by node): M is the flat ring's, each "
        "node's link carrying (W-1)/W of the payload per reduce-scatter and per all-gather; the two-level "
        "rounds (train.rounds=nodes) send (R-1)/R there, so their M is M's bandwidth part x ((R-1)/R) / "
        "((W-1)/W) plus its latency part x (R-1)/(W-1), the traffic inside a node taken as free; torch-ddp "
        "has no two-level form.",
        "Winner: the fastest bound (within 1%: the one needing less memory) among the methods that fit; "
        "'follows ddp' keeps to ddp, torch-ddp and acco (dpu and wp are one update stale and end 27-30% "
        "above ddp's loss; diloco takes local steps).",
    ]


LEGEND = (
    "acco-int8 splits an update's micro-batches between the rounds by their durations "
    "(estimate_micro_batches: auto); acco-int8-even is the even split (the default, null) with a fixed batch."
)


def _f(x, d=2, suffix=""):
    return "-" if x is None else f"{x:.{d}f}{suffix}"


def _table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _summary_table(rows: list[tuple[str, dict]], show_gib: bool) -> list[str]:
    header = ["setting", "ddp C s", "ddp M s", "comm %", "ddp s/update"] + \
        [f"{n} vs ddp" for n in METHODS[1:]] + ["fastest, follows ddp", "fastest of all"]
    out = []
    for label, s in rows:
        c, m = s["case"]["c"], s["case"]["m"]
        def name(n, s=s):
            return "-" if n is None else f"{n} ({_f(s['speedup'][n])}x" + (
                f", {_f(s['gib_per_gpu'][n], 1)} GiB)" if show_gib and s["gib_per_gpu"] else ")")
        out.append(
            [label, _f(c, 3), _f(m, 3), _f(100 * m / (c + m), 0), _f(c + m, 3)]
            + [_f(s["speedup"][n], 2, "x") + ("" if n in s["fits"] else " (no fit)") for n in METHODS[1:]]
            + [name(s["winner_follow_ddp"]), name(s["winner_all"])]
        )
    return _table(header, out)


def build(a) -> dict:
    extra = []
    for p in a.bench or []:
        extra += from_bench_json(Path(p))
    result = {"assumptions": assumptions(a), "check": check_rows(extra), "paper": [], "user": None,
              "memory": getattr(a, "memory", None)}
    if result["memory"]:
        result["assumptions"] += memory_map.assumptions()
    for setting in PAPER:
        for gbit in a.gbits:
            k, info = paper_case(setting, gbit, a)
            s = summarize(k, info["params"], a.gpu_gib)
            result["paper"].append({"setting": setting["name"], "gbit": gbit, **info, **s})
    if a.compute_s is not None or a.comm_s is not None:
        if a.compute_s is None or a.comm_s is None or a.compute_s <= 0 or a.comm_s < 0:
            raise BenchError("--compute-s and --comm-s go together (ddp's seconds per update, compute > 0)")
        k = Case(c=a.compute_s, m=a.comm_s, workers=a.workers, elem_bytes=2 if a.dtype == "bf16" else 4,
                 grad_accum=a.grad_accum, buckets=a.buckets or (math.ceil(a.params * 4 / (25 * 2**20))
                                                                if a.params else 1),
                 sync_every=a.sync_every, s_sync_every=a.s_sync_every, fragments=a.fragments,
                 fragment_delay=a.fragment_delay, workers_per_node=a.workers_per_node)
        result["user"] = summarize(k, int(a.params) if a.params else None, a.gpu_gib if a.params else None)
        result["user"]["from_run"] = getattr(a, "run", None)
    return result


def markdown(r: dict, tables: bool = True) -> str:
    """The user's figures first, then (`tables`, or without the user's figures) the bounds against
    BENCHMARKS.md's measurements and the paper's settings, then the assumptions."""
    lines = ["# acco-bench map: where each method wins", ""]
    if r["user"]:
        lines += _user_section(r["user"])
    if r.get("memory"):
        lines += memory_map.markdown(r["memory"])
    if tables or not r["user"]:
        lines += _measured_section(r)
    else:
        lines += ["The bounds against BENCHMARKS.md's measured speedups and the paper's settings: "
                  "--tables.", ""]
    lines += ["## Assumptions", ""] + [f"- {x}" for x in r["assumptions"]]
    return "\n".join(lines) + "\n"


def _user_section(u: dict) -> list[str]:
    lines = ["## Your figures", ""]
    run = u.get("from_run")
    if run:
        params = (f"{run['params']:,} parameters" if run["params"]
                  else "parameters unknown (no checkpoint: --params)")  # fmt: skip
        lines += [f"From {run['run_dir']} (ddp, {run['workers']} workers, {run['updates']} updates): C = "
                  f"{run['compute_s']:.4f} s and M = {run['comm_s']:.4f} s per update (medians of compute_s "
                  f"and comm_s after the first update), {params}, {run['dtype']}, {run['grad_accum']} "
                  "micro-batches per worker per update.", ""]  # fmt: skip
    gib = u["gib_per_gpu"]
    unit, scale = ("GiB", 1) if gib and max(gib.values()) >= 1 else ("MiB", 1024)
    rows = [[n, _f(u["time_s"][n], 3), _f(u["speedup"][n], 2, "x"), _f(u["bytes_per_param"][n], 2),
             _f(gib[n] * scale, 1) if gib else "-", "yes" if n in u["fits"] else "no"] for n in METHODS]
    lines += _table(["method", "bound s/update", "vs ddp", "bytes/param", f"{unit}/GPU", "fits"], rows)
    lines += ["", f"Fastest that follows ddp: **{u['winner_follow_ddp']}**; fastest of all: "
                  f"**{u['winner_all']}**. {LEGEND}", ""]
    return lines + (_nodes_section(u) if u.get("nodes") else [])


def _nodes_section(u: dict) -> list[str]:
    """The flat ring against the two-level rounds on the user's nodes."""
    n = u["nodes"]
    w, share, per = u["case"]["workers"], n["slow_link_share"], n["slow_link_bytes_per_collective"]
    ratio = share["nodes"] / share["flat"]
    size = (f" ({per['flat'] / 2**20:.1f} MiB against {per['nodes'] / 2**20:.1f} MiB)" if per else "")
    lines = ["## Flat ring against two-level rounds", "",
             f"{n['nodes']} nodes of {n['workers_per_node']} workers: per reduce-scatter and per all-gather "
             f"each node's slow link carries (W-1)/W = {share['flat']:.3f} of the payload on the flat ring, "
             f"(R-1)/R = {share['nodes']:.3f} with the two-level rounds, x{ratio:.2f}"
             f"{size}; ddp's comm M = {u['case']['m']:.4f} s becomes {n['comm_s']:.4f} s (W = {w}).", ""]
    rows = [[m, _f(u["time_s"][m], 3), _f(u["speedup"][m], 2, "x"),
             _f(n["time_s"].get(m), 3), _f(n["speedup"].get(m), 2, "x")] for m in METHODS]
    lines += _table(["method", "flat bound s/update", "flat vs ddp", "two-level bound s/update",
                     "two-level vs flat ddp"], rows)
    return lines + ["", f"Two-level, fastest that follows ddp: **{n['winner_follow_ddp']}**; fastest of all: "
                        f"**{n['winner_all']}** (torch-ddp has no two-level form: -).", ""]


def _measured_section(r: dict) -> list[str]:
    lines = ["## Bounds against the measured speedups (BENCHMARKS.md)", "",
              "Each cell: measured speedup over ddp / bound = measured as a share of the bound.", ""]
    names = list(dict.fromkeys(n for n in (*METHODS, *(n for row in r["check"] for n in row["methods"]))
                               if any(n in row["methods"] for row in r["check"])))
    rows = [
        [row["source"], row["link"], _f(row["c"], 3), _f(row["m"], 3)]
        + [
            (
                f"{_f(x['measured'])} / {_f(x['bound'])} = **{_f(x['ratio'])}**"
                if (x := row["methods"].get(n))
                else ""
            )
            for n in names
        ]
        for row in r["check"]
    ]
    lines += _table(["source", "link", "ddp C s", "ddp M s"] + names, rows) + [""]
    ratios = {n: [row["methods"][n]["ratio"] for row in r["check"] if n in row["methods"]] for n in names}
    lines += ["Measured / bound, range over the rows: " + "; ".join(
        f"{n} {min(v):.2f}-{max(v):.2f}" for n, v in ratios.items() if v) + ".", ""]
    lines += ["## The paper's settings (computed)", "", "Speedup bound over ddp per update; the winners with "
              f"their speedup and state per GPU. {LEGEND}", ""]
    lines += _summary_table([(f"{p['setting']}, {p['gbit']:g} Gbit/s", p) for p in r["paper"]], True) + [""]
    lines += ["State per GPU (GiB, activations excluded):", ""]
    seen = {}
    for p in r["paper"]:
        seen.setdefault(p["setting"], p)
    lines += _table(["method"] + [f"{s} ({p['params'] / 1e6:.0f}M params)" for s, p in seen.items()],
                    [[n] + [_f(p["gib_per_gpu"][n], 2) + ("" if n in p["fits"] else " (no fit)")
                            for p in seen.values()] for n in METHODS]) + [""]
    return lines


def add_arguments(p) -> None:
    p.add_argument("--from", dest="run_dir", metavar="RUN_DIR", default=None,
                   help="the folder of your ddp run (train.output_dir of python main.py train=ddp): C, M, "
                   "workers, parameters, precision and micro-batches per update read from it")  # fmt: skip
    p.add_argument("--compute-s", type=float, default=None, help="your ddp's compute per update, seconds (C)")
    p.add_argument("--comm-s", type=float, default=None, help="your ddp's comm round per update, seconds (M)")
    p.add_argument("--tables", action="store_true",
                   help="also print the bounds against BENCHMARKS.md's measured speedups and the paper's "
                   "settings (always in map.json; printed anyway without figures of yours)")  # fmt: skip
    p.add_argument(
        "--bench",
        action="append",
        default=None,
        metavar="PATH",
        help="a bench.json (acco-bench cluster) or sweep.json (sweep): its C, M and measured speedups "
        "join the check table (repeatable)",
    )
    p.add_argument("--workers", type=int, default=None, help="W (default: --from's, else 8)")
    p.add_argument("--workers-per-node", type=int, default=1, metavar="S",
                   help="S workers per node, W / S nodes (2 or more): the flat ring's bounds beside the "
                        "two-level rounds' (train.rounds=nodes), bytes on the slow link (W-1)/W against "
                        "(R-1)/R of the payload; needs your figures")
    p.add_argument("--params", default=None,
                   help="the model, " + ", ".join(memory_map.PRESETS) + ", or a parameter count (13e9: the "
                   "nearest of them for the memory table, the count itself for the bounds' GiB): every "
                   "method's memory per GPU counted by its engine on that model, on both layouts "
                   "(default: --from's count, for the bounds alone)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="training precision (default: --from's, else bf16)")  # fmt: skip
    p.add_argument("--grad-accum", type=int, default=None,
                   help="ddp's micro-batches per worker per update (default: --from's, else 2)")  # fmt: skip
    p.add_argument("--buckets", type=int, default=None,
                   help="torch-ddp's DDP buckets (default: fp32 gradients / 25 MiB, or 1 without --params)")
    p.add_argument("--sync-every", type=int, default=10, help="diloco's H (inner steps per sync)")
    p.add_argument(
        "--streaming-sync-every", dest="s_sync_every", type=int, default=20, help="streaming-diloco's H"
    )
    p.add_argument("--fragments", type=int, default=4, help="streaming-diloco's F")
    p.add_argument("--fragment-delay", type=int, default=1, help="streaming-diloco's tau, inner steps")
    p.add_argument("--peak-tflops", type=float, default=312.0, help="paper settings: peak FLOP/s (A100 bf16)")
    p.add_argument("--mfu", type=float, default=0.4, help="paper settings: model FLOPs utilisation")
    p.add_argument("--gbits", default="100,200,400", help="paper settings: link rates, Gbit/s")
    p.add_argument("--latency-us", type=float, default=10.0, help="paper settings: latency per ring step, us")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory per GPU, GiB: a method fits below it")
    p.add_argument("--out", default=None, help="also write map.md and map.json there")


def take_run_figures(a) -> None:
    """--from's figures into the arguments; --workers, --params, --dtype, --grad-accum given win."""
    a.run = from_run(Path(a.run_dir)) if getattr(a, "run_dir", None) else None
    if a.run is not None:
        if a.compute_s is not None or a.comm_s is not None:
            raise BenchError("--from reads C and M from the run: give it, or --compute-s and --comm-s, "
                             "not both")
        a.compute_s, a.comm_s = a.run["compute_s"], a.run["comm_s"]
    fallback = a.run or {"workers": 8, "params": None, "dtype": "bf16", "grad_accum": 2}
    for name in ("workers", "params", "dtype", "grad_accum"):
        if getattr(a, name) is None:
            setattr(a, name, fallback[name])


def check_nodes(a) -> None:
    """--workers-per-node: whole nodes, at least two of them, and figures of the user's to scale."""
    s = getattr(a, "workers_per_node", 1)
    if s == 1:
        return
    if s < 1 or a.workers % s or a.workers // s < 2:
        raise BenchError(f"--workers-per-node {s} must divide --workers {a.workers} into 2 nodes or more")
    if a.compute_s is None and a.model is None:
        raise BenchError("--workers-per-node compares the layouts on your figures: give --compute-s and "
                         "--comm-s (the flat ring's, ddp's), or --from a ddp run; or --params for the memory "
                         "table")


def run(a) -> int:
    try:
        a.gbits = [float(x) for x in str(a.gbits).split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--gbits takes comma-separated numbers, got {a.gbits!r}") from None
    # given here (a preset, or a count: the nearest preset), the memory table is counted for it;
    # --from's count alone draws none
    a.model = a.params = None if a.params is None else memory_map.parse_params(str(a.params))
    take_run_figures(a)
    if a.run is not None and a.run["compute_s"] <= 0:
        raise BenchError(f"--from {a.run_dir}: its median compute_s is {a.run['compute_s']}: no compute "
                         "measured")
    if a.workers < 1 or a.grad_accum < 1 or a.sync_every < 1 or a.fragments < 1 or not 0 < a.mfu <= 1:
        raise BenchError("--workers, --grad-accum, --sync-every, --fragments must be >= 1 and 0 < --mfu <= 1")
    check_nodes(a)
    for name in ("compute_s", "comm_s", "params", "gpu_gib"):  # nan and inf would reach the table
        value = getattr(a, name, None)
        if isinstance(value, str):  # a preset's name (parse_params checked it)
            continue
        if value is not None and not (0 <= value < math.inf and (value > 0 or name == "comm_s")):
            least = "0 or more" if name == "comm_s" else "above 0"
            raise BenchError(f"--{name.replace('_', '-')} must be a finite number {least}, got {value}")
    a.memory = None
    if a.model is not None:
        rows = memory_map.map_rows(a.fragments, a.s_sync_every)
        counted = memory_map.count(a.model, a.workers, a.workers_per_node, rows, bf16=a.dtype == "bf16")
        a.memory = memory_map.table(counted, a.gpu_gib)
        if isinstance(a.model, str):  # a preset: its count for the bounds' GiB
            a.params = counted["params"]
    r = build(a)
    md = markdown(r, tables=a.tables)
    print(md)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "map.md").write_text(md)
        (out / "map.json").write_text(json.dumps(r, indent=2) + "\n")
        print(f"[acco-bench] wrote {out}/map.md and map.json")
    return 0
