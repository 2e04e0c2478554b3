"""One method's training workers on the emulated hosts (or loopback), and the CPU load beside them.

`run_workers` starts ``python -m acco.cli train=METHOD ...`` once per worker with torchrun's
variables set (`layout_env`: the workers of a host share its namespace, ranked host by host),
bounds the run in time and stops every process of a failed one; `LoadMeter` records
how busy the machine's cores were meanwhile (other processes' load moves a benchmark's figures).
The cluster benchmark, the race, the convergence runs and the comm-share calibration all start
their workers here.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from acco_bench import BenchError
from acco_bench.network import Network
from acco_bench.settings import BenchSettings

# The worker command; ACCO_BENCH_WORKER (a shell-quoted command prefix) replaces it, e.g. to time
# a development build of the trainer.
WORKER_ENV = "ACCO_BENCH_WORKER"


def worker_command() -> list[str]:
    """The command every worker runs (its Hydra overrides follow): ``python -m acco.cli``, or
    ``$ACCO_BENCH_WORKER``."""
    custom = os.environ.get(WORKER_ENV)
    if custom:
        return shlex.split(custom)
    return [sys.executable, "-m", "acco.cli"]


def check_worker_available() -> None:
    """Fail with one clear line when the training CLI is not importable."""
    if os.environ.get(WORKER_ENV):
        return
    import importlib.util

    if importlib.util.find_spec("acco.cli") is None:
        raise BenchError(
            "the training CLI (acco.cli) is not installed: acco-bench drives `python -m acco.cli`"
        )


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(proc.pid, sig)


def stop_processes(procs: Sequence[subprocess.Popen], grace_s: float = 3.0) -> None:
    """SIGTERM every worker's process group, SIGKILL what is left after ``grace_s``."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            _kill_group(p, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine spent in user + nice + system mode so far (Linux)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    user, nice, system = (int(x) for x in fields[1:4])
    return (user + nice + system) / _HZ


def _stat_cpu_s(text: str) -> float:
    """User + system CPU seconds from a /proc ``stat`` line (a process's or one thread's)."""
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process, all its threads (Linux)."""
    try:
        return _stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


# A worker thread's role from its OS name (acco/engine/background.py names the comm thread; gloo
# names its transport's event loop); the main thread trains.
THREAD_ROLES = {"acco-comm": "comm", "gloo_tcp_loop": "transport"}
THREADS_EVERY_S = 1.0  # per-thread CPU is read this often (a file per thread), process CPU every poll


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of process ``pid``: its role (``training``: the main thread, ``comm``,
    ``transport``, ``other``) and its user + system CPU seconds so far (Linux; {} elsewhere)."""
    threads = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        role = "training" if int(tid) == pid else THREAD_ROLES.get(name, "other")
        threads[int(tid)] = (role, _stat_cpu_s(text))
    return threads


class LoadMeter:
    """How much CPU something other than the benchmark's workers used while they ran.

    The machine's busy time (user + nice + system, from /proc/stat) minus what the workers and
    this process used: on a shared machine, other jobs distort the timings, and this says by
    how much (in cores, averaged over the run)."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.busy0 = busy_cpu_s()
        self.self0 = sum(os.times()[:2])
        self.workers: dict[int, float] = {}
        self.network: dict[int, tuple[float, float]] = {}  # pid -> (first, last) CPU seconds seen
        self.threads: dict[tuple[int, int], tuple[str, float]] = {}  # (pid, tid) -> role, CPU seconds
        self._threads_at = self.t0

    def sample(self, procs: Sequence[subprocess.Popen], network: Sequence[subprocess.Popen] = ()) -> None:
        """``network``: long-lived processes of the emulated network (the delay line), counted
        apart from the workers and from the other load."""
        for p in procs:
            cpu = _proc_cpu_s(p.pid)
            if cpu is not None:
                self.workers[p.pid] = max(cpu, self.workers.get(p.pid, 0.0))
        if time.monotonic() >= self._threads_at:
            self._threads_at = time.monotonic() + THREADS_EVERY_S
            for p in procs:
                self.threads.update({(p.pid, tid): v for tid, v in thread_cpu_s(p.pid).items()})
        for p in network:
            cpu = _proc_cpu_s(p.pid)
            if cpu is not None:
                self.network[p.pid] = (self.network.get(p.pid, (cpu, cpu))[0], cpu)

    def result(self) -> dict:
        wall = time.monotonic() - self.t0
        busy1 = busy_cpu_s()
        if self.busy0 is None or busy1 is None or wall <= 0:
            return {}
        mine = sum(self.workers.values()) + sum(os.times()[:2]) - self.self0
        network = sum(last - first for first, last in self.network.values())
        foreign = max(0.0, (busy1 - self.busy0) - mine - network)
        out = {"workers_cpu_cores": mine / wall, "other_cpu_cores": foreign / wall, "cpus": os.cpu_count()}
        if self.network:
            out["network_cpu_cores"] = network / wall
        if self.threads:  # the workers' CPU seconds by thread role, summed over the workers
            roles: dict[str, float] = {}
            for role, cpu in self.threads.values():
                roles[role] = roles.get(role, 0.0) + cpu
            out["worker_cpu_s"] = {**roles, "network": network}
        return out


def layout_env(rank: int, nodes: int, workers_per_node: int) -> dict[str, str]:
    """torchrun's variables for worker ``rank`` of ``nodes`` x ``workers_per_node``, ranked node by
    node (rank = node * S + local, torchrun's order), and ``ACCO_WORKERS_PER_NODE``, which the engine
    reads first for the two-level rounds' layout (acco/engine/nodes.py)."""
    if not 0 <= rank < nodes * workers_per_node:
        raise ValueError(f"rank {rank} is not one of the {nodes} x {workers_per_node} workers")
    node, local = divmod(rank, workers_per_node)
    return {"RANK": str(rank), "WORLD_SIZE": str(nodes * workers_per_node), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(workers_per_node), "GROUP_RANK": str(node),
            "ACCO_WORKERS_PER_NODE": str(workers_per_node)}


def run_workers(settings: BenchSettings, method: str, out_dir: Path, net: Network,
                load: LoadMeter | None = None) -> float:
    """Run one method's workers to completion; returns the wall time. Raises BenchError on a
    failure (first failing rank, with its log's tail) or on the timeout; no worker survives.
    ``load``, when given, is sampled while the workers run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    addr, port = net.master()
    threads = str(settings.worker_threads())
    procs: list[subprocess.Popen] = []
    files = []
    start = time.monotonic()
    try:
        for rank in range(settings.workers):
            env = dict(os.environ)
            env.update(layout_env(rank, settings.hosts, settings.workers_per_node))
            env.update(MASTER_ADDR=addr, MASTER_PORT=str(port), OMP_NUM_THREADS=threads,
                       MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
            argv = [*worker_command(), *settings.overrides(method, out_dir, rank)]
            if rank == 0:
                (out_dir / "command.txt").write_text(
                    " ".join(shlex.quote(a) for a in argv) + "\n")
            log = open(logs / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed below)
            files.append(log)
            procs.append(net.popen(rank, argv, env, log, sched_batch=settings.sched == "batch"))
        deadline = start + settings.timeout_s
        while True:
            if load is not None:
                load.sample(procs, net.network_procs())
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                stop_processes(procs)
                raise BenchError(
                    f"{method}: rank {rank} exited with code {code}; its log "
                    f"({logs / f'rank{rank}.log'}) ends with:\n{_tail(logs / f'rank{rank}.log')}"
                )
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                stop_processes(procs)
                raise BenchError(f"{method}: timed out after {settings.timeout_s:.0f} s (--timeout); "
                                 f"workers killed; logs in {logs}")
            time.sleep(0.1)
        return time.monotonic() - start
    finally:
        stop_processes(procs)
        for f in files:
            f.close()


# --------------------------------------------------------------------------------------------
# one benchmark: every method on one network
