"""Sharding inside the node (acco/engine/node_shards.py) on 2 nodes x 2 workers: each block sharded
over the node's 2 workers by FSDP2, the comm rounds between the 2 nodes on the node's shards. Every
method's update equals the same plain reference as the flat ring's, and each worker holds a local
vector of half the model."""

from __future__ import annotations

import itertools

import fake_cuda
import pytest
import torch
from distributed import run_distributed
from engine_helpers import (
    Reference,
    assert_close,
    check_five_methods,
    config,
    five_methods,
    loss_fn,
    make_model,
    reference_acco,
    stream,
)
from int8_helpers import BLOCK, reference_int8
from node_shards_helpers import Counted, full_params, interrupted, refusals

from acco.engine import ConfigError, build_engine
from acco.engine import decoupled as decoupled_module
from acco.engine.shard_map import local_rows

SHARDED = dict(rounds="nodes", workers_per_node=2, shard_inside_node=True, accumulate_while_waiting=False)


def _train(rank, world, kind, cfgs, break_swap=False, device="host", limits=None):
    """Every rank: each config's full final parameters, its records, and its local vector's size;
    `device` "fake-cuda" runs the engine's GPU paths on the CPU (tests/fake_cuda.py); `limits[rank]`:
    that many micro-batches in this worker's stream."""
    with fake_cuda.maybe_installed(device):
        return _train_here(rank, world, kind, cfgs, break_swap, limits)


def _train_here(rank, world, kind, cfgs, break_swap, limits):
    if break_swap:  # the new parameters written after the next forward (its all-gathers) ran
        swap = decoupled_module.DecoupledEngine._swap_in
        late = {}

        def swap_late(self):
            late["pending"] = lambda: swap(self)

        def micro_step(self, batch, fn, lead=2, original=decoupled_module.DecoupledEngine._micro_step):
            original(self, batch, fn, lead)
            if "pending" in late:
                late.pop("pending")()

        decoupled_module.DecoupledEngine._swap_in = swap_late
        decoupled_module.DecoupledEngine._micro_step = micro_step
    out = []
    for cfg in cfgs:
        model = make_model(kind)
        engine = build_engine(model, cfg)
        batches = stream(kind, rank, world)
        if limits is not None:
            batches = itertools.islice(batches, limits[rank])
        records = list(engine.run(batches, loss_fn))
        local = engine.flat.params.numel()
        engine.close()
        out.append((full_params(model), records, local))
    return out


def test_local_rows_are_torch_chunk_s():
    for rows, S in ((5, 2), (4, 2), (1, 2), (7, 3), (2, 4)):
        chunks = torch.arange(rows).chunk(S)
        for s in range(S):
            first, padded = local_rows(rows, S, s)
            got = list(range(first, min(first + padded, rows)))
            assert got == (chunks[s].tolist() if s < len(chunks) else [])


@pytest.mark.parametrize("kind,device", [("stack", "host"), ("mlp", "host"), ("stack", "fake-cuda")])
def test_methods_sharded_inside_the_node_equal_their_references(kind, device):
    n, world, updates, clip = 2, 4, 4, 0.45
    common = dict(nb_steps_tot=n * world * updates, max_grad_norm=clip, **SHARDED)
    cfgs = five_methods(n, **common)
    results = run_distributed(_train, world, kind, cfgs, False, device)
    local = results[0][0][2]
    numel = sum(p.numel() for p in make_model(kind).parameters())
    assert local < 0.75 * numel  # half the model's rows (and padding) per worker
    check_five_methods(kind, cfgs, world, n, updates, results, "sharded in the node")


def test_a_swap_after_the_next_all_gather_is_wrong():
    """The swap must land before the next forward's all-gathers: written one micro-batch late, acco
    computes on stale parameters and leaves its reference."""
    world, updates = 4, 4
    cfg = config(method="acco", n_grad_accumulation=2, nb_steps_tot=4 * world * updates, **SHARDED)
    results = run_distributed(_train, world, "stack", [cfg], True)
    ref = Reference("stack", cfg, world, [2] * world)
    with pytest.raises(AssertionError):
        assert_close(results[0][0][0], reference_acco(ref, updates), "late swap")


def test_sharding_inside_the_node_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="needs rounds=nodes"):
        config(method="acco", shard_inside_node=True, rounds="flat")
    with pytest.raises(ConfigError, match="applies to ddp, dpu, wp, acco, diloco and streaming-diloco"):
        config(method="torch-ddp", shard_inside_node=True)
    with pytest.raises(ConfigError, match="same micro-batches per round"):
        config(method="acco", n_grad_accumulation=2, shard_inside_node=True, accumulate_while_waiting=True)


@pytest.mark.parametrize("method", ["ddp", "acco"])
def test_a_short_worker_stops_every_worker_together(method):
    """Worker 1's stream ends early: every worker learns it from a round's statistics before any
    starts a micro-batch that worker could not join (no hang), and the committed updates equal the
    reference's. ddp takes 2 micro-batches per update, two updates ahead: 7 micro-batches commit 2."""
    world, k = 4, (2 if method == "ddp" else 1)
    cfg = config(method=method, n_grad_accumulation=k, nb_steps_tot=100 * world, **SHARDED)
    # a broken agreement leaves peers waiting in a forward: the collectives' timeout ends the test
    results = run_distributed(_train, world, "stack", [cfg], False, "host", [40, 7, 40, 40], timeout_s=30)
    params, records, _ = results[0][0]
    assert len(records) == 2 and all(r[0][1][-1].step == 2 for r in results)
    for r in results[1:]:
        assert torch.equal(r[0][0], params)
    ref = Reference("stack", cfg, world, [k] * world)
    want = ref.ddp(2) if method == "ddp" else reference_acco(ref, 2)
    assert_close(params, want, f"{method}: the 2 committed updates")


def test_sharded_in_mixed_precision_tracks_the_unsharded_node_rounds():
    """bf16 parameters and gradients (FSDP2 reduce-scatters them in bf16 at each micro-batch, the
    unsharded rounds once per round): the two layouts agree to bf16's precision."""
    world, updates = 4, 4
    common = dict(method="acco", n_grad_accumulation=2, nb_steps_tot=4 * world * updates,
                  use_mixed_precision=True, accumulate_while_waiting=False)
    sharded = config(**{**SHARDED, **common})
    plain = config(rounds="nodes", workers_per_node=2, **common)
    results = run_distributed(_train_bf16, world, "stack", [sharded, plain])
    (a, _), (b, _) = results[0]
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    initial = torch.cat([p.detach().flatten() for p in make_model("stack").parameters()])
    assert (a - initial).abs().max() > 1e-2  # it trained


def _train_bf16(rank, world, kind, cfgs):
    out = []
    for cfg in cfgs:
        model = make_model(kind)
        engine = build_engine(model, cfg)
        fn = lambda m, b: loss_fn(m, (b[0].bfloat16(), b[1].bfloat16()))  # noqa: E731
        records = list(engine.run(stream(kind, rank, world), fn))
        engine.close()
        params = full_params(model) if cfg.shard_inside_node else torch.cat(
            [p.detach().float().flatten() for p in model.parameters()])
        out.append((params, records))
    return out


@pytest.mark.parametrize("method", ["acco", "wp"])
def test_a_sharded_engine_resumes_exactly(method):
    world, updates = 4, 5
    k = 1 if method == "acco" else 2
    cfg = config(method=method, n_grad_accumulation=k, nb_steps_tot=2 * world * updates, **SHARDED)
    results = run_distributed(interrupted, world, "stack", cfg, 2)
    for whole, resumed, exact, ahead, _ in results:
        assert exact and ahead > 0
        assert torch.equal(whole, resumed)


def test_a_layout_change_without_every_file_is_refused_in_one_line():
    world = 4
    cfg = config(method="acco", n_grad_accumulation=1, nb_steps_tot=4 * world, **SHARDED)
    plain = config(method="acco", n_grad_accumulation=1, nb_steps_tot=4 * world, rounds="nodes",
                   workers_per_node=2, accumulate_while_waiting=False)
    lines = run_distributed(refusals, world, cfg, plain)[0]
    assert lines == [
        "checkpoint was written by 4 workers (2 per node, sharded inside the node), this run has 4 "
        "workers (2 per node): resharding needs every worker's file",
        "checkpoint was written by 4 workers (2 per node), this run has 4 workers (2 per node, sharded "
        "inside the node): resharding needs every worker's file"]


def _across(rank, world, kind, first, then, folder, stop_after):
    """Every rank: ddp trained `stop_after` updates on `first`'s layout, its files saved, then
    resumed on `then`'s from every file (resharded), and trained to the end; the final parameters."""
    import os

    counted = Counted(kind, rank, world)
    model = make_model(kind)
    engine = build_engine(model, first)
    for record in engine.run(counted, loss_fn):
        if record.step == stop_after:
            torch.save(engine.state_dict(), os.path.join(folder, f"{rank}.pt"))
            break
    back = engine.fetched_ahead
    engine.finish()
    engine.close()
    torch.distributed.barrier()
    model = make_model(kind)
    engine = build_engine(model, then)

    def old_state(r):
        return torch.load(os.path.join(folder, f"{r}.pt"), mmap=True, weights_only=False)

    exact = engine.load_state_dict(old_state(rank), old_state)
    list(engine.run(itertools.islice(stream(kind, rank, world), counted.taken - back, None), loss_fn))
    engine.close()
    params = full_params(model) if then.shard_inside_node else torch.cat(
        [p.detach().float().flatten() for p in model.parameters()])
    return params, exact


@pytest.mark.parametrize("first,then", [("sharded", "nodes"), ("nodes", "sharded"), ("sharded", "flat")])
def test_ddp_resumes_across_sharding_and_layouts(first, then, tmp_path):
    """The fp32 master and both moments resharded between the local vectors' shards and the flat
    vector's (either shard order): ddp's next updates then follow the reference as if nothing changed."""
    world, n, updates = 4, 2, 4
    common = dict(method="ddp", n_grad_accumulation=n, nb_steps_tot=n * world * updates, max_grad_norm=0.45)
    layouts = {"sharded": dict(SHARDED), "nodes": dict(rounds="nodes", workers_per_node=2),
               "flat": dict(rounds="flat")}
    cfgs = [config(**common, **layouts[name]) for name in (first, then)]
    results = run_distributed(_across, world, "stack", *cfgs, str(tmp_path), 2)
    ref = Reference("stack", cfgs[0], world, [n] * world)
    want = ref.ddp(updates)
    for params, exact in results:
        assert not exact
        assert_close(params, want, f"ddp {first} -> {then} vs AdamW on the global batches")


def test_int8_estimate_quantizes_each_local_index_s_node_sums():
    """acco's int8 estimate round sharded inside the node: FSDP2 sums the node's gradients exactly,
    and the outer ring quantizes shard r of each local vector, as the reference written out does;
    not the unsharded node rounds' shards."""
    world, updates = 4, 4
    cfg = config(method="acco", n_grad_accumulation=2, nb_steps_tot=2 * 2 * world * updates,
                 estimate_comm="int8", **SHARDED)
    params = run_distributed(_train_int8, world, "stack", cfg)[0]
    want = reference_int8("stack", cfg, world, updates, BLOCK, workers_per_node=2, sharded=True)
    assert_close(params, want, "int8 estimate sharded in the node vs its reference")
    unsharded = reference_int8("stack", cfg, world, updates, BLOCK, workers_per_node=2)
    assert (params - unsharded).abs().max() > 1e-6


def _train_int8(rank, world, kind, cfg):
    from acco.engine import quantize as qz

    qz.BLOCK = BLOCK
    return _train_here(rank, world, kind, [cfg], False, None)[0][0]


def _with_evaluations(rank, world, kind, cfg, evaluate):
    """Every rank: the full final parameters, with (or without) a forward at the committed
    parameters after every update, as the trainer's evaluation runs it (no backward)."""
    model = make_model(kind)
    engine = build_engine(model, cfg)
    probe = stream(kind, 1000 + rank, world)
    for _ in engine.run(stream(kind, rank, world), loss_fn):
        if evaluate:
            with engine.committed_params(), torch.no_grad():
                loss_fn(model, next(probe))
    engine.close()
    return full_params(model)


@pytest.mark.parametrize("method", ["acco", "wp"])
def test_an_evaluation_between_updates_leaves_training_as_it_was(method):
    """FSDP2 keeps the root unsharded after a forward with no backward: left so, the next training
    forward would compute with the parameters the evaluation saw (wp: the committed ones, not its
    prediction; acco: those before the swap)."""
    world, k = 4, (1 if method == "acco" else 2)
    cfg = config(method=method, n_grad_accumulation=k, nb_steps_tot=2 * world * 4, **SHARDED)
    plain = run_distributed(_with_evaluations, world, "stack", cfg, False)[0]
    evaluated = run_distributed(_with_evaluations, world, "stack", cfg, True)[0]
    assert torch.equal(plain, evaluated)
