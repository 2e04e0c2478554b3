"""What a fault drill (faults.py, ``acco-bench faults``) runs: its settings, the faults it plans,
and the torchrun command and environment of the job it starts."""

from __future__ import annotations

import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from acco.launch.local import GO_FD_ENV
from acco_bench import BenchError

KINDS = {
    "kill-warm-start": "SIGKILL right after the group starts training, before its first update",
    "kill": "SIGKILL at a random moment: a random update 1..2 save intervals after the resume point, "
    "a random fraction of an update later",
    "term-save": "SIGTERM while a checkpoint is written (its checkpoint-N.tmp exists): the worker "
    "checkpoints and exits 75",
    "host-crash": "the host loses power at a random moment once two checkpoints verify: every worker "
    "frozen (SIGSTOP), the newest checkpoint's last written file cut to half its size (the page "
    "cache lost), then every worker SIGKILLed; the next start falls back to the checkpoint before",
}
SIGNALS = {"kill-warm-start": signal.SIGKILL, "kill": signal.SIGKILL, "term-save": signal.SIGTERM,
           "host-crash": signal.SIGKILL}  # fmt: skip
# The kinds after the first fault (always a kill in the warm start): one of each at least, then drawn.
WEIGHTS = {"kill": 0.45, "term-save": 0.25, "host-crash": 0.15, "kill-warm-start": 0.15}
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
               GO_FD_ENV)  # fmt: skip


@dataclass(frozen=True)
class DrillSettings:
    workers: int = 2
    faults: int = 10
    seed: int = 0  # the drill's RNG: which rank, which moment (the job's own seed is train.seed)
    save_step: int = 2
    model: str = "tiny"
    # train.n_grad_accumulation: micro-batches per worker per round (acco: 2 rounds per update)
    grad_accum: int = 2
    timeout_s: float = 300.0  # the longest wait for any one event of the job
    shared_store: bool = False
    extra: tuple[str, ...] = ()

    def validate(self) -> None:
        if not 2 <= self.workers <= 16:
            raise BenchError("--workers must be 2..16 (the drill kills one worker of a group)")
        if self.faults < 1:
            raise BenchError("--faults must be >= 1")
        if self.save_step < 1 or self.grad_accum < 1:
            raise BenchError("--save-step and --grad-accum must be >= 1")
        from acco.config import InputError, compose

        try:  # the job's config, --override included, as main.py checks it: one line before any start
            compose(self.overrides(Path("outputs"), Path("outputs")))
        except InputError as e:
            raise BenchError(f"the job cannot run: {e}") from None

    @property
    def budget_updates(self) -> int:
        """Enough updates that the job cannot finish before its last fault: an attempt advances the
        resume point by at most 2 save intervals and 2 updates (a SIGTERM stops the update after the
        save it landed in, or the next; a host crash moves it back), and the last attempt still has
        2 save intervals to run."""
        return self.faults * (2 * self.save_step + 2) + 2 * self.save_step

    def overrides(self, run_dir: Path, cache_dir: Path) -> list[str]:
        per_update = self.workers * 2 * self.grad_accum  # acco: two rounds of grad_accum per worker
        updates = self.budget_updates
        return [
            f"model={self.model}",
            "data=synthetic",
            "train=acco",
            f"train.n_grad_accumulation={self.grad_accum}",
            f"train.nb_steps_tot={updates * per_update}",
            "train.accumulate_while_waiting=false",
            f"train.save_step={self.save_step}",
            "train.save_total_limit=2",
            "train.resume_from_checkpoint=auto",
            f"train.eval_step={updates}",
            f"train.output_dir={run_dir}",
            f"train.cache_dir={cache_dir}",
            *self.extra,
        ]


def plan_faults(s: DrillSettings) -> list[dict]:
    """The K faults, from the seeded RNG: kind, rank and moment of each (one per attempt, in order)."""
    rng = random.Random(s.seed)
    rest = s.faults - 1
    kinds = ["kill", "term-save", "host-crash", "kill-warm-start"][:rest]  # one of each, when there is room
    kinds += rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()), k=rest - len(kinds))
    rng.shuffle(kinds)
    plan = []
    for kind in ["kill-warm-start", *kinds]:
        rank = "all" if kind == "host-crash" else rng.randrange(s.workers)  # a host crash takes every worker
        fault = {"kind": kind, "signal": SIGNALS[kind].name, "rank": rank}
        if kind in ("kill", "host-crash"):
            fault.update(after_updates=rng.randint(1, 2 * s.save_step), phase=round(rng.random(), 4))
        elif kind == "term-save":
            fault.update(nth_save=rng.randint(1, 2))
        else:
            fault.update(phase=round(rng.random(), 4))
        plan.append(fault)
    return plan


# --------------------------------------------------------------------------------------------
# the job as the drill sees it: torchrun, the agent's workers, the files they write


def torchrun_command(s: DrillSettings, restarts: int, run_dir: Path, cache_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(s.workers),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.1",
        "-m",
        "acco.cli",
        *s.overrides(run_dir, cache_dir),
    ]


def job_env(s: DrillSettings) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // s.workers))
    if not s.shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


# --------------------------------------------------------------------------------------------
# the two runs
