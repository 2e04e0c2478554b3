"""``acco-bench map --params``: the memory per GPU of every method, counted by the engines themselves.

Nothing here is a formula: each method's engine is built (``acco.engine.build_engine``) on a model
whose tensors live on the meta device (shapes, no storage), as rank 0 of a W-rank job on torch's
fake process group (collectives that move nothing), in bf16 mixed precision as the paper trains
(``--dtype fp32``: fp32), and its own ``state_bytes()`` is read. So the table follows the engines as
they change; a method whose engine cannot be built on meta gets no figure, and the table says why.

The engines run in a child process (``count``): the fake process group, and the meshes and groups
the engines make once per process, never touch the caller's.

FSDP2's unsharded blocks (``fsdp_unsharded``) are the one figure computed beside the engines: an
engine that shards its blocks with FSDP2 and holds only some of them unsharded at a time needs the
root unit's parameters (FSDP2 keeps the root unsharded through forward and backward) plus the
current and the prefetched block's parameters and gradients, in the compute dtype.
"""

from __future__ import annotations

import math
import multiprocessing
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from acco_bench import BenchError
from acco_bench.settings import model_settings as conf_model

# acco.models.model_config's keys. Llama-2 7B and 13B (Touvron et al. 2023, untied embeddings, the
# 32000-token vocabulary); GPT-Neo as acco/conf/model/gptneo-*.yaml say (read there: one owner).
_LLAMA2 = dict(arch="llama", vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
PRESETS: dict[str, dict | str] = {
    "llama-13b": dict(_LLAMA2, hidden_size=5120, num_layers=40, num_heads=40, intermediate_size=13824),
    "llama-7b": dict(_LLAMA2, hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008),
    "gpt-neo-2.7b": "gptneo-2.7b",
    "gpt-neo-125m": "gptneo-125m",
}
_MODEL_KEYS = ("arch", "hidden_size", "num_layers", "num_heads", "max_position_embeddings", "window_size",
               "vocab_size", "num_kv_heads", "intermediate_size", "tie_word_embeddings")  # fmt: skip
GIB = 2**30


@dataclass(frozen=True)
class MapRow:
    """One row of the table per layout in `layouts`: `method` with the EngineConfig `overrides`.
    `fsdp`: whether the engine shards its blocks with FSDP2, and how its unsharded blocks are counted:
    None (no FSDP2), "counted" (its own state_bytes holds them already), "added" (added to its total)."""

    label: str
    method: str
    overrides: dict = field(default_factory=dict)
    layouts: tuple[str, ...] = ("flat", "nodes")
    fsdp: str | None = None


def map_rows(fragments: int = 4, sync_every: int = 20) -> list[MapRow]:
    """The methods the table counts; streaming-diloco with `fragments` (its wire is the largest's)."""
    return [
        MapRow("ddp", "ddp"),
        MapRow("dpu", "dpu"),
        MapRow("wp", "wp"),
        MapRow("acco", "acco"),
        MapRow("acco-int8", "acco", {"estimate_comm": "int8"}),
        MapRow("diloco", "diloco"),
        MapRow("streaming-diloco", "streaming-diloco",
               {"num_fragments": fragments, "sync_every": max(sync_every, fragments)}),
        MapRow("torch-ddp", "torch-ddp"),
        # reshard_after_forward off: every block unsharded from forward to backward, in its state_bytes
        MapRow("torch-hsdp", "torch-hsdp", fsdp="counted"),
        # FSDP2 over the node (node_shards.py), its blocks resharded after forward: not in state_bytes
        *[MapRow(f"{m}, sharded inside the node", m, {"shard_inside_node": True}, ("nodes",), "added")
          for m in ("ddp", "acco")],
    ]  # fmt: skip


# state_bytes' components, by column; anything else is "others" (and counted in the total)
COLUMNS = ("params", "grads", "comm buffer", "optimizer", "others")
_COLUMN_OF = {
    "params": "params",
    "grads": "grads", "grad_accumulator_fp32": "grads", "grad_fp32": "grads",
    "comm_buffer": "comm buffer", "int8_send": "comm buffer", "int8_recv": "comm buffer",
    "int8_work": "comm buffer", "wire": "comm buffer", "averaged": "comm buffer",
    "master": "optimizer", "exp_avg": "optimizer", "exp_avg_sq": "optimizer", "grad_shard": "optimizer",
    "trial_workspace": "optimizer", "estimate_error": "optimizer", "wp_previous_master": "optimizer",
    "local_fp32": "optimizer", "global_params": "optimizer", "outer_momentum": "optimizer",
}  # fmt: skip


def parse_params(text: str) -> str | float:
    """--params: a preset's name, or a parameter count (13e9: the nearest preset)."""
    if text in PRESETS:
        return text
    try:
        count = float(text)
    except ValueError:
        count = math.nan
    if not 0 < count < math.inf:
        raise BenchError(f"--params takes a model ({', '.join(PRESETS)}) or a parameter count above 0 "
                         f"such as 13e9, got {text!r}")
    return count


def model_settings(preset: str) -> dict:
    """The acco model config of a preset (GPT-Neo's read from acco/conf/model)."""
    spec = PRESETS[preset]
    if isinstance(spec, dict):
        return dict(spec)
    conf = conf_model(spec)  # acco/conf/model/<spec>.yaml
    return {k: v for k, v in conf.items() if k in _MODEL_KEYS and v is not None}


def meta_model(settings: dict, device: str = "meta"):
    """The Hugging Face causal LM of an acco model config, on the meta device (shapes, no storage),
    or initialised from seed 0 on another `device`."""
    import torch
    import transformers

    from acco.models import model_config

    if device != "meta":
        torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(model_config(settings))


def fsdp_unsharded(model, compute_bytes: int) -> dict:
    """The parameters FSDP2 holds unsharded at a time, blocks as compiling.blocks finds them: the
    root unit's (what no block holds: embeddings, final norm, head), and two of the largest block's
    parameters and gradients (the current and the prefetched one)."""
    from acco.engine.compiling import blocks

    units = [b for b in blocks(model) if b is not model]
    in_blocks = {id(p) for b in units for p in b.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    block = max((sum(p.numel() for p in b.parameters()) for b in units), default=0)
    return {"root_params": root, "block_params": block, "blocks": len(units), "compute_bytes": compute_bytes,
            "bytes": compute_bytes * (root + 2 * block + 2 * block)}  # fmt: skip


def nearest_preset(count: float) -> str:
    """The preset whose parameter count is nearest `count` (by ratio)."""
    sizes = {name: sum(p.numel() for p in meta_model(model_settings(name)).parameters()) for name in PRESETS}
    return min(sizes, key=lambda n: abs(math.log(sizes[n] / count)))


def _failure(error: BaseException) -> str:
    """Why an engine could not be built on meta, in one line: the error and where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if "/acco/" in f.filename.replace("\\", "/")]
    where = own[-1] if own else frames[-1]
    place = f"{Path(where.filename).parent.name}/{Path(where.filename).name}:{where.lineno}"
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first} (in {place}, {where.name})"


def build_state_bytes(settings: dict, row: MapRow, layout: str, workers_per_node: int,
                      device: str = "meta", bf16: bool = True) -> dict[str, int]:
    """One engine's state_bytes on an initialised process group: `row` on `layout` ("flat" or "nodes"),
    in bf16 mixed precision (else fp32), the model built on `device`."""
    from acco.engine import EngineConfig, build_engine
    from acco.engine.config import ConfigWarning

    model = meta_model(settings, device)
    cfg = EngineConfig(method=row.method, use_mixed_precision=bf16, rounds=layout,
                       workers_per_node=workers_per_node, nb_steps_tot=10**12, compile=False,
                       **row.overrides)  # fmt: skip
    with warnings.catch_warnings():  # advice on training speed: nothing trains here
        warnings.simplefilter("ignore", ConfigWarning)
        engine = build_engine(model, cfg)
    try:
        return engine.state_bytes()
    finally:
        engine.close()


def _count(settings: dict, workers: int, workers_per_node: int, rows: list[MapRow], bf16: bool) -> list[dict]:
    """In the child: rank 0 of a `workers`-rank fake process group builds every row on meta."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from acco.engine import ConfigError

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=workers)
    out = []
    try:
        for row in rows:
            for layout in row.layouts:
                entry = {"label": row.label, "method": row.method, "layout": layout,
                         "overrides": row.overrides, "fsdp": row.fsdp}  # fmt: skip
                try:
                    entry["bytes"] = build_state_bytes(settings, row, layout, workers_per_node, bf16=bf16)
                except ConfigError as e:  # a row this layout cannot run (sharding on one node)
                    entry["refused"] = str(e)
                except Exception as e:  # what meta tensors or the fake group cannot do: said, not guessed
                    entry["error"] = _failure(e)
                out.append(entry)
    finally:
        dist.destroy_process_group()
    return out


def _child(requested, workers: int, workers_per_node: int, rows: list[MapRow], bf16: bool) -> dict:
    if isinstance(requested, dict):  # a model config of one's own (acco.models.model_config's keys)
        preset, settings = "model", requested
    else:
        preset = requested if isinstance(requested, str) else nearest_preset(requested)
        settings = model_settings(preset)
    model = meta_model(settings)
    params = sum(p.numel() for p in model.parameters())
    return {"preset": preset, "params": params, "fsdp_unsharded": fsdp_unsharded(model, 2 if bf16 else 4),
            "rows": _count(settings, workers, workers_per_node, rows, bf16)}  # fmt: skip


def count(requested: str | float | dict, workers: int, workers_per_node: int,
          rows: list[MapRow] | None = None, bf16: bool = True) -> dict:
    """Every row's state_bytes for the preset `requested` (the one nearest a parameter count, or a model
    config given as a dict), rank 0 of `workers` workers, `workers_per_node` per node, in bf16 mixed
    precision (else fp32), counted in a child process."""
    rows = map_rows() if rows is None else rows
    if workers < 1 or workers_per_node < 1 or workers % workers_per_node:
        raise BenchError(f"--workers-per-node {workers_per_node} must divide --workers {workers} into whole "
                         "nodes")
    # a fresh process, not a fork of this one (its threads, its process group); the forkserver's
    # preloaded modules, where the caller set them, save the child importing torch again
    fresh = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=1, mp_context=fresh) as pool:
        result = pool.submit(_child, requested, workers, workers_per_node, rows, bf16).result()
    return {"requested": requested, "workers": workers, "workers_per_node": workers_per_node,
            "dtype": "bf16" if bf16 else "fp32", **result,
            "row_specs": [asdict(r) for r in rows]}  # fmt: skip


def table(counted: dict, gpu_gib: float) -> dict:
    """GiB per GPU by column, the total and whether it fits `gpu_gib`, for every counted row."""
    fsdp = counted["fsdp_unsharded"]["bytes"]
    rows = []
    for entry in counted["rows"]:
        row = {k: entry[k] for k in ("label", "method", "layout", "fsdp")}
        if "error" in entry or "refused" in entry:
            rows.append({**row, **{k: entry[k] for k in ("error", "refused") if k in entry}})
            continue
        columns = dict.fromkeys(COLUMNS, 0)
        for name, n in entry["bytes"].items():
            columns[_COLUMN_OF.get(name, "others")] += n
        total = sum(columns.values()) + (fsdp if entry["fsdp"] == "added" else 0)
        rows.append({**row, "bytes": entry["bytes"], "gib": {c: n / GIB for c, n in columns.items()},
                     "fsdp_gib": fsdp / GIB if entry["fsdp"] else None, "total_gib": total / GIB,
                     "fits": total / GIB <= gpu_gib})  # fmt: skip
    return {**{k: v for k, v in counted.items() if k != "rows"}, "gpu_gib": gpu_gib, "rows": rows}


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(mem: dict) -> list[str]:
    """The computed memory table, with the model and layout it is for and why a row has no figure."""
    w, s, p = mem["workers"], mem["workers_per_node"], mem["params"]
    asked = mem["requested"]
    nearest = f", the preset nearest --params {asked:.3g}" if isinstance(asked, int | float) else ""
    f = mem["fsdp_unsharded"]
    precision = "bf16 mixed precision" if mem["dtype"] == "bf16" else "fp32"
    lines = ["## Memory per GPU, counted by the engines", "",
             f"{mem['preset']} ({p:,} parameters{nearest}), W = {w} workers, S = {s} per node "
             f"({w // s} node{'s' if w // s != 1 else ''}), {precision}: each engine built on the meta "
             "device as rank 0 of the job, its own state_bytes() in GiB; activations excluded. FSDP2 "
             f"unsharded: the root unit's {f['root_params']:,} parameters and 2 x the largest of "
             f"{f['blocks']} blocks ({f['block_params']:,} parameters) with 2 x its gradients, in "
             f"{mem['dtype']}.", ""]
    header = ["method", "layout", *COLUMNS, "FSDP2 unsharded", "total GiB", f"fits {mem['gpu_gib']:g} GiB"]
    body, notes = [], []
    for r in mem["rows"]:
        if "error" in r:
            body.append([r["label"], r["layout"], *["-"] * (len(COLUMNS) + 2), "not built on meta (below)"])
            notes.append(f"- {r['label']}, {r['layout']}: its engine could not be built on the meta device: "
                         f"{r['error']}.")
            continue
        if "refused" in r:
            body.append([r["label"], r["layout"], *["-"] * (len(COLUMNS) + 2), "not on this layout (below)"])
            notes.append(f"- {r['label']}, {r['layout']}: the engine refuses this layout: {r['refused']}.")
            continue
        fsdp = _gib(r["fsdp_gib"]) if r["fsdp"] != "counted" else f"({_gib(r['fsdp_gib'])})"
        body.append([r["label"], r["layout"], *[_gib(r["gib"][c]) for c in COLUMNS], fsdp,
                     _gib(r["total_gib"]), "yes" if r["fits"] else "no"])
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    if any(r.get("fsdp") == "counted" for r in mem["rows"]):
        notes.append("- (x): FSDP2's unsharded blocks, already within torch-hsdp's own count (with "
                     "reshard_after_forward off every block stays unsharded from forward to backward, and "
                     "its state_bytes counts the whole unsharded compute copy and fp32 gradient): not added "
                     "again.")
    return lines + [""] + notes + ([""] if notes else [])


def assumptions() -> list[str]:
    return [
        "Memory per GPU (--params, counted): each method's engine built by acco.engine.build_engine on the "
        "meta device (shapes, no storage), rank 0 of a W-rank job on torch's fake process group, in bf16 "
        "mixed precision (use_mixed_precision, grad_accum_dtype bf16; --dtype fp32: fp32), its state_bytes() "
        "read by component; "
        "not counted: activations, the module's buffers, the CUDA context and the allocator's slack. "
        "Columns: params, grads (and any fp32 accumulator), comm buffer (the overlapped methods' buffer, "
        "int8 buffers, diloco's wire and fp32 average), optimizer (fp32 master, moments, fp32 gradient "
        "shard, acco's estimate error and trial workspace, wp's previous master; diloco's unsharded local, "
        "global and momentum copies), others (anything else an engine reports). torch-hsdp's params and "
        "grads hold its fp32 shards too.",
        "FSDP2 unsharded: the root unit's parameters (what the repeated blocks of "
        "acco.engine.compiling.blocks do not hold: embeddings, final norm, head; FSDP2 keeps the root "
        "unsharded through forward and backward) plus 2 x the largest block's parameters and 2 x its "
        "gradients (the current block and the prefetched one), in the compute dtype (bf16; fp32 with "
        "--dtype fp32); added to the total of an engine that shards its blocks with FSDP2 and does not "
        "count them itself.",
        "Both layouts: rounds=flat (one ring over the W workers) and rounds=nodes (the two-level rounds on "
        "W / S nodes); torch-hsdp shards over the job on flat, over the node's S workers on nodes.",
        "No figure for torch-ddp: its engine agrees on static_graph by reading a tensor on the module's "
        "device, and torch's DistributedDataParallel itself checks the parameters' shapes across workers "
        "with a host read as it starts (torch 2.13): neither can read a meta tensor.",
    ]
