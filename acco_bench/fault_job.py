"""``acco-bench faults``' view of the job it signals: torchrun started in its own session, the
workers found among the agent's children (with their RANK and restart count), their progress lines
and the newest checkpoint, read from files; and the CPU other processes use meanwhile."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from acco_bench import BenchError
from acco_bench.workers import busy_cpu_s

POLL_S = 0.01  # how often the drill looks at the job's processes and files

class AttemptEnded(Exception):
    """The attempt's workers all exited before the drill signalled one (a failure of its own)."""


def children(pid: int) -> list[int]:
    found = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(x) for x in f.read().split()]
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (the agent reaps its workers on its next monitor tick)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def last_step(path: Path, since_ns: int) -> int | None:
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
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def workers(self) -> dict[int, tuple[int, int]]:
        """rank -> (pid, attempt) of the agent's running workers."""
        found = {}
        for pid in children(self.proc.pid):
            env = environ(pid)
            if "RANK" in env and running(pid):
                found[int(env["RANK"])] = (pid, int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
        return found

    def newest_step(self, since_ns: int) -> int | None:
        steps = [last_step(self.run_dir / "workers" / f"rank{r}.jsonl", since_ns) for r in range(self.n)]
        steps = [x for x in steps if x is not None]
        return max(steps) if steps else None

    def wait(self, what: str, check, timeout_s: float, poll_s: float = POLL_S, pids: list[int] | None = None):
        """check()'s first true value; BenchError when torchrun exits or `timeout_s` passes first,
        AttemptEnded when every one of `pids` has exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = check()
            if value:
                return value
            if self.proc.poll() is not None:
                raise BenchError(
                    f"torchrun exited with code {self.proc.returncode} while the drill waited for "
                    f"{what}; see {self.log_path}\n{self.tail()}"
                )
            if pids is not None and not any(running(p) for p in pids):
                raise AttemptEnded(what)
            if time.monotonic() > deadline:
                raise BenchError(f"waited {timeout_s:.0f} s for {what}; see {self.log_path}\n{self.tail()}")
            time.sleep(poll_s)

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(
                f"torchrun did not finish within {timeout_s:.0f} s; see {self.log_path}"
            ) from None

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


class OtherLoad:
    """CPU cores used by other processes while a run ran: the machine's busy time minus this
    process's and its reaped children's (torchrun, and through it every worker it reaped)."""

    def __init__(self):
        self._busy, self.t0, self.busy0, self.times0 = busy_cpu_s, time.monotonic(), busy_cpu_s(), os.times()

    def cores(self) -> float | None:
        busy1, times1, wall = self._busy(), os.times(), time.monotonic() - self.t0
        if self.busy0 is None or busy1 is None or wall <= 0:
            return None
        ours = sum(b - a for a, b in zip(self.times0[:4], times1[:4]))
        return round(max(0.0, busy1 - self.busy0 - ours) / wall, 2)


def whole_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints that verify by meta.json and sizes (the CRCs are the job's to read), newest first."""
    from acco.engine import CheckpointError
    from acco.resume import verify
    from acco.run_folder import checkpoint_folders

    whole = []
    for folder in checkpoint_folders(run_dir):
        with contextlib.suppress(CheckpointError):
            verify(folder, crc=False)
            whole.append(folder)
    return whole


def newest_checkpoint(run_dir: Path) -> int:
    """The step of the newest checkpoint that verifies (0: none), the one a new group resumes from:
    a host crash's truncated file makes the job fall back past one."""
    from acco.run_folder import step_of

    whole = whole_checkpoints(run_dir)
    return step_of(whole[0]) if whole else 0


def crash_host(run_dir: Path, pids: list[int]) -> str:
    """A host losing power, as its disk sees it: every worker frozen (nothing more is written), the
    newest whole checkpoint's last written file cut to half its size (the part a page cache kept),
    every worker killed. Returns what was cut."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGSTOP)
    folder = whole_checkpoints(run_dir)[0]
    files = [p for p in folder.rglob("*") if p.is_file()]
    last = max(files, key=lambda p: (p.stat().st_mtime_ns, p.name == "meta.json"))  # meta.json: written last
    size = last.stat().st_size
    os.truncate(last, size // 2)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return f"{folder.name}/{last.relative_to(folder)} cut to {size // 2} of {size} bytes"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
