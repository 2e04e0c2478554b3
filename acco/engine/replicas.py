"""diloco's replicas on the job's layout: which workers take an inner step together, and how a
fragment's pseudo-gradient is summed over the replicas (docs/algorithm.md, diloco).

- `FlatReplicas` (rounds=flat; also rounds=nodes on one node, or on one worker per node, where
  make_rounds gives the flat ring): every worker is its own replica. An inner step has no
  collective; a fragment's round sums the wire over the whole group, reduce-scatter + all-gather.
- `NodeReplicas` (rounds=nodes on R > 1 nodes of S > 1 workers): one replica per node, as torchft,
  torchtitan's semi_sync_method and INTELLECT-1 run DiLoCo. Each inner step the node's workers
  all-reduce their gradient sums and statistics over the inner group (an all-reduce rather than a
  reduce-scatter + sharded AdamW + all-gather: the same bytes on the node's fast links, and every
  worker keeps diloco's unsharded state, so the pseudo-gradient, the outer step and the checkpoint
  stay as they are); every worker then takes the same AdamW step, so the node's workers hold the
  same bits. A fragment's round moves node shards only: local worker s sums its chunk s of the
  wire over the R workers of local index s (the outer group, in the background), and the node
  gathers the chunks over the inner group on the main thread when the fragment lands.
- `ShardedReplicas` (the same layout, shard_inside_node): one replica per node, sharded inside it
  (node_shards.py). FSDP2 has already summed each micro-batch's gradient over the node into this
  worker's local vector, so an inner step all-reduces only the statistics and the local shards'
  squared gradient norm over the inner group, and every worker steps its own 1/S of the replica. A
  fragment is a run of the local vector, the same rows on every worker of an outer group: its
  round sums it whole over the outer group (flags inside), and nothing is gathered in the node.

Why the node's all-gather waits for the main thread: NCCL matches a group's collectives by the
order each rank issues them, and the main thread issues the inner group's gradient all-reduce at
every inner step while a streaming fragment's round may be in flight. So the background round
touches the outer group alone, the main thread the inner group alone. The data-exhausted and stop
flags, node-wide from the inner step's statistics, are summed over the outer group by the round
itself (a worker's chunk may not hold them), so the compute side still never waits for them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from acco.engine import collectives
from acco.engine.comm import EXHAUSTED, MICRO_BATCHES, N_STATS, STOP
from acco.engine.node_shards import ShardedRounds
from acco.engine.nodes import NodeRounds

__all__ = ["FlatReplicas", "NodeReplicas", "ShardedReplicas", "make_replicas"]


class FlatReplicas:
    """Every worker its own replica: no per-step collective, the round over the whole group."""

    per_step = False  # an inner step issues no collective

    def __init__(self, group, world_size: int):
        self.group, self.world_size, self.count = group, world_size, world_size

    def write_flags(self, wire_flags: torch.Tensor, exhausted: bool, stop: bool) -> None:
        wire_flags[0] = float(exhausted)
        wire_flags[1] = float(stop)

    def sum_fragment(self, wire: torch.Tensor, wire_shard: torch.Tensor, n: int, m: int) -> tuple[bool, bool]:
        """On the comm thread: the first `m` wire elements summed over the workers in place; the
        flags (elements `n`, `n + 1`), read here so that the compute side never waits."""
        shard = wire_shard[: m // self.world_size]
        collectives.reduce_scatter(shard, wire[:m], group=self.group)
        collectives.all_gather(wire[:m], shard, group=self.group)
        exhausted, stop = (wire[n : n + 2] > 0).tolist()
        return exhausted, stop

    def gather_fragment(self, wire: torch.Tensor) -> None:
        """On the main thread, as the fragment lands: the round left the whole sum already."""


class NodeReplicas:
    """One replica per node of `rounds` (NodeRounds): the inner step over the inner group, the
    fragment's sum over the outer group on node shards, then gathered inside the node."""

    per_step = True

    def __init__(self, rounds: NodeRounds, device: torch.device):
        self.rounds = rounds
        self.world_size, self.count = rounds.world_size, rounds.layout.nodes
        # The node's flags as of its last inner step (every worker of the node alike), and the
        # round's copy of them, summed over the nodes.
        self.node_flags = torch.zeros(2, dtype=torch.float32, device=device)
        self.round_flags = torch.zeros(2, dtype=torch.float32, device=device)

    def average_step(self, grads: torch.Tensor, stats: torch.Tensor, n: int, exhausted: bool,
                     stop: bool) -> bool:
        """The node's gradient sum and statistics on every worker of the node (the caller divides by
        the node's weight); whether the node takes an inner step: some worker of it had data. A
        worker whose data ran out reads that on the host (a sync at the data's end only)."""
        stats[EXHAUSTED] = float(exhausted)
        stats[STOP] = float(stop)
        dist.all_reduce(stats, group=self.rounds.inner_group)
        dist.all_reduce(grads, group=self.rounds.inner_group)
        self.node_flags.copy_(stats[EXHAUSTED : STOP + 1])
        return n > 0 or stats[MICRO_BATCHES].item() > 0

    def write_flags(self, wire_flags: torch.Tensor, exhausted: bool, stop: bool) -> None:
        """The node's flags, not this worker's: the local workers of one outer group must agree."""
        wire_flags.copy_(self.node_flags)

    def sum_fragment(self, wire: torch.Tensor, wire_shard: torch.Tensor, n: int, m: int) -> tuple[bool, bool]:
        """On the comm thread, the outer group only: this worker's chunk of the first `m` wire
        elements summed over the nodes, in place; the flags summed beside it."""
        self.round_flags.copy_(wire[n : n + 2])
        chunk = self.rounds.node_chunk(wire[:m])
        shard = wire_shard[: m // self.world_size]
        collectives.reduce_scatter(shard, chunk, group=self.rounds.outer_group)
        collectives.all_gather(chunk, shard, group=self.rounds.outer_group)
        dist.all_reduce(self.round_flags, group=self.rounds.outer_group)
        exhausted, stop = (self.round_flags > 0).tolist()
        return exhausted, stop

    def gather_fragment(self, wire: torch.Tensor) -> None:
        """On the main thread, as the fragment lands: the node's S summed chunks into every worker's
        wire (the inner group, which the main thread alone uses)."""
        self.rounds.all_gather_inner(wire, self.rounds.node_chunk(wire))


class ShardedReplicas(FlatReplicas):
    """One replica per node of `rounds` (ShardedRounds), sharded inside it: the inner step's
    statistics and norm over the inner group (the main thread's, as FSDP2's), a fragment of the
    local vector summed over the outer group (the comm thread's) as the flat replicas sum theirs."""

    per_step = True

    def __init__(self, rounds: ShardedRounds, device: torch.device):
        super().__init__(rounds.outer_group, rounds.layout.nodes)
        self.inner_group = rounds.inner_group
        self.node_flags = torch.zeros(2, dtype=torch.float32, device=device)  # as NodeReplicas'
        # the statistics, then the squared norm of the gradient sum's local shards: one all-reduce
        self.node_stats = torch.zeros(N_STATS + 1, dtype=torch.float64, device=device)

    def node_step(self, grads: torch.Tensor, stats: torch.Tensor, exhausted: bool,
                  stop: bool) -> torch.Tensor:
        """The node's statistics into `stats` on every worker of the node, and the squared L2 norm
        of the node's gradient sum (its S local shards'), returned on the device (no host read)."""
        stats[EXHAUSTED] = float(exhausted)
        stats[STOP] = float(stop)
        self.node_stats[:N_STATS].copy_(stats)
        self.node_stats[N_STATS].copy_(torch.linalg.vector_norm(grads, dtype=torch.float32).square())
        dist.all_reduce(self.node_stats, group=self.inner_group)
        stats.copy_(self.node_stats[:N_STATS])
        self.node_flags.copy_(stats[EXHAUSTED : STOP + 1])
        return self.node_stats[N_STATS]

    def write_flags(self, wire_flags: torch.Tensor, exhausted: bool, stop: bool) -> None:
        """The node's flags, not this worker's: every worker of the job must learn the same."""
        wire_flags.copy_(self.node_flags)


def make_replicas(rounds, group, world_size: int, device: torch.device):
    """One replica per node where `rounds` are the two-level ones (sharded inside the node or not),
    else every worker its own."""
    if isinstance(rounds, ShardedRounds):
        return ShardedReplicas(rounds, device)
    if isinstance(rounds, NodeRounds):
        return NodeReplicas(rounds, device)
    return FlatReplicas(group, world_size)
