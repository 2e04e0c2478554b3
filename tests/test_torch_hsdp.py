"""torch-hsdp (acco/engine/torch_hsdp.py), PyTorch's FSDP2 on the node layout, on real gloo
processes: on 2 nodes x 2 workers (HSDP: sharded inside the node, replicated across), one node
(plain FSDP2), one worker per node and rounds=flat, its parameters, per-update losses and
gradient norms equal the plain AdamW reference on the global batches (acco_bench/reference.py),
with clipping acting on some updates, with and without accumulation, with FSDP units per block;
a checkpoint taken mid-run resumes to the uninterrupted run's parameters, on its own layout only.
"""

from __future__ import annotations

import io
import math

import torch
import torch.distributed as dist
from distributed import run_distributed
from engine_helpers import assert_close, config, loss_fn, make_model, micro_batch, stream
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.utils import parameters_to_vector

from acco.engine import CheckpointError, ConfigError, build_engine
from acco_bench import reference

TWO_NODES = dict(method="torch-hsdp", workers_per_node=2)


class Stack(nn.Module):
    """Two transformer blocks in a ModuleList and a head: each block is an FSDP unit of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True, bias=False
            )
            for _ in range(2)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make(kind: str) -> nn.Module:
    return Stack() if kind == "stack" else make_model(kind)


def data_kind(kind: str) -> str:
    return "block" if kind == "stack" else kind


def ref_for(kind: str, cfg, world: int, counts: list[int]) -> reference.Reference:
    return reference.Reference(make(kind), cfg, world, counts, loss_fn=loss_fn,
                               read=lambda r, j: micro_batch(data_kind(kind), j * world + r))  # fmt: skip


def layout(engine) -> dict:
    """The mesh and what this worker holds of the model."""
    params = list(engine.sharded.parameters())
    return {
        "mesh": tuple(engine.mesh.shape),
        "dims": engine.mesh.mesh_dim_names,
        "placements": {str(p.placements) for p in params},
        "units": sum(isinstance(m, FSDPModule) for m in engine.sharded.modules()),
        "local": [p.to_local().numel() for p in params],
        "grads_sharded": all(isinstance(p.grad, DTensor) for p in params),
        "state_bytes": engine.state_bytes(),
    }


def train(rank, world, runs):
    """Each (kind, cfg): a fresh model trained to its budget; the caller's module (the committed
    view, gathered by `finish`), the records and the layout."""
    out = []
    for kind, cfg in runs:
        cfg = cfg[rank] if isinstance(cfg, list) else cfg
        model = make(kind)
        engine = build_engine(model, cfg)
        records = list(engine.run(stream(data_kind(kind), rank, world), loss_fn))
        out.append((parameters_to_vector(model.parameters()).detach().float(), records, layout(engine)))
        engine.close()
    return out


def check(got, ref: reference.Reference, updates: int, what: str) -> None:
    params, records, _ = got
    expected = ref.ddp(updates)
    assert [r.step for r in records] == list(range(1, updates + 1)), what
    assert_close(params, expected, f"{what} vs AdamW on the global batches")
    assert_close(torch.tensor([r.loss for r in records]), torch.tensor(ref.losses), f"{what}: losses")
    if not all(math.isnan(r.grad_norm) for r in records):  # nan: clipping off
        assert_close(
            torch.tensor([r.grad_norm for r in records]), torch.tensor(ref.grad_norms), f"{what}: norms"
        )


# max_grad_norm between the gradient norms these runs see (mlp 0.29-0.43 on 4 workers, 0.40-0.55
# with one micro-batch per update, the stack
# 0.45-0.75), so that some updates are clipped and others not.
def test_two_nodes_of_two_one_worker_per_node_and_flat_equal_the_reference():
    world, n, updates = 4, 2, 4
    budget = n * world * updates
    runs = [
        ("mlp", config(**TWO_NODES, n_grad_accumulation=n, nb_steps_tot=budget, max_grad_norm=0.35)),
        ("stack", config(**TWO_NODES, n_grad_accumulation=n, nb_steps_tot=budget, max_grad_norm=0.6)),
        ("mlp", config(**TWO_NODES, n_grad_accumulation=1, nb_steps_tot=budget // n, max_grad_norm=0.45)),
        ("mlp", config(method="torch-hsdp", workers_per_node=1, n_grad_accumulation=n, nb_steps_tot=budget)),
        ("mlp", config(**TWO_NODES, rounds="flat", n_grad_accumulation=n, nb_steps_tot=budget)),
    ]
    results = run_distributed(train, world, runs)
    for rank_result in results[1:]:  # every worker's view holds the same committed parameters
        for (theta, *_), (theta0, *_) in zip(rank_result, results[0]):
            assert torch.equal(theta, theta0)
    for (kind, cfg), got in zip(runs, results[0]):
        ref = ref_for(kind, cfg, world, [cfg.n_grad_accumulation] * world)
        check(got, ref, updates, f"{kind}, {cfg.workers_per_node} per node, rounds={cfg.rounds}")
        if cfg.max_grad_norm:
            norms = torch.tensor(ref.grad_norms)
            assert norms.min() < cfg.max_grad_norm < norms.max(), (
                f"clipping should act on some updates: {norms}"
            )

    mlp, stack, single, replicated, flat = (got[2] for got in results[0])
    numel = sum(p.numel() for p in make("mlp").parameters())
    assert (mlp["mesh"], mlp["dims"]) == ((2, 2), ("replicate", "shard"))
    assert mlp["placements"] == {"(Replicate(), Shard(dim=0))"} and mlp["grads_sharded"]
    # sharded inside the node (the two workers of a node hold the model between them), the same
    # shards on both nodes (rank = node * 2 + local)
    local = [r[0][2]["local"] for r in results]
    assert local[0] == local[2] and local[1] == local[3] and sum(local[0]) + sum(local[1]) == numel
    assert max(sum(x) for x in local) < numel
    assert stack["units"] == 3 and mlp["units"] == 1  # each block, then the root
    assert replicated["mesh"] == (4, 1) and sum(replicated["local"]) == numel  # S = 1: replicated
    assert flat["mesh"] == (4,) and flat["dims"] == ("shard",) and flat["placements"] == {"(Shard(dim=0),)"}
    sb = mlp["state_bytes"]
    assert sb["exp_avg"] == sb["exp_avg_sq"] == 4 * sum(local[0])  # AdamW's moments: this worker's shard
    assert sb["params"] == 4 * sum(local[0]) + 4 * numel + 4 * numel  # shards, the view, the compute copy


def test_one_node_is_plain_fsdp2_and_unequal_counts_give_the_count_weighted_mean():
    world, updates = 2, 4
    runs = [
        (
            "mlp",
            config(**TWO_NODES, n_grad_accumulation=2, nb_steps_tot=2 * world * updates, max_grad_norm=0.45),
        ),
        ("mlp", [config(**TWO_NODES, n_grad_accumulation=k, nb_steps_tot=4 * updates) for k in (3, 1)]),
    ]
    (one_node, uneven), _ = run_distributed(train, world, runs)
    assert one_node[2]["mesh"] == (2,) and one_node[2]["placements"] == {"(Shard(dim=0),)"}
    ref = ref_for("mlp", runs[0][1], world, [2, 2])
    check(one_node, ref, updates, "one node of 2")
    norms = torch.tensor(ref.grad_norms)
    assert norms.min() < 0.45 < norms.max(), norms
    assert [r.micro_batches for r in uneven[1]] == [[3, 1]] * updates
    check(uneven, ref_for("mlp", runs[1][1][0], world, [3, 1]), updates, "counts 3 and 1")


def _mixed_precision(rank, world, cfgs):
    """What FSDP2's collectives carried (dtype) per config, the trained view and its dtype; and
    where an engine built from other weights on each rank starts."""
    sent = []
    # (torch 2.13's names, which FSDP2 calls)
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def recording(name):
        def call(output, input, *args, **kwargs):
            sent.append((name, input.dtype))
            return originals[name](output, input, *args, **kwargs)

        return call

    out = []
    try:
        for name in originals:
            setattr(dist, name, recording(name))
        for cfg in cfgs:
            sent.clear()
            model = make_model("mlp")
            engine = build_engine(model, cfg)
            list(engine.run(stream("mlp", rank, world), loss_fn))
            view_dtype = next(model.parameters()).dtype
            out.append((parameters_to_vector(model.parameters()).detach().float(), set(sent), view_dtype))
            engine.close()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    model = make_model("mlp")
    with torch.no_grad():  # every rank its own initial weights
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + rank)))
    own = parameters_to_vector(model.parameters()).detach().clone()
    engine = build_engine(model, cfgs[0])
    shards = torch.cat([p.full_tensor().flatten() for p in engine.sharded.parameters()])
    return out, own, parameters_to_vector(model.parameters()).detach().clone(), shards


def test_mixed_precision_gathers_bf16_parameters_and_reduces_fp32_gradients_from_rank0s_weights():
    world, updates = 2, 3
    cfgs = [
        config(**TWO_NODES, n_grad_accumulation=2, nb_steps_tot=2 * world * updates, use_mixed_precision=mp)
        for mp in (True, False)
    ]
    (runs, own0, _, _), (_, own1, view1, shards1) = run_distributed(_mixed_precision, world, cfgs)
    (bf16, bf16_sent, view_dtype), (fp32, fp32_sent, fp32_view) = runs

    def kinds(sent, name):  # (float64: the engine's statistics, all-gathered beside FSDP's collectives)
        return {dtype for n, dtype in sent if n == name} - {torch.float64}

    assert kinds(bf16_sent, "all_gather_single") == {torch.bfloat16}  # the parameters, in bf16
    assert kinds(bf16_sent, "reduce_scatter_single") == {torch.float32}  # the gradients, in fp32
    fp32_kinds = kinds(fp32_sent, "all_gather_single") | kinds(fp32_sent, "reduce_scatter_single")
    assert fp32_kinds == {torch.float32} and len(fp32_sent) > 2
    assert view_dtype == torch.bfloat16 and fp32_view == torch.float32  # the view: what training computes in
    assert torch.isfinite(bf16).all() and 0 < (bf16 - fp32).abs().max() < 0.05  # close to fp32, not equal
    # Rank 1 started from its own weights: it trains from rank 0's, its fp32 shards exactly rank 0's
    # fp32 weights (not the bf16-rounded ones), its view their bf16 rounding.
    assert not torch.equal(own0, own1) and not torch.equal(own0, own0.bfloat16().float())
    assert torch.equal(shards1, own0) and torch.equal(view1, own0.bfloat16())


def _save_and_resume(rank, world, updates, at):
    """The uninterrupted run, then one stopped after update `at` and saved, and a fresh engine on
    other initial weights resumed from that state (through torch.save) to the same budget."""
    cfg = config(**TWO_NODES, n_grad_accumulation=2, nb_steps_tot=2 * world * updates, max_grad_norm=0.35)
    model = make_model("mlp")
    engine = build_engine(model, cfg)
    straight = [r.loss for r in engine.run(stream("mlp", rank, world), loss_fn)]
    uninterrupted = parameters_to_vector(model.parameters()).detach().clone()

    engine = build_engine(make_model("mlp"), cfg)
    read = [0]

    def counted():
        for batch in stream("mlp", rank, world):
            read[0] += 1
            yield batch

    first = []
    for record in engine.run(counted(), loss_fn):
        first.append(record.loss)
        if record.step == at:
            break
    state = engine.state_dict()
    saved = io.BytesIO()
    torch.save(state, saved)
    sizes = {name: t.numel() for name, t in state["params"].items()}
    moments = {name: m["exp_avg"].numel() for name, m in state["optimizer"].items()}

    torch.manual_seed(7)
    other = make_model("mlp")
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    resumed = build_engine(other, cfg)
    saved.seek(0)
    assert resumed.load_state_dict(torch.load(saved, weights_only=False)) is True
    position = read[0] - state["fetched_ahead"]  # the micro-batches the saved updates consumed
    rest = stream("mlp", rank, world)
    for _ in range(position):
        next(rest)
    second = [r.loss for r in resumed.run(rest, loss_fn)]
    refused = []
    for bad in (config(method="torch-hsdp", workers_per_node=1, nb_steps_tot=8),  # same W, another layout
                config(method="torch-ddp", nb_steps_tot=8)):  # fmt: skip
        try:
            build_engine(make_model("mlp"), bad).load_state_dict(state)
        except CheckpointError as e:
            refused.append(str(e))
    try:  # the mesh spans the job: a group of its own is refused
        build_engine(make_model("mlp"), cfg, group=dist.new_group(list(range(world))))
    except ConfigError as e:
        refused.append(str(e))
    # 3 rows over 2 workers: FSDP2 pads the shard of 1 row to 2; the state holds the row alone
    torch.manual_seed(0)
    padded = build_engine(nn.Linear(8, 3), cfg).state_dict()["params"]
    written = {n: (t.numel(), t.untyped_storage().nbytes() // t.element_size()) for n, t in padded.items()}
    return {"written": written, "straight": straight, "uninterrupted": uninterrupted,
            "losses": first + second, "resumed": parameters_to_vector(other.parameters()).detach().clone(),
            "sizes": sizes, "moments": moments, "refused": refused}  # fmt: skip


def test_a_checkpoint_resumes_exactly_on_its_layout_and_is_refused_on_another():
    world, updates, at = 4, 6, 3
    results = run_distributed(_save_and_resume, world, updates, at)
    numel = {name: p.numel() for name, p in make_model("mlp").named_parameters()}
    for rank, got in enumerate(results):
        assert got["losses"] == got["straight"] and len(got["straight"]) == updates
        assert torch.equal(got["resumed"], got["uninterrupted"]), rank
        # each worker saved its own shards, of parameters and moments: half of each tensor's rows
        assert set(got["sizes"]) == set(numel) == set(got["moments"])
        assert all(got["sizes"][n] == got["moments"][n] <= -(-numel[n] // 2) for n in numel), got["sizes"]
        layout_line, method_line, group_line = got["refused"]
        assert layout_line == (
            "torch-hsdp resumes only on the layout it was saved with (its shards follow the "
            "mesh): saved by 4 workers, 2 per node; this run has 4, 1 per node"
        )
        assert method_line.startswith("checkpoint was written by method 'torch-hsdp'"), method_line
        assert group_line.startswith("torch-hsdp needs the default process group"), group_line
    assert sum(results[r]["sizes"][n] for r in (0, 1) for n in numel) == sum(numel.values())
    # the padded shard is saved without its padding: torch.save writes a view's whole storage
    assert [got["written"]["weight"] for got in results] == [(16, 16), (8, 8), (16, 16), (8, 8)]
