"""Sharded AdamW on this worker's fp32 master shard (commit and trial steps) and the LR schedule.

The commit step is torch's own AdamW on one flat fp32 tensor. The trial step runs the very same
kernel on copies, chunk by chunk through a small fixed workspace, writing the would-be parameters
into an output buffer and leaving the master shard, the moments, the step count and the schedule
exactly as they were: ACCO's estimate round needs no copy of the optimizer state, and its estimate
is bit for bit what a commit would make.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from acco.engine.config import EngineConfig

# Elements per chunk of the trial step: its workspace is three fp32 chunks (the master's and the
# moments' copies), 48 MiB at most, and never more than 4 bytes per shard element. A smaller chunk
# keeps the workspace in the cache: alone on a 2-core EPYC (32 MiB L3), on a 29.4M-element shard,
# 2^18 took 78-87 ms against 115-131, but in training (4 workers on its 2 cores, the comm thread
# beside the compute) no faster (BENCHMARKS-history.md, "From 10: the round's bytes"). On a GPU
# each chunk is three kernel launches: acco-bench gpu's micro-benchmark times 2^18 to 2^22.
TRIAL_CHUNK = 1 << 22


def learning_rate(cfg: EngineConfig, micro_batches_before: int, batch: int) -> float:
    """LR of an update that consumes `batch` micro-batches after `micro_batches_before` were committed.

    Advanced by micro-batches, not by updates, so every method and every worker speed follows the
    same schedule as a function of data seen: `micro_batches_before`, `batch`, `cfg.warmup` and
    `cfg.nb_steps_tot` all count micro-batches over all workers (`cfg.n_warmup_steps`, which
    counts updates, plays no part here). Warm-up counts this update's batch (the first update
    already moves); the decay starts from the micro-batches before it.
    """
    lr = cfg.learning_rate
    if cfg.warmup > 0 and micro_batches_before < cfg.warmup:
        return lr * min(1.0, (micro_batches_before + batch) / cfg.warmup)
    if cfg.scheduler_name == "constant":
        return lr
    span = max(1, cfg.nb_steps_tot - cfg.warmup)
    progress = min(1.0, max(0.0, (micro_batches_before - cfg.warmup) / span))
    if cfg.scheduler_name == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


class ShardedAdamW:
    """AdamW over one flat fp32 master shard: weight decay on its first `decayed` elements (the
    matrices and embeddings, FlatParams puts them first), none on the rest (biases, norms)."""

    def __init__(
        self, master: torch.Tensor, cfg: EngineConfig, decayed: int | None = None, trial: bool = True,
        chunk: int | None = None,
    ):
        self.master = master
        self.beta1, self.beta2 = cfg.adam_beta1, cfg.adam_beta2
        self.eps, self.weight_decay = cfg.adam_eps, cfg.weight_decay
        self.decayed = master.numel() if decayed is None else decayed
        # The moments are two flat buffers; each param group's state tensors are views of them.
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        ranges = [(slice(0, self.decayed), self.weight_decay), (slice(self.decayed, master.numel()), 0.0)]
        ranges = [(r, wd) for r, wd in ranges if r.stop > r.start]
        self.views = [(master[r], r) for r, _ in ranges]
        # torch's fused AdamW: one kernel per group over the shard, on CPU too (11x the
        # single-tensor path on 5M parameters, measured), and no temporaries.
        self.opt = torch.optim.AdamW(
            [{"params": [view], "weight_decay": wd} for (view, _), (_, wd) in zip(self.views, ranges)],
            lr=cfg.learning_rate,
            betas=(self.beta1, self.beta2),
            eps=self.eps,
            fused=True,
        )
        # Moments exist from the start (torch creates them lazily) so trial steps can read them
        # and checkpoints always have them.
        for view, r in self.views:
            self.opt.state[view] = {
                "step": torch.zeros((), dtype=torch.float32, device=master.device),
                "exp_avg": self.exp_avg[r],
                "exp_avg_sq": self.exp_avg_sq[r],
            }
        # trial-step workspace, allocated once, for acco only (the one method with trial steps):
        # one chunk (`chunk` elements, else TRIAL_CHUNK) of the master and of each moment, and the
        # step count the kernel reads
        self._chunk = max(1, min(chunk or TRIAL_CHUNK, -(-master.numel() // 3)))
        self.trial_workspace = master.new_empty(3 * self._chunk) if trial else None
        self._trial_step = master.new_zeros(()) if trial else None
        # What the gradient is divided by inside the kernel (torch's AMP grad_scale argument, which
        # the kernel divides by and writes the quotient back to the gradient): the round's global
        # weight and clipping, applied without a pass over the shard of their own.
        self._divisor = master.new_ones(())
        self._steps = 0  # host copy of the step count: a trial step reads it without a device sync

    @property
    def step_count(self) -> int:
        return self._steps

    def restore_step(self, step: int) -> None:
        """Set the step count (resume, or a restored snapshot of the state tensors)."""
        for group in self.opt.param_groups:
            self.opt.state[group["params"][0]]["step"].fill_(step)
        self._steps = step

    def commit(self, grad: torch.Tensor, lr: float, divisor: float = 1.0) -> None:
        """One real AdamW step on the gradient `grad / divisor` (left in `grad`): master, moments
        and step count advance."""
        self.opt.grad_scale = self._divide_by(divisor)  # read by torch's fused step, as AMP sets it
        for view, r in self.views:
            view.grad = grad[r]
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        for view, _ in self.views:
            view.grad = None
        self._steps += 1

    def trial(self, grad: torch.Tensor, lr: float, divisor: float = 1.0, *, out: torch.Tensor | None = None,
              each: Callable[[slice, torch.Tensor], None] | None = None) -> None:
        """Write what commit(grad, lr, divisor) would make of the master shard into `out`, or hand
        it chunk by chunk to `each(chunk's slice of the shard, its new values)` while they are
        still in the workspace (and in the cache); change no state but `grad`, which is left
        divided as commit leaves it.

        torch's fused AdamW kernel, commit's own, runs on copies of the master and the moments one
        chunk at a time, so the result is bit for bit a commit's. Three kernels a chunk (copy in,
        AdamW, copy out) move at most 62 bytes an element with a bf16 `out` (the kernel writes the
        divided gradient back; the division then needs no pass of its own), where AdamW written
        as eight tensor operations moved 96 (2.2x faster on one CPU thread); a workspace that stays
        in the cache saves most of the copies' share. `out` may be `grad` itself (each chunk is
        written after the kernel has read it).
        """
        self._trial_step.fill_(self._steps + 1)  # the kernel reads the step it takes
        grad_scale = self._divide_by(divisor)
        n = self._chunk
        p, m, v = self.trial_workspace.view(3, n)
        for (_, r), group in zip(self.views, self.opt.param_groups):
            for start in range(r.start, r.stop, n):
                c = slice(start, min(start + n, r.stop))
                k = c.stop - c.start
                sources = [self.master[c], self.exp_avg[c], self.exp_avg_sq[c]]
                torch._foreach_copy_([p[:k], m[:k], v[:k]], sources)
                torch._fused_adamw_(
                    [p[:k]], [grad[c]], [m[:k]], [v[:k]], [], [self._trial_step], lr=lr, beta1=self.beta1,
                    beta2=self.beta2, weight_decay=group["weight_decay"], eps=self.eps, amsgrad=False,
                    maximize=False, grad_scale=grad_scale,
                )
                if each is None:
                    out[c].copy_(p[:k])
                else:
                    each(c, p[:k])

    def _divide_by(self, divisor: float) -> torch.Tensor | None:
        """The kernel's grad_scale for `divisor`: None for 1 (then it writes nothing back)."""
        if divisor == 1.0:
            return None
        self._divisor.fill_(divisor)
        return self._divisor

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {
            "master": self.master,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "step": self.opt.state[self.opt.param_groups[0]["params"][0]]["step"],
        }
