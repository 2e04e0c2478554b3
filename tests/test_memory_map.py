"""acco-bench map's memory table (acco_bench/memory_map.py): every engine built on the meta device,
rank 0 of a fake process group, counts what the same engine counts on real tensors in a real 4-rank
gloo job; the map's bytes-per-parameter formula agrees with the engines it is drawn from; the FSDP2
figure is the root's and two blocks' parameters and gradients; the CLI prints the table for Llama-2
13B on 2 nodes x 8 GPUs."""

from __future__ import annotations

import json

import pytest
from distributed import run_distributed

from acco_bench.cli import main
from acco_bench.map_bounds import memory_bytes
from acco_bench.memory_map import (
    build_state_bytes,
    count,
    fsdp_unsharded,
    map_rows,
    meta_model,
    nearest_preset,
)

# a tiny Llama (grouped-query attention, tied embeddings): 205,120 parameters, 51,280 a shard at W = 4
TINY_LLAMA = dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, max_position_embeddings=256, vocab_size=2048)  # fmt: skip
W, S = 4, 2


def real_state_bytes(rank, world, settings, rows):
    """Every row, both layouts, built on real CPU tensors in this gloo job: rank 0's state_bytes."""
    return {(row.label, layout): build_state_bytes(settings, row, layout, S, device="cpu")
            for row in rows for layout in row.layouts}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_counted():
    return count(TINY_LLAMA, W, S, map_rows(fragments=2, sync_every=4))


def test_meta_built_engines_count_what_a_real_gloo_job_holds(tiny_counted):
    """Every method's engine on meta (fake process group) reports, component by component, the bytes the
    same engine reports on real tensors on rank 0 of a real 4-rank gloo job of 2 nodes x 2 workers, both
    layouts, ddp and acco sharded inside the node too; torch-ddp, which cannot be built on meta, has no
    figure and says why."""
    rows = map_rows(fragments=2, sync_every=4)
    real = run_distributed(real_state_bytes, W, TINY_LLAMA, rows)[0]
    meta = {(r["label"], r["layout"]): r for r in tiny_counted["rows"]}
    assert set(meta) == set(real) and len(meta) == sum(len(row.layouts) for row in rows)
    for key, r in meta.items():
        if r["method"] == "torch-ddp":
            assert "error" in r and "meta" in r["error"] and real[key]["params"] > 0, r
            continue
        assert r["bytes"] == real[key], key
    # the layout shows where the engines differ: torch-hsdp shards over the node, acco's int8 buffers
    # hold R (the nodes) rows instead of W
    for label in ("torch-hsdp", "acco-int8"):
        assert meta[label, "flat"]["bytes"] != meta[label, "nodes"]["bytes"], label
    assert meta["acco", "flat"]["bytes"] == meta["acco", "nodes"]["bytes"]
    # sharded inside the node: the model-sized vectors are the node's local vector, FSDP2's rows of
    # every parameter for this local index (about 1/S of the model), the optimizer shard 1/W as before
    sharded, plain = meta["acco, sharded inside the node", "nodes"]["bytes"], meta["acco", "nodes"]["bytes"]
    assert plain["params"] / S <= sharded["params"] < plain["params"] / S * 1.01
    assert sharded["comm_buffer"] == sharded["params"] and sharded["master"] == plain["master"]


def test_bytes_per_parameter_formula_agrees_with_the_engines(tiny_counted):
    """map_bounds.memory_bytes (the bounds' winners) per parameter equals the meta-built engines' own
    count for the decoupled methods in bf16 on the flat ring; acco's components are the per-element
    count written out: 2 bytes per padded parameter for params, grads and the comm buffer, 4 per
    shard element for the fp32 master, moments, gradient shard and estimate error, and the trial
    step's three chunks."""
    p = tiny_counted["params"]
    assert p == 205120
    flat = {r["label"]: r.get("bytes") for r in tiny_counted["rows"] if r["layout"] == "flat"}
    for label in ("ddp", "dpu", "wp", "acco", "acco-int8"):
        held = sum(flat[label].values()) / p
        assert held == pytest.approx(memory_bytes(label, W, 2), rel=1e-3), label
        if label in ("ddp", "dpu", "wp"):  # no rounding at all: exact
            assert held == memory_bytes(label, W, 2), label
    padded, shard = p, p // W
    assert flat["acco"] == {
        "params": 2 * padded, "grads": 2 * padded, "comm_buffer": 2 * padded,
        "master": 4 * shard, "exp_avg": 4 * shard, "exp_avg_sq": 4 * shard, "grad_shard": 4 * shard,
        "estimate_error": 4 * shard, "trial_workspace": 4 * 3 * -(-shard // 3),
    }  # fmt: skip


def test_fsdp_unsharded_is_the_root_and_two_blocks():
    """The root unit's parameters (embedding tied to the head, final norm) and 2 x one block's parameters
    and gradients, in the compute dtype, written out for the tiny Llama; a parameter count takes the
    preset nearest it."""
    model = meta_model(TINY_LLAMA)
    root = 2048 * 64 + 64
    # q and o 64 x 64, k and v 64 x 32 (2 of 4 heads), the MLP's three 64 x 128, two norms
    block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    got = fsdp_unsharded(model, 2)
    assert (got["root_params"], got["block_params"], got["blocks"]) == (root, block, 2)
    assert got["bytes"] == 2 * (root + 4 * block)
    assert [nearest_preset(n) for n in (13e9, 8e9, 3e9, 1e8)] == ["llama-13b", "llama-7b", "gpt-neo-2.7b",
                                                                   "gpt-neo-125m"]  # fmt: skip


def test_map_prints_the_memory_table_for_llama_13b(tmp_path, capsys):
    """`acco-bench map --params llama-13b --workers 16 --workers-per-node 8`: the table, every method on
    both layouts, ddp's 4 bytes per padded parameter and 16 per shard element, whether each fits 80
    GiB; torch-ddp's row says it was not built; bad --params is one line."""
    out = tmp_path / "map"
    assert main(["map", "--params", "llama-13b", "--workers", "16", "--workers-per-node", "8",
                 "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    mem = json.loads((out / "map.json").read_text())["memory"]
    assert mem["preset"] == "llama-13b" and mem["params"] == 13_015_864_320
    rows = {(r["label"], r["layout"]): r for r in mem["rows"]}
    assert {layout for _, layout in rows} == {"flat", "nodes"} and len(rows) == 20
    padded = -(-mem["params"] // 16) * 16
    assert rows["ddp", "flat"]["total_gib"] * 2**30 == 4 * padded + 16 * padded // 16
    assert rows["ddp", "flat"]["fits"] and not rows["diloco", "nodes"]["fits"]
    assert "error" in rows["torch-ddp", "flat"]
    header = "| method | layout | params | grads | comm buffer | optimizer | others | FSDP2 unsharded |"
    assert header in printed
    assert "| ddp | flat | 24.24 | 24.24 | 0.00 | 12.12 | 0.00 | - | 60.61 | yes |" in printed
    assert "| torch-ddp | nodes | - |" in printed and "FSDP2 unsharded: the root unit's" in printed
    # Llama-2 13B's root: untied embedding and head, final norm; a block: attention 4 d^2, MLP 3 d i, 2 norms
    d, i = 5120, 13824
    fsdp = 2 * (2 * 32000 * d + d + 4 * (4 * d * d + 3 * d * i + 2 * d))
    assert mem["fsdp_unsharded"]["bytes"] == fsdp
    for label in ("ddp, sharded inside the node", "acco, sharded inside the node"):
        r = rows[label, "nodes"]
        assert r["total_gib"] * 2**30 == sum(r["bytes"].values()) + fsdp and r["fits"], label
    assert ("acco, sharded inside the node", "flat") not in rows
    assert main(["map", "--params", "llama-13", "--workers", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("acco-bench: --params takes a model (llama-13b,") and err.count("\n") == 1
