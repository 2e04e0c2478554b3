"""Where the workers sit: a job of W = R nodes x S workers, ranked node by node (rank = node * S +
local: torchrun's and SLURM's order), as the launcher says it; the two-level rounds' shard order
on it (acco/engine/nodes.py, which re-exports all of this).

Arithmetic on the environment only, without torch: the local launcher checks a layout before it
starts its workers (acco/validate.py), while they have not yet imported torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from acco.engine.config import ConfigError

__all__ = [
    "WORKERS_PER_NODE_ENV", "NodeLayout", "check_layout", "layout_from_env", "layout_words",
    "rounds_workers_per_node", "shard_file_rank", "workers_per_node_from_env",
]

# The local launcher's emulated nodes (launch.workers_per_node), read before the real launchers'.
WORKERS_PER_NODE_ENV = "ACCO_WORKERS_PER_NODE"
# The launchers' word for how many workers share a node, first found wins: the local launcher's,
# torchrun's, then SLURM's (a uniform "4", or "4(x2)").
_ENV_KEYS = (WORKERS_PER_NODE_ENV, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


def layout_from_env() -> tuple[str, int] | None:
    """The variable that says how many workers share a node, and its value; None where none does."""
    for key in _ENV_KEYS:
        value = os.environ.get(key, "").split("(")[0].strip()
        if value.isdigit() and int(value) > 0:
            return key, int(value)
    return None


def workers_per_node_from_env(world_size: int) -> int:
    """Workers per node as the launcher says it, else the whole job on one node."""
    found = layout_from_env()
    return found[1] if found else world_size


def rounds_workers_per_node(rounds: str, world_size: int, workers_per_node: int | None = None) -> int:
    """The workers per node a job's rounds run on (checked): the whole job on one ring for
    rounds=flat, else the given value or the launcher's."""
    if rounds == "flat":
        return world_size
    S = workers_per_node or workers_per_node_from_env(world_size)
    check_layout(world_size, S)
    return S


def check_layout(world_size: int, workers_per_node: int, where: str = "workers_per_node") -> None:
    """One line, before anything starts, for a layout that cannot be a job's."""
    if workers_per_node < 1 or world_size % workers_per_node:
        raise ConfigError(
            f"{where}={workers_per_node} does not divide the {world_size} workers into whole nodes: "
            f"use a divisor of {world_size}"
        )


def layout_words(world_size: int, workers_per_node: int) -> str:
    """"2 nodes x 2 workers", for the lines a run prints."""
    nodes = world_size // workers_per_node
    return (f"{nodes} node{'s' if nodes != 1 else ''} x {workers_per_node} "
            f"worker{'s' if workers_per_node != 1 else ''}")  # fmt: skip


@dataclass(frozen=True)
class NodeLayout:
    nodes: int  # R
    workers_per_node: int  # S
    rank: int  # global: node * S + local

    @property
    def node(self) -> int:
        return self.rank // self.workers_per_node

    @property
    def local(self) -> int:
        return self.rank % self.workers_per_node

    @property
    def shard_rank(self) -> int:
        """Which shard of the flat vector this worker owns in the two-level rounds."""
        return self.local * self.nodes + self.node


def shard_file_rank(shard: int, world_size: int, workers_per_node: int) -> int:
    """The global rank that owned flat shard `shard` in a job of that layout (the rank its
    checkpoint file is named after): the inverse of NodeLayout.shard_rank."""
    nodes = world_size // workers_per_node
    return (shard % nodes) * workers_per_node + shard // nodes
