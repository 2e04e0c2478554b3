"""Flat parameter and gradient buffers, and the ZeRO-1 shard layout.

Every trainable parameter of the module becomes a view of one flat vector, and its `.grad` a view
of another, so that a whole model is moved, zeroed, reduced or copied with one tensor operation.
Both vectors are padded to a multiple of the world size: worker i owns the i-th contiguous slice.

The parameters that weight decay applies to (matrices and embeddings: two or more dimensions, as
nanoGPT decides it and as Hugging Face's Trainer does for GPT-Neo and Llama) come first, then the
others (biases, norm weights): each group is one contiguous range, so the optimizer runs over two
views of a shard. In bf16 mode only the trainable parameters are cast (buffers such as rotary
frequencies keep their dtype), and the fp32 master shard is taken from the weights before the cast.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from acco.engine.nodes import shard_file_rank

# The order of the flat vector (decayed parameters first), recorded in checkpoints: a checkpoint
# of another order cannot be resumed, its shards would land on other parameters.
FLAT_ORDER = "decayed-first"


def state_header(engine) -> dict:
    """The keys a FlatParams engine's state starts with (DecoupledEngine, DiLoCoEngine): who wrote it,
    in which flat order and size, and how far it got (`samples`: the committed micro-batches, under
    the checkpoints' key)."""
    return {
        "method": engine.cfg.method,
        "order": FLAT_ORDER,
        "numel": engine.flat.model_numel,
        "world_size": engine.world_size,
        "rank": engine.rank,
        # the two-level rounds' S (0: the flat ring): which shard each rank's file holds
        "workers_per_node": engine.rounds.workers_per_node,
        # sharded inside the node (node_shards.py): the shards are of each node's local vector
        "shard_inside_node": engine.cfg.shard_inside_node,
        "samples": engine.committed_micro_batches,
        "step": engine.step,
        "wall_time": engine.last_wall_time,
    }


def same_layout(state: dict, engine) -> bool:
    """Whether a saved state is this worker's own: the same world, rank and shard order (an exact
    resume), rather than one to reshard."""
    return (state["world_size"] == engine.world_size and state["rank"] == engine.rank
            and state.get("workers_per_node", 0) == engine.rounds.workers_per_node)


def shard_files(old_state, state: dict):
    """`old_state(rank)` (a saved worker's file) as a function of the flat shard it holds: on the
    two-level layout worker (node r, local s) held shard s * R + r (acco/engine/nodes.py)."""
    S = state.get("workers_per_node", 0)
    if not S:
        return old_state
    return lambda shard: old_state(shard_file_rank(shard, int(state["world_size"]), S))


@dataclass(frozen=True)
class ShardLayout:
    numel: int  # real number of parameters P
    world_size: int
    rank: int

    @property
    def padded_numel(self) -> int:
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def shard_slice(self) -> slice:
        start = self.rank * self.shard_numel
        return slice(start, start + self.shard_numel)


class FlatParams:
    """Owns `params` and `grads`, flat padded vectors that the module's parameters and grads view."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, world_size: int, rank: int):
        self.module = module
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the module has no trainable parameters")
        self.trainable = [p for p in trainable if p.dim() >= 2] + [p for p in trainable if p.dim() < 2]
        # weight decay: [0, decay_numel)
        self.decay_numel = sum(p.numel() for p in self.trainable if p.dim() >= 2)
        device = self.trainable[0].device
        numel = sum(p.numel() for p in self.trainable)
        self.layout = ShardLayout(numel, world_size, rank)
        self.dtype = dtype
        self.params = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        self.grads = torch.zeros_like(self.params)
        # This worker's fp32 master shard, from the weights as given (before any cast to bf16).
        self.master_shard = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=device)
        lo, hi = self.shard.start, self.shard.stop
        offset = 0
        self.param_ranges = []  # each trainable parameter's range in the flat vector, in its order
        for p in self.trainable:
            n = p.numel()
            self.param_ranges.append((offset, offset + n))
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                self.master_shard[a - lo : b - lo].copy_(p.detach().flatten()[a - offset : b - offset])
            view = self.params[offset : offset + n].view_as(p)
            view.copy_(p.detach())
            # Re-point the parameter at the flat storage; autograd then accumulates into the
            # .grad view below in place, as long as nobody sets .grad to None.
            p.data = view
            p.grad = self.grads[offset : offset + n].view_as(p)
            offset += n
        for p in module.parameters():  # frozen weights compute in the same dtype as the others
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(dtype)

    def check_grad_views(self) -> None:
        """Fail loudly if something (e.g. zero_grad(set_to_none=True)) detached a .grad from the flat
        buffer."""
        lo = self.grads.data_ptr()
        hi = lo + self.grads.numel() * self.grads.element_size()
        for p in self.trainable:
            if p.grad is None or not lo <= p.grad.data_ptr() < hi:
                raise RuntimeError(
                    "a parameter's .grad no longer views the engine's flat gradient buffer; "
                    "do not call zero_grad(set_to_none=True) or assign .grad on an engine-managed module"
                )

    @property
    def shard(self) -> slice:
        return self.layout.shard_slice

    @property
    def model_numel(self) -> int:
        return self.layout.numel


def world_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def broadcast_module(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Rank 0's parameters and buffers on every rank, each in its own dtype (an fp32 checkpoint keeps
    its low bits). Once per run, tensor by tensor: a flat copy would cost a model-sized temporary."""
    if world_of(group)[0] == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(t.data, src=src, group=group)
