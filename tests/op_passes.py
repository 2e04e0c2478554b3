"""`Passes`: the ops that read or write a large tensor, in order: what a test of memory traffic
counts (views and bare allocations move no bytes and are left out)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ALLOCATIONS = {"empty", "empty_like", "empty_strided"}


class Passes(TorchDispatchMode):
    """Notes each op, views and allocations aside, that reads or writes a tensor of at least
    `numel` elements (an output included)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        if not func.is_view and name not in ALLOCATIONS and any(t.numel() >= self.numel for t in tensors):
            self.ops.append(name)
        return out
