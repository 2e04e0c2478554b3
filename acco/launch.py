"""Process launching for torch.distributed: torchrun, SLURM (srun), or local workers.

- ``dist_env()`` reads the ranks that a launcher put in the environment (torchrun first, then
  SLURM), or returns None for a plain ``python main.py``.
- ``init_distributed()`` creates the process group from it (gloo on CPU, nccl on CUDA), with a
  timeout of minutes rather than torch's 30-minute default, or a one-process group when there is
  no launcher, so that collectives always work.
- ``launch_local(nproc, argv)`` is the launcher of a plain ``python main.py``: it starts ``nproc``
  copies of the command with torchrun's variables set and stops all of them as soon as one fails,
  blaming the root cause: a worker that crashed, else the rank that the others found had stopped
  (see ``report_lost_ranks``), rather than whichever worker happened to exit first.
  Typical use at the top of an entry point::

      if dist_env() is None and nproc > 1:
          sys.exit(launch_local(nproc, self_command()))
      rank, world_size, local_rank, device = init_distributed()

  The workers find RANK in their environment, so they do not launch again.

Why not ``torch.distributed.launcher.api.elastic_launch``: it restarts groups, rendezvous through
its own agent, and reports a failure as a multi-line ``ChildFailedError`` table after its own
monitoring interval. Here the contract is smaller and stricter (first failure ends the run within
a second, one line naming the rank, whole process trees killed, signals forwarded), and it is
~150 lines that tests can read.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from itertools import product

__all__ = [
    "DEFAULT_PORT",
    "dist_env",
    "expand_nodelist",
    "every_rank_at",
    "free_port",
    "init_distributed",
    "launch_local",
    "report_lost_ranks",
    "self_command",
]

DEFAULT_PORT = 29500
_SLURM_PORT_SPREAD = 3000  # 29500..32499: below Linux's ephemeral range (32768+)


# --------------------------------------------------------------------------- SLURM node lists


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"bad SLURM node list {text!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"bad SLURM node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"bad SLURM node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range_set(body: str, text: str) -> list[str]:
    out = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise ValueError(f"bad SLURM node list {text!r}: {item!r} is not a number or a range")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"bad SLURM node list {text!r}: range {item!r} goes down")
        width = len(lo)  # node[01-10] keeps the zero padding of its lower bound
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list, as ``scontrol show hostnames`` does.

    ``node[01-04,07]`` -> node01 node02 node03 node04 node07;
    ``gpu-a[1,3],gpu-b2`` -> gpu-a1 gpu-a3 gpu-b2; ``r[1-2]-n[1-2]`` -> r1-n1 r1-n2 r2-n1 r2-n2.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [
            _expand_range_set(p[1:-1], nodelist) if p.startswith("[") else [p] for p in pieces if p != ""
        ]
        hosts.extend("".join(combo) for combo in product(*choices))
    return hosts


# --------------------------------------------------------------------------- environment


def _slurm_port(job_id: str | None) -> int:
    digits = re.sub(r"\D", "", job_id or "")
    return DEFAULT_PORT + (int(digits) % _SLURM_PORT_SPREAD if digits else 0)


def dist_env() -> dict | None:
    """Ranks from the environment, or None when no launcher set them.

    Returns ``{"source", "rank", "world_size", "local_rank", "local_world_size", "master_addr",
    "master_port"}``. torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) win
    over SLURM's, so ``torchrun`` inside an allocation works. Under ``srun`` the ranks come from
    SLURM_PROCID / SLURM_NTASKS (the step's SLURM_STEP_NUM_TASKS when set) / SLURM_LOCALID, the
    master is the first host of the step's node list (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST)
    and the port 29500 + SLURM_JOB_ID % 3000, unless MASTER_ADDR / MASTER_PORT are set.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        return {
            "source": "torchrun",
            "rank": rank,
            "world_size": world,
            "local_rank": int(env.get("LOCAL_RANK", rank)),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", world)),
            "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": int(env.get("MASTER_PORT", DEFAULT_PORT)),
        }
    world_s = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    # Only a task of an srun step is one of the job's ranks. The batch script itself (and an
    # salloc shell) also has SLURM_PROCID=0 and SLURM_NTASKS=N, but no step: there a plain
    # `python main.py` starts its own local workers instead of waiting for N-1 peers.
    in_step = "SLURM_STEP_NUM_TASKS" in env or env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).isdigit()
    if "SLURM_PROCID" in env and world_s and in_step:
        rank, world = int(env["SLURM_PROCID"]), int(world_s)
        nodelist = (
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        )
        master = env.get("MASTER_ADDR")
        if not master:
            hosts = expand_nodelist(nodelist) if nodelist else []
            master = hosts[0] if hosts else "127.0.0.1"
        tasks_per_node = re.match(
            r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
        )
        return {
            "source": "slurm",
            "rank": rank,
            "world_size": world,
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            "local_world_size": int(tasks_per_node.group(0)) if tasks_per_node else 1,
            "master_addr": master,
            "master_port": int(env.get("MASTER_PORT") or _slurm_port(env.get("SLURM_JOB_ID"))),
        }
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def self_command() -> list[str]:
    """The command line that started this process (``python -m pkg``, scripts and console entry
    points alike), to start more copies of it."""
    return [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]


# --------------------------------------------------------------------------- process group


def _device_for(local_rank: int, use_cuda: bool):
    import torch

    if not use_cuda:
        return torch.device("cpu")
    n = torch.cuda.device_count()
    # with one visible GPU per task (srun --gpus-per-task=1) every local rank sees cuda:0
    device = torch.device("cuda", local_rank if local_rank < n else local_rank % n)
    torch.cuda.set_device(device)
    return device


def init_distributed(timeout_s: float = 30, backend: str | None = None):
    """Join (or create) the default process group; returns ``(rank, world_size, local_rank, device)``.

    - An existing process group is reused as it is.
    - Else the ranks come from ``dist_env()`` (MASTER_ADDR / MASTER_PORT are exported from SLURM's
      variables when missing); backend nccl with device ``cuda:local_rank`` when CUDA is available,
      gloo on CPU otherwise (``backend`` overrides).
    - With no launcher at all, a one-process group on an in-memory store (no port, no network),
      so that collectives work unchanged with world_size 1.
    Collectives time out after ``timeout_s`` seconds instead of torch's 30 minutes.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        start_heartbeat(timeout_s)
        env = dist_env()
        local_rank = env["local_rank"] if env else 0
        # get_backend() is "undefined" when the user let torch pick, or "cpu:gloo,cuda:nccl"
        backend_name = str(dist.get_backend())
        use_cuda = torch.cuda.is_available() and ("nccl" in backend_name or backend_name == "undefined")
        return rank, world, local_rank, _device_for(local_rank, use_cuda)

    use_cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
    backend = backend or ("nccl" if use_cuda else "gloo")
    timeout = timedelta(seconds=timeout_s)
    env = dist_env()
    if env is None:
        device = _device_for(0, use_cuda)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1, 0, device

    os.environ.setdefault("MASTER_ADDR", env["master_addr"])
    os.environ.setdefault("MASTER_PORT", str(env["master_port"]))
    device = _device_for(env["local_rank"], use_cuda)
    # The rendezvous waits as long as a slow node's start-up may take (under srun every rank
    # checks its inputs first); only the collectives get the short timeout.
    store, rank, world_size = next(
        dist.rendezvous("env://", rank=env["rank"], world_size=env["world_size"], timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    start_heartbeat(timeout_s)
    return rank, world_size, env["local_rank"], device


# --------------------------------------------------------------------------- local launcher


def _parent_death_signal_setter():
    """A function for ``preexec_fn`` that asks Linux to SIGTERM the child when the launcher dies
    (PR_SET_PDEATHSIG); None elsewhere. libc is loaded here, before any fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def setter() -> None:  # runs in the child between fork and exec: no imports, no locks
        prctl(1, int(signal.SIGTERM))

    return setter


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # each worker leads its own process group: its children too
    except (ProcessLookupError, PermissionError):
        pass


# A worker that fails because a peer died or stalled writes what it found (which rank stopped)
# into this folder before it exits, so that the launcher blames that rank (acco.engine.progress).
FAILURE_DIR_ENV = "ACCO_FAILURE_DIR"
# When the first worker to fail only lost a peer, how long the launcher waits for the other exits
# before blaming: a dead peer makes its neighbours fail at once, and its own exit is the answer.
_ROOT_CAUSE_WAIT_S = 1.0


def report_lost_ranks(rank: int, lost: list[int], message: str) -> None:
    """Tell acco's local launcher, when there is one, that this worker fails because ranks `lost`
    died or stalled (empty: unknown which), with the line that says so."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return
    path = os.path.join(folder, f"rank{rank}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "lost": lost, "message": message}, f)
        os.replace(path + ".tmp", path)  # the launcher never reads half a report
    except OSError:
        pass  # the launcher then blames the first exit, as it would without reports


def _lost_report(folder: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(folder, f"rank{rank}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _root_cause(failed: dict[int, int], folder: str, procs: list[subprocess.Popen]) -> tuple[str, int]:
    """The line that blames the failure explaining the others, and the exit code to return.

    `failed` maps rank -> exit code, in the order the workers exited. A worker that failed on its
    own (no lost-peer report) is the cause, one killed by a signal (OOM killer, segfault) first;
    else every failure is a lost peer, and what the survivors found is relayed."""
    reports = {rank: r for rank in failed if (r := _lost_report(folder, rank)) is not None}
    crashed = [rank for rank in failed if rank not in reports]
    named = [r for r in reports.values() if r["lost"]]
    if crashed or not named:
        rank = min(crashed or failed, key=lambda r: failed[r] >= 0)  # signals first, then exit order
        line = f"rank {rank} (pid {procs[rank].pid}) {_describe(failed[rank])}"
    else:
        rank = named[0]["rank"]
        line = f"{named[0]['message']} (reported by rank {rank}, which {_describe(failed[rank])})"
    code = failed[rank]
    return line, code if code > 0 else 128 - code


def launch_local(
    nproc: int,
    argv: list[str],
    env_extra: dict | None = None,
    grace_s: float = 5.0,
) -> int:
    """Run ``nproc`` local workers of ``argv`` (torchrun's variables set, master 127.0.0.1 on a
    free port) and wait for them.

    Returns 0 when every worker exits 0. As soon as one exits otherwise, one line naming the rank
    at fault goes to stderr, the others get SIGTERM and, after ``grace_s`` seconds, SIGKILL; the
    return value is the exit code of the worker blamed (128 + signal number when it was killed).
    The rank at fault is the worker that failed, unless it failed only because a peer died or
    stalled: it then reported the lost rank (``report_lost_ranks``), the launcher waits a moment
    for a worker that failed on its own and, if none did, relays that report. SIGINT and
    SIGTERM received by the launcher are forwarded to the workers, which get ``grace_s`` seconds
    before SIGKILL (a second signal kills them at once); the launcher then returns 128 + signal
    number. Each worker runs in its own process group, killed whole at the end, so nothing is left
    behind; if the launcher itself is killed, the kernel sends the workers SIGTERM (Linux).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    base = dict(os.environ)
    base.update({k: str(v) for k, v in (env_extra or {}).items()})
    report_dir = tempfile.mkdtemp(prefix="acco-launch-")
    base.update(
        {FAILURE_DIR_ENV: report_dir},
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
    )
    exits: queue.Queue = queue.Queue()  # (rank, returncode) in the order the workers exit
    signals_received: list[int] = []
    procs: list[subprocess.Popen] = []

    def on_signal(signum, _frame):  # forward; no locks taken here
        signals_received.append(signum)
        for p in procs:
            if p.returncode is None:
                _signal_group(p, signum if len(signals_received) == 1 else signal.SIGKILL)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    result, forwarded = 0, False
    try:
        preexec = _parent_death_signal_setter()
        for rank in range(nproc):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=preexec))
        # waiter threads only once every fork is done (preexec_fn and threads do not mix)
        for rank, p in enumerate(procs):
            threading.Thread(target=lambda r=rank, p=p: exits.put((r, p.wait())), daemon=True).start()
        running = nproc
        while running:
            if signals_received:
                result, forwarded = 128 + signals_received[0], True
                break
            try:
                rank, code = exits.get(timeout=0.2)
            except queue.Empty:
                continue
            running -= 1
            if code != 0:
                failed = {rank: code}
                if _lost_report(report_dir, rank) is not None:  # it only lost a peer: wait a moment
                    deadline = time.monotonic() + _ROOT_CAUSE_WAIT_S
                    while running and time.monotonic() < deadline:
                        try:
                            rank, code = exits.get(timeout=max(0.0, deadline - time.monotonic()))
                        except queue.Empty:
                            break
                        running -= 1
                        if code != 0:
                            failed[rank] = code
                line, result = _root_cause(failed, report_dir, procs)
                alive = sum(p.returncode is None for p in procs)
                print(f"acco.launch: {line}; stopping the other {alive} worker(s)", file=sys.stderr, flush=True)
                break
        return result
    finally:
        _stop(procs, grace_s, terminate=not forwarded)
        shutil.rmtree(report_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(procs: list[subprocess.Popen], grace_s: float, terminate: bool = True) -> None:
    """SIGTERM the workers still running (unless a signal was just forwarded to them), SIGKILL
    what is left after ``grace_s``, reap them, and SIGKILL whatever they left in their groups."""
    if terminate:
        for p in procs:
            if p.returncode is None:
                _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        _signal_group(p, signal.SIGKILL)  # the group's other members too, if any remain
        p.wait()


# --------------------------------------------------------------------------- slow one-off work


RENDEZVOUS_TIMEOUT_S = 1800.0  # how long the first rank waits for the last one to start

# Liveness: every rank bumps its counter on the rendezvous store from a daemon thread. The long
# waits below poll the store and give up as soon as a peer's counter has stood still for the
# collective timeout: a worker that died (srun does not stop the others by default) or stalled
# (SIGSTOP, a hung file system) during one-off work ends the run within that timeout, not after
# the hour that the work itself may take.
_ALIVE = "acco/alive/{}"
_heartbeat = {"timeout_s": 30.0, "generation": 0}


def start_heartbeat(timeout_s: float) -> None:
    """Start this rank's liveness counter on the current process group's store (nothing in a
    one-process run). A later call replaces the beat: a process may destroy its group and make
    another, whose peers must see it alive too."""
    import torch.distributed as dist

    _heartbeat["timeout_s"] = float(timeout_s)
    _heartbeat["generation"] += 1  # the previous beat, if any, stops at its next tick
    if dist.get_world_size() == 1:
        return
    store, key = dist.distributed_c10d._get_default_store(), _ALIVE.format(dist.get_rank())
    interval, generation = min(5.0, max(0.5, timeout_s / 6)), _heartbeat["generation"]

    def beat() -> None:
        try:
            while _heartbeat["generation"] == generation:
                store.add(key, 1)
                time.sleep(interval)
        except Exception:  # the store is gone (its host exited, or the group was destroyed)
            return

    threading.Thread(target=beat, name="acco-heartbeat", daemon=True).start()


def wait_on_store(keys: list[str], what: str, slow_timeout_s: float = 3600.0) -> None:
    """Wait until every key is set on the default store: up to `slow_timeout_s` while all peers
    are alive, but fail within the collective timeout once one of them stops (LostWorkerError)."""
    import torch.distributed as dist

    from acco.engine.progress import LostWorkerError

    store, world, me = dist.distributed_c10d._get_default_store(), dist.get_world_size(), dist.get_rank()
    start = time.monotonic()
    seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
    # Polls with `check`, not a blocking `wait`: the store client holds its lock for the whole of
    # a wait, which would also hold up this rank's own heartbeat. Peers' counters are read once
    # a second, to stay light on the store with many ranks.
    delay, next_liveness_check = 0.001, start
    while not store.check(keys):
        time.sleep(delay)
        delay = min(0.05, delay * 2)
        now = time.monotonic()
        if now < next_liveness_check:
            continue
        next_liveness_check = now + 1.0
        if now - start > slow_timeout_s:
            raise TimeoutError(f"waited {slow_timeout_s:.0f} s for the other workers ({what})")
        for rank in range(world):
            if rank == me:
                continue
            count = store.add(_ALIVE.format(rank), 0)  # reads the counter (0 if it never beat)
            last = seen.get(rank)
            if last is None or count != last[0]:
                seen[rank] = (count, now)
            elif now - last[1] > _heartbeat["timeout_s"]:
                message = (
                    f"rank {rank} stopped responding (died or stalled) while the workers waited for {what}: "
                    f"no sign of life for {now - last[1]:.0f} s (launch.timeout_s={_heartbeat['timeout_s']:g})"
                )
                report_lost_ranks(me, [rank], message)
                raise LostWorkerError(message, lost=[rank])


# Every rank makes the same calls for a given name in the same order: a count per name makes
# each key unique, and a call that only some ranks make (save_model on rank 0) shifts no other name.
_calls: dict[str, int] = {}


def _unique(kind: str, key: str) -> str:
    _calls[kind + key] = _calls.get(kind + key, 0) + 1
    return f"acco/{kind}/{_calls[kind + key]}/{key}"


def after_rank0(work, key: str, slow_timeout_s: float = 3600.0):
    """Run `work()` on rank 0 while the other ranks wait for it, then return on every rank.

    For one-off work that may take minutes (training a tokenizer, writing a large model): a plain
    barrier would hit the collective timeout, which is kept short so that a dead or stalled worker
    is noticed quickly. The others wait on the rendezvous store instead (`wait_on_store`): up to
    `slow_timeout_s` while rank 0 is alive, within the collective timeout once it is not.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    key = _unique("after_rank0", key)
    result = work() if rank == 0 else None
    if world == 1:
        return result
    if rank == 0:
        dist.distributed_c10d._get_default_store().set(key, "done")
    else:
        wait_on_store([key], f"rank 0's {key.rsplit('/', 1)[-1] or key}", slow_timeout_s)
    return result


def every_rank_at(key: str, slow_timeout_s: float = 3600.0) -> None:
    """A barrier on the rendezvous store, with `slow_timeout_s` instead of the collective timeout.

    For the end of per-rank one-off work whose duration may differ between ranks by more than the
    collective timeout (tokenizing the data, building or loading the model): the first collective
    after it would otherwise fail on the ranks that finished early. A rank that dies or stalls
    meanwhile ends the wait within the collective timeout (`wait_on_store`).
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    key = _unique("every_rank_at", key)
    store = dist.distributed_c10d._get_default_store()
    if store.add(key, 1) == dist.get_world_size():  # the last rank to arrive opens the gate
        store.set(key + "/all", "1")
    wait_on_store([key + "/all"], f"every worker to finish its {key.rsplit('/', 1)[-1]}", slow_timeout_s)
