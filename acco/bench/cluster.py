"""``acco-bench cluster`` and ``acco-bench sweep``: the methods side by side on an emulated cluster.

Each of N emulated hosts (:class:`~acco.bench.netns.EmulatedCluster`: a network namespace whose
link is shaped with ``tc``) runs one training worker, ``python -m acco.cli train=METHOD ...`` with
torchrun's variables set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` = host 0's address, ...), so
the gradients and parameters of every comm round cross the shaped links as real gloo traffic. The
methods run one after the other on one cluster with identical settings (model, data, seed,
samples, effective batch), each bounded in time; every worker writes its own per-update timers
(``workers/rank{r}.jsonl``) and rank 0 the run's ``metrics.jsonl`` and ``summary.json``, from
which :func:`method_metrics` derives the figures of ``bench.json``.

Where namespaces cannot be made (not root, no iproute2, no shaping qdisc) the harness says why and
stops, unless ``--loopback`` asks for unshaped local processes on 127.0.0.1. Kernels without
``netem`` shape the rate with ``tbf`` and add the latency with :mod:`acco.bench.delayline` (the
outputs say which).

Effective batch: ``grad_accum`` is the number of micro-batches per worker and per optimizer update
for ddp, torch-ddp, dpu and wp; acco runs ``grad_accum / 2`` per round, since one acco update takes
two rounds (the paper's Table 5: acco 2 against ddp 4).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from acco.bench import netns

ALL_METHODS = ("ddp", "torch-ddp", "dpu", "wp", "acco")
# Variants run as methods of their own, side by side: name -> (train config, its overrides).
VARIANTS = {
    "acco-paper": ("acco", ("train.acco_estimate=paper",)),
    "acco-lean": ("acco", ("train.acco_estimate=lean",)),
}
KNOWN_METHODS = ALL_METHODS + tuple(VARIANTS)


def base_method(method: str) -> str:
    """The train config a method or variant name runs (acco-lean: acco)."""
    return VARIANTS[method][0] if method in VARIANTS else method

COMM_MEASURES = {
    "ddp": "time inside the comm round (reduce-scatter, optimizer step, all-gather), computation waiting",
    "torch-ddp": "ZeroRedundancyOptimizer's step and parameter broadcast only: DDP's bucketed all-reduce "
                 "runs inside backward and is counted in compute_s_per_update",
    "acco": "the comm thread's busy time for both rounds of an update (estimate and update)",
    "overlapped": "the comm thread's busy time for the update's round",
}
OVERLAPPED = ("dpu", "wp", "acco")
# A comm-bound default (measured on the 2-core VM, see BENCHMARKS.md): GPT-Neo "tiny" widened to
# 1.1M parameters, micro-batches of 8 x 96 tokens, 4 per worker per update, 100 Mbit/s links:
# ddp spends about 40% of its step in its comm round there.
DEFAULT_MODEL_SIZE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4}
# The worker command; ACCO_BENCH_WORKER (a shell-quoted command prefix) replaces it, e.g. to time
# a development build of the trainer.
WORKER_ENV = "ACCO_BENCH_WORKER"


class BenchError(RuntimeError):
    """A benchmark that cannot run as asked (no namespaces, a worker failed, a timeout)."""


@dataclass
class BenchSettings:
    """Everything that defines one run of the methods; identical for every method of the run."""

    hosts: int = 2
    bandwidth: str | None = "100mbit"  # None: unshaped
    latency: str | None = "1ms"  # one-way, per link (netem, or tbf + the delay line)
    methods: tuple[str, ...] = ALL_METHODS
    model: str = "tiny"
    model_size: dict = field(default_factory=lambda: dict(DEFAULT_MODEL_SIZE))
    nb_steps_tot: int = 200  # micro-batches over all workers, whatever the method
    grad_accum: int = 4  # micro-batches per worker per update (ddp); acco runs grad_accum // 2 per round
    batch_size: int = 8
    max_length: int = 96
    seed: int = 0
    slow_worker: tuple[int, float] | None = None  # (rank, factor)
    accumulate_while_waiting: bool = False  # acco (and dpu/wp): keep computing while a round runs
    mixed_precision: bool = False  # bf16 is slower than fp32 on this CPU
    loopback: bool = False
    timeout_s: float = 600.0  # per method
    repeats: int = 1  # every method runs that many times, interleaved; the median run is reported
    retry_disturbed: int = 0  # run a method again (that many times at most) when other processes loaded the CPU
    # "normal": workers under the default scheduler; "batch": under SCHED_BATCH, so that gloo's
    # I/O thread, woken thousands of times a second by a shaped link, does not preempt the compute
    # thread on every wake-up (see BENCHMARKS.md: the emulation's cores are shared with the network)
    sched: str = "normal"
    threads: int | None = None  # torch threads per worker (default: cores // hosts)
    data: str = "synthetic"
    data_path: str | None = None
    tokenizer: str | None = None
    eval_step: int | None = None  # None: only the final evaluation matters (a large value)
    extra: tuple[str, ...] = ()  # more Hydra overrides, for every method and rank

    def validate(self) -> None:
        bad = [m for m in self.methods if m not in KNOWN_METHODS]
        if bad:
            raise BenchError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(KNOWN_METHODS)}")
        if not self.methods:
            raise BenchError("no method to run")
        if self.hosts < 1:
            raise BenchError("--hosts must be >= 1")
        if self.repeats < 1:
            raise BenchError("--repeats must be >= 1")
        if self.sched not in ("normal", "batch"):
            raise BenchError(f"--sched must be normal or batch, got {self.sched!r}")
        if self.sched == "batch" and not hasattr(os, "SCHED_BATCH"):
            raise BenchError("--sched batch needs Linux (SCHED_BATCH)")
        if self.grad_accum < 2 or self.grad_accum % 2:
            raise BenchError(
                f"--grad-accum must be even (got {self.grad_accum}): acco runs half of it per round, "
                "two rounds per update, to match the other methods' effective batch"
            )
        if self.slow_worker is not None:
            rank, factor = self.slow_worker
            if not 0 <= rank < self.hosts:
                raise BenchError(f"--slow-worker rank {rank} is not one of the {self.hosts} hosts")
            if factor < 1:
                raise BenchError(f"--slow-worker factor must be >= 1, got {factor}")
        if self.bandwidth is not None:
            try:
                netns.parse_rate(self.bandwidth)
            except ValueError as e:
                raise BenchError(str(e)) from e

    def grad_accum_for(self, method: str) -> int:
        return self.grad_accum // 2 if base_method(method) == "acco" else self.grad_accum

    def worker_threads(self) -> int:
        if self.threads:
            return self.threads
        return max(1, (os.cpu_count() or 1) // max(1, self.hosts))

    def overrides(self, method: str, out_dir: Path, rank: int) -> list[str]:
        """The Hydra overrides of one worker."""
        o = [
            f"train={base_method(method)}",
            *VARIANTS.get(method, (None, ()))[1],
            f"model={self.model}",
            f"data={self.data}",
            f"train.nb_steps_tot={self.nb_steps_tot}",
            f"train.output_dir={out_dir}",
            f"train.seed={self.seed}",
            "launch.nproc=1",
            f"train.n_grad_accumulation={self.grad_accum_for(method)}",
            f"train.batch_size={self.batch_size}",
            f"train.max_length={self.max_length}",
            f"train.accumulate_while_waiting={str(self.accumulate_while_waiting).lower()}",
            f"train.use_mixed_precision={str(self.mixed_precision).lower()}",
            f"train.eval_step={self.eval_step if self.eval_step else 10**9}",
            "train.save=false",
        ]
        o += [f"model.{k}={v}" for k, v in self.model_size.items()]
        if self.data_path:
            o.append(f"data.path={self.data_path}")
        if self.tokenizer:
            o.append(f"model.tokenizer={self.tokenizer}")
        if self.slow_worker is not None and self.slow_worker[0] == rank:
            o.append(f"train.slowdown={self.slow_worker[1]}")
        o += list(self.extra)
        return o

    def describe(self) -> dict:
        d = asdict(self)
        d["methods"] = list(self.methods)
        d["slow_worker"] = list(self.slow_worker) if self.slow_worker else None
        d["grad_accum_per_method"] = {m: self.grad_accum_for(m) for m in self.methods}
        d["worker_threads"] = self.worker_threads()
        return d


def worker_command() -> list[str]:
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
        raise BenchError("the training CLI (acco.cli) is not installed: acco-bench drives `python -m acco.cli`")


# --------------------------------------------------------------------------------------------
# the network


class Network:
    """Where the workers run: an :class:`EmulatedCluster` or local processes on 127.0.0.1."""

    def __init__(self, hosts: int, bandwidth: str | None, latency: str | None, loopback: bool):
        self.hosts = hosts
        self.cluster: netns.EmulatedCluster | None = None
        self._port = 29500
        if loopback:
            self.kind = "loopback"
            self.note = "local processes on 127.0.0.1, unshaped (--loopback)"
            self.bandwidth, self.latency, self.latency_emulated, self.shaper = None, None, False, None
            return
        reason = netns.netns_unavailable_reason()
        if reason is not None:
            raise BenchError(
                f"cannot emulate a cluster here: {reason} Run as root with iproute2 (ip, tc), "
                "or pass --loopback to run the workers unshaped on 127.0.0.1."
            )
        netns.cleanup_stale()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # said below, in the outputs
            self.cluster = netns.EmulatedCluster(hosts, bandwidth=bandwidth, latency=latency)
        self.kind = "netns"
        self.bandwidth, self.latency = bandwidth, latency
        self.shaper = self.cluster.shaper
        self.latency_emulated = self.cluster.latency_emulated
        joined = ("joined by TUN devices and a user-space delay line" if self.shaper == "tbf+delayline"
                  else "on a bridge")
        if bandwidth is None:
            self.note = f"{hosts} network namespaces {joined}, unshaped links"
        else:
            self.note = f"{hosts} network namespaces {joined}, each link shaped to {bandwidth} with tc tbf" \
                if self.shaper != "netem" else \
                f"{hosts} network namespaces {joined}, each link shaped to {bandwidth} with tc netem"
        if self.shaper == "tbf+delayline":
            self.note += f", one-way latency {latency} (no netem in this kernel)"
        elif self.shaper == "netem" and latency is not None:
            self.note += f", latency {latency}"
        if latency is not None and not self.latency_emulated:
            self.note += f"; latency {latency} NOT emulated (this kernel has no netem, only tbf)"
        elif latency is None and self.shaper == "tbf":
            self.note += "; no latency emulated (this kernel has no netem)"

    def network_procs(self) -> list[subprocess.Popen]:
        """Processes that carry the emulated network (the delay line), if any."""
        proc = self.cluster.delay_proc if self.cluster is not None else None
        return [proc] if proc is not None else []

    def describe(self) -> dict:
        return {"kind": self.kind, "bandwidth": self.bandwidth, "latency": self.latency,
                "latency_emulated": self.latency_emulated, "shaper": self.shaper, "note": self.note}

    def master(self) -> tuple[str, int]:
        if self.cluster is None:
            from acco.launch import free_port

            return "127.0.0.1", free_port()
        # Every namespace has its own port space; a fresh port per method avoids TIME_WAIT.
        self._port += 1
        return self.cluster.addr(0), self._port

    def popen(self, rank: int, argv: list[str], env: dict, log, sched_batch: bool = False) -> subprocess.Popen:
        kw = dict(env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                  start_new_session=True, preexec_fn=_preexec(sched_batch))
        if self.cluster is None:
            return subprocess.Popen(argv, **kw)
        return self.cluster.popen(rank, argv, **kw)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _preexec(sched_batch: bool):
    """preexec_fn for a worker: the kernel SIGKILLs it if the harness dies (Linux), so no orphan
    keeps a namespace alive or a core busy; with ``sched_batch`` the worker (all its threads) runs
    under SCHED_BATCH, whose threads do not preempt a running thread when they wake up."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None
    batch = sched_batch and hasattr(os, "SCHED_BATCH")
    param = os.sched_param(0) if batch else None

    def setter() -> None:
        if prctl is not None:
            prctl(1, int(signal.SIGKILL))
        if batch:
            os.sched_setscheduler(0, os.SCHED_BATCH, param)

    return setter


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


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine spent in user + nice + system mode so far (Linux)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    user, nice, system = (int(x) for x in fields[1:4])
    return (user + nice + system) / _HZ


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process, all its threads (Linux)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


class LoadMeter:
    """How much CPU something other than the benchmark's workers used while they ran.

    The machine's busy time (user + nice + system, from /proc/stat) minus what the workers and
    this process used: on a shared machine, other jobs distort the timings, and this says by
    how much (in cores, averaged over the run)."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.busy0 = _busy_cpu_s()
        self.self0 = sum(os.times()[:2])
        self.workers: dict[int, float] = {}
        self.network: dict[int, tuple[float, float]] = {}  # pid -> (first, last) CPU seconds seen

    def sample(self, procs: Sequence[subprocess.Popen], network: Sequence[subprocess.Popen] = ()) -> None:
        """``network``: long-lived processes of the emulated network (the delay line), counted
        apart from the workers and from the other load."""
        for p in procs:
            cpu = _proc_cpu_s(p.pid)
            if cpu is not None:
                self.workers[p.pid] = max(cpu, self.workers.get(p.pid, 0.0))
        for p in network:
            cpu = _proc_cpu_s(p.pid)
            if cpu is not None:
                self.network[p.pid] = (self.network.get(p.pid, (cpu, cpu))[0], cpu)

    def result(self) -> dict:
        wall = time.monotonic() - self.t0
        busy1 = _busy_cpu_s()
        if self.busy0 is None or busy1 is None or wall <= 0:
            return {}
        mine = sum(self.workers.values()) + sum(os.times()[:2]) - self.self0
        network = sum(last - first for first, last in self.network.values())
        foreign = max(0.0, (busy1 - self.busy0) - mine - network)
        out = {"workers_cpu_cores": mine / wall, "other_cpu_cores": foreign / wall, "cpus": os.cpu_count()}
        if self.network:
            out["network_cpu_cores"] = network / wall
        return out


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
        for rank in range(settings.hosts):
            env = dict(os.environ)
            env.update(RANK=str(rank), WORLD_SIZE=str(settings.hosts), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=addr, MASTER_PORT=str(port), OMP_NUM_THREADS=threads,
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
                raise BenchError(f"{method}: rank {rank} exited with code {code}; its log "
                                 f"({logs / f'rank{rank}.log'}) ends with:\n{_tail(logs / f'rank{rank}.log')}")
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
# reading a run


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _own(value, rank: int):
    """A worker file's micro_batches: its own count, or the per-worker list."""
    if isinstance(value, list):
        return value[rank] if rank < len(value) else None
    return value


def method_metrics(run_dir: Path, settings: BenchSettings, skip: int = 1) -> dict:
    """The figures of one method's run, from its own timers.

    - ``step_time_s``: median seconds between consecutive updates (rank 0's wall clock);
    - ``compute_s_per_update``: median over updates of the slowest worker's compute time (the
      critical path);
    - ``comm_s_per_update``: median over updates of the smallest comm time over workers: ddp's
      time inside its comm round, an overlapped method's comm-thread busy time (acco: both
      rounds); the worker that reached the round last waited least in it, so its figure is the
      round itself rather than the wait for a slower worker;
    - ``overlap_efficiency`` = max(compute, comm) / step_time;
    - ``samples_per_s``, ``tokens_per_s``: steady state, between the end of update ``skip`` and
      the last (the first update holds connection set-up and acco's non-overlapped warm start);
      the whole run's figures from ``summary.json`` are kept as ``*_overall``.

    The first ``skip`` updates are left out of the medians when at least ``skip + 2`` exist.
    """
    summary = {}
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in metrics if r.get("type") == "train"]
    evals = [r for r in metrics if r.get("type") == "eval"]
    workers = {}
    for path in sorted((run_dir / "workers").glob("rank*.jsonl")):
        with contextlib.suppress(ValueError):
            workers[int(path.stem[4:])] = {r["step"]: r for r in read_jsonl(path) if "step" in r}
    if not train:
        raise BenchError(f"{run_dir}: no training records in metrics.jsonl")
    if len(train) < skip + 2:
        skip = 0
    steady = train[skip:]
    steps = [r["step"] for r in steady]

    def per_update(key: str, reduce):
        vals = []
        for s in steps:
            xs = [w[s][key] for w in workers.values() if s in w and w[s].get(key) is not None]
            if xs:
                vals.append(reduce(xs))
        if not vals:  # no worker files: rank 0's own record
            vals = [r.get(key) for r in steady]
        return _median(vals)

    walls = [r["wall_time"] for r in train]
    diffs = [b - a for a, b in zip(walls[skip:], walls[skip + 1:])] if len(train) > 1 else []
    if skip == 0 and walls:
        diffs = [walls[0]] + diffs
    step_time = _median(diffs) if diffs else summary.get("step_time_s")
    compute = per_update("compute_s", max)
    comm = per_update("comm_s", min)
    wait = per_update("wait_s", statistics.mean)
    eff = max(compute, comm) / step_time if step_time and compute is not None and comm is not None else None

    # The trainer counts micro-batches in "samples"; here a sample is a sequence.
    seq = settings.batch_size
    first = train[skip - 1] if skip > 0 else {"wall_time": 0.0, "samples": 0}
    last = train[-1]
    span = last["wall_time"] - first["wall_time"]
    samples_ps = (last["samples"] - first["samples"]) * seq / span if span > 0 else None
    tokens_ps = samples_ps * settings.max_length if samples_ps is not None else None

    mbs = [r.get("micro_batches") for r in steady if isinstance(r.get("micro_batches"), list)]
    n_workers = len(mbs[0]) if mbs else settings.hosts
    mb_by_worker = ([statistics.mean(m[i] for m in mbs) for i in range(n_workers)] if mbs
                    else summary.get("micro_batches_per_update_by_worker"))
    # per-worker throughput: that worker's micro-batches per second of the steady span
    # per-worker throughput: that worker's samples per second over the steady span
    per_worker_sps = None
    if mbs and span > 0:
        per_worker_sps = [sum(m[i] for m in mbs) * settings.batch_size / span for i in range(n_workers)]
    per_worker_timers = {}
    for rank, w in sorted(workers.items()):
        rows = [w[s] for s in steps if s in w]
        per_worker_timers[str(rank)] = {
            "compute_s_per_update": _median(r.get("compute_s") for r in rows),
            "wait_s_per_update": _median(r.get("wait_s") for r in rows),
            "comm_s_per_update": _median(r.get("comm_s") for r in rows),
            "micro_batches_per_update": (statistics.mean(_own(r.get("micro_batches"), rank) for r in rows)
                                         if rows and all(_own(r.get("micro_batches"), rank) is not None
                                                         for r in rows) else None),
        }
    final_eval = summary.get("final_eval_loss")
    if final_eval is None and evals:
        final_eval = evals[-1].get("eval_loss")
    return {
        "step_time_s": step_time,
        "samples_per_s": samples_ps,
        "tokens_per_s": tokens_ps,
        "compute_s_per_update": compute,
        "comm_s_per_update": comm,
        # what comm_s_per_update measures, per method (torch-ddp's all-reduce runs inside backward)
        "comm_s_measures": COMM_MEASURES.get(summary.get("method"), COMM_MEASURES["overlapped"]),
        "wait_s_per_update": wait,
        "overlap_efficiency": eff,
        "final_eval_loss": final_eval,
        "peak_mem_mb": summary.get("peak_mem_mb"),
        "micro_batches_per_update_by_worker": mb_by_worker,
        "samples_per_s_by_worker": per_worker_sps,
        "timers_by_worker": per_worker_timers,
        "updates": len(train),
        "updates_in_medians": len(steady),
        "samples": last.get("samples", 0) * seq,  # sequences over all workers
        "micro_batches_total": last.get("samples"),
        "final_train_loss": last.get("loss"),
        "wall_time_s": summary.get("wall_time_s", last["wall_time"]),
        "samples_per_s_overall": summary["samples_per_s"] * seq if summary.get("samples_per_s") else None,
        "tokens_per_s_overall": summary.get("tokens_per_s"),
        "summary": summary,
        # [wall_time_s, samples (sequences), training loss] per update, for time-to-loss figures
        "curve": [[r["wall_time"], r["samples"] * seq, r["loss"]] for r in train],
    }


BUSY_CORES = 0.15  # other processes' CPU use (cores) above which a run is flagged as disturbed
RETRY_PAUSE_S = 20.0


def combine_repeats(results: list[dict]) -> dict:
    """One method's repetitions: the figures of the repetition with the median step time (so they
    stay consistent with each other), chosen among the undisturbed repetitions when there are any
    (other processes below BUSY_CORES), every repetition's step time and samples/s alongside."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[-1]
    if len(results) == 1:
        return ok[0]
    quiet = [r for r in ok if ((r.get("load") or {}).get("other_cpu_cores") or 0.0) <= BUSY_CORES]
    pool = sorted(quiet or ok, key=lambda r: r["step_time_s"] or float("inf"))
    chosen = dict(pool[(len(pool) - 1) // 2])
    chosen["repeats"] = [{k: r.get(k) for k in ("step_time_s", "samples_per_s", "compute_s_per_update",
                                                  "comm_s_per_update", "load", "error", "run_dir")} for r in results]
    chosen["repeats_used"] = len(pool)
    return chosen


def _running_mean(xs: list[float], k: int = 3) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def add_comparisons(methods: dict) -> dict:
    """Speedups of every method over ddp and torch-ddp (ratios of the same run), and the overlap
    bounds computed from ddp's own compute C and comm M.

    - ``speedup_step_vs_X`` = step_time(X) / step_time(method) (same effective batch);
    - ``speedup_samples_vs_X`` = samples/s(method) / samples/s(X) (what to compare when the batch
      per update varies, with ``--accumulate-while-waiting`` or a slow worker);
    - ``ideal_overlap`` = (C+M)/max(C,M): the bound for a method that overlaps one comm round per
      update (dpu, wp); ``ideal_acco`` = (C+M)/max(C,2M): acco runs TWO rounds per update (an
      estimate round and an update round, each moving the whole gradient and parameter vector),
      so its bound is lower once M > C/2.
    """
    out = {"bounds": {}}
    ddp = methods.get("ddp")
    if ddp and ddp.get("compute_s_per_update") and ddp.get("comm_s_per_update") is not None:
        c, m = ddp["compute_s_per_update"], ddp["comm_s_per_update"]
        out["bounds"] = {
            "ddp_compute_s": c,
            "ddp_comm_s": m,
            "ddp_comm_fraction": m / (c + m) if c + m > 0 else None,
            "ideal_overlap": (c + m) / max(c, m),
            "ideal_acco": (c + m) / max(c, 2 * m),
        }
    # Time to reach a target training loss: the loss every method reaches (the highest of their final
    # losses, each the mean of its last 3 updates), first crossed by a 3-update running mean.
    finals = {n: _running_mean([c[2] for c in r["curve"]])[-1] for n, r in methods.items()
              if "error" not in r and r.get("curve")}
    if finals:
        target = max(finals.values())
        out["target_train_loss"] = target
        for n in finals:
            curve = methods[n]["curve"]
            smooth = _running_mean([c[2] for c in curve])
            hit = next((i for i, v in enumerate(smooth) if v <= target), None)
            methods[n]["time_to_target_loss_s"] = curve[hit][0] if hit is not None else None
            methods[n]["samples_to_target_loss"] = curve[hit][1] if hit is not None else None
    for name, res in methods.items():
        if "error" in res:
            continue
        for ref in ("ddp", "torch-ddp"):
            base = methods.get(ref)
            if not base or "error" in base:
                continue
            if res.get("step_time_s") and base.get("step_time_s"):
                res[f"speedup_step_vs_{ref}"] = base["step_time_s"] / res["step_time_s"]
            if res.get("samples_per_s") and base.get("samples_per_s"):
                res[f"speedup_samples_vs_{ref}"] = res["samples_per_s"] / base["samples_per_s"]
        b = out["bounds"]
        if b and res.get("speedup_step_vs_ddp"):
            res["fraction_of_ideal_overlap"] = res["speedup_step_vs_ddp"] / b["ideal_overlap"]
            if base_method(name) == "acco":
                res["fraction_of_ideal_acco"] = res["speedup_step_vs_ddp"] / b["ideal_acco"]
    return out


# --------------------------------------------------------------------------------------------
# one benchmark: every method on one network


def run_bench(settings: BenchSettings, out: Path, net: Network | None = None, log=print) -> dict:
    """Run every method of ``settings`` on ``net`` (made and torn down here when None) and write
    ``out/bench.json``, ``out/bench.md`` and the plots. Returns the bench.json content. A method
    that fails or times out is recorded with its error and the others still run."""
    from acco.bench import report

    settings.validate()
    check_worker_available()
    out.mkdir(parents=True, exist_ok=True)
    own = net is None
    if own:
        net = Network(settings.hosts, settings.bandwidth, settings.latency, settings.loopback)
    try:
        log(f"[acco-bench] {net.note}")
        runs: dict[str, list[dict]] = {m: [] for m in settings.methods}
        for rep in range(settings.repeats):
            for method in settings.methods:
                run_dir = out / method if settings.repeats == 1 else out / method / f"rep{rep}"
                log(f"[acco-bench] {method}{f' (repeat {rep + 1}/{settings.repeats})' if settings.repeats > 1 else ''}: "
                    f"{settings.hosts} workers, {settings.grad_accum_for(method)} micro-batches per "
                    f"{'round' if method == 'acco' else 'update'} of {settings.batch_size}x{settings.max_length} "
                    f"tokens, nb_steps_tot={settings.nb_steps_tot}")
                attempts = 0
                while True:
                    if run_dir.exists():  # the trainer appends to metrics.jsonl: start clean
                        shutil.rmtree(run_dir)
                    load = LoadMeter()
                    try:
                        wall = run_workers(settings, method, run_dir, net, load)
                        res = method_metrics(run_dir, settings)
                        res["harness_wall_s"] = wall
                        res["load"] = load.result()
                        res["run_dir"] = str(run_dir)
                    except BenchError as e:
                        log(f"[acco-bench] {method} FAILED: {e}")
                        res = {"error": str(e)}
                        break
                    other = res["load"].get("other_cpu_cores") or 0.0
                    if other <= BUSY_CORES or attempts >= settings.retry_disturbed:
                        res["disturbed_attempts"] = attempts
                        break
                    attempts += 1
                    log(f"[acco-bench] {method}: other processes used {other:.2f} CPU cores during the run; "
                        f"running it again ({attempts}/{settings.retry_disturbed}) after {RETRY_PAUSE_S:.0f} s")
                    time.sleep(RETRY_PAUSE_S)
                runs[method].append(res)
                if "error" not in res:
                    other = res["load"].get("other_cpu_cores")
                    busy = (f"; WARNING: other processes used {other:.2f} CPU cores meanwhile, timings are disturbed"
                            if other is not None and other > BUSY_CORES else "")
                    log(f"[acco-bench] {method}: step {res['step_time_s']:.3f} s, compute "
                        f"{res['compute_s_per_update']:.3f} s, comm {res['comm_s_per_update']:.3f} s, "
                        f"overlap eff. {res['overlap_efficiency']:.2f}, {res['samples_per_s']:.1f} samples/s{busy}")
        methods = {m: combine_repeats(rs) for m, rs in runs.items()}
        comparisons = add_comparisons(methods)
        bench = {
            "config": {**settings.describe(), "network": net.describe(),
                       "machine": machine_description(), "worker_command": worker_command()},
            "methods": methods,
            **comparisons,
        }
    finally:
        if own:
            net.close()
    (out / "bench.json").write_text(json.dumps(bench, indent=2, default=str) + "\n")
    report.write_bench_report(bench, out)
    return bench


def rerender(out: Path) -> dict:
    """Recompute ``out/bench.json``'s figures from the run folders it lists (after a change to the
    analysis) and write bench.json, bench.md and the plots again; the loads measured then are kept."""
    from acco.bench import report

    bench = json.loads((out / "bench.json").read_text())
    cfg = dict(bench["config"])
    keys = {f for f in BenchSettings.__dataclass_fields__}
    settings = BenchSettings(**{k: v for k, v in cfg.items() if k in keys})
    settings.methods = tuple(cfg["methods"])
    methods = {}
    for name, old in bench["methods"].items():
        if "error" in old:
            methods[name] = old
            continue
        reps = old.get("repeats") or [old]
        dirs = sorted((out / name).glob("rep*")) or [out / name]
        results = []
        for i, d in enumerate(dirs):
            res = method_metrics(d, settings)
            res["run_dir"] = str(d)
            res["load"] = (reps[i] if i < len(reps) else {}).get("load") or old.get("load")
            results.append(res)
        methods[name] = combine_repeats(results)
    bench["methods"] = methods
    bench.update(add_comparisons(methods))
    (out / "bench.json").write_text(json.dumps(bench, indent=2, default=str) + "\n")
    report.write_bench_report(bench, out)
    return bench


def machine_description() -> dict:
    import platform

    try:
        import torch

        tv = torch.__version__
    except ImportError:  # pragma: no cover
        tv = None
    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu_model": model, "torch": tv, "python": platform.python_version(),
            "platform": platform.platform(), "backend": "gloo"}


# --------------------------------------------------------------------------------------------
# the sweep


def sweep_label(bw: str | None) -> str:
    return "unshaped" if bw is None else bw


def run_sweep(settings: BenchSettings, bandwidths: Sequence[str | None], out: Path, log=print) -> dict:
    """One :func:`run_bench` per bandwidth (``None``: unshaped veth links; on loopback when
    namespaces are unavailable and ``settings.loopback``), then ``sweep.json``, ``sweep.md`` and
    the speedup plot."""
    from acco.bench import report

    settings.validate()
    check_worker_available()
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for bw in bandwidths:
        label = sweep_label(bw)
        if settings.loopback and bw is not None:
            log(f"[acco-bench] sweep: {label} skipped: --loopback cannot shape links")
            continue
        s = BenchSettings(**{**asdict(settings), "bandwidth": bw})
        s.methods = tuple(settings.methods)
        s.slow_worker = settings.slow_worker
        log(f"[acco-bench] sweep point {label}")
        bench = run_bench(s, out / label.replace("/", "_"), log=log)
        points.append({"label": label, "bandwidth": bw,
                       "bandwidth_bps": netns.parse_rate(bw) if bw else None, "bench": bench})
    sweep = {"config": {**settings.describe(), "bandwidths": [sweep_label(b) for b in bandwidths],
                        "machine": machine_description()},
             "points": [{"label": p["label"], "bandwidth_bps": p["bandwidth_bps"],
                         "network": p["bench"]["config"]["network"],
                         "bounds": p["bench"].get("bounds", {}),
                         "methods": {m: {k: v for k, v in r.items() if k not in ("summary", "timers_by_worker")}
                                     for m, r in p["bench"]["methods"].items()}}
                        for p in points]}
    (out / "sweep.json").write_text(json.dumps(sweep, indent=2, default=str) + "\n")
    report.write_sweep_report(sweep, out)
    return sweep
