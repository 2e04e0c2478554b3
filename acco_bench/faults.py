"""``acco-bench faults``: a fault drill under torchrun's elastic agent.

    acco-bench faults --workers 2 --faults 10 --out outputs/bench/faults

One fixed-batch job (acco, ``train.accumulate_while_waiting=false``, the tiny model on the synthetic
corpus, a checkpoint every ``--save-step`` updates, ``train.resume_from_checkpoint=auto``) runs
twice with the same seed, both times as ``python -m torch.distributed.run --standalone
--nproc-per-node N ... -m acco.cli ...``:

1. uninterrupted (``--max-restarts 0``): the reference, and the update times the fault moments are
   drawn against;
2. under faults (``--max-restarts K+1``): the drill signals one worker of every start of the group
   (an *attempt*, torchrun's ``TORCHELASTIC_RESTART_COUNT``), K times, then lets the last attempt
   finish. Each fault's rank and moment come from a seeded RNG (``--seed``):

   - ``kill-warm-start``: SIGKILL right after the group starts training, before its first update
     (the first fault always: the job's first start);
   - ``kill``: SIGKILL at a random moment: in a random update 1..2 save intervals after the
     attempt's resume point, at a random fraction of an update's time after the previous one;
   - ``term-save``: SIGTERM while a checkpoint is being written (its ``checkpoint-N.tmp`` folder
     exists): the worker finishes the update in flight, checkpoints and exits 75, which torchrun
     counts as a failure (the path a preemption of one worker takes);
   - ``host-crash``: the host loses power, as ``kill`` once two checkpoints verify: every worker
     is frozen (SIGSTOP: nothing more reaches the disk), the newest checkpoint's last written
     file (meta.json) is cut to half its size, as a page cache that never reached the disk leaves
     it, and every worker is SIGKILLed; the next start skips that checkpoint, says so, and
     resumes from the one before (the agent, which a real host crash takes too, stands in for
     the scheduler that restarts the job).

The signals come from outside the workers: the drill finds them as the agent's child processes
(their ``RANK`` and ``TORCHELASTIC_RESTART_COUNT`` read from ``/proc/PID/environ``) and follows
them through the files the job writes: each rank's ``workers/rank{r}.jsonl`` (a line per update,
only lines written since the attempt started count), rank 0's TensorBoard file (made just before
training starts; its name holds the pid), the ``checkpoint-N.tmp`` folders. Every wait is on a
file, a line or a process exit, with ``--timeout``; the only sleeps are the random moments
themselves.

Per fault: the update reached before the fault, the update the next attempt resumed from (the
newest complete checkpoint), work lost (their difference, in updates), seconds from the signal to
the group gone, to the next group's start and to its first new update. At the end: whether every
fault was survived (the job finished, exit 0, after a restart per fault and no other), and whether
the final parameters equal the uninterrupted run's bit for bit: the saved model (safetensors) and
every rank's master shard in the final checkpoint (all of its tensors are compared and reported).

torch 2.13's agent keeps one TCPStore for all attempts (``TORCHELASTIC_USE_AGENT_STORE``), and a
restarted group's gloo rendezvous can read the addresses the previous attempt left there (pytorch
issue 135712), acco's store waits the previous attempt's keys: the drill runs torchrun's c10d
rendezvous (``--standalone``) with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per
attempt, hosted by rank 0) unless ``--shared-store`` is given (docs/checkpoints.md, "Restarts").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from acco_bench import BenchError
from acco_bench.fault_job import (
    POLL_S,
    AttemptEnded,
    Job,
    OtherLoad,
    crash_host,
    metrics,
    newest_checkpoint,
    running,
    whole_checkpoints,
)
from acco_bench.fault_plan import (
    KINDS,
    SIGNALS,
    DrillSettings,
    job_env,
    plan_faults,
    torchrun_command,
)
from acco_bench.fault_results import compare_runs, markdown, passed, summarize, worker_exit_codes

_SAVE_POLL_S = 0.001  # while it waits for a save to begin (a tiny model's save takes milliseconds)


def run_straight(s: DrillSettings, run_dir: Path, cache_dir: Path, log_path: Path) -> dict:
    cmd = torchrun_command(s, 0, run_dir, cache_dir)
    job = Job(cmd, job_env(s), run_dir, log_path, s.workers)
    start, load = time.monotonic(), OtherLoad()
    try:
        rc = job.finish(s.timeout_s + 10 * s.budget_updates)
    finally:
        job.stop()
    if rc != 0:
        raise BenchError(f"the uninterrupted run failed (exit {rc}); see {log_path}\n{job.tail()}")
    train = [x for x in metrics(run_dir) if x["type"] == "train"]
    steps = [b["wall_time"] - a["wall_time"] for a, b in zip(train, train[1:])]
    return {"command": cmd, "wall_s": round(time.monotonic() - start, 2), "other_cpu_cores": load.cores(),
            "updates": train[-1]["step"],
            "update_s": statistics.median(steps), "first_update_s": train[0]["wall_time"]}



@dataclass
class _Attempt:
    number: int
    pids: dict[int, int]  # rank -> pid
    since_ns: int  # wall clock when the drill first saw all its workers
    seen_at: float  # the same, monotonic
    resumed_from: int
    first_update_at: float | None = None
    training_at: float | None = None  # rank 0's TensorBoard file appeared: training starts
    fault: dict | None = None
    notes: list[str] = field(default_factory=list)


def run_faulted(s: DrillSettings, plan: list[dict], run_dir: Path, cache_dir: Path, log_path: Path,
                update_s: float, first_update_s: float, log=print) -> dict:
    """The job under the planned faults; returns {"command", "wall_s", "attempts", "faults", "unplanned"}."""
    cmd = torchrun_command(s, s.faults + 1, run_dir, cache_dir)
    job = Job(cmd, job_env(s), run_dir, log_path, s.workers)
    start, load = time.monotonic(), OtherLoad()
    faults: list[dict] = []
    unplanned: list[dict] = []
    attempts: list[_Attempt] = []
    pending = list(plan)
    try:
        last_number = -1
        while True:
            a = _next_attempt(job, s, last_number)
            last_number = a.number
            attempts.append(a)
            prev = faults[-1] if faults and "next_resumed_from" not in faults[-1] else None
            if prev is not None:  # the group the previous fault brought down is back
                prev.update(
                    next_resumed_from=a.resumed_from,
                    lost_updates=prev["reached"] - a.resumed_from,
                    restart_s=round(a.seen_at - prev["_at"], 3),
                )
            try:
                if not pending:  # the last attempt: it runs to the end of the budget
                    _track(
                        job,
                        a,
                        s,
                        "the last attempt's first update",
                        lambda a=a: a.first_update_at,
                        None,
                        prev,
                    )
                    break
                fault = dict(pending[0], attempt=a.number, resumed_from=a.resumed_from)
                _inject(job, a, s, fault, update_s, first_update_s, prev)
                pending.pop(0)
                faults.append(fault)
                log(f"[acco-bench] fault {len(faults)}/{s.faults}: {fault['signal']} to rank {fault['rank']} "
                    f"(attempt {a.number}, {fault['during']}); the group ended at update {fault['reached']}, "
                    f"{fault['down_s']:.1f} s after it")
            except AttemptEnded as e:
                unplanned.append({"attempt": a.number, "resumed_from": a.resumed_from, "while": str(e)})
                log(
                    f"[acco-bench] attempt {a.number} ended without a fault of the drill (while waiting for "
                    f"{e})"
                )
        rc = job.finish(s.timeout_s + 10 * s.budget_updates)
        if prev is not None and prev.get("recover_s") is None and attempts[-1].first_update_at is not None:
            prev["recover_s"] = round(attempts[-1].first_update_at - prev["_at"], 3)
    finally:
        job.stop()
    exit_codes = worker_exit_codes(log_path)
    for fault in faults:
        # the agent logs the exit code of the worker that failed first (the others it stops itself)
        fault["worker_exit_codes"] = {
            r: exit_codes[pid] for r, pid in fault.pop("_pids").items() if pid in exit_codes
        }
        fault.pop("_at", None)
    text = log_path.read_text(errors="replace")
    return {
        "command": cmd,
        "exit_code": rc,
        "wall_s": round(time.monotonic() - start, 2),
        "other_cpu_cores": load.cores(),
        "attempts": len(attempts),
        "faults": faults,
        "unplanned": unplanned,
        "resumes": {
            "exact": text.count("resuming exactly from"),
            "resharded": text.count(", resharded to "),
            "stopped_on_signal_lines": len(re.findall(r"^acco: stopped on ", text, re.M)),
        },
    }


def _next_attempt(job: Job, s: DrillSettings, after: int) -> _Attempt:
    def group():
        found = job.workers()
        attempts = {a for _, a in found.values()}
        if len(found) == s.workers and len(attempts) == 1 and min(attempts) > after:
            return found
        return None

    found = job.wait(f"the workers of attempt {after + 1}", group, s.timeout_s)
    now_ns, now = time.time_ns(), time.monotonic()
    # The old group has exited (the agent waits for that): the newest complete checkpoint is the one
    # every new worker resumes from.
    return _Attempt(
        number=next(iter(found.values()))[1],
        pids={r: p for r, (p, _) in found.items()},
        since_ns=now_ns,
        seen_at=now,
        resumed_from=newest_checkpoint(job.run_dir),
    )


def _track(
    job: Job, a: _Attempt, s: DrillSettings, what: str, check, poll_s: float | None, prev: dict | None
):
    """Wait for check(), noting meanwhile the attempt's start of training and first update (the
    previous fault's recovery)."""
    tb_pattern = f"events.out.tfevents.*.{a.pids[0]}.*"

    def observe():
        now = time.monotonic()
        if a.training_at is None and any((job.run_dir / "tensorboard").glob(tb_pattern)):
            a.training_at = now
            if prev is not None:
                prev["training_s"] = round(now - prev["_at"], 3)
        if a.first_update_at is None:
            step = job.newest_step(a.since_ns)
            if step is not None and step > a.resumed_from:
                a.first_update_at = now
                if prev is not None:
                    prev["recover_s"] = round(now - prev["_at"], 3)
        return check()

    return job.wait(what, observe, s.timeout_s, poll_s or POLL_S, pids=list(a.pids.values()))


def _inject(job: Job, a: _Attempt, s: DrillSettings, fault: dict, update_s: float, first_update_s: float,
            prev: dict | None) -> None:
    kind, rank = fault["kind"], fault["rank"]
    if kind == "kill-warm-start":
        _track(job, a, s, f"attempt {a.number}'s start of training", lambda: a.training_at, None, prev)
        time.sleep(fault["phase"] * first_update_s)  # the moment: a random fraction of the warm start
    elif kind in ("kill", "host-crash"):
        target = a.resumed_from + fault["after_updates"]
        # a host crash costs the newest checkpoint: it waits for one before it to fall back to
        least = 2 if kind == "host-crash" else 0
        _track(job, a, s, f"update {target}" + (" and two whole checkpoints" if least else ""),
               lambda: (job.newest_step(a.since_ns) or 0) >= target and len(whole_checkpoints(job.run_dir))
               >= least, None, prev)  # fmt: skip
        time.sleep(fault["phase"] * update_s)  # the moment: a random fraction of the next update
    else:  # term-save: the nth save after the resume point, as soon as its .tmp folder exists
        step = (a.resumed_from // s.save_step + fault["nth_save"]) * s.save_step
        tmp = job.run_dir / f"checkpoint-{step}.tmp"

        def saving():
            # this attempt's save, not the debris of an earlier attempt's; or, should the drill have
            # missed the whole save between two looks, the checkpoint it made
            for folder in (tmp, job.run_dir / f"checkpoint-{step}"):
                with contextlib.suppress(OSError):
                    if folder.stat().st_ctime_ns >= a.since_ns:
                        return True
            return False

        _track(job, a, s, f"the save of checkpoint-{step}", saving, _SAVE_POLL_S, prev)
    fault["_at"] = time.monotonic()
    if kind == "host-crash":
        fault["truncated"] = crash_host(job.run_dir, list(a.pids.values()))
    else:
        os.kill(a.pids[rank], SIGNALS[kind])
    reached = job.newest_step(a.since_ns)
    fault["fired_at_update"] = reached if reached is not None else a.resumed_from
    if kind == "term-save":
        landed = tmp.exists()
        fault["during"] = f"the save of checkpoint-{step}" + ("" if landed else " (it had just completed)")
        fault["in_save"] = landed
    elif kind == "kill-warm-start":
        fault["in_warm_start"] = reached is None or reached <= a.resumed_from
        fault["during"] = (
            "the warm start" if fault["in_warm_start"] else f"update {reached + 1} (after the warm start)"
        )
    else:
        fault["during"] = f"update {fault['fired_at_update'] + 1}"
        if kind == "host-crash":
            fault["during"] += f"; {fault['truncated']}"
    fault["_pids"] = dict(a.pids)
    job.wait(f"attempt {a.number}'s workers to exit", lambda: not any(running(p) for p in a.pids.values()),
             s.timeout_s)
    fault["down_s"] = round(time.monotonic() - fault["_at"], 3)
    reached = job.newest_step(a.since_ns)
    fault["reached"] = reached if reached is not None else a.resumed_from


# --------------------------------------------------------------------------------------------
# the drill, its report


def run_drill(s: DrillSettings, out: Path, log=print) -> dict:
    """The uninterrupted run, the run under faults, the comparison; writes out/bench.json and bench.md."""
    s.validate()
    if not Path("/proc/self/task").is_dir():
        raise BenchError("the fault drill finds the workers through /proc (Linux only)")
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    for name in ("straight", "faulted"):
        if (out / name).exists():  # a run appends to its metrics and resumes its checkpoints: start clean
            import shutil

            shutil.rmtree(out / name)
    plan = plan_faults(s)
    from acco_bench.cluster import machine_description

    bench = {
        "command": command_line(s, out),
        "config": {
            **asdict(s),
            "budget_updates": s.budget_updates,
            "kinds": KINDS,
            "store": "shared agent store (torch's default)"
            if s.shared_store
            else "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store per attempt",
        },
        "machine": machine_description(),
        "plan": plan,
    }
    try:
        log(f"[acco-bench] faults: the uninterrupted run ({s.workers} workers, {s.budget_updates} updates)")
        straight = run_straight(s, out / "straight", cache, out / "straight.log")
        bench["straight"] = straight
        log(
            f"[acco-bench] uninterrupted: {straight['wall_s']:.1f} s, {straight['update_s']:.3f} s per "
            f"update; now {s.faults} faults"
        )
        faulted = run_faulted(
            s,
            plan,
            out / "faulted",
            cache,
            out / "faulted.log",
            straight["update_s"],
            straight["first_update_s"],
            log,
        )
        bench["faulted"] = faulted
        bench["comparison"] = compare_runs(out / "straight", out / "faulted")
        bench["summary"] = summarize(bench)
    except BenchError as e:
        bench["error"] = str(e)
        raise
    finally:
        (out / "bench.json").write_text(json.dumps(bench, indent=2, default=str) + "\n")
        (out / "bench.md").write_text(markdown(bench))
    return bench


def command_line(s: DrillSettings, out: Path) -> str:
    d = DrillSettings()
    flags = [
        f"--workers {s.workers}",
        f"--faults {s.faults}",
        f"--seed {s.seed}",
        f"--save-step {s.save_step}",
    ]
    flags += [f"--model {s.model}"] if s.model != d.model else []
    flags += [f"--grad-accum {s.grad_accum}"] if s.grad_accum != d.grad_accum else []
    flags += ["--shared-store"] if s.shared_store else []
    flags += [f"--override {shlex.quote(x)}" for x in s.extra]
    return " ".join(["acco-bench faults", *flags, f"--out {shlex.quote(str(out))}"])


# --------------------------------------------------------------------------------------------
# the subcommand


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DrillSettings()
    p.add_argument(
        "--workers", type=int, default=d.workers, help="local workers under torchrun (2-4 on a small machine)"
    )
    p.add_argument(
        "--faults", type=int, default=d.faults, help="faults to inject, one per start of the group"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="the drill's RNG (which rank, which moment)")
    p.add_argument(
        "--save-step",
        type=int,
        default=d.save_step,
        help="train.save_step: a checkpoint every that many updates",
    )
    p.add_argument("--model", default=d.model, help="model config name (acco/conf/model)")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="train.n_grad_accumulation (micro-batches per worker per round)")
    p.add_argument(
        "--timeout", type=float, default=d.timeout_s, help="seconds the drill waits for any one event"
    )
    p.add_argument(
        "--shared-store",
        action="store_true",
        help="leave torchrun's agent store shared across restarts (torch's default; see the module doc)",
    )
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for the job (repeatable)")
    p.add_argument(
        "--out", default="outputs/bench/faults", help="output folder (default outputs/bench/faults)"
    )


def main(args: argparse.Namespace) -> int:
    s = DrillSettings(
        workers=args.workers,
        faults=args.faults,
        seed=args.seed,
        save_step=args.save_step,
        model=args.model,
        grad_accum=args.grad_accum,
        timeout_s=args.timeout,
        shared_store=args.shared_store,
        extra=tuple(args.override),
    )
    out = Path(args.out)
    bench = run_drill(s, out)
    print(f"[acco-bench] wrote {out}/bench.json and bench.md")
    print((out / "bench.md").read_text())
    return 0 if passed(bench) else 1
