"""The comm round (docs/algorithm.md, "The comm round"); acco/engine/background.py runs it beside the
next micro-batches.

A round takes a flat gradient payload and its statistics (summed loss weight, summed loss,
micro-batch count, data-exhausted and stop flags) and, on every worker, runs four named steps
(`CommRound.run`; docs/algorithm.md numbers the same work in six):
  1. `_reduce`: reduce-scatters the payload (sum): this worker receives its shard (first, so
     that a lost peer's error names the ring's neighbours),
  2. `_statistics`: all-gathers the statistics (docs/algorithm.md, "Statistics"; per-worker
     counts kept) with this worker's shard norm, so that the global norm costs no extra
     collective and no extra host read; the update's learning rate follows from them,
  3. `_step`: divides by the global weight N (an average over every micro-batch of every
     worker), with max_grad_norm clips to the global norm, and runs AdamW on its fp32 master
     shard: committed in an update round, as a trial step (Opt_trial, nothing committed) in
     acco's estimate round (`RoundKind`); what the step sends, theta_{t+1}, wp's prediction or
     acco's estimate, is estimate.py's `Lookahead`,
  4. `_gather`: all-gathers the new parameter shard into the `new_params` vector.
Both collectives run in place: 1 leaves the summed shard in this worker's own slice of the payload,
4 gathers from the new shard written into its own slice of `new_params`.

`estimate_comm: int8` (acco only; acco/engine/quantize.py): the estimate round's reduce-scatter
is an all-to-all of int8 blocks summed in fp32, and its all-gather sends the int8 delta
theta~_{t+1} - theta_t, added to the theta_t every worker holds. The update round stays exact.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from acco.engine import collectives, progress, quantize
from acco.engine.config import EngineConfig
from acco.engine.flat import FlatParams, world_of
from acco.engine.optim import ShardedAdamW, learning_rate

# Layout of the per-worker statistics vector that the compute side fills for each payload
# (decoupled.backward_and_count).
# STOP: this worker was asked to stop (a signal, acco.trainer): the flag travels with the statistics,
# so every worker learns it in the same round and they stop after the same update, with no
# collective of its own.
WEIGHT, LOSS, MICRO_BATCHES, EXHAUSTED, STOP = range(5)
N_STATS = 5
# The round sends two more: the L2 norm of this worker's reduced (summed) gradient shard, and
# (acco, estimate_micro_batches=auto) the split this worker proposes: the proposals travel with
# the statistics, so every worker takes the same one (the largest) with no collective of its own.
SHARD_NORM = N_STATS
SPLIT_PROPOSAL = N_STATS + 1
N_SENT = N_STATS + 2


class RoundKind(enum.Enum):
    """The two kinds of comm round (docs/algorithm.md, "The schedules"); the value is the label
    that progress marks, and so errors naming a stalled rank, show."""

    # acco only: theta~_{t+1} = Opt_trial(theta_t, g~_t); the optimizer state, the step count and
    # the committed micro-batches are left as they were, and the accumulator is kept (g_t adds to
    # g~_t).
    ESTIMATE = "estimate round"
    # Every method's update: theta_{t+1} = Opt(theta_t, g) is committed (the step and the committed
    # micro-batches advance).
    UPDATE = "update round"


def new_stats(device: torch.device) -> torch.Tensor:
    return torch.zeros(N_STATS, dtype=torch.float64, device=device)


@dataclass
class RoundResult:
    kind: RoundKind
    lr: float
    loss: float  # weighted mean loss of the payload's micro-batches, all workers
    micro_batches: list[int]  # the payload's micro-batches, per worker
    committed_micro_batches: int  # over all workers, in committed updates so far (after this round)
    step: int  # committed updates (update rounds that applied a gradient) so far, after this round
    exhausted: bool  # some worker ran out of data
    stop: bool  # some worker was asked to stop (every worker stops after this update)
    weight: float  # summed loss weight of the payload, all workers (target tokens, or micro-batches)
    grad_norm: float  # global L2 norm of the averaged gradient, before clipping (nan: clipping off)
    # auto split, update rounds: the largest split any worker proposed, every worker's next one
    agreed_split: int | None = None


class CommRound:
    """Collectives + sharded optimizer for one worker. Runs in whichever thread calls it."""

    def __init__(
        self, flat: FlatParams, cfg: EngineConfig, group: dist.ProcessGroup | None, split, lookahead,
        rounds,
    ):
        """`split` and `lookahead`: acco/engine/estimate.py's EstimateSplit and Lookahead, which the
        engine builds and owns; the round reads the split and steps through the lookahead. `rounds`:
        nodes.py's flat ring or two-level rounds, which move the payload and the parameters; the
        statistics go over `group` (the whole job)."""
        self.cfg = cfg
        self.group = group
        self.rounds = rounds
        self.layout = flat.layout
        # the statistics come from every worker of the job (with sharding inside the node the
        # layout's ring is only the outer group's R workers)
        self.world_size = world_of(group)[0]
        device = flat.params.device
        self.master = flat.master_shard  # fp32, from the weights before any cast
        # weight decay applies to the first `decayed` elements of this shard (FlatParams' order)
        decayed = min(max(flat.decay_numel - flat.shard.start, 0), self.layout.shard_numel)
        self.optimizer = ShardedAdamW(self.master, cfg, decayed, trial=cfg.method == "acco")
        # Preallocated shard-sized buffers: nothing model-sized is allocated per round.
        self.grad_shard = torch.empty_like(self.master)  # fp32 gradient the optimizer reads
        # Both collectives run in place on this worker's own slice of the round's vectors
        # (`_own`): the reduce-scatter leaves the summed shard in the payload's slice (in mixed
        # precision; in fp32 it lands in grad_shard itself), the all-gather sends the new shard from
        # new_params' slice. No received or sent shard of their own (2 bytes per shard element
        # each), and at world size 1 neither collective copies anything.
        self.in_place_reduce = flat.dtype != torch.float32
        self.shard = flat.shard
        self.stats_sent = torch.zeros(N_SENT, dtype=torch.float64, device=device)
        self.stats_all = torch.zeros(self.world_size * N_SENT, dtype=torch.float64, device=device)
        self.shard_norm = torch.zeros((), dtype=torch.float32, device=device)
        self.max_grad_norm = cfg.max_grad_norm or 0.0
        # estimate_comm=int8: the estimate round's int8 collectives, their buffers allocated here;
        # its all-gather adds the delta to theta_t, the model's parameters during that round.
        self.int8 = None
        if cfg.method == "acco" and cfg.estimate_comm == "int8":
            # the block size, quantize.BLOCK, read now: tests set it
            # on the nodes' layout the outer level alone: only the bytes that cross nodes are quantized
            self.int8 = quantize.Int8EstimateComm(
                rounds.outer_size, rounds.outer_rank, self.layout.shard_numel, device, rounds.outer_group,
                quantize.BLOCK,
            )
            self.params = flat.params
        # read here: the split in effect (the estimate round's LR) and this worker's proposal
        self.split = split
        self.lookahead = lookahead
        # set by the engine's request_stop (any thread): sent from the next round on
        self.stop_requested = False
        self.committed_micro_batches = 0  # over all workers, in committed updates (the budget's unit)
        self.step = 0  # committed updates
        # Test/benchmark hook run inside every round (e.g. to emulate a slower network).
        self.delay_hook: Callable[[], None] | None = None

    def run(
        self, payload: torch.Tensor, stats: torch.Tensor, new_params: torch.Tensor, kind: RoundKind,
        predict: bool = False,
    ) -> RoundResult:
        """One round of `kind` on this worker's `payload` (summed gradients, with their `stats`);
        the new parameters (theta_{t+1}, or acco's estimate theta~_{t+1}) land in `new_params`.
        The two may be one buffer: the payload is read in full before the result is written.
        `predict` (wp's overlapped update rounds): `new_params` receives the prediction
        2 theta_{t+1} - theta_t, computed on the fp32 master shard and cast once; theta_{t+1}
        itself stays in the master shards."""
        # If this round times out, the ranks that never marked it are the ones that stopped.
        progress.mark(f"update {self.step + 1} ({kind.value})")
        int8 = self.int8 is not None and kind is RoundKind.ESTIMATE  # the update round stays exact
        self._reduce(payload, int8)
        result = self._statistics(stats, kind)
        # The new shard is written into new_params' own slice, where the all-gather sends it from
        # (after the summed shard, which may be the same memory, was read).
        sent = self._own(new_params)
        estimate = self._step(result, predict, int8, sent)
        self.committed_micro_batches, self.step = result.committed_micro_batches, result.step
        if self.delay_hook is not None:
            self.delay_hook()
        self._gather(new_params, sent, estimate, int8)
        return result

    def _own(self, vector: torch.Tensor) -> torch.Tensor:
        """This worker's slice of a full (padded) flat vector: where its shard lives in place."""
        return vector[self.shard]

    def _reduce(self, payload: torch.Tensor, int8: bool) -> None:
        """grad_shard = this worker's shard of every worker's payload, summed (fp32). The ring
        first: when a peer has died or stalled, its error names the ring's neighbours. Every
        collective is issued at world size 1 too (NCCL runs a one-rank communicator)."""
        if int8:  # straight into the fp32 shard (the nodes' inner level exact, in place)
            self.int8.reduce_scatter(self.rounds.reduce_scatter_inner(payload), self.grad_shard)
        elif not self.in_place_reduce:  # fp32: straight into the fp32 shard
            self.rounds.reduce_scatter(self.grad_shard, payload)
        else:  # into the payload's own slice, then widened
            summed = self._own(payload)
            self.rounds.reduce_scatter(summed, payload)
            self.grad_shard.copy_(summed)

    def _statistics(self, stats: torch.Tensor, kind: RoundKind) -> RoundResult:
        """Every worker's statistics, this shard's norm and (auto split) its proposal, all-gathered
        and read on the host: the round's result, before its step."""
        self.stats_sent[:N_STATS].copy_(stats)
        if self.stop_requested:  # sticky: acco's update round, which yields the record, carries it too
            self.stats_sent[STOP] = 1
        if self.split.auto:
            self.stats_sent[SPLIT_PROPOSAL] = self.split.proposal
        if self.max_grad_norm:  # one pass over the shard; padding is zero, so the shards' squared
            # norms add up to the whole gradient's squared norm. (Read from the fp32 copy: a norm
            # of the bf16 shard summed in fp32 read half the bytes but took 10x as long on a CPU.)
            torch.linalg.vector_norm(self.grad_shard, out=self.shard_norm)
            self.stats_sent[SHARD_NORM].copy_(self.shard_norm)
        collectives.all_gather_small(self.stats_all, self.stats_sent, group=self.group)
        # The only host read of a round: the comm side waits here, the compute side never does.
        rows = self.stats_all.view(self.world_size, N_SENT).tolist()
        weight = sum(row[WEIGHT] for row in rows)
        micro_batches = [int(row[MICRO_BATCHES]) for row in rows]
        total = sum(micro_batches)  # the payload's, over all workers
        is_update = kind is RoundKind.UPDATE
        commits = is_update and weight > 0
        # An estimate round takes the LR of the update it estimates (during warm-up not a smaller one).
        update_micro_batches = total if is_update else self.split.estimated_update(total)
        grad_norm = float("nan")
        if self.max_grad_norm and weight > 0:
            grad_norm = math.sqrt(sum(row[SHARD_NORM] ** 2 for row in rows)) / weight
        return RoundResult(
            kind=kind,
            lr=learning_rate(self.cfg, self.committed_micro_batches, update_micro_batches),
            loss=sum(row[LOSS] for row in rows) / weight if weight > 0 else float("nan"),
            micro_batches=micro_batches,
            committed_micro_batches=self.committed_micro_batches + (total if commits else 0),
            step=self.step + 1 if commits else self.step,
            exhausted=any(row[EXHAUSTED] > 0 for row in rows),
            stop=any(row[STOP] > 0 for row in rows),
            weight=weight,
            grad_norm=grad_norm,
            # every worker reads the same rows: the same split
            agreed_split=int(max(row[SPLIT_PROPOSAL] for row in rows))
            if self.split.auto and is_update
            else None,
        )

    def _step(
        self, result: RoundResult, predict: bool, int8: bool, sent: torch.Tensor
    ) -> torch.Tensor | None:
        """The optimizer on this worker's shard: committed (update round) or a trial (estimate
        round); the new shard lands in `sent`, or for the int8 gather its fp32 form is returned."""
        if not result.weight > 0:  # nobody had data: nothing to apply
            sent.copy_(self.master)
            return self.master
        # The gradient is divided by the global weight and clipped (torch's clip_grad_norm_
        # formula) inside the AdamW kernel itself (its grad_scale divisor): no pass of its own.
        divisor = result.weight
        if self.max_grad_norm:
            divisor /= min(1.0, self.max_grad_norm / (result.grad_norm + 1e-6))
        if result.kind is RoundKind.UPDATE:
            self.lookahead.commit(self.optimizer, self.grad_shard, result.lr, divisor, predict, sent)
            return None
        return self.lookahead.trial(self.optimizer, self.grad_shard, result.lr, divisor, int8, sent)

    def _gather(self, new_params: torch.Tensor, sent: torch.Tensor, estimate: torch.Tensor | None,
                int8: bool) -> None:
        """new_params = every worker's new shard (`sent`, its own slice), all-gathered in place
        (int8: the estimate's delta to the theta_t every worker holds, added to it)."""
        if int8:
            chunk = self.rounds.node_chunk(new_params)
            self.int8.all_gather_delta(chunk, estimate, self.rounds.node_chunk(self.params))
            self.rounds.all_gather_inner(new_params, chunk)
        else:
            self.rounds.all_gather(new_params, sent)
