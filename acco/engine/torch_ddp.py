"""torch-ddp: what a PyTorch user would run instead of acco, tuned as PyTorch's documentation advises.

torch's DistributedDataParallel (bucketed all-reduce overlapped with backward) with
ZeroRedundancyOptimizer(AdamW), the same hyper-parameters, budget and LR schedule as the other
methods. Mixed precision is the usual PyTorch recipe: fp32 parameters, bf16 autocast, and
gradients all-reduced in bf16 (DDP's bf16 compression hook) so the wire carries what acco's does.

The tuning (BENCHMARKS.md, "torch-ddp: why it is slower, and its tuning"):
- DDP's gradient_as_bucket_view: the .grad tensors are views of DDP's buckets (no copy, and no
  second gradient-sized buffer). ZeRO's parameters_as_bucket_view: the updated shards are
  broadcast bucket by bucket, not parameter by parameter.
- DDP's bucket_cap_mb from train.bucket_cap_mb. Given explicitly it also caps the first bucket:
  torch's smaller 1 MiB first bucket applies only when the argument is left out.
- static_graph when an update is one micro-batch per worker. With accumulation (no_sync on all
  micro-batches but the last) it stays off: in torch 2.13 a backward under no_sync with
  static_graph fails DDP's internal assert (expect_autograd_hooks_) in the first update; past it,
  the gradients stop being all-reduced (pytorch/pytorch#187732); running those micro-batches on the
  bare module instead of under no_sync gives wrong gradients too. tests/test_torch_ddp.py pins
  the failure, so the gate can go once torch is fixed. static_graph gains little here anyway:
  every parameter is used (find_unused_parameters stays off) and gradient checkpointing is
  non-reentrant (use_reentrant=False), the cases static_graph exists for; and its first update
  all-reduces only after the whole backward.
- ZeroRedundancyOptimizer's overlap_with_ddp (the step run in DDP's comm hook,
  ddp_zero_hook.hook_with_zero_step; NCCL only) is not used: it would change what is trained, in
  every configuration. (1) The step runs in the last bucket's hook, during backward, before the
  engine holds the whole averaged gradient: no clipping by its global norm (max_grad_norm, on by
  default), no division by the loss weight summed over all workers (known from the statistics
  all-gather after backward). (2) Its functional AdamW takes one parameter group, and decay on the
  matrices but not on biases and norms needs two (unless weight_decay is 0). (3) The functional AdamW reads
  its learning rate from its own defaults, which ZeroRedundancyOptimizer's param_groups never reach: the
  per-update schedule would be silently dropped. (4) The first two updates (three with static_graph) do not
  step the optimizer at all: ZeRO waits for DDP's rebuilt buckets before it assigns its shards, so
  those updates' micro-batches would count in the budget without training (torch's docs suggest
  dummy inputs first). (5) gloo is refused (it may hang, pytorch/pytorch#62300): nothing here could
  test it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grad_norm_

from acco.engine import collectives, progress
from acco.engine.comm import (
    EXHAUSTED,
    LOSS,
    MICRO_BATCHES,
    N_STATS,
    STOP,
    WEIGHT,
    new_stats,
)
from acco.engine.config import CheckpointError, EngineConfig, UpdateRecord
from acco.engine.decoupled import LossFn, backward_and_count
from acco.engine.flat import ShardLayout, world_of
from acco.engine.optim import learning_rate

_END = object()


def bf16_hook(group, bucket):
    """torch's bf16_compress_hook, for the backends torch does not allow it on (gloo): the bucket is
    cast to bf16, divided by the world size, all-reduced, and copied back into the fp32 bucket.
    (group: ProcessGroup | None, bucket: GradBucket -> Future[Tensor]. No annotations: DDP compares
    them with the classes, and this module's are strings.)"""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return fut.then(decompress)



def take_ahead(engine, batches: Iterator, n: int) -> list:
    """The torch engines' next update's micro-batches, up to `n`, taken before the update they follow
    is committed (counted in engine.fetched_ahead): whether every worker has them travels with
    that update's statistics, so that no worker starts a forward the others will not join."""
    taken = []
    for _ in range(n):
        batch = next(batches, _END)
        if batch is _END:
            break
        taken.append(batch)
    engine.fetched_ahead = len(taken)
    return taken


def first_batches(engine, batches: Iterator, n: int) -> tuple[list, bool]:
    """The first update's micro-batches, and whether some worker has fewer than `n` (one all-reduce)."""
    upcoming = take_ahead(engine, batches, n)
    return upcoming, collectives.any_worker(len(upcoming) < n, engine.device, engine.group)


def gathered_statistics(engine) -> tuple[list[list[float]], float, list[int]]:
    """The torch engines' one host read per update: every worker's statistics (comm.py's layout),
    all-gathered; the rows, the summed loss weight and each worker's micro-batches."""
    table = torch.empty(engine.world_size * N_STATS, dtype=engine.stats.dtype, device=engine.device)
    collectives.all_gather_small(table, engine.stats, group=engine.group)
    rows = table.view(engine.world_size, N_STATS).tolist()
    return rows, sum(row[WEIGHT] for row in rows), [int(row[MICRO_BATCHES]) for row in rows]


def step_and_record(engine, rows, micro_batches: list[int], grad_norm: float, compute_s: float,
                    start: float, t0: float) -> UpdateRecord:
    """The torch engines' update once their gradients are the clipped mean: torch's optimizer step
    at the schedule's learning rate, the counters, and the update's record (`rows`: the gathered
    statistics; `start`: when the update's communication began, `t0`: the run's start)."""
    total = sum(micro_batches)  # this update's, over all workers
    lr = learning_rate(engine.cfg, engine.committed_micro_batches, total)
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    engine.optimizer.step()
    engine.committed_micro_batches += total
    engine.step += 1
    step_s = time.perf_counter() - start
    weight = sum(row[WEIGHT] for row in rows)
    record = UpdateRecord(
        step=engine.step,
        committed_micro_batches=engine.committed_micro_batches,
        loss=sum(row[LOSS] for row in rows) / weight,
        lr=lr,
        micro_batches=micro_batches,
        compute_s=compute_s,
        wait_s=step_s,
        comm_s=step_s,
        wall_time=time.perf_counter() - t0,
        weight=weight,
        grad_norm=grad_norm,
        stop=any(row[STOP] > 0 for row in rows),
    )
    engine.last_wall_time = record.wall_time
    return record

class TorchDDPEngine:
    def __init__(self, module: nn.Module, cfg: EngineConfig, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch-ddp needs an initialised process group (torch.distributed)")
        self.cfg = cfg
        self.module = module
        self.group = group
        self.world_size, self.rank = world_of(group)
        self.device = next(module.parameters()).device
        module.to(torch.float32)
        device_ids = [self.device] if self.device.type == "cuda" else None
        # static_graph only without accumulation: torch 2.13's DDP with static_graph fails on a
        # backward under no_sync (see the module docstring; test_torch_ddp.py pins the failure).
        # Every rank must agree (DDP's collectives differ with it), and ranks may accumulate
        # different counts: one micro-batch per update on every worker.
        most = torch.tensor([float(cfg.n_grad_accumulation)], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        self.static_graph = most.item() == 1
        # DDP broadcasts rank 0's parameters and buffers at construction.
        self.ddp = DistributedDataParallel(
            module,
            device_ids=device_ids,
            process_group=group,
            bucket_cap_mb=cfg.bucket_cap_mb,
            gradient_as_bucket_view=True,
            static_graph=self.static_graph,
        )
        if cfg.use_mixed_precision:
            # torch refuses its own bf16 hook without CUDA and NCCL; gloo all-reduces bf16 too
            on_nccl = self.device.type == "cuda" and dist.get_backend(group) == "nccl"
            self.ddp.register_comm_hook(group, default_hooks.bf16_compress_hook if on_nccl else bf16_hook)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = ZeroRedundancyOptimizer(
            # weight decay on the matrices and embeddings, not biases and norms (as FlatParams)
            [
                {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
            ],
            optimizer_class=torch.optim.AdamW,
            process_group=group,
            # the updated shards are broadcast bucket by bucket, not parameter by parameter
            parameters_as_bucket_view=True,
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
        )
        self.stats = new_stats(self.device)
        self.committed_micro_batches = 0  # over all workers, in committed updates (the budget's unit)
        self.step = 0  # committed updates
        self.wall_time_offset = self.last_wall_time = 0.0
        self.fetched_ahead = 0  # micro-batches taken from the stream for the next update, not computed yet
        self._stop_requested = False

    def request_stop(self) -> None:
        """Signal-safe: this worker's next statistics tell every worker to stop after that update."""
        self._stop_requested = True

    def _autocast(self):
        if not self.cfg.use_mixed_precision:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


    def run(self, batches: Iterable, loss_fn: LossFn) -> Iterator[UpdateRecord]:
        cfg = self.cfg
        batches = iter(batches)
        t0 = time.perf_counter() - self.wall_time_offset
        per_update = cfg.n_grad_accumulation  # micro-batches per worker per update
        # Every rank must know before a backward that every other rank will run it too (DDP's
        # collectives would hang otherwise): the next update's micro-batches are fetched first,
        # and whether everyone has them travels with the statistics all-reduce.
        upcoming, exhausted = first_batches(self, batches, per_update)
        while not exhausted:
            start = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=False)
            self.stats.zero_()
            # Progress marks before each collective: DDP's buffer broadcast in the first forward,
            # then its gradient all-reduce in the last backward (a rank may stall in between).
            progress.mark(f"update {self.step + 1} (start)")
            for k, batch in enumerate(upcoming):
                sync = k == per_update - 1
                with contextlib.nullcontext() if sync else self.ddp.no_sync(), self._autocast():
                    out = loss_fn(self.ddp, batch)
                if sync:
                    progress.mark(f"update {self.step + 1} (gradient all-reduce)")
                backward_and_count(out, self.stats)
            compute_s = time.perf_counter() - start
            start = time.perf_counter()
            upcoming = take_ahead(self, batches, per_update)
            self.stats[EXHAUSTED] = float(len(upcoming) < per_update)
            if self._stop_requested:  # (stats are zeroed per update: set again each time)
                self.stats[STOP] = 1
            table, weight, micro_batches = gathered_statistics(self)
            # DDP averaged the summed gradients over workers; make it a mean over the weight. (The
            # list is rebuilt each time: DDP re-buckets, and re-points .grad, after its first step.)
            with_grad = [p for p in self.module.parameters() if p.grad is not None]
            torch._foreach_mul_([p.grad for p in with_grad], self.world_size / weight)
            # Every rank holds the whole averaged gradient after DDP's all-reduce (ZeRO shards only
            # the optimizer state), so torch's own clip_grad_norm_ clips by the global norm.
            grad_norm = math.nan
            if cfg.max_grad_norm:
                grad_norm = float(clip_grad_norm_(with_grad, cfg.max_grad_norm, foreach=True))
            # ZeroRedundancyOptimizer: each rank steps its shard, then broadcasts it
            record = step_and_record(self, table, micro_batches, grad_norm, compute_s, start, t0)
            exhausted = any(row[EXHAUSTED] > 0 for row in table)
            yield record
            if self.committed_micro_batches >= cfg.nb_steps_tot:
                break

    def state_dict(self) -> dict:
        """This rank's ZeRO optimizer shard and its slice of the parameters (replicated by DDP:
        each worker saves one slice, and a resume all-gathers them). The slice is copied from the
        parameters that overlap it: nothing model-sized is allocated (the padding stays zero)."""
        layout = self._layout()
        shard = torch.zeros(layout.shard_numel, dtype=self._dtype(), device=self.device)
        lo, hi, offset = layout.shard_slice.start, layout.shard_slice.stop, 0
        for p in self.module.parameters():
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                shard[a - lo : b - lo].copy_(p.detach().reshape(-1)[a - offset : b - offset])
            offset += p.numel()
        return {
            "method": "torch-ddp",
            "numel": layout.numel,
            "world_size": self.world_size,
            "rank": self.rank,
            "samples": self.committed_micro_batches,
            "step": self.step,
            "wall_time": self.last_wall_time,
            "params_shard": shard,
            "optimizer": self.optimizer.optim.state_dict(),  # this rank's ZeRO shard
            # run() has already read the next update's micro-batches when it yields: the data
            # position saved beside this state must be moved back by that many (exact resume).
            "fetched_ahead": self.fetched_ahead,
        }

    def load_state_dict(self, state: dict, old_state=None) -> bool:
        """Restore on the world size the state was saved with (ZeRO shards by parameter); `old_state`
        (resharding, DecoupledEngine's) is refused by the world-size check below."""
        if state["method"] != "torch-ddp":
            raise CheckpointError(
                f"checkpoint was written by method {state['method']!r}, this run is 'torch-ddp'"
            )
        if state["world_size"] != self.world_size:
            raise CheckpointError(
                "torch-ddp resumes only on the world size it was saved with (ZeRO shards by parameter)"
            )
        params, layout = list(self.module.parameters()), self._layout()
        if state["numel"] != layout.numel:
            raise CheckpointError(
                f"checkpoint holds {state['numel']:,} parameters, the model has a different size"
            )
        flat = torch.empty(layout.padded_numel, dtype=self._dtype(), device=self.device)
        shard = state["params_shard"].to(self.device)
        collectives.all_gather(flat, shard, group=self.group)
        with torch.no_grad():
            for p, saved in zip(params, flat[: layout.numel].split([p.numel() for p in params])):
                p.copy_(saved.view_as(p))
        self.optimizer.optim.load_state_dict(state["optimizer"])
        self.committed_micro_batches, self.step = int(state["samples"]), int(state["step"])
        self.wall_time_offset = float(state["wall_time"])
        return True

    def _layout(self) -> ShardLayout:
        return ShardLayout(sum(p.numel() for p in self.module.parameters()), self.world_size, self.rank)

    def _dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def state_bytes(self) -> dict[str, int]:
        """Bytes this worker holds for training, by component (numel x element size): the full
        parameters (ZeroRedundancyOptimizer's buckets hold them, parameters_as_bucket_view), the full
        gradients (DDP's buckets, which .grad views), AdamW's moments for this worker's ZeRO shard
        (allocated at the first step, counted before it too). Not counted, as for the other
        methods: activations, the module's buffers, AdamW's step counters (one scalar per tensor),
        and the bf16 hook's compressed copy of a bucket while it is on the wire (transient)."""
        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        local = [p for group in self.optimizer.optim.param_groups for p in group["params"]]
        return {
            "params": size(self.module.parameters()),
            "grads": size(p for p in self.module.parameters() if p.requires_grad),
            "exp_avg": size(local),
            "exp_avg_sq": size(local),
        }

    @contextlib.contextmanager
    def committed_params(self):
        yield self.module

    def compute_context(self):
        """fp32 parameters under bf16 autocast in mixed precision: evaluation must run under it too
        (flash_attention_2 refuses fp32 inputs, and the loss would be another function's)."""
        return self._autocast()

    def quiesce(self) -> None:
        """Nothing runs in the background."""

    def sync_note(self) -> None:
        """An evaluation sees the parameters that training takes its steps at: nothing to add."""

    def finish(self) -> None:
        """Nothing to finish: the model always holds the committed parameters."""

    def close(self) -> None:
        pass
