"""The two-level rounds (acco/engine/nodes.py) on 2 nodes x 2 workers: every method's update equals
the same plain reference as the flat ring's (tests/test_engine_methods.py), and the shard order,
the layout's checks and the collectives' two levels are the ones the docstring states."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_distributed
from engine_helpers import (
    assert_close,
    check_five_methods,
    config,
    five_methods,
    loss_fn,
    make_model,
    micro_batch,
    reference_diloco,
    run_engine,
    stream,
)
from int8_helpers import BLOCK, reference_int8, train_counting
from torch.nn.utils import parameters_to_vector

from acco.engine import ConfigError, build_engine
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
    cfgs = five_methods(n, **common)
    results = run_distributed(run_engine, world, "mlp", cfgs, 0.0, shard_rank, device)
    assert results[0][0][2] == 0 and [r[0][2] for r in results] == [0, 2, 1, 3]  # the two-level order
    check_five_methods("mlp", cfgs, world, n, updates, results, "on 2 x 2")


def test_int8_estimate_quantizes_the_node_sums_on_two_nodes():
    # the inner level exact, the outer level's bytes int8: the reference quantizes each node's sum
    updates, world = 4, 4
    cfg = config(method="acco", n_grad_accumulation=2, nb_steps_tot=2 * 2 * world * updates,
                 estimate_comm="int8", **NODES)
    results = run_distributed(train_counting, world, "mlp", [cfg], BLOCK)
    qz.BLOCK = 2048  # (set by the in-process reference runs' default)
    params = results[0][0][0]
    assert_close(params, reference_int8("mlp", cfg, world, updates, BLOCK, workers_per_node=2),
                 "int8 estimate on 2 x 2 vs the node-sum reference")
    flat = reference_int8("mlp", cfg, world, updates, BLOCK)  # each worker's own sum quantized
    assert (params - flat).abs().max() > 1e-6
    for r in range(1, world):
        torch.testing.assert_close(results[r][0][0], params, rtol=0, atol=0)


def _diloco_run(rank, world, kind, cfgs):
    """Every rank: each config's final parameters, records and local parameters after each step."""
    out = []
    for cfg in cfgs:
        model = make_model(kind)
        engine = build_engine(model, cfg)
        records, local = [], []
        bf16 = cfg.use_mixed_precision
        loss = (lambda m, b: loss_fn(m, (b[0].bfloat16(), b[1].bfloat16()))) if bf16 else loss_fn
        for record in engine.run(stream(kind, rank, world), loss):
            records.append(record)
            local.append(engine.local.clone())
        engine.close()
        out.append((parameters_to_vector(model.parameters()).detach(), records, torch.stack(local)))
    return out


def test_diloco_one_replica_per_node_equals_its_reference():
    """rounds=nodes on 2 x 2: one replica per node. Each inner step the node's two workers average
    their gradients and take the same AdamW step (bit-identical local parameters inside a node,
    different between nodes); a fragment's pseudo-gradient is averaged over the 2 nodes. Equal to
    the reference of 2 replicas, each stepping on its 2 workers' micro-batches; the records' loss
    is the node's. rounds=flat on the same 4 workers keeps 4 replicas of one worker."""
    kind, world, n = "mlp", 4, 2
    diloco = dict(method="diloco", n_grad_accumulation=n, nb_steps_tot=n * world * 7, sync_every=3,
                  max_grad_norm=0.5)
    streaming = dict(method="streaming-diloco", n_grad_accumulation=n, nb_steps_tot=n * world * 9,
                     sync_every=4, num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5,
                     outer_lr=0.5, outer_momentum=0.8)  # fmt: skip
    cfgs = [config(**diloco, **NODES), config(**streaming, **NODES), config(**streaming, rounds="flat")]
    results = run_distributed(_diloco_run, world, kind, cfgs)
    for rank_result in results[1:]:  # the final model is the global one, the same everywhere
        for (theta, *_), (theta0, *_) in zip(rank_result, results[0]):
            assert torch.equal(theta, theta0)
    for c, (cfg, S) in enumerate(zip(cfgs, (2, 2, 1))):
        theta, records, local = results[0][c]
        expected, losses = reference_diloco(kind, cfg, world, workers_per_replica=S)
        what = f"{cfg.method} rounds={cfg.rounds}"
        assert [r.step for r in records] == list(range(1, len(losses) + 1)), what
        assert records[-1].committed_micro_batches == cfg.nb_steps_tot, what
        assert_close(theta, expected, f"{what} vs the reference of {world // S} replicas of {S}")
        assert_close(torch.tensor([r.loss for r in records]), torch.tensor(losses), f"{what}: losses")
        node_peer, other_node = results[1][c][2], results[2][c][2]
        if S == 2:  # the node's workers take the same steps; the nodes' data differ
            assert torch.equal(local, node_peer), what
            assert not torch.allclose(local, other_node), what
            assert all(math.isclose(r.loss, p.loss) for r, p in zip(records, results[1][c][1])), what
        else:  # every worker its own replica
            assert not torch.allclose(local, node_peer), what


def test_diloco_on_nodes_in_mixed_precision():
    """bf16 on 2 x 2, the gradients summed in bf16 or in fp32 (rounded once for the node's wire):
    the node's workers still hold the same bits, every worker ends on the same global parameters,
    and the run stays near the fp32 reference of 2 replicas of 2."""
    kind, world = "mlp", 4
    common = dict(method="streaming-diloco", n_grad_accumulation=2, nb_steps_tot=2 * world * 8, sync_every=4,
                  num_fragments=2, fragment_sync_delay=1, use_mixed_precision=True, **NODES)  # fmt: skip
    cfgs = [config(**common, grad_accum_dtype=d) for d in ("bf16", "fp32")]
    results = run_distributed(_diloco_run, world, kind, cfgs)
    expected, _ = reference_diloco(kind, config(**{**common, "use_mixed_precision": False}), world, 2)
    for c, cfg in enumerate(cfgs):
        theta, records, local = results[0][c]
        assert theta.dtype == torch.bfloat16 and all(math.isfinite(r.loss) for r in records)
        assert torch.equal(local, results[1][c][2]) and torch.equal(results[2][c][2], results[3][c][2])
        assert all(torch.equal(theta, r[c][0]) for r in results[1:])
        # bf16 ends 0.0012 from the fp32 reference, which moved the parameters by up to 0.12
        torch.testing.assert_close(theta.float(), expected, rtol=0, atol=0.005, msg=cfg.grad_accum_dtype)


def _short_stream_run(rank, world, short_rank, short, cfg):
    model = make_model("mlp")
    engine = build_engine(model, cfg)
    data = [micro_batch("mlp", j * world + rank) for j in range(short if rank == short_rank else 6)]
    records, local, next_loss = [], [], []
    for record in engine.run(data, loss_fn):
        records.append((record.step, record.weight, record.loss))
        local.append(engine.local.clone())
        with torch.no_grad():  # this worker's next micro-batch alone, at the parameters it is computed at
            next_loss.append(loss_fn(model, data[record.step]).item() if record.step < len(data) else None)
    engine.close()
    return parameters_to_vector(model.parameters()).detach(), records, torch.stack(local), next_loss


def test_diloco_on_nodes_when_one_worker_s_data_runs_out():
    """Worker 2 (node 1, local 0) has 3 micro-batches, the others 6: at step 4 node 1 steps on
    worker 3's alone (its weight and loss), the node's workers still alike; the node's
    data-exhausted flag, which worker 2's chunk of the wire does not hold, reaches every worker with
    the sync at step 4, where all stop."""
    world = 4
    cfg = config(method="diloco", n_grad_accumulation=1, nb_steps_tot=1000, sync_every=4, **NODES)
    results = run_distributed(_short_stream_run, world, 2, 3, cfg)
    for rank, (theta, records, *_) in enumerate(results):
        assert [step for step, *_ in records] == [1, 2, 3, 4], rank
        assert [w for _, w, _ in records] == ([4, 4, 4, 2] if rank >= 2 else [4, 4, 4, 4]), rank
        assert torch.equal(theta, results[0][0])
    assert torch.equal(results[2][2], results[3][2]) and torch.equal(results[0][2], results[1][2])
    # node 1's 4th loss is worker 3's 4th micro-batch's alone, also on worker 2
    assert math.isclose(results[2][1][3][2], results[3][3][2], rel_tol=1e-6)
    assert results[3][1][3][2] == results[2][1][3][2]
