"""What a caller needs of a module whose parameters may be sharded by FSDP2 (DTensors; sharded inside
the node, acco/engine/node_shards.py): whether its forwards are collectives, and its whole state.

Each forward of such a module all-gathers every block over the node's workers: each worker of a
node must run as many forwards as its peers (an evaluation whose batches split unevenly pads the
short workers with forwards it does not count), or the job hangs. Its whole parameters are
gathered by every worker together, tensor by tensor. A plain module (every other engine, or none)
passes through both unchanged, with no collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# copy(tensor, name) -> the tensor's value kept (a host copy)
Copy = Callable[[torch.Tensor, str], torch.Tensor]


def forwards_in_lockstep(module: nn.Module) -> bool:
    """Whether a forward of `module` runs collectives (FSDP2's all-gathers): every worker of its
    groups must then run the same number of forwards as its peers."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def full_state_dict(module: nn.Module, copy: Copy | None) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with each tensor whole, as `copy(tensor, name)` returns it (a host
    copy): a sharded parameter is all-gathered (DTensor.full_tensor), copied, and dropped before the
    next, so that one whole tensor at most is on the device at a time. Every worker calls it
    together where the module is sharded (the all-gathers are collectives, in state_dict order);
    a worker that keeps nothing passes `copy` None and gets {}. A tensor under two names (tied
    weights) is gathered and copied once, and both names hold that one copy."""
    state = module.state_dict(keep_vars=True)  # FSDP2's pre-hook: the sharded parameters, DTensors
    kept: dict[int, torch.Tensor | None] = {}
    out = {}
    for name, t in state.items():
        key = id(t) if isinstance(t, DTensor) else t.data_ptr()  # plain: views of one flat vector
        if key not in kept:
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            kept[key] = copy(whole.detach(), name) if copy is not None else None
            del whole
        if copy is not None:
            out[name] = kept[key]
    return out

