"""ddp (ZeRO-1), dpu, wp and acco: one loop, four schedules of the same comm round.

Read this file with the tables of docs/algorithm.md ("The schedules") beside it:

    method  rounds, in order      at a round's launch the accumulator is  swap-in writes
    ddp     update (no overlap)   zeroed                                  theta_{t+1}
    dpu     update                zeroed                                  theta_{t+1}
    wp      update                zeroed                                  2 theta_{t+1} - theta_t
    acco    estimate, update, ..  kept (estimate) / zeroed (update)       theta~_{t+1} / theta_{t+1}

(ROUND_SCHEDULE holds the rounds column; comm.RoundKind names the two kinds.)

Overlapped methods first compute one payload with no overlap (acco: g~_0 at theta_0), then loop:
launch a round on the payload, keep computing micro-batches until it is done (at least
`n_grad_accumulation`), wait, and swap the round's parameters into the model.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from acco.engine.background import BackgroundComm
from acco.engine.comm import (
    EXHAUSTED,
    LOSS,
    MICRO_BATCHES,
    WEIGHT,
    CommRound,
    RoundKind,
    RoundResult,
    new_stats,
)
from acco.engine.config import CheckpointError, EngineConfig, UpdateRecord, advise
from acco.engine.device import device_ops
from acco.engine.estimate import EstimateSplit, Lookahead
from acco.engine.flat import (
    FLAT_ORDER,
    FlatParams,
    ShardLayout,
    broadcast_module,
    same_layout,
    shard_files,
    state_header,
    world_of,
)
from acco.engine.node_shards import AgreedBatches, NodeShards, agree_first, check_sharding, sharded_rounds
from acco.engine.nodes import make_rounds

# loss_fn(model, micro_batch) -> loss, or (loss, weight): the gradient of `loss` is accumulated and
# the update divides by the summed weight over all workers (default 1 per micro-batch, so a mean
# over micro-batches; return (sum of token losses, number of target tokens) for a per-token mean).
LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, Any]"]

_END = object()


# The kinds of the comm rounds that make one update, in order (docs/algorithm.md): acco
# alternates an estimate round and an update round, every other method runs update rounds only.
ROUND_SCHEDULE: dict[str, tuple[RoundKind, ...]] = {
    "acco": (RoundKind.ESTIMATE, RoundKind.UPDATE),
    "ddp": (RoundKind.UPDATE,),
    "dpu": (RoundKind.UPDATE,),
    "wp": (RoundKind.UPDATE,),
}


def backward_and_count(out, stats: torch.Tensor) -> None:
    """The compute side of every engine (torch-ddp and diloco call it too): backpropagate one
    micro-batch's loss_fn output, `loss` or `(loss, weight)`, and add it to the statistics
    (comm.py's layout), on the device (no host sync)."""
    loss, weight = out if isinstance(out, tuple) else (out, 1.0)
    loss.backward()
    stats[WEIGHT] += weight
    stats[LOSS] += loss.detach()
    stats[MICRO_BATCHES] += 1


class DecoupledEngine:
    """Trains `module` in place with ddp, dpu, wp or acco; `run` yields one UpdateRecord per update."""

    def __init__(self, module: nn.Module, cfg: EngineConfig, group: dist.ProcessGroup | None = None):
        if cfg.method in ("torch-ddp", "torch-hsdp"):
            raise ValueError(f"{cfg.method} runs on an engine of its own; use acco.engine.build_engine")
        self.cfg = cfg
        self.module = module
        self.group = group
        self.world_size, self.rank = world_of(group)
        dtype = torch.bfloat16 if cfg.use_mixed_precision else torch.float32
        # Rank 0's weights everywhere, in their own dtype, before the fp32 master shard is taken
        # from them (broadcasting after the cast would leave each rank a master of its own weights).
        broadcast_module(module, group)
        # the flat ring or the two-level rounds (nodes.py): which shard this worker owns follows;
        # sharded inside the node (node_shards.py): FSDP2 in the node, rounds between nodes
        self.sharded = cfg.shard_inside_node
        if self.sharded:
            self.rounds = sharded_rounds(cfg, group, self.world_size, self.rank)
            self.flat = NodeShards(module, dtype, self.rounds)
        else:
            self.rounds = make_rounds(cfg.rounds, group, self.world_size, self.rank, cfg.workers_per_node)
            self.flat = FlatParams(module, dtype, self.world_size, self.rounds.shard_rank)
        self.device = self.flat.params.device
        # acco's split of an update between its two rounds: decided here, read by the round
        self.split = EstimateSplit(cfg, self.flat.layout.shard_numel, self.flat.params.element_size())
        # what a round sends ahead of theta_{t+1} (wp's prediction, acco's estimate) and its state
        self.lookahead = Lookahead(cfg, self.flat.master_shard)
        self.comm = CommRound(self.flat, cfg, group, self.split, self.lookahead, self.rounds)
        self.overlapped = cfg.method != "ddp"
        # n_warmup_steps sequential updates, each of every round's share, on every worker
        rounds = len(ROUND_SCHEDULE[cfg.method])
        sequential = cfg.n_warmup_steps * cfg.n_grad_accumulation * rounds * self.world_size
        if self.overlapped and cfg.n_warmup_steps and sequential >= cfg.nb_steps_tot:
            k = getattr(cfg, "key_prefix", "")
            advise(f"{k}n_warmup_steps={cfg.n_warmup_steps} sequential updates take {sequential} "
                   f"micro-batches, not fewer than {k}nb_steps_tot={cfg.nb_steps_tot}: {cfg.method} never "
                   "overlaps (it trains as ddp)")
        # The gradient accumulator: the flat gradient buffer itself, or in mixed precision with
        # grad_accum_dtype fp32 an fp32 vector that each micro-batch's bf16 gradients are added to
        # (torch-ddp's fp32 gradients sum alike); rounded to bf16 once, when a round takes it.
        fp32_sum = cfg.use_mixed_precision and cfg.grad_accum_dtype == "fp32"
        self.accumulator = (
            torch.zeros_like(self.flat.grads, dtype=torch.float32) if fp32_sum else self.flat.grads
        )
        self.stats = new_stats(self.device)  # statistics of what the accumulator holds
        if self.overlapped:
            # docs/algorithm.md's one communication buffer: a round reduce-scatters the payload (the
            # gradients swapped out) in it before it all-gathers the new parameters into it, so one
            # model-sized buffer serves both.
            self.comm_buffer = torch.zeros_like(self.flat.params)
            self.payload_stats = new_stats(self.device)
            self.background = BackgroundComm(self.device)
        # wp computes at its prediction, which the comm round forms on the fp32 master shard; the
        # committed parameters are the master shards, gathered on demand (`committed_params`).
        self.wp = cfg.method == "wp"
        self._predicting = False  # wp: the model holds the prediction, not the committed parameters
        self._prediction_stashed = False  # inside committed_params: the prediction waits in `comm_buffer`
        self.ops = device_ops(self.device)
        self._inflight: list = []  # events behind the last micro-batches queued
        self._resume_overlap = False  # set by load_state_dict: the accumulator holds the next payload
        self.recomputed_micro_batches = 0  # set by load_state_dict: the saved accumulator's, not kept
        self._in_overlap = False  # past the warm start: the accumulator is part of the state
        self._agreed: AgreedBatches | None = None  # sharded: the micro-batches taken ahead
        self.wall_time_offset = self.last_wall_time = 0.0

    # ---- the computation side -------------------------------------------------------------

    def _micro_step(self, batch: Any, loss_fn: LossFn, lead: int = 2) -> None:
        backward_and_count(loss_fn(self.module, batch), self.stats)
        if self.accumulator is not self.flat.grads:
            self.accumulator.add_(self.flat.grads)
            self.flat.grads.zero_()
        # Bound how far the host runs ahead of the GPU (at most `lead` micro-batches queued), so
        # that "is the round done yet?" is asked at the pace of real computation. A blocking
        # event: the host sleeps in the wait instead of spinning a core (on the CPU: no wait).
        event = self.ops.event(blocking=True)
        event.record(self.ops.current_stream())
        self._inflight.append(event)
        while len(self._inflight) > lead:
            self._inflight.pop(0).synchronize()

    def _accumulate(self, batches: Iterator, loss_fn: LossFn, minimum: int, round_in_flight=None) -> float:
        """Compute micro-batches into the accumulator; returns the seconds spent."""
        start = time.perf_counter()
        n = 0
        keep_going = round_in_flight is not None and self.cfg.accumulate_while_waiting
        most = self.cfg.most_micro_batches(minimum)
        while n < minimum or (keep_going and n < most and not round_in_flight.done()):
            batch = next(batches, _END)
            if batch is _END:
                self.stats[EXHAUSTED] = 1
                break
            # The payload-ready event that `_launch` records completes only after every micro-batch
            # queued before it (a stream runs in order), and the round waits for it: whatever the
            # host has queued when it sees the round done delays the next round. Where the next
            # check may launch one, keep only the running micro-batch queued (lead 1); elsewhere
            # two, so the GPU never waits for the host.
            may_launch = keep_going and n + 1 >= minimum
            self._micro_step(batch, loss_fn, lead=1 if may_launch else 2)
            n += 1
        return time.perf_counter() - start

    # ---- one update without overlap (ddp, and the warm-up of overlapped methods) --------------

    def _sequential_update(self, batches: Iterator, loss_fn: LossFn, micro_batches: int) -> UpdateRecord:
        compute_s = self._accumulate(batches, loss_fn, micro_batches)
        self._agree_ahead()
        start = time.perf_counter()
        # The accumulator is the payload and the model's parameters receive the result: no overlap.
        if self.accumulator is not self.flat.grads:
            self.flat.grads.copy_(self.accumulator)
            self.accumulator.zero_()
        result = self.comm.run(self.flat.grads, self.stats, self.flat.params, RoundKind.UPDATE)
        wait_s = time.perf_counter() - start  # the round, run here: waited for in full
        self.flat.grads.zero_()
        self.stats.zero_()
        return self._record(result, compute_s, wait_s, wait_s)

    # ---- overlapped rounds -----------------------------------------------------------------

    def _launch(self, kind: RoundKind):
        """Swap-out: the accumulator becomes the payload; zero it unless this is acco's estimate
        round (then the gradients g_t computed during the round add to g~_t). On CUDA the copies
        and the zeroing are queued on the compute stream and the payload-ready event is recorded
        behind them (`BackgroundComm.submit`): the round reads the payload only once it is whole,
        and the next micro-batches add to the accumulator only after it was copied."""
        self._agree_ahead()
        self.comm_buffer.copy_(self.accumulator)
        self.payload_stats.copy_(self.stats)
        if kind is RoundKind.UPDATE:
            self.accumulator.zero_()
            self.stats.zero_()
        predict = self.wp and kind is RoundKind.UPDATE  # wp: the round gathers 2 theta_{t+1} - theta_t
        return self.background.submit(
            lambda: self.comm.run(self.comm_buffer, self.payload_stats, self.comm_buffer, kind, predict)
        )

    def _agree_ahead(self) -> None:
        """Sharded inside the node: top up the micro-batches taken ahead before a round's
        statistics are taken; a worker short of them says so in that round (EXHAUSTED), so that
        every worker stops before a micro-batch some peer could not join (node_shards.py)."""
        if self._agreed is not None and self._agreed.top_up():
            self.stats[EXHAUSTED] = 1

    @property
    def fetched_ahead(self) -> int:
        """Micro-batches taken from the stream and not computed yet (read again on resume)."""
        return len(self._agreed.queue) if self._agreed is not None else 0

    def _swap_in(self) -> None:
        self.flat.params.copy_(self.comm_buffer)
        self._predicting = self.wp

    def run(self, batches: Iterable, loss_fn: LossFn) -> Iterator[UpdateRecord]:
        """Train until `nb_steps_tot` micro-batches over all workers are committed, or data runs out.

        Between two yielded records no comm round is in flight and the model holds the committed
        parameters (see `committed_params` for wp), so the caller may evaluate or checkpoint.
        """
        cfg = self.cfg
        batches = iter(batches)
        self._t0 = time.perf_counter() - self.wall_time_offset
        self.flat.check_grad_views()
        round_kinds = ROUND_SCHEDULE[cfg.method]
        # n_grad_accumulation counts a worker's micro-batches per round; a sequential update takes
        # every round's share at once (acco k matches ddp 2k).
        micro_batches_per_update = cfg.n_grad_accumulation * len(round_kinds)
        if self.sharded:  # two rounds' micro-batches agreed ahead (the most any two rounds take)
            self._agreed = batches = AgreedBatches(batches, 2 * micro_batches_per_update)
            if agree_first(self, batches):
                self.finish()
                return

        def finished() -> bool:
            return self.comm.committed_micro_batches >= cfg.nb_steps_tot or self._exhausted

        self._exhausted = False
        # n_warmup_steps counts updates (not micro-batches, as `warmup` does): that many first
        # updates of an overlapped method run as ddp; ddp runs nothing else.
        sequential_updates = cfg.n_warmup_steps if self.overlapped else float("inf")
        while self.comm.step < sequential_updates:
            record = self._sequential_update(batches, loss_fn, micro_batches_per_update)
            if record.weight > 0:  # else nothing was committed (every worker's data had run out)
                yield record
            if finished():
                self.finish()
                return

        # Warm start: the first payload, as many as the last round kind computes, with nothing to
        # overlap (unless a checkpoint restored the accumulator that the last round filled).
        compute_s = 0.0
        if not self._resume_overlap:
            compute_s = self._accumulate(batches, loss_fn, self.split.during(round_kinds[-1]))
        self._resume_overlap = False
        self._in_overlap = True
        wait_s = comm_s = 0.0
        ending = False  # sharded: an estimate round said some worker is short; its update computes nothing
        for kind in itertools.cycle(round_kinds):
            if kind is RoundKind.UPDATE:
                self.split.adopt()
            handle = self._launch(kind)
            minimum = 0 if ending else self.split.during(kind)
            compute_s += self._accumulate(batches, loss_fn, minimum, handle)
            start = time.perf_counter()
            timed = handle.result()
            wait_s += time.perf_counter() - start
            result: RoundResult = timed.value
            self.split.note_round(kind, timed.busy_s)
            comm_s += timed.busy_s
            self._swap_in()
            if kind is RoundKind.ESTIMATE:  # its update round completes the update
                ending = self.sharded and result.exhausted
                continue
            record = self._record(result, compute_s, wait_s, comm_s)
            compute_s = wait_s = comm_s = 0.0
            if record.weight > 0:  # as above: an update that committed nothing yields no record
                yield record
            if finished():
                break
        self.finish()

    def _record(self, result: RoundResult, compute_s: float, wait_s: float, comm_s: float) -> UpdateRecord:
        self._exhausted = result.exhausted
        self.split.agree(result.agreed_split)
        return UpdateRecord(
            step=result.step,
            committed_micro_batches=result.committed_micro_batches,
            loss=result.loss,
            lr=result.lr,
            micro_batches=result.micro_batches,
            compute_s=compute_s,
            wait_s=wait_s,
            comm_s=comm_s,
            wall_time=self._wall(),
            weight=result.weight,
            grad_norm=result.grad_norm,
            estimate_micro_batches=self.split.e if self._in_overlap and self.cfg.method == "acco" else None,
            stop=result.stop,
        )

    def request_stop(self) -> None:
        """Signal-safe: this worker's next round tells every worker to stop after its update."""
        self.comm.stop_requested = True

    def _wall(self) -> float:
        self.last_wall_time = time.perf_counter() - self._t0
        return self.last_wall_time

    def finish(self) -> None:
        """Every worker calls it once training ends, also when the caller stops early (its loop's
        `break` leaves `run` suspended): the model then holds the committed parameters (wp gathers
        them: a collective), so that rank 0 alone may save it. Idempotent."""
        self._in_overlap = False
        # Work computed during the last round belongs to no committed update: drop it.
        self.flat.grads.zero_()
        self.accumulator.zero_()
        self.stats.zero_()
        if self._predicting:  # every worker finishes together: the committed parameters are gathered
            self._gather(self.comm.optimizer.master, self.flat.params)
            self._predicting = False
        self._inflight.clear()

    def quiesce(self) -> None:
        """Nothing to land: no round is in flight between two records (DiLoCoEngine's may be)."""

    def sync_note(self) -> None:
        """An evaluation sees the committed parameters, as every update's record: nothing to add."""

    def compute_context(self):
        """Training's (and evaluation's) precision context: the parameters are in its dtype."""
        return contextlib.nullcontext()

    @property
    def committed_micro_batches(self) -> int:  # over all workers, in committed updates: the comm round's
        return self.comm.committed_micro_batches

    @property
    def step(self) -> int:  # committed updates so far
        return self.comm.step

    # ---- checkpoints: taken between two yielded updates, when no round is in flight -----------

    def state_dict(self) -> dict:
        """This worker's training state, each distinct tensor once across workers: its fp32 optimizer
        shard (master, moments), acco's estimate-error shard, wp's predicted-weights shard, and the
        gradient accumulator only where an exact resume needs it (a fixed batch, EngineConfig.fixed_batch:
        train=acco's default is one). The accumulator holds the next round's payload, computed while
        the last round ran (acco: at the estimate theta~): computing it again at a resume, at the
        committed parameters, gives other gradients. The parameters are not saved: the committed ones
        are the gathered master (`load_state_dict`). Where the micro-batch counts follow timing (a
        round's minimum can grow under accumulate_cap) a resume restarts the overlapped regime from
        its warm start and the accumulator's micro-batches are read again (``dropped_micro_batches``:
        the data position goes back by that many)."""
        opt = self.comm.optimizer
        keep_accumulator = self._in_overlap and self.cfg.fixed_batch
        dropped = int(self.stats[MICRO_BATCHES].item()) if self._in_overlap and not keep_accumulator else 0
        return {
            **state_header(self),
            "master": opt.master,
            "exp_avg": opt.exp_avg,
            "exp_avg_sq": opt.exp_avg_sq,
            # wp: a copy of this shard of the predicted weights (torch.save writes a view's whole storage)
            "predicted": self._prediction()[self.flat.shard].clone() if self._predicting else None,
            # Overlapped methods with a fixed batch: the gradients computed during the last round, the next
            # payload.
            "accumulator": self.accumulator if keep_accumulator else None,
            "accumulator_stats": self.stats if keep_accumulator else None,
            "dropped_micro_batches": dropped,
            "fetched_ahead": self.fetched_ahead,  # sharded: taken from the stream, not computed yet
            # acco_estimate=lean: this shard's last estimate error (None for the other estimates)
            "estimate_error": self.lookahead.estimate_error,
            "split": self.split.state_dict(),  # acco: the accumulator's payload was computed with 2k - e
        }

    def load_state_dict(self, state: dict, old_state: Callable[[int], dict] | None = None) -> bool:
        """Restore a worker's state. On the world size it was saved with the run continues exactly
        (True); on another, `old_state(r)` gives old worker r's state (memory-mapped: only the
        slices of the old shards that overlap this worker's new one are read), the fp32 master and
        moments are resharded, and the overlapped regime restarts from its warm start (False).
        Every worker calls it together: the parameters are all-gathered from the master shards."""
        if state["method"] != self.cfg.method:
            raise CheckpointError(
                f"checkpoint was written by method {state['method']!r}, this run is {self.cfg.method!r}"
            )
        if state["numel"] != self.flat.model_numel:
            raise CheckpointError(
                f"checkpoint holds {state['numel']:,} parameters, the model has {self.flat.model_numel:,}"
            )
        self._check_sharding(state)
        if state.get("order") != FLAT_ORDER:
            raise CheckpointError(
                "checkpoint was written by an earlier acco that ordered the parameters otherwise; "
                "it cannot be resumed by this version"
            )
        opt = self.comm.optimizer
        self.comm.committed_micro_batches, self.comm.step = int(state["samples"]), int(state["step"])
        opt.restore_step(self.comm.step)
        self.wall_time_offset = float(state["wall_time"])
        exact = same_layout(state, self)
        if not exact and old_state is None:
            raise CheckpointError(
                f"checkpoint was written by {state['world_size']} workers in shard order "
                f"{state.get('workers_per_node', 0)} (workers per node; 0 flat), this run has "
                f"{self.world_size} in order {self.rounds.workers_per_node}: resharding needs every "
                "worker's file"
            )
        if exact:
            for name in ("master", "exp_avg", "exp_avg_sq"):
                getattr(opt, name).copy_(state[name])
        else:
            self._reshard(shard_files(old_state, state), int(state["world_size"]))
        # wp computes at its prediction, saved by shard; every other model at the committed parameters
        predicted = state.get("predicted") if exact and self.wp else None
        self._gather(predicted if predicted is not None else opt.master, self.flat.params)
        self._predicting = predicted is not None
        # micro-batches the saved run had accumulated that this one computes again (their data is read again)
        self.recomputed_micro_batches = int(state.get("dropped_micro_batches", 0))
        if not exact:
            return False
        if state.get("split") is not None:
            self.split.load_state_dict(state["split"])
        error = self.lookahead.estimate_error
        if error is not None:  # older checkpoints and other estimates: none
            saved = state.get("estimate_error")
            error.copy_(saved) if saved is not None else error.zero_()
        if state.get("accumulator") is not None:
            self.accumulator.copy_(state["accumulator"])
            saved = state["accumulator_stats"]  # (4 numbers before the stop flag existed)
            self.stats.zero_()[: saved.numel()].copy_(saved)
            self._resume_overlap = True
        return True

    def _check_sharding(self, state: dict) -> None:
        """A checkpoint sharded inside the node resumes on its own layout, sharded, only."""
        check_sharding(state, self)

    def _reshard(self, old_state: Callable[[int], dict], old_world: int) -> None:
        """This worker's new shard of the fp32 master and moments, copied slice by slice from the
        old shards that overlap it (at most a few old files are touched, each only in that range)."""
        opt, numel = self.comm.optimizer, self.flat.layout.numel
        old_size = ShardLayout(numel, old_world, 0).shard_numel
        lo, hi = self.flat.shard.start, min(self.flat.shard.stop, numel)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            getattr(opt, name).zero_()  # the padding stays zero
        for r in range(lo // old_size, -(-hi // old_size)) if hi > lo else ():
            old = old_state(r)
            a, b = max(lo, r * old_size), min(hi, (r + 1) * old_size)
            for name in ("master", "exp_avg", "exp_avg_sq"):
                getattr(opt, name)[a - lo : b - lo].copy_(old[name][a - r * old_size : b - r * old_size])
            del old  # a memory-mapped file is released before the next one is touched

    def state_bytes(self) -> dict[str, int]:
        """Bytes this worker holds for training, by component, each storage counted once
        (numel x element size of the engine's tensors; activations and the module's buffers not
        included)."""
        comm, opt = self.comm, self.comm.optimizer
        parts = {
            "params": self.flat.params,
            "grads": self.flat.grads,
            "grad_accumulator_fp32": self.accumulator,
            "comm_buffer": self.comm_buffer if self.overlapped else None,
            "master": opt.master,
            "exp_avg": opt.exp_avg,
            "exp_avg_sq": opt.exp_avg_sq,
            "grad_shard": comm.grad_shard,
            "trial_workspace": opt.trial_workspace,
            "estimate_error": self.lookahead.estimate_error,
            "wp_previous_master": self.lookahead.previous_master,
            **(
                {
                    "int8_send": comm.int8.send.words,
                    "int8_recv": comm.int8.recv.words,
                    "int8_work": comm.int8.work,
                }
                if comm.int8
                else {}
            ),
        }
        out, seen = {}, set()
        for name, t in parts.items():
            # each storage once, known by the storage itself rather than by its address: on the meta
            # device, where a model is built only to count what it would hold, every address is 0
            if t is not None and (storage := t.untyped_storage()._cdata) not in seen:
                seen.add(storage)
                out[name] = t.numel() * t.element_size()
        return out

    def _gather(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        """`out` (full, padded, model dtype) = every worker's `shard`, gathered as the update round does."""
        sent = out[self.flat.shard]  # in place, as the round gathers
        sent.copy_(shard)
        self.rounds.all_gather(out, sent)

    def _prediction(self) -> torch.Tensor:
        """wp: the full vector of the predicted parameters, wherever it is now."""
        return self.comm_buffer if self._prediction_stashed else self.flat.params

    @contextlib.contextmanager
    def committed_params(self):
        """The model holds the last committed parameters inside this block. wp computes at its
        prediction elsewhere: then every worker enters the block together, as the committed
        parameters are all-gathered from the fp32 master shards; the prediction waits in the comm
        buffer, idle between rounds (no model-sized copy is kept for it). Re-entrant. Sharded inside
        the node, a forward in the block (an evaluation: no backward) leaves FSDP2's root unsharded
        at the parameters it saw: dropped on the way out, so that training's next forward gathers
        the local vector as it is then."""
        try:
            if not self._predicting or self._prediction_stashed:
                yield self.module
                return
            self.comm_buffer.copy_(self.flat.params)
            self._gather(self.comm.optimizer.master, self.flat.params)
            self._prediction_stashed = True
            try:
                yield self.module
            finally:
                self.flat.params.copy_(self.comm_buffer)
                self._prediction_stashed = False
        finally:
            if self.sharded:
                self.flat.reshard()

    def close(self) -> None:
        if self.overlapped:
            self.background.close()
