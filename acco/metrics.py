"""What a run writes: metrics.jsonl, per-worker timers, TensorBoard, summary.json, plots, progress.

Rank 0 writes the run's files; every rank writes its own timers to workers/rank{r}.jsonl so that
benchmarks can see each worker's compute and idle time.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from acco.engine import UpdateRecord
from acco.engine.device import device_ops


class RunLog:
    def __init__(
        self, output_dir: str, rank: int, world_size: int, tokens_per_micro_batch: int, log_every: int = 10,
        resume_step: int | None = None,
    ):
        self.dir = Path(output_dir)
        self.rank, self.world_size = rank, world_size
        self.tokens_per_micro_batch = tokens_per_micro_batch
        self.log_every = log_every
        self.records: list[UpdateRecord] = []
        self.evals: list[dict] = []
        self._unprinted: tuple | None = None  # the last update, if log_every left its line out
        workers = self.dir / "workers"
        workers.mkdir(parents=True, exist_ok=True)
        # A resumed run continues its files from the checkpoint's update (a crash may have left
        # lines after it); a new run starts them afresh.
        mode = "w" if resume_step is None else "a"
        worker_file = workers / f"rank{rank}.jsonl"
        if resume_step is not None:
            _truncate_after(worker_file, resume_step)
        self._worker = open(worker_file, mode)
        self._metrics = self._tb = self._bar = None
        if rank == 0:
            if resume_step is not None:
                _truncate_after(self.dir / "metrics.jsonl", resume_step)
            self._metrics = open(self.dir / "metrics.jsonl", mode)
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        self._t0 = time.perf_counter()

    # ---- per update / per evaluation -------------------------------------------------------

    def start_progress(
        self, budget_micro_batches: int, committed_micro_batches: int = 0, sync_note: str | None = None
    ):
        """A tqdm bar on rank 0 in a terminal; plain log lines every `log_every` updates otherwise,
        after one saying that training has begun (a first update may take minutes on a CPU), and
        what evaluations see where that is not what training computes at (the engine's `sync_note`)."""
        if self.rank != 0:
            return
        if not sys.stderr.isatty():
            since = f" from {committed_micro_batches:,}" if committed_micro_batches else ""
            print(f"training: {self.world_size} worker(s), {self.tokens_per_micro_batch:,} tokens per "
                  f"micro-batch, a budget of {budget_micro_batches:,} micro-batches{since}; a line every "
                  f"{self.log_every} updates", flush=True)
        if sync_note:
            print(f"evaluations see the {sync_note}", flush=True)
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=budget_micro_batches, initial=committed_micro_batches, unit="mb", dynamic_ncols=True,
                desc="train",
            )

    def update(self, record: UpdateRecord) -> dict:
        self.records.append(record)
        done = record.committed_micro_batches  # the x axis: micro-batches over all workers
        line = {
            "type": "train",
            "step": record.step,
            "samples": done,  # metrics.jsonl's key, as the reference repo's users read it
            "tokens": done * self.tokens_per_micro_batch,  # positions, padding included
            "target_tokens": record.weight,  # this update's tokens with a label, all workers
            "loss": record.loss if math.isfinite(record.loss) else None,  # (JSON has no NaN)
            "lr": record.lr,
            # before clipping, as Hugging Face's Trainer logs it
            "grad_norm": record.grad_norm if math.isfinite(record.grad_norm) else None,
            "wall_time": record.wall_time,
            "compute_s": record.compute_s,
            "wait_s": record.wait_s,
            "comm_s": record.comm_s,
            "micro_batches": record.micro_batches,
            "estimate_micro_batches": record.estimate_micro_batches,  # acco's split (None: other methods)
        }
        self._worker.write(
            json.dumps({k: line[k] for k in ("step", "compute_s", "wait_s", "comm_s", "micro_batches",
                                                 "estimate_micro_batches")}) + "\n"
        )
        self._worker.flush()
        if self.rank != 0:
            return line
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()  # a killed run keeps its lines up to the last update
        for key in ("loss", "lr", "compute_s", "wait_s", "comm_s"):
            self._tb.add_scalar(f"train/{key}", getattr(record, key), done)
        if line["grad_norm"] is not None:  # None with clipping off
            self._tb.add_scalar("train/grad_norm", record.grad_norm, done)
        if record.estimate_micro_batches is not None:
            self._tb.add_scalar("train/estimate_micro_batches", record.estimate_micro_batches, done)
        tokens_per_s = line["tokens"] / max(record.wall_time, 1e-9)
        self._tb.add_scalar("train/tokens_per_s", tokens_per_s, done)
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
            self._bar.set_postfix(loss=f"{record.loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        elif record.step % self.log_every == 0 or record.step == 1:
            self._print(record, tokens_per_s)
        else:
            self._unprinted = (record, tokens_per_s)  # printed at the end if it stays the last
        return line

    def print_pending(self) -> None:
        """The latest update's line, if log_step left it out: before its evaluation's and its
        checkpoint's lines (the console's order is the run's), and at the end of the run."""
        if self._unprinted is not None:
            self._print(*self._unprinted)

    def _print(self, record: UpdateRecord, tokens_per_s: float) -> None:
        self._unprinted = None
        print(
            f"step {record.step:>6}  samples {record.committed_micro_batches:>8}  loss {record.loss:.4f}  "
            f"lr {record.lr:.2e}  "
            + (f"grad_norm {record.grad_norm:.3f}  " if math.isfinite(record.grad_norm) else "")
            + f"tokens/s {tokens_per_s:,.0f}",
            flush=True,
        )

    def evaluation(self, step: int, samples: int, eval_loss: float, eval_s: float | None = None,
                   sync_note: str | None = None) -> None:
        """``eval_s``: the evaluation's own seconds, inside the wall_time of later updates;
        ``sync_note``: what the evaluation saw (the engine's: diloco's global parameters), on its line."""
        entry = {"type": "eval", "step": step, "samples": samples, "eval_loss": eval_loss}
        if eval_s is not None:
            entry["eval_s"] = eval_s
        self.evals.append(entry)
        if self.rank != 0:
            return
        self._metrics.write(json.dumps(entry) + "\n")
        self._metrics.flush()
        self._tb.add_scalar("eval/loss", eval_loss, samples)
        message = f"eval  step {step}  samples {samples}  eval_loss {eval_loss:.4f}"
        if sync_note:
            message += f"  ({sync_note})"
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    # ---- end of run ----------------------------------------------------------------------

    def summary(self, method: str, device, extra: dict | None = None) -> dict:
        self.print_pending()  # the last update's line, whatever log_step
        recs = self.records
        wall = recs[-1].wall_time if recs else 0.0
        samples = recs[-1].committed_micro_batches if recs else 0
        tokens = samples * self.tokens_per_micro_batch
        # Steady state: leave out the first update (warm start, allocator, first collectives).
        steady = recs[1:] if len(recs) > 1 else recs
        steps = [b.wall_time - a.wall_time for a, b in zip(recs, recs[1:])] or [wall]

        def median(values):
            values = list(values)
            return statistics.median(values) if values else 0.0

        compute, comm = median(r.compute_s for r in steady), median(r.comm_s for r in steady)
        step_time = median(steps)
        by_worker = [
            statistics.fmean(r.micro_batches[w] for r in steady) if steady else 0.0
            for w in range(self.world_size)
        ]
        summary = {
            "method": method,
            "world_size": self.world_size,
            "updates": len(recs),
            "samples": samples,
            "tokens": tokens,
            "final_loss": recs[-1].loss if recs else math.nan,
            "final_eval_loss": self.evals[-1]["eval_loss"] if self.evals else None,
            "wall_time_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            # Tokens that carry a label, per second, from the end of the first update: the
            # figure to compare for fine-tuning, where padding and prompts fill the blocks.
            "target_tokens_per_s": sum(r.weight for r in recs[1:]) / (recs[-1].wall_time - recs[0].wall_time)
            if len(recs) > 1 and recs[-1].wall_time > recs[0].wall_time
            else 0.0,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "step_time_s": step_time,
            "compute_s_per_update": compute,
            "wait_s_per_update": median(r.wait_s for r in steady),
            "comm_s_per_update": comm,
            # How close the run came to the overlap bound max(compute, comm) per update.
            "overlap_efficiency": max(compute, comm) / step_time if step_time > 0 else 0.0,
            "idle_fraction": sum(r.wait_s for r in recs) / wall if wall > 0 else 0.0,
            # peak_gpu_mem_mb (the allocator's, on a GPU) or peak_rss_mb (the process's, on the CPU)
            **dict([device_ops(device).peak_memory()]),
            "micro_batches_per_update_by_worker": by_worker,
        }
        summary.update(extra or {})
        return summary

    def close(self, summary: dict | None = None) -> None:
        self._worker.close()
        if self.rank != 0:
            return
        if self._bar is not None:
            self._bar.close()
        self._metrics.close()
        self._tb.close()
        if summary is not None:
            tmp = self.dir / "summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
            os.replace(tmp, self.dir / "summary.json")
            plot_runs({summary["method"]: self.dir}, self.dir / "loss.png")


def _entries(path: Path) -> list[tuple[str, dict]]:
    """(line, entry) of each whole line of a JSON-lines log; a last line without its newline is a
    write that a kill or a full disk cut short, and is left out."""
    lines = path.read_text().splitlines(keepends=True)
    entries = []
    for number, line in enumerate(lines, 1):
        if not line.endswith("\n"):
            break
        try:
            entries.append((line, json.loads(line)))
        except ValueError as e:
            raise ValueError(f"{path}: line {number} is not a JSON record ({e})") from None
    return entries


def _truncate_after(path: Path, step: int) -> None:
    if path.exists():
        path.write_text("".join(line for line, entry in _entries(path) if entry["step"] <= step))


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    train, evals = [], []
    for _, entry in _entries(Path(run_dir) / "metrics.jsonl"):
        (train if entry["type"] == "train" else evals).append(entry)
    return train, evals


def plot_runs(runs: dict[str, str | Path], path: str | Path) -> None:
    """Loss against samples and against wall-clock time, one curve per run (eval loss dashed, marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run_dir in runs.items():
        train, evals = read_metrics(run_dir)
        if not train:
            continue
        line = by_samples.plot(
            [t["samples"] for t in train], [t["loss"] for t in train], label=f"{name} train"
        )[0]
        by_time.plot(
            [t["wall_time"] for t in train],
            [t["loss"] for t in train],
            color=line.get_color(),
            label=f"{name} train",
        )
        if evals:
            steps = {t["step"]: t["wall_time"] for t in train}
            # dashed, each evaluation marked: a single one (a short run) is a point, not nothing
            by_samples.plot(
                [e["samples"] for e in evals],
                [e["eval_loss"] for e in evals],
                "o--",
                markersize=3,
                color=line.get_color(),
                label=f"{name} eval",
            )
            timed = [(steps[e["step"]], e["eval_loss"]) for e in evals if e["step"] in steps]
            if timed:
                by_time.plot(*zip(*timed), "o--", markersize=3, color=line.get_color(), label=f"{name} eval")
    by_samples.set_xlabel("micro-batches (all workers)")
    by_time.set_xlabel("wall-clock time (s)")
    for ax in (by_samples, by_time):
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
