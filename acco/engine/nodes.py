"""Where the workers sit, and the rounds' two collectives on that layout (docs/algorithm.md,
"Two-level rounds").

A job of W = R nodes x S workers, ranked node by node (rank = node * S + local: torchrun's and
SLURM's order). A flat ring sends (W - 1) / W of the payload through each node's slow link per
reduce-scatter; the two-level rounds send (R - 1) / R:

  reduce-scatter  1. inside the node (S workers, fast links): the local worker s receives the
                     node's sum of chunk s, R shards long;
                  2. between nodes (the R workers of local index s, one per node): each receives
                     one shard of that chunk, summed over every worker.
  all-gather      the reverse: between nodes into the node's chunk, then inside the node.

So worker (node r, local s) owns shard s * R + r of the flat vector (`shard_rank`), not shard
`rank`; with one node (R = 1) or one worker per node (S = 1) the two orders are the same and the
two-level rounds are the flat ring. The optimizer shard stays 1/W. A checkpoint records the
layout, so that a resume on another layout finds each shard's file (`shard_file_rank`). That
arithmetic, and the layout as the launcher's environment says it, is layout.py's (no torch: the
local launcher checks a layout before its workers start); this module re-exports it.

Both collectives run in place, as collectives.py's do: the reduce-scatter's output may be the
input's own shard, the all-gather's input the output's own shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from acco.engine import collectives
from acco.engine.config import ConfigError
from acco.engine.layout import (
    NodeLayout,
    check_layout,
    layout_words,
    rounds_workers_per_node,
    shard_file_rank,
    workers_per_node_from_env,
)

__all__ = [
    "FlatRounds", "NodeLayout", "NodeRounds", "check_layout", "make_rounds", "shard_file_rank",
    "workers_per_node_from_env",
]


class FlatRounds:
    """Today's flat ring over `group`: worker `rank` owns shard `rank`."""

    workers_per_node = 0  # recorded in checkpoints: a flat layout

    def __init__(self, group, world_size: int, rank: int, note: str = "flat ring"):
        self.group, self.world_size, self.shard_rank = group, world_size, rank
        self.note = note  # the run's start-up line: the layout, and which rounds run on it
        # the int8 estimate round's level: the whole ring (see NodeRounds)
        self.outer_group, self.outer_size, self.outer_rank = group, world_size, rank

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        collectives.reduce_scatter(output, input, group=self.group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        collectives.all_gather(output, input, group=self.group)

    # The int8 estimate round quantizes the outer level only; on the flat ring that is all of it.
    def node_chunk(self, vector: torch.Tensor) -> torch.Tensor:
        return vector

    def reduce_scatter_inner(self, input: torch.Tensor) -> torch.Tensor:
        return input

    def all_gather_inner(self, output: torch.Tensor, chunk: torch.Tensor) -> None:
        pass


class NodeRounds:
    """The two-level rounds on `layout`: an inner group per node, an outer group per local index,
    made once (every rank makes every group, in the same order, as new_group requires)."""

    def __init__(self, layout: NodeLayout):
        self.layout = layout
        R, S = layout.nodes, layout.workers_per_node
        self.world_size, self.workers_per_node = R * S, S
        self.shard_rank = layout.shard_rank
        self.inner_group = self.outer_group = None
        for node in range(R):
            g = dist.new_group([node * S + s for s in range(S)])
            if node == layout.node:
                self.inner_group = g
        for s in range(S):
            g = dist.new_group([node * S + s for node in range(R)])
            if s == layout.local:
                self.outer_group = g
        self.outer_size, self.outer_rank = R, layout.node
        self.note = f"{layout_words(R * S, S)}: two-level rounds"

    def node_chunk(self, vector: torch.Tensor) -> torch.Tensor:
        """This worker's chunk of a flat vector after the inner reduce-scatter: R shards, local s's."""
        n = vector.numel() // self.workers_per_node
        return vector.view(-1)[self.layout.local * n : (self.layout.local + 1) * n]

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """`input` is overwritten in this worker's chunk (the node's sum lands there)."""
        collectives.reduce_scatter(output, self.reduce_scatter_inner(input), group=self.outer_group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        chunk = self.node_chunk(output)
        collectives.all_gather(chunk, input, group=self.outer_group)
        self.all_gather_inner(output, chunk)

    def reduce_scatter_inner(self, input: torch.Tensor) -> torch.Tensor:
        """The inner level alone: the node's sum of this worker's chunk, in place; returns it."""
        chunk = self.node_chunk(input)
        collectives.reduce_scatter(chunk, input, group=self.inner_group)
        return chunk

    def all_gather_inner(self, output: torch.Tensor, chunk: torch.Tensor) -> None:
        collectives.all_gather(output, chunk, group=self.inner_group)


_made: dict = {}


def make_rounds(rounds: str, group, world_size: int, rank: int, workers_per_node: int | None = None):
    """The rounds' collectives for `rounds` ("flat" or "nodes"): NodeRounds where the job spans more
    than one node of more than one worker, else the flat ring (the same thing there). The groups
    are made once per process and layout."""
    S = workers_per_node or workers_per_node_from_env(world_size)
    if rounds == "flat" or world_size == 1:
        return FlatRounds(group, world_size, rank, _flat_note(world_size, S, rounds))
    if group is not None and group is not dist.GroupMember.WORLD:
        raise ConfigError("rounds=nodes needs the default process group (the whole job); "
                          "pass group=None or rounds=flat")
    S = rounds_workers_per_node(rounds, world_size, workers_per_node)  # checked
    if S in (1, world_size):
        return FlatRounds(group, world_size, rank, _flat_note(world_size, S, rounds))
    key = (dist.group.WORLD, S)  # a new default group (after destroy_process_group) makes new ones
    if key not in _made:
        _made[key] = NodeRounds(NodeLayout(world_size // S, S, rank))
    return _made[key]


def _flat_note(world_size: int, S: int, rounds: str) -> str:
    """The start-up line of a flat ring: on which layout, and why not in two levels."""
    if world_size % S:  # a layout that rounds=flat never reads (nor checks)
        return "flat ring"
    why = " (rounds=flat)" if rounds == "flat" and 1 < S < world_size else ""
    return f"{layout_words(world_size, S)}: flat ring{why}"
