"""diloco and streaming-diloco: local AdamW steps, and now and then an outer step on the average.

DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (Douillard et al. 2025), with the semantics of
torchft's ``local_sgd.py``, the reference implementation:

- A replica runs the inner optimizer, AdamW with ddp's hyper-parameters and schedule, on its own
  data and its own full copy of the parameters. With rounds=nodes on R > 1 nodes of S > 1 workers
  a replica is a node: each inner step its workers average their gradients over the node and take
  the same step (replicas.py); else every worker is a replica, with no collective per step. The
  state is not sharded: every worker keeps the fp32 local parameters and both moments in full.
  With shard_inside_node the node's replica is sharded over its workers instead (node_shards.py):
  FSDP2 reduce-scatters each micro-batch's gradient inside the node, every worker keeps its local
  vector (1/S of the model) and runs the inner AdamW, the pseudo-gradient and the outer step on it,
  and the clipping norm is the node's (its squared local norms summed with the step's statistics).
- The model is cut into F fragments, contiguous runs of its parameters in registration order (the
  order of its layers); diloco has one. Fragment i is prepared at inner steps s with
  (s - offset_i) % H == 0, offset_i = floor(H / F * (i + 1)): its pseudo-gradient, the global
  minus the local parameters, is averaged over the replicas in the background, and tau =
  fragment_sync_delay inner steps later it is applied by the outer Nesterov SGD to the fragment's
  global parameters. The local parameters then become the global ones, or with alpha =
  fragment_update_alpha keep that share of their own progress: local = lerp(global, local, alpha).
- Every worker holds the global parameters (identical everywhere) and the outer momentum.

Evaluation and checkpoints see the global parameters; at the end of the run every fragment with
local progress is synchronised once more, so the final model is the global one. In mixed precision
the pseudo-gradients travel in bf16 and are averaged back into fp32.

Per inner step the loss and gradient norm reported are the replica's: this worker's, or on the node
layout its node's (there is no per-step collective between replicas to make them global); the
data-exhausted flag travels with the next all-reduce.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch import nn

from acco.engine import progress
from acco.engine.background import BackgroundComm
from acco.engine.comm import EXHAUSTED, LOSS, WEIGHT, new_stats
from acco.engine.config import LOCAL_SGD_METHODS, CheckpointError, EngineConfig, UpdateRecord
from acco.engine.decoupled import LossFn, backward_and_count
from acco.engine.device import device_ops
from acco.engine.flat import FLAT_ORDER, FlatParams, broadcast_module, state_header, world_of
from acco.engine.node_shards import AgreedBatches, NodeShards, agree_first, check_sharding, sharded_rounds
from acco.engine.nodes import make_rounds
from acco.engine.optim import ShardedAdamW, learning_rate
from acco.engine.replicas import make_replicas

_END = object()


def fragment_slices(flat: FlatParams | NodeShards, module: nn.Module,
                    num_fragments: int) -> list[list[slice]]:
    """The flat-vector ranges of each fragment: the trainable parameters in registration order cut
    into `num_fragments` runs of about equal size (a run of layers), adjacent ranges merged. Sharded
    inside the node the cut is the same (by the whole parameters' sizes) and the ranges are each
    parameter's rows in the local vector: the same on every worker of an outer group."""
    where = {id(p): r for p, r in zip(flat.trainable, flat.param_ranges)}
    ordered = [p for p in module.parameters() if p.requires_grad]
    if num_fragments > len(ordered):
        raise ValueError(
            f"num_fragments={num_fragments} but the model has only {len(ordered)} parameter tensors"
        )
    total, before, last = flat.model_numel, 0, -1
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(num_fragments)]
    for k, p in enumerate(ordered):
        # The fragment where the parameter's middle falls; but no fragment is skipped (at most one
        # past the last one used) and the parameters left suffice for the fragments left.
        i = min((2 * before + p.numel()) * num_fragments // (2 * total), num_fragments - 1)
        i = min(max(i, num_fragments - (len(ordered) - k)), last + 1)
        last = i
        ranges[i].append(where[id(p)])
        before += p.numel()
    fragments = []
    for runs in ranges:
        merged: list[list[int]] = []
        for a, b in sorted(runs):
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        fragments.append([slice(a, b) for a, b in merged])
    return fragments


def _replicas_text(workers_per_node: int, world_size: int) -> str:
    if not workers_per_node:
        return f"{world_size} replicas of one worker"
    return f"{world_size // workers_per_node} replicas of {workers_per_node} workers (one per node)"


class DiLoCoEngine:
    """Trains `module` in place with diloco or streaming-diloco; `run` yields one record per inner step."""

    def __init__(self, module: nn.Module, cfg: EngineConfig, group: dist.ProcessGroup | None = None):
        if cfg.method not in LOCAL_SGD_METHODS:
            raise ValueError(f"DiLoCoEngine runs {', '.join(LOCAL_SGD_METHODS)}, not {cfg.method!r}")
        self.cfg, self.module, self.group = cfg, module, group
        self.world_size, self.rank = world_of(group)
        # rounds=nodes on R > 1 nodes of S > 1 workers: one replica per node (replicas.py), else
        # every worker its own; sharded inside the node: the node's replica over its workers
        self.sharded = cfg.shard_inside_node
        if self.sharded:
            self.rounds = sharded_rounds(cfg, group, self.world_size, self.rank)
        else:
            self.rounds = make_rounds(cfg.rounds, group, self.world_size, self.rank, cfg.workers_per_node)
        dtype = torch.bfloat16 if cfg.use_mixed_precision else torch.float32
        broadcast_module(module, group)  # rank 0's weights, before the fp32 copy is taken from them
        # One "shard" holding everything (the local vector, sharded inside the node): the inner
        # optimizer is not sharded between replicas.
        if self.sharded:
            self.flat = NodeShards(module, dtype, self.rounds, whole_master=True)
        else:
            self.flat = FlatParams(module, dtype, 1, 0)
        self.device = self.flat.params.device
        self.replicas = make_replicas(self.rounds, group, self.world_size, self.device)
        self.local = self.flat.master_shard  # fp32 local parameters, the inner AdamW's master
        self.inner = ShardedAdamW(self.local, cfg, self.flat.decay_numel, trial=False)
        self.global_params = self.local.clone()  # the last synchronised parameters, fp32
        self.outer_momentum = torch.zeros_like(self.local)
        self.fragments = fragment_slices(self.flat, module, cfg.num_fragments)
        sizes = [sum(s.stop - s.start for s in f) for f in self.fragments]
        H, F = cfg.sync_every, cfg.num_fragments
        self.offsets = [math.floor(H / F * (i + 1)) for i in range(F)]
        # The wire: one fragment's pseudo-gradient (model dtype), the data-exhausted and the stop
        # flags, padded to a multiple of the world size for the reduce-scatter + all-gather (on the
        # node layout: S chunks of R shards; sharded inside the node: R shards of the local vector's).
        padded = self._wire_numel(max(sizes))
        self.wire = torch.zeros(padded, dtype=dtype, device=self.device)
        self.wire_shard = torch.empty(padded // self.replicas.world_size, dtype=dtype, device=self.device)
        self.averaged = torch.empty(max(sizes), dtype=torch.float32, device=self.device)  # fp32 average
        self.grad = self.flat.grads if dtype == torch.float32 else torch.zeros_like(self.local)
        # mixed precision, grad_accum_dtype fp32: each micro-batch's bf16 gradients add to the fp32 `grad`
        self.sum_fp32 = self.grad is not self.flat.grads and cfg.grad_accum_dtype == "fp32"
        self.stats = new_stats(self.device)
        self.norm = torch.zeros((), dtype=torch.float32, device=self.device)  # the inner step's gradient norm
        # An inner step's loss sum, weight and norm (and, sharded, whether a worker of the node is
        # short of the micro-batches after the next step's), copied to the host behind the step's
        # work and read once the next step's micro-batches are queued: the GPU never drains for a record.
        self.step_stats = torch.zeros(4, dtype=torch.float64, device=self.device)
        self.ops = device_ops(self.device)
        self.host_stats = self.ops.host_buffer(4, dtype=torch.float64)
        # blocking: the host sleeps in `_read_stats`' wait instead of spinning a core
        self.stats_ready = self.ops.event(blocking=True)
        self.computed_ahead = 0  # the next step's micro-batches, computed before this step's record
        self.background = BackgroundComm(self.device)
        self.pending: tuple[int, Future] | None = None  # the fragment whose all-reduce is in flight
        self.averaged_fragment: int | None = None  # `averaged` holds this fragment's landed result
        self.last_merge = [0] * F  # inner step at which each fragment last took the global parameters
        self.step = 0  # inner steps
        self.committed_micro_batches = 0  # micro-batches over all workers in inner steps so far
        self._stop = False  # some worker ran out of data (learnt from an all-reduce)
        # this worker ran out of data; sharded: its node agreed to compute no more micro-batches
        self._exhausted = False
        self._agreed: AgreedBatches | None = None  # sharded: the micro-batches taken ahead
        self._stop_requested = self._stop_agreed = False  # request_stop: sent with the next all-reduce
        self._last_loss = float("nan")
        self.wall_time_offset = 0.0
        self.last_wall_time = 0.0

    # ---- the inner step: local AdamW, no collective ----------------------------------------

    def _compute(self, batches: Iterator, loss_fn: LossFn) -> int:
        """Compute up to n_grad_accumulation micro-batches into the accumulator; returns how many."""
        n = 0
        while n < self.cfg.n_grad_accumulation and not self._exhausted:
            batch = next(batches, _END)
            if batch is _END:
                self._exhausted = True
                break
            backward_and_count(loss_fn(self.module, batch), self.stats)
            if self.sum_fp32:
                self.grad.add_(self.flat.grads)
                self.flat.grads.zero_()
            n += 1
        return n

    def _average(self, n: int) -> bool:
        """The replica's gradient sum and statistics: this worker's own, or on the node layout the
        node's (summed in the model dtype, as ddp's wire); whether the replica takes an inner step."""
        if self.sharded:
            return self._node_step(n)
        if not self.replicas.per_step:
            return n > 0
        if self.sum_fp32:  # the fp32 sum rounded to bf16 once, for the wire
            self.flat.grads.copy_(self.grad)
        stepped = self.replicas.average_step(
            self.flat.grads, self.stats, n, self._exhausted, self._stop_requested
        )
        if self.sum_fp32:
            self.grad.copy_(self.flat.grads)
        return stepped

    def _node_step(self, n: int) -> bool:
        """Sharded inside the node: FSDP2 has summed the node's gradients into this worker's shards.
        The micro-batches ahead are topped up first, so that the node's statistics say whether every
        worker of it has those after the next step's (node_shards.AgreedBatches); the node's
        gradient norm, before the division by its weight, goes to `norm`. Every worker of the node
        ran the same micro-batches: it steps where this worker had some."""
        short = self._exhausted or self._agreed.top_up()
        grads = self.grad if self.sum_fp32 else self.flat.grads
        squared = self.replicas.node_step(grads, self.stats, short, self._stop_requested)
        torch.div(squared.sqrt(), self.stats[WEIGHT].clamp(min=1e-30), out=self.norm)
        return n > 0

    def _apply(self, n: int) -> tuple[float, bool]:
        """One AdamW step on the replica's accumulated micro-batches, `n` of them this worker's
        (none anywhere in the replica: no step); returns the LR and whether it stepped. The step's
        statistics are queued for the host (`_read_stats`), not read."""
        per_step = self.world_size * self.cfg.n_grad_accumulation
        lr = learning_rate(self.cfg, self.committed_micro_batches, per_step)
        norm = self.norm.zero_()
        stepped = self._average(n)
        if stepped:
            if self.grad is not self.flat.grads and not self.sum_fp32:
                self.grad.copy_(self.flat.grads)
            self.grad.div_(self.stats[WEIGHT].to(self.grad.dtype))
            if not self.sharded:  # sharded: the node's, from `_node_step`
                torch.linalg.vector_norm(self.grad, out=norm)
            if self.cfg.max_grad_norm:  # torch's clip_grad_norm_ formula, on the device
                self.grad.mul_((self.cfg.max_grad_norm / (norm + 1e-6)).clamp_(max=1.0))
            self.inner.commit(self.grad, lr)
            self.flat.params.copy_(self.local)
            if self.sum_fp32:
                self.grad.zero_()
        self.step_stats[0].copy_(self.stats[LOSS])
        self.step_stats[1].copy_(self.stats[WEIGHT])
        self.step_stats[2].copy_(norm)
        self.step_stats[3].copy_(self.stats[EXHAUSTED])
        self.host_stats.copy_(self.step_stats, non_blocking=True)
        self.stats_ready.record(self.ops.current_stream())
        self.flat.grads.zero_()
        self.stats.zero_()
        # Counted alike on every worker (the budget and the fragment schedule must agree), also for
        # the inner steps without data that keep the schedule until the all-reduce that tells every
        # worker some worker's data ran out (no record is yielded for those, `run`).
        self.step += 1
        self.committed_micro_batches += per_step
        return lr, stepped

    def _read_stats(self, stepped: bool) -> tuple[float, float]:
        """The last step's (gradient norm before clipping, loss weight) on the host; waits for that
        step alone (the next one's micro-batches may already be queued behind it)."""
        self.stats_ready.synchronize()
        loss_sum, weight, norm, short = self.host_stats.tolist()
        if stepped:
            self._last_loss = loss_sum / weight
        if self.sharded and short:  # a worker of the node lacks some micro-batch after the next step's:
            self._exhausted = True  # the node computes none (that flag also reaches the other nodes)
        return (norm if self.cfg.max_grad_norm else float("nan")), weight

    # ---- fragments: prepare (launch the all-reduce) and sync (outer step, merge) ---------------

    def _prepare(self, i: int) -> None:
        """Launch the average of fragment i's pseudo-gradient, global - local, in the background."""
        n = 0
        for s in self.fragments[i]:
            k = s.stop - s.start
            torch.sub(self.global_params[s], self.local[s], out=self.wire[n : n + k])
            n += k
        self.replicas.write_flags(self.wire[n : n + 2], self._exhausted, self._stop_requested)
        m = self._wire_numel(n)
        self.wire[n + 2 : m].zero_()
        step = self.step
        self.pending = (i, self.background.submit(lambda: self._all_reduce(i, step, n, m)))

    def _wire_numel(self, n: int) -> int:
        """A fragment of `n` elements' wire: with the two flags, padded to a multiple of the world size."""
        return -(-(n + 2) // self.world_size) * self.world_size

    def _all_reduce(self, i: int, step: int, n: int, m: int) -> tuple[bool, bool]:
        """On the comm thread: sum the first `m` wire elements over the replicas in place (a
        bandwidth-optimal reduce-scatter then all-gather, issued at world size 1 too; on the node
        layout between nodes only, this worker's chunk: the node gathers it at `_land`); returns
        whether some worker ran out of data (element `n`) and whether one was asked to stop (`n + 1`),
        read here so that the compute side never waits."""
        progress.mark(f"update {step} (all-reduce of fragment {i})")
        return self.replicas.sum_fragment(self.wire, self.wire_shard, n, m)

    def _land(self) -> tuple[float, float]:
        """Wait for the all-reduce in flight (on the node layout, then gather the node's chunks on
        this thread) and keep its fp32 average over the replicas; (wait_s, busy_s)."""
        i, future = self.pending
        n = sum(s.stop - s.start for s in self.fragments[i])
        start = time.perf_counter()
        timed = future.result()
        self.replicas.gather_fragment(self.wire[: self._wire_numel(n)])
        wait, busy, (exhausted, stop) = time.perf_counter() - start, timed.busy_s, timed.value
        torch.div(self.wire[:n], self.replicas.count, out=self.averaged[:n])
        if exhausted:  # some worker ran out of data: this sync is the last
            self._stop = True
        self._stop_agreed |= stop  # some worker was asked to stop: every worker stops at this step
        self.pending, self.averaged_fragment = None, i
        return wait, busy

    def _sync(self, i: int, alpha: float) -> None:
        """Outer Nesterov SGD on fragment i's global parameters (torch.optim.SGD's update with
        nesterov=True, dampening 0), then the local parameters take them (keeping alpha of theirs)."""
        mu, n = self.cfg.outer_momentum, 0
        for s in self.fragments[i]:
            g = self.averaged[n : n + s.stop - s.start]
            n += s.stop - s.start
            buf = self.outer_momentum[s]
            buf.mul_(mu).add_(g)
            g.add_(buf, alpha=mu)
            self.global_params[s].sub_(g, alpha=self.cfg.outer_lr)
            if alpha:
                self.local[s].lerp_(self.global_params[s], 1.0 - alpha)
            else:
                self.local[s].copy_(self.global_params[s])
            self.flat.params[s].copy_(self.local[s])
        self.averaged_fragment = None
        self.last_merge[i] = self.step

    def _due(self, i: int, delay: int) -> bool:
        return (
            self.step >= self.offsets[i] + delay
            and (self.step - self.offsets[i] - delay) % self.cfg.sync_every == 0
        )

    def _fragments_step(self) -> tuple[float, float]:
        """The prepares and syncs due at this inner step (torchft's order: prepares first)."""
        wait = busy = 0.0
        tau = self.cfg.fragment_sync_delay
        for i in range(self.cfg.num_fragments):
            if self._due(i, 0):
                self._prepare(i)
        for i in range(self.cfg.num_fragments):
            if self._due(i, tau):
                if self.pending is not None and self.pending[0] == i:
                    w, b = self._land()
                    wait, busy = wait + w, busy + b
                if self.averaged_fragment == i:
                    self._sync(i, self.cfg.fragment_update_alpha)
        return wait, busy

    def _synchronise_all(self) -> tuple[float, float]:
        """End of the run: the pending fragment is applied, then every fragment with local progress
        since its last merge is synchronised once more (alpha 0: the final model is the global one)."""
        wait = busy = 0.0
        if self.pending is not None:
            wait, busy = self._land()
        if self.averaged_fragment is not None:
            self._sync(self.averaged_fragment, 0.0)
        for i in range(self.cfg.num_fragments):
            if self.last_merge[i] < self.step:
                self._prepare(i)
                w, b = self._land()
                wait, busy = wait + w, busy + b
                self._sync(i, 0.0)
        # A fragment merged at this very step kept alpha of its local progress: drop it too.
        self.local.copy_(self.global_params)
        self.flat.params.copy_(self.local)
        return wait, busy

    # ---- the loop ----------------------------------------------------------------------------

    def run(self, batches: Iterable, loss_fn: LossFn) -> Iterator[UpdateRecord]:
        """Train until `nb_steps_tot` micro-batches over all workers have gone into inner steps (or
        a worker's data ran out); one record per inner step that had micro-batches. Between two
        records the model holds this worker's local parameters; `committed_params` gives the
        global ones."""
        batches = iter(batches)
        if self.sharded:  # two inner steps' micro-batches agreed ahead, as node_shards.py's rounds
            self._agreed = batches = AgreedBatches(batches, 2 * self.cfg.n_grad_accumulation)
            if agree_first(self, batches):
                self.finish()
                return
        t0 = time.perf_counter() - self.wall_time_offset
        self.flat.check_grad_views()
        start = time.perf_counter()
        n = self._compute(batches, loss_fn)
        compute = time.perf_counter() - start
        while True:
            start = time.perf_counter()
            lr, stepped = self._apply(n)
            compute += time.perf_counter() - start
            wait, busy = self._fragments_step()
            finished = self.committed_micro_batches >= self.cfg.nb_steps_tot or self._stop
            if finished:
                w, b = self._synchronise_all()
                wait, busy = wait + w, busy + b
            else:  # the next step's micro-batches go into the queue before this step's record is read
                start = time.perf_counter()
                self.computed_ahead = self._compute(batches, loss_fn)
                next_compute = time.perf_counter() - start
            norm, weight = self._read_stats(stepped)
            self.last_wall_time = time.perf_counter() - t0
            if stepped:  # an inner step with no data (after the replica's ran out) is no update: no record
                yield UpdateRecord(
                    step=self.step,
                    committed_micro_batches=self.committed_micro_batches,
                    loss=self._last_loss,
                    lr=lr,
                    micro_batches=[n] * self.world_size,
                    compute_s=compute,
                    wait_s=wait,
                    comm_s=busy,
                    wall_time=self.last_wall_time,
                    weight=weight * self.replicas.count,
                    grad_norm=norm,
                    stop=self._stop_agreed,
                )
            if finished:
                return
            n, compute, self.computed_ahead = self.computed_ahead, next_compute, 0

    def request_stop(self) -> None:
        """Signal-safe: the next fragment all-reduce tells every worker to stop at the step it lands
        (at most sync_every / num_fragments inner steps later)."""
        self._stop_requested = True

    @property
    def fetched_ahead(self) -> int:
        """Sharded: micro-batches taken from the stream and not computed yet (read again on resume)."""
        return len(self._agreed.queue) if self._agreed is not None else 0

    def _write_params(self, source: torch.Tensor) -> None:
        """The model's parameters = `source`, outside an inner step; sharded, what an evaluation's
        forward left unsharded is dropped, so that the next forward gathers these."""
        self.flat.params.copy_(source)
        if self.sharded:
            self.flat.reshard()

    @contextlib.contextmanager
    def committed_params(self):
        """The model holds the global parameters inside this block (it computes at its local ones)."""
        self.quiesce()
        self._write_params(self.global_params)
        try:
            yield self.module
        finally:
            self._write_params(self.local)

    def sync_note(self) -> str:
        """What an evaluation sees, for its log line (it is not what the training loss is taken at,
        each worker's local parameters): the global parameters as of each fragment's last sync, and
        the inner step of the next one (the run's last step syncs every fragment)."""
        merged = self.last_merge
        if not any(merged):
            seen = "global parameters: the initial ones, no sync yet"
        elif len(merged) == 1:
            seen = f"global parameters as synced at step {merged[0]}"
        else:
            steps = ", ".join(str(s) if s else "-" for s in merged)
            seen = f"global parameters, fragments 1-{len(merged)} as synced at steps {steps}"
            seen += " (-: not yet)" if not all(merged) else ""
        nxt = self._next_sync()
        return f"{seen}; " + (f"next sync at step {nxt}" if nxt is not None else "the run's last sync")

    def _next_sync(self) -> int | None:
        """The inner step at which a fragment next takes the averaged parameters: the first one due
        (offset + delay, then every sync_every), or the run's last step if it comes first (as the
        budget stands: data may run out sooner); None once the run is over."""
        per_step = self.world_size * self.cfg.n_grad_accumulation
        last = self.step + -(-max(self.cfg.nb_steps_tot - self.committed_micro_batches, 0) // per_step)
        if last == self.step:
            return None
        H, tau = self.cfg.sync_every, self.cfg.fragment_sync_delay
        due = [o + tau if self.step < o + tau else o + tau + ((self.step - o - tau) // H + 1) * H
               for o in self.offsets]  # fmt: skip
        return min(min(due), last)

    def quiesce(self) -> None:
        """No all-reduce in flight: the caller may run collectives of its own (its result is kept
        and applied at its scheduled step, as if it had landed then). NCCL matches a group's
        collectives by the order each rank issues them: the trainer calls this on every rank before
        any collective of its own (an evaluation's, a checkpoint's), never during a round."""
        if self.pending is not None:
            self._land()

    def finish(self) -> None:
        """Every worker calls it once training ends, also when the caller stopped early: nothing in
        flight, the next step's micro-batches dropped, and the model holds the global parameters,
        so that rank 0 alone may save it. Idempotent."""
        self.quiesce()
        self.flat.grads.zero_()
        if self.sum_fp32:
            self.grad.zero_()
        self.stats.zero_()
        self.computed_ahead = 0
        self._write_params(self.global_params)

    def compute_context(self):
        """The parameters already are in the training dtype."""
        return contextlib.nullcontext()

    # ---- checkpoints ----------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes this worker holds for training, by component."""

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        out = {
            "params": size(self.flat.params),
            "grads": size(self.flat.grads),
            "local_fp32": size(self.local),
            "exp_avg": size(self.inner.exp_avg),
            "exp_avg_sq": size(self.inner.exp_avg_sq),
            "global_params": size(self.global_params),
            "outer_momentum": size(self.outer_momentum),
            "wire": size(self.wire) + size(self.wire_shard),
            "averaged": size(self.averaged),
        }
        if self.grad is not self.flat.grads:
            out["grad_fp32"] = size(self.grad)
        return out

    def _shared(self) -> tuple[bool, dist.ProcessGroup | None]:
        """Who saves what every worker holds identically (the global parameters, the outer momentum,
        a landed average), and the group it is broadcast over on load: rank 0 and the job; sharded
        inside the node, node 0's worker of each local index and its outer group (the local vector's
        rows)."""
        if self.sharded:
            return self.rounds.layout.node == 0, self.rounds.outer_group
        return self.rank == 0, self.group

    def state_dict(self) -> dict:
        """This worker's local parameters and inner AdamW state (its own: not sharded between
        replicas); rank 0 alone (sharded: node 0's workers) saves what every worker holds identically:
        the global parameters, the outer momentum and a landed all-reduce result not yet applied."""
        self.quiesce()
        shared = self._shared()[0]
        averaged = self.averaged_fragment
        n = sum(s.stop - s.start for s in self.fragments[averaged]) if averaged is not None else 0
        landed = self.averaged[:n] if shared and n else None
        if landed is not None and n < self.averaged.numel():  # torch.save writes a view's whole storage:
            landed = landed.clone()  # a fragment shorter than the buffer (the largest one's) is copied out
        return {
            **state_header(self),
            "fragments": self.cfg.num_fragments,
            "sync_every": self.cfg.sync_every,
            "last_merge": list(self.last_merge),
            "inner_steps": self.inner.step_count,
            "master": self.local,
            "exp_avg": self.inner.exp_avg,
            "exp_avg_sq": self.inner.exp_avg_sq,
            "global_params": self.global_params if shared else None,
            "outer_momentum": self.outer_momentum if shared else None,
            "averaged_fragment": averaged,
            "averaged": landed,
            "stop": self._stop,
            # the next step's micro-batches, computed ahead of this record: a resume reads them again
            "dropped_micro_batches": self.computed_ahead,
            "fetched_ahead": self.fetched_ahead,  # sharded: taken from the stream, not computed yet
        }

    def load_state_dict(self, state: dict, old_state=None) -> bool:
        """Restore a worker's state exactly; only on the world size it was saved with (every
        worker's local parameters and inner moments are its own). Every worker calls it together:
        the shared tensors are broadcast from rank 0."""
        if state["method"] != self.cfg.method:
            raise CheckpointError(
                f"checkpoint was written by method {state['method']!r}, this run is {self.cfg.method!r}"
            )
        if state["numel"] != self.flat.model_numel or state.get("order") != FLAT_ORDER:
            raise CheckpointError(
                f"checkpoint holds {state['numel']:,} parameters in another order or number; "
                f"the model has {self.flat.model_numel:,}"
            )
        check_sharding(state, self)
        if state["world_size"] != self.world_size or state["rank"] != self.rank:
            raise CheckpointError(
                f"{self.cfg.method} resumes only on the world size it was saved with "
                f"({state['world_size']} workers; every worker's local state is its own)"
            )
        if state.get("workers_per_node", 0) != self.rounds.workers_per_node:
            raise CheckpointError(
                f"{self.cfg.method} resumes only on the replica layout it was saved with: the checkpoint "
                f"has {_replicas_text(state.get('workers_per_node', 0), self.world_size)}, this run "
                f"{_replicas_text(self.rounds.workers_per_node, self.world_size)} (train.rounds, "
                f"launch.workers_per_node or the launcher's)"
            )
        if (state["fragments"], state["sync_every"]) != (self.cfg.num_fragments, self.cfg.sync_every):
            raise CheckpointError(
                f"checkpoint synchronised {state['fragments']} fragment(s) every {state['sync_every']} "
                f"steps; this run: {self.cfg.num_fragments} every {self.cfg.sync_every}"
            )
        self.committed_micro_batches, self.step = int(state["samples"]), int(state["step"])
        self.wall_time_offset = float(state["wall_time"])
        self.last_merge = list(state["last_merge"])
        self._stop = bool(state.get("stop", False))
        self.local.copy_(state["master"])
        self.inner.exp_avg.copy_(state["exp_avg"])
        self.inner.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.inner.restore_step(int(state["inner_steps"]))
        shared, group = self._shared()
        if shared:
            self.global_params.copy_(state["global_params"])
            self.outer_momentum.copy_(state["outer_momentum"])
        self.averaged_fragment = state["averaged_fragment"]
        n = (
            sum(s.stop - s.start for s in self.fragments[self.averaged_fragment])
            if self.averaged_fragment is not None
            else 0
        )
        if shared and n:
            self.averaged[:n].copy_(state["averaged"])
        if self.world_size > 1:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for t in (
                (self.global_params, self.outer_momentum, self.averaged[:n])
                if n
                else (self.global_params, self.outer_momentum)
            ):
                dist.broadcast(t, src=src, group=group)
        self._write_params(self.local)
        return True

    def close(self) -> None:
        self.background.close()
