"""Sharding inside the node (EngineConfig.shard_inside_node): ddp, dpu, wp and acco with each block's
parameters and gradients sharded over the S workers of a node by FSDP2, and the comm rounds run
between nodes on the node's shards (docs/algorithm.md, "Sharding inside the node").

A job of W = R nodes x S workers (nodes.py's layout). Each block of the model, then the root, is
`fully_shard`ed on a 1-D mesh over the node's group: a forward all-gathers a block inside the node,
a backward reduce-scatters its gradient there (a sum: the divide factor is 1), and worker (node r,
local s) keeps local s's rows of every parameter. Those rows are this worker's *local vector*:
`NodeShards.params`, one flat padded vector that FSDP2's shards view (as FlatParams' parameters view
its flat vector), its gradient shards viewing `NodeShards.grads`. Every worker of local index s holds
the same rows on its node, so the comm round is the flat ring of the R workers of local index s (the
outer group): reduce-scatter of the local vector to 1/R of it (1/W of the model), the sharded AdamW
on that shard, all-gather back into the local vector. The optimizer shard stays 1/W; the replicated
state per worker (parameters, gradient accumulator, comm buffer) falls from 3 model-sized vectors to
3 local vectors, 1/S of the model each, plus the blocks FSDP2 holds unsharded at a time.

ACCO's ordering, kept:
- the payload is the accumulated gradient shards, copied at the round's launch: FSDP2's reduce-
  scatter and accumulation of the last micro-batch are ordered before the copy (its backward ends
  by waiting for them on the compute stream);
- the new parameters are swapped into the local vector on the compute stream before the next
  forward, whose first all-gather (and every prefetch, all inside one forward or backward) reads
  them;
- every worker of a node computes the same micro-batches per round (a fixed batch: EngineConfig
  refuses another), and no worker starts a micro-batch a peer of its node will not: the
  micro-batches are taken two rounds ahead, and whether every worker has them travels with each
  round's statistics (`AgreedBatches`).

Two groups are busy at once: FSDP2's node group on the main thread, and the comm thread's outer
group and whole-job statistics; no group is used by both threads while a round is in flight (the
rule docs/internals.md states for NCCL's issue order).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from acco.engine import collectives
from acco.engine.compiling import blocks
from acco.engine.config import CheckpointError, ConfigError
from acco.engine.device import mesh_device_type
from acco.engine.flat import ShardLayout, same_layout
from acco.engine.layout import NodeLayout, layout_words, rounds_workers_per_node
from acco.engine.nodes import FlatRounds, NodeRounds, make_rounds
from acco.engine.shard_map import local_rows


class ShardedRounds(FlatRounds):
    """The rounds of a node-sharded job: the flat ring of the R workers of this local index (the
    outer group), on the local vector. Recorded in checkpoints as workers_per_node S, sharded."""

    def __init__(self, nodes: NodeRounds):
        layout = nodes.layout
        super().__init__(nodes.outer_group, layout.nodes, layout.node,
                         f"{layout_words(nodes.world_size, layout.workers_per_node)}: sharded inside "
                         "the node, rounds between nodes")
        self.workers_per_node = layout.workers_per_node
        self.inner_group = nodes.inner_group
        self.layout = layout


def sharded_rounds(cfg, group, world_size: int, rank: int) -> ShardedRounds:
    """The node layout's groups (made once, nodes.py), for a job of more than one node of more than
    one worker: with one node there is nothing between nodes to run rounds on (torch-hsdp, or plain
    acco, is the method there); with one worker per node nothing to shard."""
    S = rounds_workers_per_node("nodes", world_size, cfg.workers_per_node)
    if S in (1, world_size):
        raise ConfigError(
            f"shard_inside_node needs several nodes of several workers; this job is "
            f"{layout_words(world_size, S)} (set launch.workers_per_node, or run without it)"
        )
    nodes = make_rounds("nodes", group, world_size, rank, S)
    return ShardedRounds(nodes)


class NodeShards:
    """FlatParams' role (acco/engine/flat.py) on the node's shards: `params` and `grads` are this
    worker's local vectors, which FSDP2's sharded parameters and their gradients view; `layout` is
    the local vector's ZeRO-1 layout over the R workers of this local index; `master_shard` its fp32
    shard, taken from the weights as given (before the cast to the training dtype). `whole_master`
    (diloco, whose inner optimizer is the node's, not sharded between nodes): the layout is one
    shard, the master the whole local vector."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, rounds: ShardedRounds,
                 whole_master: bool = False):
        self.module = module
        layout: NodeLayout = rounds.layout
        S, s = layout.workers_per_node, layout.local
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError("the module has no trainable parameters")
        params = dict(module.named_parameters())
        if any(params[n].dim() == 0 for n in names):
            raise ConfigError("shard_inside_node shards parameters by rows: a 0-dim parameter cannot be")
        # decayed parameters (dim >= 2) first, as FlatParams orders the flat vector
        self.names = [n for n in names if params[n].dim() >= 2] + [n for n in names if params[n].dim() < 2]
        self.shapes = [tuple(params[n].shape) for n in self.names]  # unsharded, in that order (shard_map.py)
        # this worker's padded rows of each parameter, in that order: where each lives in the local vector
        self.offsets, offset = [], 0
        for n in self.names:
            p = params[n]
            first, padded = local_rows(p.shape[0], S, s)
            self.offsets.append((offset, first, padded))
            offset += padded * p[0].numel()
        self.decay_numel = sum(padded * params[n][0].numel()
                               for n, (_, _, padded) in zip(self.names, self.offsets) if params[n].dim() >= 2)
        self.layout = ShardLayout(offset, *((1, 0) if whole_master else (layout.nodes, layout.node)))
        # each parameter's range in the local vector, in `names`' order (diloco's fragments)
        self.param_ranges = [(o, o + padded * params[n][0].numel())
                             for n, (o, _, padded) in zip(self.names, self.offsets)]
        self.model_numel = sum(params[n].numel() for n in self.names)
        self.dtype = dtype
        device = params[self.names[0]].device
        self.master_shard = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=device)
        self._fill(self.master_shard, params, self.layout.shard_slice.start)
        with torch.no_grad():
            for p in module.parameters():  # the training dtype before sharding: FSDP2 keeps it
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        self.params = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        self.grads = torch.zeros_like(self.params)
        mesh = DeviceMesh.from_group(rounds.inner_group, mesh_device_type(device))
        units = [b for b in blocks(module) if b is not module]
        for unit in [*units, module]:
            # the last block keeps its parameters from its forward to its backward, which comes next
            # (one all-gather fewer per micro-batch, for one block's memory: torchtitan's choice)
            fully_shard(unit, mesh=mesh, reshard_after_forward=unit is not units[-1] if units else True)
            # a plain sum inside the node, as the rounds' reduce-scatter (no divide, no PREMUL_SUM)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        self.trainable = self._view(module)
        self.units = [m for m in module.modules() if isinstance(m, FSDPModule)]

    def _fill(self, out: torch.Tensor, params: dict, start: int) -> None:
        """out = the local vector's [start, start + len(out)), from the unsharded parameters."""
        stop = start + out.numel()
        for n, (offset, first, padded) in zip(self.names, self.offsets):
            p = params[n].detach()
            rows = p[first : first + padded].flatten()  # the padding stays zero
            a, b = max(start, offset), min(stop, offset + rows.numel())
            if a < b:
                out[a - start : b - start].copy_(rows[a - offset : b - offset])

    def _view(self, module: nn.Module) -> list[nn.Parameter]:
        """Re-point each FSDP2 shard (its padded data, the DTensor's local rows) at the local vector,
        and its gradient at the gradient vector: FSDP2 then all-gathers from `params` and adds each
        reduce-scattered gradient into `grads` in place."""
        fsdp_params = {}
        for m in module.modules():
            state = getattr(m, "_get_fsdp_state", None)
            group = state()._fsdp_param_group if state is not None else None
            for fp in group.fsdp_params if group is not None else ():
                fsdp_params[id(fp.sharded_param)] = fp
        trainable = []
        for n, (offset, _, padded) in zip(self.names, self.offsets):
            p = module.get_parameter(n)
            fp = fsdp_params[id(p)]
            if tuple(fp.padded_sharded_param_size)[0] != padded:
                raise RuntimeError(f"FSDP2 shards {n} into {tuple(fp.padded_sharded_param_size)}, "
                                   f"not {padded} rows: this torch's sharding is not the one assumed")
            size = fp.padded_sharded_param_size.numel()
            data = self.params[offset : offset + size].view(fp.padded_sharded_param_size)
            data.copy_(fp._sharded_param_data.view(fp.padded_sharded_param_size))
            rows = p._local_tensor.shape[0]
            fp._sharded_param_data = data.view(-1)
            p._local_tensor = data.narrow(0, 0, rows)
            grad = self.grads[offset : offset + size].view(fp.padded_sharded_param_size).narrow(0, 0, rows)
            p.grad = fp.to_sharded_dtensor(grad)
            trainable.append(p)
        return trainable

    def check_grad_views(self) -> None:
        """Fail loudly if something detached a gradient shard from the gradient vector (FSDP2 would
        then assign new gradients the rounds never see)."""
        lo = self.grads.data_ptr()
        hi = lo + self.grads.numel() * self.grads.element_size()
        for p in self.trainable:
            local = p.grad._local_tensor if p.grad is not None else None
            if local is None or (local.numel() and not lo <= local.data_ptr() < hi):
                raise RuntimeError(
                    "a parameter's gradient shard no longer views the engine's gradient vector; do not "
                    "call zero_grad(set_to_none=True) or assign .grad on an engine-managed module"
                )

    def reshard(self) -> None:
        """Drop the unsharded parameters a forward without backward left (FSDP2 keeps the root's after
        its forward, for the backward it expects): the next forward all-gathers the local vector as
        it is now, not as it was at an evaluation's forward."""
        for unit in self.units:
            unit.reshard()

    @property
    def shard(self) -> slice:
        return self.layout.shard_slice


def check_sharding(state: dict, engine) -> None:
    """diloco's and streaming-diloco's checkpoint sharded inside the node (each node's local vector,
    with state every worker of an outer group shares) resumes on its own layout, sharded, only; one
    line otherwise. (ddp, dpu, wp and acco reshard between any layouts: shard_map.py.)"""
    saved = bool(state.get("shard_inside_node", False))
    if saved == engine.sharded and (not saved or same_layout(state, engine)):
        return

    def words(sharded, world, per_node):
        return f"{world} workers ({per_node} per node){', sharded inside the node' if sharded else ''}"
    old = words(saved, state["world_size"], state.get("workers_per_node", 0))
    raise CheckpointError(
        f"checkpoint was written by {old}, "
        f"this run has {words(engine.sharded, engine.world_size, engine.rounds.workers_per_node)}: a "
        "checkpoint sharded inside the node resumes on its own layout with train.shard_inside_node="
        f"{str(saved).lower()} only"
    )


_END = object()


class AgreedBatches(Iterator):
    """The micro-batches of a node-sharded worker, taken `ahead` in advance (two rounds' worth):
    `top_up` refills the queue before each round's statistics are sent and says whether this worker
    is short, so every worker learns from that round whether all of them can run the next two
    rounds' micro-batches, before any of them starts one (an FSDP2 forward that a peer never joins
    would hang). The engine stops after a round that reports a short worker; the queued
    micro-batches are read again on resume (`fetched_ahead`)."""

    def __init__(self, batches: Iterable, ahead: int):
        self.batches, self.ahead = iter(batches), ahead
        self.queue: collections.deque = collections.deque()

    def top_up(self) -> bool:
        """Fill the queue to `ahead`; True if the stream ended first (this worker is short)."""
        while len(self.queue) < self.ahead:
            batch = next(self.batches, _END)
            if batch is _END:
                return True
            self.queue.append(batch)
        return False

    def __next__(self):
        if not self.queue:  # the agreement above rules it out: a bug, not the end of the data
            raise RuntimeError("a node-sharded worker ran out of agreed micro-batches")
        return self.queue.popleft()


def agree_first(engine, batches: AgreedBatches) -> bool:
    """Before the first micro-batch: whether some worker is short of the first two rounds' (one
    all-reduce, as the torch engines' first update)."""
    return collectives.any_worker(batches.top_up(), engine.device, engine.group)
