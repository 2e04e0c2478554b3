"""diloco and streaming-diloco sharded inside the node (acco/engine/diloco.py with
shard_inside_node) on 2 nodes x 2 workers: one replica per node, each block sharded over the node's
2 workers by FSDP2, every worker running the inner AdamW, the pseudo-gradient and the outer step on
its local vector (half the model). The same reference as the unsharded replica per node: 2 replicas
of 2 workers (tests/engine_helpers.reference_diloco)."""

from __future__ import annotations

import itertools
import math

import fake_cuda
import pytest
import torch
from distributed import run_distributed
from engine_helpers import assert_close, config, loss_fn, make_model, micro_batch, reference_diloco, stream
from node_shards_helpers import full_params, interrupted, refusals
from torch.nn.utils import parameters_to_vector

from acco.engine import build_engine

NODES = dict(rounds="nodes", workers_per_node=2)
SHARDED = dict(NODES, shard_inside_node=True)
STREAMING = dict(method="streaming-diloco", sync_every=4, num_fragments=2, fragment_sync_delay=1,
                 fragment_update_alpha=0.5, outer_lr=0.5, outer_momentum=0.8)  # fmt: skip


def _loss(cfg):
    if cfg.use_mixed_precision:
        return lambda m, b: loss_fn(m, (b[0].bfloat16(), b[1].bfloat16()))
    return loss_fn


def _params(model, cfg) -> torch.Tensor:
    if cfg.shard_inside_node:
        return full_params(model)
    return parameters_to_vector(model.parameters()).detach().float()


def _train(rank, world, kind, cfgs, limits=None, evaluate=False, device="host"):
    """Every rank: each config's whole final parameters, its records, and (local vector's numel,
    the engine's state bytes); `limits[rank]`: that many micro-batches in this worker's stream;
    `evaluate`: a forward at the global parameters after every record, as the trainer's evaluations
    (and, as the trainer, `finish` once training ends); `device` "fake-cuda" runs the engine's GPU
    paths on the CPU (tests/fake_cuda.py)."""
    with fake_cuda.maybe_installed(device):
        return _train_here(rank, world, kind, cfgs, limits, evaluate)


def _train_here(rank, world, kind, cfgs, limits, evaluate):
    out = []
    for cfg in cfgs:
        model = make_model(kind)
        engine = build_engine(model, cfg)
        fn = _loss(cfg)
        batches = stream(kind, rank, world)
        if limits is not None:
            batches = itertools.islice(batches, limits[rank])
        records = []
        for record in engine.run(batches, fn):
            records.append(record)
            if evaluate:
                with engine.committed_params(), torch.no_grad():
                    fn(model, micro_batch(kind, 10_000 + rank))
        engine.finish()
        sizes = (engine.flat.params.numel(), sum(engine.state_bytes().values()))
        engine.close()
        out.append((_params(model, cfg), records, sizes))
    return out


def _counts(records):
    return [r.step for r in records]


@pytest.mark.parametrize("kind,device", [("stack", "host"), ("mlp", "host"), ("stack", "fake-cuda")])
def test_diloco_sharded_inside_the_node_equals_the_replica_per_node_reference(kind, device):
    """fp32: diloco and streaming-diloco sharded in the node end on the reference's global
    parameters (2 replicas of 2 workers), with its losses, and with the unsharded node replica's
    clipping norms (the node's: the workers' squared local norms summed); each worker holds about
    half of the unsharded replica's state."""
    world, n, clip = 4, 2, 0.3
    diloco = dict(method="diloco", n_grad_accumulation=n, nb_steps_tot=n * world * 7, sync_every=3,
                  max_grad_norm=clip)  # fmt: skip
    streaming = dict(STREAMING, n_grad_accumulation=n, nb_steps_tot=n * world * 9, max_grad_norm=clip)
    cfgs = [config(**diloco, **SHARDED), config(**streaming, **SHARDED), config(**diloco, **NODES)]
    results = run_distributed(_train, world, kind, cfgs, None, False, device)
    for rank_result in results[1:]:  # the final model is the global one, the same everywhere
        for (theta, *_), (theta0, *_) in zip(rank_result, results[0]):
            assert torch.equal(theta, theta0)
    (_, plain_records, (plain_local, plain_bytes)) = results[0][2]
    numel = sum(p.numel() for p in make_model(kind).parameters())
    assert plain_local == numel
    for c, cfg in enumerate(cfgs[:2]):
        theta, records, (local, state_bytes) = results[0][c]
        expected, losses = reference_diloco(kind, cfg, world, workers_per_replica=2)
        what = f"{cfg.method} sharded in the node"
        assert _counts(records) == list(range(1, len(losses) + 1)), what
        assert records[-1].committed_micro_batches == cfg.nb_steps_tot, what
        assert_close(theta, expected, f"{what} vs the reference of 2 replicas of 2")
        assert_close(torch.tensor([r.loss for r in records]), torch.tensor(losses), f"{what}: losses")
        node_peer = results[1][c][1]
        assert all(math.isclose(r.loss, p.loss) for r, p in zip(records, node_peer)), what
        assert local < 0.75 * numel and state_bytes < 0.75 * plain_bytes, (what, local, state_bytes)
    sharded_norms = torch.tensor([r.grad_norm for r in results[0][0][1]])
    plain_norms = torch.tensor([r.grad_norm for r in plain_records])
    assert (plain_norms > clip).any()  # clipping changed some steps
    assert_close(sharded_norms, plain_norms, "the node's gradient norm, sharded vs unsharded")


def test_diloco_sharded_in_mixed_precision_tracks_the_unsharded_replica_per_node():
    """bf16 (FSDP2 reduce-scatters each micro-batch's gradient in bf16, the unsharded node replica
    all-reduces the step's sum once): streaming-diloco sharded ends near the unsharded run and near
    the fp32 reference, on every worker the same global parameters."""
    kind, world = "stack", 4
    common = dict(STREAMING, n_grad_accumulation=2, nb_steps_tot=2 * world * 8, use_mixed_precision=True)
    cfgs = [config(**common, **SHARDED), config(**common, **NODES)]
    results = run_distributed(_train, world, kind, cfgs)
    (sharded, records, _), (plain, _, _) = results[0]
    assert all(math.isfinite(r.loss) for r in records)
    assert all(torch.equal(r[0][0], sharded) for r in results[1:])
    torch.testing.assert_close(sharded, plain, rtol=0, atol=5e-3)  # 0.001 measured
    expected, _ = reference_diloco(kind, config(**{**common, "use_mixed_precision": False}), world, 2)
    torch.testing.assert_close(sharded, expected, rtol=0, atol=5e-3)  # 0.0012 measured
    initial = torch.cat([p.detach().flatten() for p in make_model(kind).parameters()])
    assert (sharded - initial).abs().max() > 5e-2  # it trained


def test_a_short_worker_stops_every_worker_without_a_hang():
    """Worker 2 (node 1, local 0) has 3 micro-batches, the others 40: node 1 learns at step 2's
    statistics (the micro-batches are agreed two steps ahead) that step 4's is missing, computes
    step 3's and no more (its peer starts no forward worker 2 would not join); its flag reaches
    node 0 with the sync at step 4, where every worker stops, on the same global parameters."""
    world = 4
    cfg = config(method="diloco", n_grad_accumulation=1, nb_steps_tot=1000, sync_every=4, **SHARDED)
    results = run_distributed(_train, world, "stack", [cfg], [40, 40, 3, 40])
    for rank, ((theta, records, _),) in enumerate(results):
        assert _counts(records) == ([1, 2, 3, 4] if rank < 2 else [1, 2, 3]), rank
        assert torch.equal(theta, results[0][0][0])
    node1 = [[r.loss for r in results[rank][0][1]] for rank in (2, 3)]
    assert node1[0] == node1[1]


def test_an_evaluation_between_steps_leaves_training_as_it_was():
    """A forward at the global parameters after every record (FSDP2 keeps the root's unsharded
    parameters after a forward without backward): the next training forward still computes at the
    local ones, so the run ends where it ends without evaluations."""
    world = 4
    cfg = config(**STREAMING, n_grad_accumulation=1, nb_steps_tot=world * 10, **SHARDED)
    plain = run_distributed(_train, world, "stack", [cfg])
    evaluated = run_distributed(_train, world, "stack", [cfg], None, True)
    for a, b in zip(plain, evaluated):
        assert torch.equal(a[0][0], b[0][0])


def test_a_sharded_diloco_resumes_exactly():
    """streaming-diloco, fragment 0 prepared at step 2 and applied at 3: the state taken after step
    2 holds its landed average (saved by node 0's workers, broadcast on each outer group at load)."""
    world = 4
    cfg = config(**{**STREAMING, "fragment_update_alpha": 0.25}, n_grad_accumulation=1,
                 nb_steps_tot=world * 10, **SHARDED)  # fmt: skip
    results = run_distributed(interrupted, world, "stack", cfg, 2, _in_flight)
    for whole, resumed, exact, ahead, in_flight in results:
        assert exact and in_flight and ahead > 0
        assert torch.equal(whole, resumed)


def _in_flight(engine) -> bool:
    """Whether a fragment's round is in flight."""
    return engine.pending is not None


def test_a_sharded_diloco_checkpoint_is_refused_unsharded_and_the_reverse():
    world = 4
    common = dict(method="diloco", n_grad_accumulation=1, nb_steps_tot=4 * world, sync_every=2)
    lines = run_distributed(refusals, world, config(**common, **SHARDED), config(**common, **NODES))[0]
    assert lines == [
        "checkpoint was written by 4 workers (2 per node), sharded inside the node, this run has 4 "
        "workers (2 per node): a checkpoint sharded inside the node resumes on its own layout with "
        "train.shard_inside_node=true only",
        "checkpoint was written by 4 workers (2 per node), this run has 4 workers (2 per node), sharded "
        "inside the node: a checkpoint sharded inside the node resumes on its own layout with "
        "train.shard_inside_node=false only",
    ]
