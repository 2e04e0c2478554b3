"""Sharding inside the node (acco/engine/node_shards.py) on 2 nodes x 2 workers: each block sharded
over the node's 2 workers by FSDP2, the comm rounds between the 2 nodes on the node's shards. Every
method's update equals the same plain reference as the flat ring's, and each worker holds a local
vector of half the model."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from engine_helpers import (
    Reference,
    assert_close,
    config,
    loss_fn,
    make_model,
    reference_acco,
    reference_delayed,
    stream,
)

from acco.engine import ConfigError, build_engine
from acco.engine import decoupled as decoupled_module
from acco.engine.node_shards import local_rows

SHARDED = dict(rounds="nodes", workers_per_node=2, shard_inside_node=True, accumulate_while_waiting=False)


def full_params(model) -> torch.Tensor:
    """The whole model's parameters, in the plain module's order (all-gathered inside the node)."""
    return torch.cat([p.full_tensor().detach().float().flatten() for p in model.parameters()])


def _train(rank, world, kind, cfgs, break_swap=False):
    """Every rank: each config's full final parameters, its records, and its local vector's size."""
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
        records = list(engine.run(stream(kind, rank, world), loss_fn))
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


@pytest.mark.parametrize("kind", ["stack", "mlp"])
def test_methods_sharded_inside_the_node_equal_their_references(kind):
    n, world, updates, clip = 2, 4, 4, 0.45
    common = dict(nb_steps_tot=n * world * updates, max_grad_norm=clip, **SHARDED)
    cfgs = [
        config(method="ddp", n_grad_accumulation=n, **common),
        config(method="acco", n_grad_accumulation=n // 2, acco_estimate="paper", **common),
        config(method="acco", n_grad_accumulation=n // 2, acco_estimate="lean", **common),
        config(method="dpu", n_grad_accumulation=n, **common),
        config(method="wp", n_grad_accumulation=n, **common),
    ]
    results = run_distributed(_train, world, kind, cfgs)
    (ddp, ddp_rec, local), (acco, _, _), (lean, _, _), (dpu, _, _), (wp, _, _) = results[0]
    numel = sum(p.numel() for p in make_model(kind).parameters())
    assert local < 0.75 * numel  # half the model's rows (and padding) per worker
    for rank_result in results[1:]:
        for (theta, *_), (theta0, *_) in zip(rank_result, results[0]):
            assert torch.equal(theta, theta0)

    ref = Reference(kind, cfgs[0], world, [n] * world)
    assert_close(ddp, ref.ddp(updates), "ddp sharded in the node vs AdamW on the global batches")
    assert_close(torch.tensor([r.loss for r in ddp_rec]), torch.tensor(ref.losses), "ddp losses")
    assert_close(torch.tensor([r.grad_norm for r in ddp_rec]), torch.tensor(ref.grad_norms), "ddp norms")
    ref = Reference(kind, cfgs[1], world, [n // 2] * world)
    assert_close(acco, reference_acco(ref, updates), "acco sharded vs the estimate/update reference")
    ref = Reference(kind, cfgs[2], world, [n // 2] * world)
    assert_close(lean, reference_acco(ref, updates, lean=True), "acco lean sharded vs its reference")
    for name, got, predict in (("dpu", dpu, False), ("wp", wp, True)):
        ref = Reference(kind, cfgs[0], world, [n] * world)
        assert_close(got, reference_delayed(ref, updates, predict), f"{name} sharded vs its recurrence")


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
    with pytest.raises(ConfigError, match="applies to ddp, dpu, wp and acco"):
        config(method="diloco", shard_inside_node=True)
    with pytest.raises(ConfigError, match="same micro-batches per round"):
        config(method="acco", n_grad_accumulation=2, shard_inside_node=True, accumulate_while_waiting=True)
