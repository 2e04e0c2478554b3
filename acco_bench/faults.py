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
     counts as a failure (the path a preemption of one worker takes).

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
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from acco_bench import BenchError

KINDS = {
    "kill-warm-start": "SIGKILL right after the group starts training, before its first update",
    "kill": "SIGKILL at a random moment: a random update 1..2 save intervals after the resume point, "
            "a random fraction of an update later",
    "term-save": "SIGTERM while a checkpoint is written (its checkpoint-N.tmp exists): the worker checkpoints "
                 "and exits 75",
}
SIGNALS = {"kill-warm-start": signal.SIGKILL, "kill": signal.SIGKILL, "term-save": signal.SIGTERM}
# The kinds after the first fault (always a kill in the warm start): one of each at least, then drawn.
WEIGHTS = {"kill": 0.6, "term-save": 0.25, "kill-warm-start": 0.15}
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ACCO_JOB_CONFIG")  # fmt: skip
_POLL_S = 0.01  # how often the drill looks at the job's processes and files
_SAVE_POLL_S = 0.001  # while it waits for a save to begin (a tiny model's save takes milliseconds)


@dataclass(frozen=True)
class DrillSettings:
    workers: int = 2
    faults: int = 10
    seed: int = 0  # the drill's RNG: which rank, which moment (the job's own seed is train.seed)
    save_step: int = 2
    model: str = "tiny"
    grad_accum: int = 2  # train.n_grad_accumulation: micro-batches per worker per round (acco: 2 rounds per update)
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

    @property
    def budget_updates(self) -> int:
        """Enough updates that the job cannot finish before its last fault: an attempt advances the
        resume point by at most 2 save intervals and 2 updates (a SIGTERM stops the update after the
        save it landed in, or the next), and the last attempt still has 2 save intervals to run."""
        return self.faults * (2 * self.save_step + 2) + 2 * self.save_step

    def overrides(self, run_dir: Path, cache_dir: Path) -> list[str]:
        per_update = self.workers * 2 * self.grad_accum  # acco: two rounds of grad_accum per worker
        updates = self.budget_updates
        return [f"model={self.model}", "data=synthetic", "train=acco", f"train.n_grad_accumulation={self.grad_accum}",
                f"train.nb_steps_tot={updates * per_update}", "train.accumulate_while_waiting=false",
                f"train.save_step={self.save_step}", "train.save_total_limit=2", "train.resume_from_checkpoint=auto",
                f"train.eval_step={updates}", f"train.output_dir={run_dir}", f"train.cache_dir={cache_dir}",
                *self.extra]  # fmt: skip


def plan_faults(s: DrillSettings) -> list[dict]:
    """The K faults, from the seeded RNG: kind, rank and moment of each (one per attempt, in order)."""
    rng = random.Random(s.seed)
    rest = s.faults - 1
    kinds = ["kill", "term-save", "kill-warm-start"][:rest]  # one of each, when there is room
    kinds += rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()), k=rest - len(kinds))
    rng.shuffle(kinds)
    plan = []
    for kind in ["kill-warm-start", *kinds]:
        fault = {"kind": kind, "signal": SIGNALS[kind].name, "rank": rng.randrange(s.workers)}
        if kind == "kill":
            fault.update(after_updates=rng.randint(1, 2 * s.save_step), phase=round(rng.random(), 4))
        elif kind == "term-save":
            fault.update(nth_save=rng.randint(1, 2))
        else:
            fault.update(phase=round(rng.random(), 4))
        plan.append(fault)
    return plan


# --------------------------------------------------------------------------------------------
# the job as the drill sees it: torchrun, the agent's workers, the files they write


class _AttemptEnded(Exception):
    """The attempt's workers all exited before the drill signalled one (a failure of its own)."""


def _children(pid: int) -> list[int]:
    found = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(x) for x in f.read().split()]
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (the agent reaps its workers on its next monitor tick)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _last_step(path: Path, since_ns: int) -> int | None:
    """The step of the last whole line of a per-update jsonl file, if the file was written since
    `since_ns` (wall clock, ns): a restarted attempt truncates it to its resume point first."""
    try:
        st = path.stat()
        if st.st_mtime_ns < since_ns:
            return None
        with open(path, "rb") as f:
            f.seek(max(0, st.st_size - 4096))
            tail = f.read()
    except OSError:
        return None
    lines = tail.split(b"\n")[:-1]  # the part after the last newline is not a whole line yet
    for line in reversed(lines):
        with contextlib.suppress(ValueError, KeyError):
            return int(json.loads(line)["step"])
    return None


class Job:
    """One torchrun job: the agent, its workers by attempt, the files they write."""

    def __init__(self, cmd: list[str], env: dict, run_dir: Path, log_path: Path, workers: int):
        self.cmd, self.run_dir, self.log_path, self.n = cmd, run_dir, log_path, workers
        self._log = open(log_path, "w")
        self._log.write("$ " + " ".join(shlex.quote(a) for a in cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def workers(self) -> dict[int, tuple[int, int]]:
        """rank -> (pid, attempt) of the agent's running workers."""
        found = {}
        for pid in _children(self.proc.pid):
            env = _environ(pid)
            if "RANK" in env and _running(pid):
                found[int(env["RANK"])] = (pid, int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
        return found

    def newest_step(self, since_ns: int) -> int | None:
        steps = [_last_step(self.run_dir / "workers" / f"rank{r}.jsonl", since_ns) for r in range(self.n)]
        steps = [x for x in steps if x is not None]
        return max(steps) if steps else None

    def wait(self, what: str, check, timeout_s: float, poll_s: float = _POLL_S, pids: list[int] | None = None):
        """check()'s first true value; BenchError when torchrun exits or `timeout_s` passes first,
        _AttemptEnded when every one of `pids` has exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = check()
            if value:
                return value
            if self.proc.poll() is not None:
                raise BenchError(f"torchrun exited with code {self.proc.returncode} while the drill waited for "
                                 f"{what}; see {self.log_path}\n{self.tail()}")
            if pids is not None and not any(_running(p) for p in pids):
                raise _AttemptEnded(what)
            if time.monotonic() > deadline:
                raise BenchError(f"waited {timeout_s:.0f} s for {what}; see {self.log_path}\n{self.tail()}")
            time.sleep(poll_s)

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(f"torchrun did not finish within {timeout_s:.0f} s; see {self.log_path}") from None

    def stop(self) -> None:
        """torchrun's whole process group (it started the workers in it): SIGTERM, SIGKILL after 10 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def tail(self, n: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


class _OtherLoad:
    """CPU cores used by other processes while a run ran: the machine's busy time minus this
    process's and its reaped children's (torchrun, and through it every worker it reaped)."""

    def __init__(self):
        from acco_bench.cluster import _busy_cpu_s

        self._busy, self.t0, self.busy0, self.times0 = _busy_cpu_s, time.monotonic(), _busy_cpu_s(), os.times()

    def cores(self) -> float | None:
        busy1, times1, wall = self._busy(), os.times(), time.monotonic() - self.t0
        if self.busy0 is None or busy1 is None or wall <= 0:
            return None
        ours = sum(b - a for a, b in zip(self.times0[:4], times1[:4]))
        return round(max(0.0, busy1 - self.busy0 - ours) / wall, 2)


def _newest_checkpoint(run_dir: Path) -> int:
    from acco import checkpoint

    found = checkpoint.list_checkpoints(run_dir)
    return int(found[-1].name.split("-")[1]) if found else 0


def torchrun_command(s: DrillSettings, restarts: int, run_dir: Path, cache_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(s.workers),
            "--max-restarts", str(restarts), "--monitor-interval", "0.1", "-m", "acco.cli",
            *s.overrides(run_dir, cache_dir)]  # fmt: skip


def job_env(s: DrillSettings) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}  # fmt: skip
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // s.workers))
    if not s.shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


# --------------------------------------------------------------------------------------------
# the two runs


def run_straight(s: DrillSettings, run_dir: Path, cache_dir: Path, log_path: Path) -> dict:
    cmd = torchrun_command(s, 0, run_dir, cache_dir)
    job = Job(cmd, job_env(s), run_dir, log_path, s.workers)
    start, load = time.monotonic(), _OtherLoad()
    try:
        rc = job.finish(s.timeout_s + 10 * s.budget_updates)
    finally:
        job.stop()
    if rc != 0:
        raise BenchError(f"the uninterrupted run failed (exit {rc}); see {log_path}\n{job.tail()}")
    train = [x for x in _metrics(run_dir) if x["type"] == "train"]
    steps = [b["wall_time"] - a["wall_time"] for a, b in zip(train, train[1:])]
    return {"command": cmd, "wall_s": round(time.monotonic() - start, 2), "other_cpu_cores": load.cores(),
            "updates": train[-1]["step"],
            "update_s": statistics.median(steps), "first_update_s": train[0]["wall_time"]}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


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
    start, load = time.monotonic(), _OtherLoad()
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
                prev.update(next_resumed_from=a.resumed_from, lost_updates=prev["reached"] - a.resumed_from,
                            restart_s=round(a.seen_at - prev["_at"], 3))  # fmt: skip
            try:
                if not pending:  # the last attempt: it runs to the end of the budget
                    _track(job, a, s, "the last attempt's first update", lambda a=a: a.first_update_at, None, prev)
                    break
                fault = dict(pending[0], attempt=a.number, resumed_from=a.resumed_from)
                _inject(job, a, s, fault, update_s, first_update_s, prev)
                pending.pop(0)
                faults.append(fault)
                log(f"[acco-bench] fault {len(faults)}/{s.faults}: {fault['signal']} to rank {fault['rank']} "
                    f"(attempt {a.number}, {fault['during']}); the group ended at update {fault['reached']}, "
                    f"{fault['down_s']:.1f} s after it")
            except _AttemptEnded as e:
                unplanned.append({"attempt": a.number, "resumed_from": a.resumed_from, "while": str(e)})
                log(f"[acco-bench] attempt {a.number} ended without a fault of the drill (while waiting for {e})")
        rc = job.finish(s.timeout_s + 10 * s.budget_updates)
        if prev is not None and prev.get("recover_s") is None and attempts[-1].first_update_at is not None:
            prev["recover_s"] = round(attempts[-1].first_update_at - prev["_at"], 3)
    finally:
        job.stop()
    exit_codes = _worker_exit_codes(log_path)
    for fault in faults:
        # the agent logs the exit code of the worker that failed first (the others it stops itself)
        fault["worker_exit_codes"] = {r: exit_codes[pid] for r, pid in fault.pop("_pids").items() if pid in exit_codes}
        fault.pop("_at", None)
    text = log_path.read_text(errors="replace")
    return {"command": cmd, "exit_code": rc, "wall_s": round(time.monotonic() - start, 2),
            "other_cpu_cores": load.cores(), "attempts": len(attempts), "faults": faults, "unplanned": unplanned,
            "resumes": {"exact": text.count("resuming exactly from"), "resharded": text.count(", resharded to "),
                        "stopped_on_signal_lines": len(re.findall(r"^acco: stopped on ", text, re.M))}}  # fmt: skip


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
    return _Attempt(number=next(iter(found.values()))[1], pids={r: p for r, (p, _) in found.items()}, since_ns=now_ns,
                    seen_at=now, resumed_from=_newest_checkpoint(job.run_dir))  # fmt: skip


def _track(job: Job, a: _Attempt, s: DrillSettings, what: str, check, poll_s: float | None, prev: dict | None):
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

    return job.wait(what, observe, s.timeout_s, poll_s or _POLL_S, pids=list(a.pids.values()))


def _inject(job: Job, a: _Attempt, s: DrillSettings, fault: dict, update_s: float, first_update_s: float,
            prev: dict | None) -> None:
    kind, rank = fault["kind"], fault["rank"]
    pid = a.pids[rank]
    if kind == "kill-warm-start":
        _track(job, a, s, f"attempt {a.number}'s start of training", lambda: a.training_at, None, prev)
        time.sleep(fault["phase"] * first_update_s)  # the moment: a random fraction of the warm start
    elif kind == "kill":
        target = a.resumed_from + fault["after_updates"]
        _track(job, a, s, f"update {target}", lambda: (job.newest_step(a.since_ns) or 0) >= target, None, prev)
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
    os.kill(pid, SIGNALS[kind])
    reached = job.newest_step(a.since_ns)
    fault["fired_at_update"] = reached if reached is not None else a.resumed_from
    if kind == "term-save":
        landed = tmp.exists()
        fault["during"] = f"the save of checkpoint-{step}" + ("" if landed else " (it had just completed)")
        fault["in_save"] = landed
    elif kind == "kill-warm-start":
        fault["in_warm_start"] = reached is None or reached <= a.resumed_from
        fault["during"] = "the warm start" if fault["in_warm_start"] else f"update {reached + 1} (after the warm start)"
    else:
        fault["during"] = f"update {fault['fired_at_update'] + 1}"
    fault["_pids"] = dict(a.pids)
    job.wait(f"attempt {a.number}'s workers to exit", lambda: not any(_running(p) for p in a.pids.values()),
             s.timeout_s)
    fault["down_s"] = round(time.monotonic() - fault["_at"], 3)
    reached = job.newest_step(a.since_ns)
    fault["reached"] = reached if reached is not None else a.resumed_from


_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)|exitcode\s*: (-?\d+) \(pid: (\d+)\)")


def _worker_exit_codes(log_path: Path) -> dict[int, int]:
    """pid -> exit code, from the agent's log lines (it logs a group's failures before restarting it)."""
    codes = {}
    for m in _EXIT.finditer(log_path.read_text(errors="replace")):
        code, pid = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
        codes[int(pid)] = int(code)
    return codes


# --------------------------------------------------------------------------------------------
# the comparison


def _bits_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.dtype.is_floating_point:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _tensors(state, name: str = ""):
    import torch

    if isinstance(state, torch.Tensor):
        yield name, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{name}/{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _tensors(v, f"{name}[{i}]")


def compare_runs(straight: Path, faulted: Path) -> dict:
    """The final state of the two runs, bit for bit: the saved model, every rank file's tensors of
    the final checkpoint (master shard, moments, accumulator, ...), and the logged losses."""
    from safetensors.torch import load_file

    from acco import checkpoint

    a_ck, b_ck = checkpoint.list_checkpoints(straight)[-1], checkpoint.list_checkpoints(faulted)[-1]
    out = {"straight_checkpoint": a_ck.name, "faulted_checkpoint": b_ck.name}
    a_model, b_model = load_file(straight / "model" / "model.safetensors"), load_file(faulted / "model" / "model.safetensors")
    out["model_bit_equal"] = a_model.keys() == b_model.keys() and all(_bits_equal(a_model[k], b_model[k]) for k in a_model)
    meta = checkpoint.load_meta(a_ck)
    world = int(meta["world_size"])
    differing, master, compared = [], True, 0
    for rank in range(world):
        a = dict(_tensors(checkpoint.load_worker(a_ck, rank, world)))
        b = dict(_tensors(checkpoint.load_worker(b_ck, rank, world)))
        for name in sorted(a.keys() | b.keys()):
            same = name in a and name in b and _bits_equal(a[name], b[name])
            compared += 1
            if not same:
                differing.append(f"rank{rank}{name}")
                master = master and name != "/engine/master"
    out.update(master_bit_equal=master and a_ck.name == b_ck.name, checkpoint_tensors_compared=compared,
               checkpoint_tensors_differing=differing)  # fmt: skip
    out["final_params_bit_equal"] = bool(out["model_bit_equal"] and out["master_bit_equal"])
    a_m, b_m = _metrics(straight), _metrics(faulted)
    losses = [{x["step"]: x.get("loss") for x in m if x["type"] == "train"} for m in (a_m, b_m)]
    evals = [[x["eval_loss"] for x in m if x["type"] == "eval"] for m in (a_m, b_m)]
    out.update(train_losses_equal=losses[0] == losses[1], eval_losses_equal=evals[0] == evals[1],
               final_eval_loss=evals[1][-1] if evals[1] else None, updates=max(losses[1]) if losses[1] else 0)  # fmt: skip
    return out


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

    bench = {"command": command_line(s, out),
             "config": {**asdict(s), "budget_updates": s.budget_updates, "kinds": KINDS,
                        "store": "shared agent store (torch's default)" if s.shared_store
                        else "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store per attempt"},
             "machine": machine_description(), "plan": plan}  # fmt: skip
    try:
        log(f"[acco-bench] faults: the uninterrupted run ({s.workers} workers, {s.budget_updates} updates)")
        straight = run_straight(s, out / "straight", cache, out / "straight.log")
        bench["straight"] = straight
        log(f"[acco-bench] uninterrupted: {straight['wall_s']:.1f} s, {straight['update_s']:.3f} s per update; "
            f"now {s.faults} faults")
        faulted = run_faulted(s, plan, out / "faulted", cache, out / "faulted.log", straight["update_s"],
                              straight["first_update_s"], log)  # fmt: skip
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
    flags = [f"--workers {s.workers}", f"--faults {s.faults}", f"--seed {s.seed}", f"--save-step {s.save_step}"]
    flags += [f"--model {s.model}"] if s.model != d.model else []
    flags += [f"--grad-accum {s.grad_accum}"] if s.grad_accum != d.grad_accum else []
    flags += ["--shared-store"] if s.shared_store else []
    flags += [f"--override {shlex.quote(x)}" for x in s.extra]
    return " ".join(["acco-bench faults", *flags, f"--out {shlex.quote(str(out))}"])


def summarize(bench: dict) -> dict:
    s = bench["config"]
    faulted, cmp_ = bench["faulted"], bench["comparison"]
    faults = faulted["faults"]
    finished = faulted["exit_code"] == 0
    for f in faults:
        f["survived"] = finished and "next_resumed_from" in f
    lost = [f["lost_updates"] for f in faults if "lost_updates" in f]
    recover = [f["recover_s"] for f in faults if f.get("recover_s") is not None]
    startup = [f["training_s"] - f["restart_s"] for f in faults if f.get("training_s") is not None]
    return {
        "faults_planned": s["faults"], "faults_injected": len(faults),
        "faults_survived": sum(f["survived"] for f in faults), "unplanned_failures": len(faulted["unplanned"]),
        "restarts": faulted["attempts"] - 1, "finished": finished,
        "lost_updates_max": max(lost) if lost else None, "lost_updates_total": sum(lost),
        "lost_updates_mean": round(statistics.mean(lost), 2) if lost else None,
        "at_most_one_save_interval_lost": bool(lost) and max(lost) <= s["save_step"],
        "recover_s_median": round(statistics.median(recover), 2) if recover else None,
        "recover_s_max": max(recover) if recover else None,
        "startup_s_median": round(statistics.median(startup), 2) if startup else None,
        "down_s_max": max(f["down_s"] for f in faults) if faults else None,
        "final_params_bit_equal": cmp_["final_params_bit_equal"],
        "all_checkpoint_tensors_bit_equal": not cmp_["checkpoint_tensors_differing"],
        "losses_equal": cmp_["train_losses_equal"] and cmp_["eval_losses_equal"],
        "overhead_s": round(faulted["wall_s"] - bench["straight"]["wall_s"], 1),
    }  # fmt: skip


def passed(bench: dict) -> bool:
    m = bench.get("summary") or {}
    return bool(m and m["finished"] and m["faults_survived"] == m["faults_planned"] and not m["unplanned_failures"]
                and m["final_params_bit_equal"] and m["at_most_one_save_interval_lost"])  # fmt: skip


def markdown(bench: dict) -> str:
    from acco_bench.report import fmt, md_table

    c = bench["config"]
    lines = [f"# acco-bench faults: {c['workers']} workers under torchrun, {c['faults']} faults", ""]
    if bench.get("command"):
        lines += [f"Command: `{bench['command']}`", ""]
    m = bench.get("machine") or {}
    lines += [f"Machine: {m.get('cpus')} CPUs ({m.get('cpu_model')}), torch {m.get('torch')}, gloo. Job: acco, "
              f"fixed batch, model {c['model']}, synthetic data, a checkpoint every {c['save_step']} updates, "
              f"{c['budget_updates']} updates; {c['store']}.", ""]  # fmt: skip
    if bench.get("error"):
        lines += ["**The drill failed:**", "", "```", bench["error"], "```", ""]
    faulted = bench.get("faulted")
    if faulted:
        rows = [[i + 1, f["kind"], f["signal"], f["rank"], f["attempt"], f["during"], f["resumed_from"], f["reached"],
                 f.get("next_resumed_from", "-"), f.get("lost_updates", "-"), fmt(f["down_s"], 1),
                 fmt(f.get("restart_s"), 1), fmt(f.get("training_s"), 1), fmt(f.get("recover_s"), 1),
                 ", ".join(f"rank {r}: {v}" for r, v in f.get("worker_exit_codes", {}).items())]
                for i, f in enumerate(faulted["faults"])]  # fmt: skip
        lines += [md_table(["#", "fault", "signal", "rank", "attempt", "during", "resumed from", "reached",
                            "next resumed from", "lost (updates)", "down s", "restart s", "training s", "recover s",
                            "first exit"], rows), ""]  # fmt: skip
        lines += ["*reached*: the newest update any worker logged before the group ended; *lost* = reached minus "
                  "the update the next attempt resumed from; *down*: from the signal to the last worker's exit; "
                  "*restart*: to the next group's workers; *training*: to its start of training (rank 0's "
                  "TensorBoard file: the workers have imported, loaded the data and the model); *recover*: to its "
                  "first new update (none when that group was itself killed in its warm start); *first exit*: the "
                  "exit code of the worker that failed first, as torchrun logs it (75: checkpointed on the "
                  "signal).", ""]  # fmt: skip
        if faulted["unplanned"]:
            lines += [f"Attempts that ended without a fault of the drill: {faulted['unplanned']}", ""]
    s = bench.get("summary")
    if s:
        st = bench["straight"]
        lines += [
            f"- Faults injected {s['faults_injected']} of {s['faults_planned']}, survived {s['faults_survived']}; "
            f"restarts {s['restarts']}, failures not injected by the drill {s['unplanned_failures']}; the job "
            + ("finished (exit 0)." if s["finished"] else "did **not** finish."),
            f"- Work lost per fault: at most {s['lost_updates_max']} updates (mean {s['lost_updates_mean']}, "
            f"{s['lost_updates_total']} in all; a save every {c['save_step']}): "
            + ("at most one save interval." if s["at_most_one_save_interval_lost"] else "**more than one save interval**."),
            f"- Time to recover (signal to the first new update): median {fmt(s['recover_s_median'], 1)} s, max "
            f"{fmt(s['recover_s_max'], 1)} s, of which the new group's start-up (its workers started to its start "
            f"of training) median {fmt(s.get('startup_s_median'), 1)} s; the group was down within "
            f"{fmt(s['down_s_max'], 1)} s of a signal at most.",
            f"- Final parameters bit-equal to the uninterrupted run's: **{'yes' if s['final_params_bit_equal'] else 'no'}** "
            f"(the saved model and every rank's master shard); every tensor of the final checkpoint "
            f"({bench['comparison']['checkpoint_tensors_compared']}): "
            f"{'equal' if s['all_checkpoint_tensors_bit_equal'] else 'differ: ' + ', '.join(bench['comparison']['checkpoint_tensors_differing'])}; "
            f"losses and evaluations: {'equal' if s['losses_equal'] else 'differ'}.",
            f"- Wall clock: uninterrupted {st['wall_s']:.0f} s ({st['update_s']:.2f} s per update), under faults "
            f"{faulted['wall_s']:.0f} s; other processes used {fmt(st.get('other_cpu_cores'), 2)} and "
            f"{fmt(faulted.get('other_cpu_cores'), 2)} CPU cores meanwhile (of {m.get('cpus')}).",
            "",
        ]  # fmt: skip
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the subcommand


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DrillSettings()
    p.add_argument("--workers", type=int, default=d.workers, help="local workers under torchrun (2-4 on a small machine)")
    p.add_argument("--faults", type=int, default=d.faults, help="faults to inject, one per start of the group")
    p.add_argument("--seed", type=int, default=d.seed, help="the drill's RNG (which rank, which moment)")
    p.add_argument("--save-step", type=int, default=d.save_step, help="train.save_step: a checkpoint every that many updates")
    p.add_argument("--model", default=d.model, help="model config name (acco/conf/model)")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="train.n_grad_accumulation (micro-batches per worker per round)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds the drill waits for any one event")
    p.add_argument("--shared-store", action="store_true",
                   help="leave torchrun's agent store shared across restarts (torch's default; see the module doc)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for the job (repeatable)")
    p.add_argument("--out", default="outputs/bench/faults", help="output folder (default outputs/bench/faults)")


def main(args: argparse.Namespace) -> int:
    s = DrillSettings(workers=args.workers, faults=args.faults, seed=args.seed, save_step=args.save_step,
                      model=args.model, grad_accum=args.grad_accum, timeout_s=args.timeout,
                      shared_store=args.shared_store, extra=tuple(args.override))  # fmt: skip
    out = Path(args.out)
    bench = run_drill(s, out)
    print(f"[acco-bench] wrote {out}/bench.json and bench.md")
    print((out / "bench.md").read_text())
    return 0 if passed(bench) else 1
