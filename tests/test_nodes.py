"""The two-level rounds (acco/engine/nodes.py) on 2 nodes x 2 workers: every method's update equals
the same plain reference as the flat ring's (tests/test_engine_methods.py), and the shard order,
the layout's checks and the collectives' two levels are the ones the docstring states."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from engine_helpers import Reference, assert_close, config, reference_acco, reference_delayed, run_engine

from test_estimate_int8 import BLOCK, _train, reference_int8

from acco.engine import ConfigError
from acco.engine import quantize as qz
from acco.engine.nodes import NodeLayout, check_layout, shard_file_rank, workers_per_node_from_env

NODES = dict(rounds="nodes", workers_per_node=2)


def shard_rank(engine, model) -> int:
    return engine.rounds.shard_rank


def test_shard_order_and_its_inverse():
    # worker (node r, local s) owns shard s * R + r; the file of shard i is that worker's rank
    for R, S in ((2, 2), (2, 3), (3, 2), (4, 1), (1, 4)):
        owned = [NodeLayout(R, S, rank).shard_rank for rank in range(R * S)]
        assert sorted(owned) == list(range(R * S))
        assert [shard_file_rank(i, R * S, S) for i in owned] == list(range(R * S))
    assert [NodeLayout(2, 2, r).shard_rank for r in range(4)] == [0, 2, 1, 3]


def test_layout_from_the_environment_and_its_check(monkeypatch):
    for key in ("ACCO_WORKERS_PER_NODE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    assert workers_per_node_from_env(8) == 8  # no launcher: one node
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert workers_per_node_from_env(8) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert workers_per_node_from_env(8) == 2
    monkeypatch.setenv("ACCO_WORKERS_PER_NODE", "8")  # the local launcher's emulated nodes win
    assert workers_per_node_from_env(8) == 8
    with pytest.raises(ConfigError, match="does not divide the 6 workers"):
        check_layout(6, 4)
    with pytest.raises(ConfigError, match="rounds must be one of"):
        config(rounds="tree")


# fake-cuda: the engines' GPU paths (comm stream, events) on the CPU, over the two levels' groups
@pytest.mark.parametrize("device", ["host", "fake-cuda"])
def test_methods_equal_their_references_on_two_nodes(device):
    n, world, updates, clip = 2, 4, 4, 0.45
    budget = n * world * updates
    common = dict(nb_steps_tot=budget, max_grad_norm=clip, **NODES)
    cfgs = [
        config(method="ddp", n_grad_accumulation=n, **common),
        config(method="acco", n_grad_accumulation=n // 2, acco_estimate="paper", **common),
        config(method="acco", n_grad_accumulation=n // 2, acco_estimate="lean", **common),
        config(method="dpu", n_grad_accumulation=n, **common),
        config(method="wp", n_grad_accumulation=n, **common),
    ]
    results = run_distributed(run_engine, world, "mlp", cfgs, 0.0, shard_rank, device)
    (ddp, ddp_rec, order), (acco, acco_rec, _), (lean, _, _), (dpu, _, _), (wp, _, _) = results[0]
    assert order == 0 and [r[0][2] for r in results] == [0, 2, 1, 3]  # the two-level order, not flat
    for rank_result in results[1:]:
        for (theta, *_), (theta0, *_) in zip(rank_result, results[0]):
            assert torch.equal(theta, theta0)

    ref = Reference("mlp", cfgs[0], world, [n] * world)
    assert_close(ddp, ref.ddp(updates), "ddp on 2 x 2 vs AdamW on the global batches")
    assert_close(torch.tensor([r.loss for r in ddp_rec]), torch.tensor(ref.losses), "ddp losses")
    assert_close(torch.tensor([r.grad_norm for r in ddp_rec]), torch.tensor(ref.grad_norms), "ddp norms")
    ref = Reference("mlp", cfgs[1], world, [n // 2] * world)
    assert_close(acco, reference_acco(ref, updates), "acco on 2 x 2 vs the estimate/update reference")
    ref = Reference("mlp", cfgs[2], world, [n // 2] * world)
    assert_close(lean, reference_acco(ref, updates, lean=True), "acco lean on 2 x 2 vs its reference")
    for name, got, predict in (("dpu", dpu, False), ("wp", wp, True)):
        ref = Reference("mlp", cfgs[0], world, [n] * world)
        assert_close(got, reference_delayed(ref, updates, predict), f"{name} on 2 x 2 vs its recurrence")


def test_int8_estimate_quantizes_the_node_sums_on_two_nodes():
    # the inner level exact, the outer level's bytes int8: the reference quantizes each node's sum
    updates, world = 4, 4
    cfg = config(method="acco", n_grad_accumulation=2, nb_steps_tot=2 * 2 * world * updates,
                 estimate_comm="int8", **NODES)
    results = run_distributed(_train, world, "mlp", [cfg], BLOCK)
    qz.BLOCK = 2048  # (set by the in-process reference runs' default)
    params = results[0][0][0]
    assert_close(params, reference_int8("mlp", cfg, world, updates, BLOCK, workers_per_node=2),
                 "int8 estimate on 2 x 2 vs the node-sum reference")
    flat = reference_int8("mlp", cfg, world, updates, BLOCK)  # each worker's own sum quantized
    assert (params - flat).abs().max() > 1e-6
    for r in range(1, world):
        torch.testing.assert_close(results[r][0][0], params, rtol=0, atol=0)
