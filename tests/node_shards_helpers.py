"""Shared by the tests of sharding inside the node (acco/engine/node_shards.py): the whole model's
parameters of a module whose blocks FSDP2 shards over the node."""

from __future__ import annotations

import torch


def full_params(model) -> torch.Tensor:
    """The whole model's parameters, in the plain module's order (all-gathered inside the node)."""
    return torch.cat([p.full_tensor().detach().float().flatten() for p in model.parameters()])
