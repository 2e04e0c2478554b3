"""torch-hsdp: PyTorch's own FSDP2 (`fully_shard`) on the job's node layout, the PyTorch peer of
the two-level rounds as torch-ddp is of the flat ring.

A job of W = R nodes x S workers (acco/engine/nodes.py) trains on a 2-D DeviceMesh (R, S), dims
"replicate" and "shard": each parameter, gradient and AdamW moment is sharded over the S workers of
a node and replicated across the R nodes (HSDP). A gradient is reduce-scattered inside the node,
then its shard all-reduced between nodes, so each node's link carries a 1/S shard per update; the
parameters are all-gathered inside the node only. One node (R = 1), or rounds=flat, is the 1-D
mesh (W,): plain FSDP2, fully sharded over the job. One worker per node (S = 1) is the mesh (R, 1):
plain replication, DDP's all-reduce with AdamW on the whole model everywhere.

The same hyper-parameters, budget, LR schedule (optim.py), weight-decay grouping (FlatParams' rule:
decay on parameters of dim >= 2), global-norm clipping and UpdateRecord as the other methods, and
torch's own AdamW (fused) on the DTensor shards. Mixed precision is FSDP2's MixedPrecisionPolicy:
fp32 shards, bf16 parameters for compute, fp32 gradient reduction (and accumulation).

The tuning, for speed (memory is not what this peer is compared on):
- each repeated block (compiling.blocks: a transformer's layers) is its own FSDP unit, then the root:
  one all-gather and one reduce-scatter per block, overlapped with the next block's compute;
- reshard_after_forward=False (FSDP1's _HYBRID_SHARD_ZERO2): the unsharded parameters stay from the
  forward to the backward, so the backward all-gathers nothing; FSDP2's default (True) all-gathers
  every block a second time, for memory;
- gradient accumulation with FSDP2's own switches: set_requires_gradient_sync(False) (no
  reduce-scatter nor all-reduce) and set_reshard_after_backward(False) (no second all-gather) on
  all micro-batches of an update but the last, which reduces the fp32 sum and reshards. The
  update's parameters are all-gathered once, its gradients reduced once.

Training runs on a sharded deep copy of the module: `fully_shard` turns a module's parameters into
DTensor shards and its state_dict into theirs, and an evaluation that ran FSDP's forward would
all-gather per batch (ranks evaluate different numbers of batches: a hang). The caller's module is
the committed view instead: every worker together all-gathers the full parameters into it on
`committed_params` and `finish`, in the dtype training computes in (bf16 in mixed precision), so
evaluation and rank 0's save_pretrained see a plain module. It is one model-sized copy on each
worker, counted in state_bytes.

Checkpoints hold each worker's shards (parameters, AdamW's moments) by parameter name and resume
exactly on the same layout; another world size or workers per node is refused with one line
(FSDP2's shards follow the mesh: resharding them is not done here).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from acco.engine import progress
from acco.engine.comm import EXHAUSTED, STOP, new_stats
from acco.engine.compiling import blocks
from acco.engine.config import CheckpointError, ConfigError, EngineConfig, UpdateRecord
from acco.engine.decoupled import LossFn, backward_and_count
from acco.engine.device import mesh_device_type
from acco.engine.flat import broadcast_module, world_of
from acco.engine.layout import rounds_workers_per_node
from acco.engine.torch_ddp import first_batches, gathered_statistics, step_and_record, take_ahead

METHOD = "torch-hsdp"
_meshes: dict = {}  # one mesh per device type and shape: its process groups are made once per process


def device_mesh(device_type: str, world_size: int, workers_per_node: int) -> DeviceMesh:
    """(R, S) with dims ("replicate", "shard"); one node: the 1-D ("shard",) mesh, plain FSDP2."""
    nodes = world_size // workers_per_node
    shape, names = (
        ((nodes, workers_per_node), ("replicate", "shard")) if nodes > 1 else ((world_size,), ("shard",))
    )
    key = (device_type, shape)
    if key not in _meshes:
        _meshes[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _meshes[key]


def shard_module(module: nn.Module, mesh: DeviceMesh, mixed_precision: bool) -> None:
    """fully_shard each repeated block, then the root (which takes what is left: embeddings, head)."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    units = [b for b in blocks(module) if b is not module]
    for unit in [*units, module]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=False, mp_policy=policy)


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy where it is a view into a larger storage (FSDP2 pads a shard whose rows do not
    divide evenly): torch.save writes a view's whole storage."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


class TorchHSDPEngine:
    def __init__(self, module: nn.Module, cfg: EngineConfig, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch-hsdp needs an initialised process group (torch.distributed)")
        if group is not None and group is not dist.GroupMember.WORLD:
            raise ConfigError(
                "torch-hsdp needs the default process group (its device mesh spans the job); pass group=None"
            )
        self.cfg, self.module, self.group = cfg, module, None
        self.world_size, self.rank = world_of(None)
        self.device = next(module.parameters()).device
        S = rounds_workers_per_node(cfg.rounds, self.world_size, cfg.workers_per_node)
        self.workers_per_node = S
        self.mesh = device_mesh(mesh_device_type(self.device), self.world_size, S)
        broadcast_module(module)  # rank 0's weights everywhere: each rank shards its own copy
        # The training copy, fp32 (its shards are the masters); the caller's module is the
        # committed view, in the dtype training computes in.
        self.sharded = copy.deepcopy(module).to(torch.float32)
        module.to(torch.bfloat16 if cfg.use_mixed_precision else torch.float32)
        shard_module(self.sharded, self.mesh, cfg.use_mixed_precision)
        self.params = [p for p in self.sharded.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.sharded.parameters())
        self.optimizer = torch.optim.AdamW(
            # weight decay on the matrices and embeddings, not biases and norms (as FlatParams)
            [
                {"params": [p for p in self.params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            fused=True,
        )
        self.stats = new_stats(self.device)
        self.committed_micro_batches = 0  # over all workers, in committed updates (the budget's unit)
        self.step = 0  # committed updates
        self.wall_time_offset = self.last_wall_time = 0.0
        self.fetched_ahead = 0  # micro-batches taken from the stream for the next update, not computed yet
        self._stop_requested = False
        self._syncing: bool | None = None  # the FSDP switches as last set (set again only on a change)
        self._view_step = 0  # the update the caller's module holds (it holds the initial weights)

    def request_stop(self) -> None:
        """Signal-safe: this worker's next statistics tell every worker to stop after that update."""
        self._stop_requested = True

    def _sync(self, last: bool) -> None:
        """The last micro-batch of an update reduces the summed gradients and reshards; the others
        accumulate locally, the unsharded parameters kept for the next forward."""
        if self._syncing is not last:
            self.sharded.set_requires_gradient_sync(last)
            self.sharded.set_reshard_after_backward(last)
            self._syncing = last

    def run(self, batches: Iterable, loss_fn: LossFn) -> Iterator[UpdateRecord]:
        cfg = self.cfg
        batches = iter(batches)
        t0 = time.perf_counter() - self.wall_time_offset
        per_update = cfg.n_grad_accumulation  # micro-batches per worker per update
        # Every rank must know before a forward that every other rank will run it too (FSDP's
        # collectives would hang otherwise): the next update's micro-batches are fetched first,
        # and whether everyone has them travels with the statistics all-gather (as torch-ddp).
        upcoming, exhausted = first_batches(self, batches, per_update)
        while not exhausted:
            start = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            self.stats.zero_()
            self.sharded.train(self.module.training)  # the caller's mode (dropout) for its module's copy
            # Progress marks before each collective: the all-gathers of the first forward, then the
            # reduce-scatters (and all-reduces between nodes) of the last backward.
            progress.mark(f"update {self.step + 1} (start)")
            for k, batch in enumerate(upcoming):
                self._sync(k == per_update - 1)
                if k == per_update - 1:
                    progress.mark(f"update {self.step + 1} (gradient reduce-scatter)")
                backward_and_count(loss_fn(self.sharded, batch), self.stats)
            compute_s = time.perf_counter() - start
            start = time.perf_counter()
            upcoming = take_ahead(self, batches, per_update)
            record, exhausted = self._commit(len(upcoming) < per_update, compute_s, start, t0)
            yield record
            if self.committed_micro_batches >= cfg.nb_steps_tot:
                break
        self.finish()

    def _commit(
        self, out_of_data: bool, compute_s: float, start: float, t0: float
    ) -> tuple[UpdateRecord, bool]:
        """The statistics all-gather, then the step on this worker's shards: mean over the loss
        weight, clipping by the global norm, AdamW at the schedule's learning rate. Returns the
        update's record and whether some worker's data ran out."""
        cfg = self.cfg
        self.stats[EXHAUSTED] = float(out_of_data)
        if self._stop_requested:  # (stats are zeroed per update: set again each time)
            self.stats[STOP] = 1
        table, weight, micro_batches = gathered_statistics(self)
        with torch.no_grad():
            # FSDP averaged the summed gradients over the W workers; make it a mean over the weight.
            grads = [p.grad for p in self.params if p.grad is not None]
            torch._foreach_mul_([g.to_local() for g in grads], self.world_size / weight)
            grad_norm = math.nan
            if cfg.max_grad_norm:
                # the norm of the shards' norms: one all-reduce over the shard dim of the mesh
                norm = get_total_norm(grads, foreach=True)
                norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                clip_grads_with_norm_(self.params, cfg.max_grad_norm, norm, foreach=True)
                grad_norm = float(norm)
        record = step_and_record(self, table, micro_batches, grad_norm, compute_s, start, t0)
        return record, any(row[EXHAUSTED] > 0 for row in table)

    def state_dict(self) -> dict:
        """This worker's shards, by parameter name: the fp32 parameters and AdamW's state (views of
        the live tensors: nothing model-sized is allocated)."""
        named = dict(self.sharded.named_parameters())
        moments = {}
        for name, p in named.items():
            state = self.optimizer.state.get(p)
            if state:  # from the first step on
                moments[name] = {
                    "step": state["step"],
                    "exp_avg": state["exp_avg"].to_local(),
                    "exp_avg_sq": state["exp_avg_sq"].to_local(),
                }
        return {
            "method": METHOD,
            "numel": self.numel,
            "world_size": self.world_size,
            "workers_per_node": self.workers_per_node,
            "rank": self.rank,
            "samples": self.committed_micro_batches,
            "step": self.step,
            "wall_time": self.last_wall_time,
            "params": {name: _own(p.detach().to_local()) for name, p in named.items()},
            "optimizer": moments,
            # run() has already read the next update's micro-batches when it yields: the data
            # position saved beside this state must be moved back by that many (exact resume).
            "fetched_ahead": self.fetched_ahead,
        }

    def load_state_dict(self, state: dict, old_state=None) -> bool:
        """Restore on the layout the state was saved with (each worker's own shards); another world
        size or workers per node is refused (`old_state`, resharding, is never used)."""
        if state["method"] != METHOD:
            raise CheckpointError(
                f"checkpoint was written by method {state['method']!r}, this run is {METHOD!r}"
            )
        saved = (state["world_size"], state.get("workers_per_node"))
        if saved != (self.world_size, self.workers_per_node):
            raise CheckpointError(
                f"torch-hsdp resumes only on the layout it was saved with (its shards follow the mesh): "
                f"saved by {saved[0]} workers, {saved[1]} per node; this run has {self.world_size}, "
                f"{self.workers_per_node} per node"
            )
        named = dict(self.sharded.named_parameters())
        if state["numel"] != self.numel or set(state["params"]) != set(named):
            raise CheckpointError(
                f"checkpoint holds {state['numel']:,} parameters, the model has a different size or names"
            )
        with torch.no_grad():
            for name, p in named.items():
                p.to_local().copy_(state["params"][name])
                self.optimizer.state.pop(p, None)
                if name in state["optimizer"]:
                    self.optimizer.state[p] = self._moments(p, state["optimizer"][name])
        self.committed_micro_batches, self.step = int(state["samples"]), int(state["step"])
        self.wall_time_offset = float(state["wall_time"])
        self._view_step = -1  # the caller's module holds the initial weights: gathered when asked
        return True

    def _moments(self, p: DTensor, saved: dict) -> dict:
        """AdamW's state of `p` from its saved local shards, as DTensors placed like `p` (fused
        AdamW keeps its step count on the parameter's device)."""

        def placed(local: torch.Tensor) -> DTensor:
            local = local.to(device=self.device, dtype=torch.float32, copy=True)
            return DTensor.from_local(
                local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )

        step = saved["step"].to(device=self.device, dtype=torch.float32, copy=True)
        return {"step": step, "exp_avg": placed(saved["exp_avg"]), "exp_avg_sq": placed(saved["exp_avg_sq"])}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this worker holds for training, by component (numel x element size). params: the
        fp32 shards, the caller's module (the committed view, full, in the compute dtype) and the
        unsharded compute copy that each update all-gathers and keeps to its last backward
        (reshard_after_forward off); grads: the reduced fp32 shards and the unsharded gradients
        accumulated in the reduce dtype (fp32) during an update; AdamW's moments for the shards.
        Not counted, as for the other methods: activations, buffers, AdamW's step counters."""

        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        shards = [p.to_local() for p in self.params]
        full = sum(p.numel() for p in self.params)
        compute = 2 if self.cfg.use_mixed_precision else 4
        return {
            "params": size(shards) + size(self.module.parameters()) + compute * full,
            "grads": size(shards) + 4 * full,
            "exp_avg": size(shards),
            "exp_avg_sq": size(shards),
        }

    @torch.no_grad()
    def _gather_view(self) -> None:
        """Every worker together: the committed parameters, all-gathered from the shards into the
        caller's module (once per update: nothing is gathered while it is up to date)."""
        if self._view_step == self.step:
            return
        progress.mark(f"the parameters' all-gather after update {self.step}")
        views = dict(self.module.named_parameters())
        for name, shard in self.sharded.named_parameters():
            views[name].copy_(shard.full_tensor())
        self._view_step = self.step

    @contextlib.contextmanager
    def committed_params(self):
        """Every worker enters together (an all-gather, when the view is behind): the caller's
        module holds the committed parameters, a plain module (no FSDP hook, no DTensor)."""
        self._gather_view()
        yield self.module

    def compute_context(self):
        """Nothing: training computes in the parameters' dtype (FSDP2 casts them to bf16 in mixed
        precision), as evaluation does on the committed view, which holds that dtype."""
        return contextlib.nullcontext()

    def quiesce(self) -> None:
        """Nothing runs in the background."""

    def sync_note(self) -> None:
        """An evaluation sees the parameters that training takes its steps at: nothing to add."""

    def finish(self) -> None:
        """Every worker, once training ends: the caller's module holds the committed parameters,
        so that rank 0 alone may save it. Idempotent."""
        self._gather_view()

    def close(self) -> None:
        pass
