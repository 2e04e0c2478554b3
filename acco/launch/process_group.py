"""The process group, and the waits on its store for slow one-off work.

- ``init_distributed()`` joins the default process group (gloo on CPU, nccl on CUDA) with a
  timeout of seconds rather than torch's 30 minutes, or makes a one-process group when there is
  no launcher, so that collectives always work.
- ``after_rank0``, ``every_rank_at`` and ``wait_on_store`` wait on the rendezvous store for work
  that may take far longer than the collective timeout (tokenizing, writing a large model), while
  a heartbeat tells a dead or stalled peer from a slow one.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from datetime import timedelta

from acco.engine.progress import LostWorkerError, report_lost_ranks, store_listening
from acco.launch.env import dist_env

RENDEZVOUS_TIMEOUT_S = 1800.0  # how long the first rank waits for the last one to start

# NCCL's collective timeout also bounds communicator set-up (ncclCommInitRank at init with
# device_id, and the communicators torch makes lazily later, e.g. for point-to-point pairs): at 32
# ranks over several nodes, bootstrap and topology detection take from seconds to a minute or more,
# so a 30 s timeout would fail healthy jobs. The floor is torch's own NCCL default halved. A lost
# rank is then noticed within minutes on NCCL; gloo keeps the short timeout.
NCCL_MIN_TIMEOUT_S = 300.0

# Liveness: every rank bumps its counter on the rendezvous store from a daemon thread. The long
# waits below poll the store and give up as soon as a peer's counter has stood still for the
# collective timeout: a worker that died (srun does not stop the others by default) or stalled
# (SIGSTOP, a hung file system) during one-off work ends the run within that timeout, not after
# the hour that the work itself may take.
_ALIVE = "acco/alive/{}"
_heartbeat: dict = {}  # "timeout_s" (the collective timeout) and "stop", set by start_heartbeat


def _no_gpu_reason() -> str | None:
    """Why no CUDA device can be used here (a CPU-only torch, or none visible), or None."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    if torch.version.cuda is None:
        return "this torch is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"torch (built for CUDA {torch.version.cuda}) sees no CUDA device{where}"


def _nccl_only(backend: str) -> bool:
    """Whether `backend` ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl", ...) is NCCL with no backend
    for CPU tensors: such a group cannot work without a GPU."""
    backend = backend.lower().replace(" ", "")
    if ":" in backend:
        mapping = dict(item.split(":", 1) for item in backend.split(",") if ":" in item)
        return "cpu" not in mapping and "nccl" in mapping.values()
    return backend == "nccl"


def _check_gpu_for(backend: str) -> None:
    """One InputError line when `backend` needs a GPU and none is visible: before any process
    group is made (NCCL would otherwise fail at its first collective, or cuda:local_rank % 0)."""
    reason = _no_gpu_reason() if _nccl_only(backend) else None
    if reason is not None:
        from acco.config import InputError

        raise InputError(
            f"backend {backend} needs a CUDA GPU and none is visible ({reason}): use gloo on the CPU"
        )


def _device_for(local_rank: int, use_cuda: bool):
    import torch

    if not use_cuda:
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if n == 0:  # torch.cuda.is_available() said yes, yet no device is visible
        _check_gpu_for("nccl")
    # with one visible GPU per task (srun --gpus-per-task=1) every local rank sees cuda:0
    device = torch.device("cuda", local_rank if local_rank < n else local_rank % n)
    torch.cuda.set_device(device)
    return device


def backend_settings(backend: str, timeout_s: float) -> tuple[float, dict[str, str]]:
    """The collective timeout (seconds) and the environment defaults for `backend`.

    On NCCL: at least NCCL_MIN_TIMEOUT_S, and TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (torch's
    "CleanUpOnly"; its default, 3, tears the process down from the watchdog thread): a collective
    that fails or times out aborts the communicator and the next call raises a Python error, which
    `progress.names_lost_ranks` turns into one naming the rank that stopped (NCCL itself only names
    the operation and its sequence number). Read when the process group is made; a value the user
    exported wins. Gloo: the timeout as given, nothing set."""
    if "nccl" not in backend:
        return float(timeout_s), {}
    return max(float(timeout_s), NCCL_MIN_TIMEOUT_S), {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def init_distributed(timeout_s: float | None = None, backend: str | None = None):
    """Join (or create) the default process group; returns ``(rank, world_size, local_rank, device)``.

    - An existing process group is reused as it is.
    - Else the ranks come from ``dist_env()`` (MASTER_ADDR / MASTER_PORT are exported from SLURM's
      variables when missing); backend nccl with device ``cuda:local_rank`` when CUDA is available,
      gloo on CPU otherwise (``backend`` overrides).
    - With no launcher at all, a one-process group on an in-memory store (no port, no network),
      so that collectives work unchanged with world_size 1.
    Collectives time out after ``timeout_s`` seconds (None: train.timeout_s's default) instead of
    torch's 30 minutes (NCCL: at least ``NCCL_MIN_TIMEOUT_S``, see ``backend_settings``).
    NCCL with no backend for CPU tensors (asked for, or the existing group's) where no GPU is
    visible is one ``InputError`` line, raised before any group, rendezvous or heartbeat.
    """
    import torch
    import torch.distributed as dist

    if timeout_s is None:
        from acco.config import TrainArgs

        timeout_s = TrainArgs.timeout_s
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        # get_backend() is "undefined" when the user let torch pick, or "cpu:gloo,cuda:nccl"
        backend_name = str(dist.get_backend())
        _check_gpu_for(backend_name)  # the user's group: NCCL alone, with no GPU here
        start_heartbeat(timeout_s)
        env = dist_env()
        local_rank = env["local_rank"] if env else 0
        use_cuda = torch.cuda.is_available() and ("nccl" in backend_name or backend_name == "undefined")
        return rank, world, local_rank, _device_for(local_rank, use_cuda)

    use_cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
    backend = backend or ("nccl" if use_cuda else "gloo")
    _check_gpu_for(backend)  # before the environment, the rendezvous and the group
    collective_timeout_s, env_defaults = backend_settings(backend, timeout_s)
    for key, value in env_defaults.items():
        os.environ.setdefault(key, value)
    if "nccl" in backend:
        # NCCL kernels run on the group's own stream, not the caller's (the comm round's
        # high-priority side stream), for async collectives (DDP's buckets) and, before torch 2.8,
        # for synchronous ones too: make that stream high priority, or a round queues behind the
        # next micro-batch's kernels. Read when a communicator is made (torch's initNCCLComm); a
        # value the user exported wins.
        os.environ.setdefault("TORCH_NCCL_HIGH_PRIORITY", "1")
    timeout = timedelta(seconds=collective_timeout_s)
    env = dist_env()
    if env is None:
        device = _device_for(0, use_cuda)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1, 0, device

    os.environ.setdefault("MASTER_ADDR", env["master_addr"])
    os.environ.setdefault("MASTER_PORT", str(env["master_port"]))
    device = _device_for(env["local_rank"], use_cuda)
    # The rendezvous waits as long as a slow node's start-up may take (under srun every rank
    # imports torch first); only the collectives get the short timeout.
    store, rank, world_size = next(
        dist.rendezvous(
            "env://",
            rank=env["rank"],
            world_size=env["world_size"],
            timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
        )
    )
    # device_id on CUDA binds the process to its GPU and creates the NCCL communicator now, inside
    # init_process_group's timeout, rather than at the first collective.
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)  # fmt: skip
    start_heartbeat(timeout_s)
    return rank, world_size, env["local_rank"], device


def start_heartbeat(timeout_s: float) -> None:
    """Start this rank's liveness counter on the current process group's store (nothing in a
    one-process run). A later call replaces the beat: a process may destroy its group and make
    another, whose peers must see it alive too."""
    import torch.distributed as dist

    stop_heartbeat()  # a later call replaces the beat
    atexit.unregister(stop_heartbeat)  # registered once however many beats were started
    atexit.register(stop_heartbeat)  # a plain sys.exit must not leave a beat inside the store's client
    _heartbeat["timeout_s"] = float(timeout_s)
    if dist.get_world_size() == 1:
        return
    store, key = dist.distributed_c10d._get_default_store(), _ALIVE.format(dist.get_rank())
    interval, stopped = min(5.0, max(0.5, timeout_s / 6)), threading.Event()

    def beat() -> None:
        try:
            while not stopped.is_set() and store_listening(store):  # its host gone: stop, silently
                store.add(key, 1)
                stopped.wait(interval)
        except Exception:  # the store is gone (its host exited, or the group was destroyed)
            return

    thread = threading.Thread(target=beat, name="acco-heartbeat", daemon=True)
    _heartbeat["stop"] = (stopped, thread)
    thread.start()


def stop_heartbeat() -> None:
    """Stop this rank's beat and wait for it: a beat still inside the store's C++ client when the
    interpreter exits aborts the process ("terminate called without an active exception"), whose
    exit code then says SIGABRT rather than its own. Also run at exit (atexit)."""
    stopped, thread = _heartbeat.pop("stop", (None, None))
    if stopped is not None:
        stopped.set()
        thread.join(timeout=10)


def _store_host_alive(store, what: str) -> bool:
    if not store_listening(store):
        message = (f"the rendezvous store's host (rank 0, unless torchrun hosts the store) exited while "
                   f"the workers waited for {what}")
        raise LostWorkerError(message, lost=[])
    return True


def wait_on_store(keys: list[str], what: str, slow_timeout_s: float = 3600.0) -> None:
    """Wait until every key is set on the default store: up to `slow_timeout_s` while all peers
    are alive, but fail within the collective timeout once one of them stops (LostWorkerError)."""
    import torch.distributed as dist

    store, world, me = dist.distributed_c10d._get_default_store(), dist.get_world_size(), dist.get_rank()
    timeout_s = _heartbeat.get("timeout_s")
    if timeout_s is None:  # no beat started here (a group made elsewhere): the default timeout
        from acco.config import TrainArgs

        timeout_s = TrainArgs.timeout_s
    start = time.monotonic()
    seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
    # Polls with `check`, not a blocking `wait`: the store client holds its lock for the whole of
    # a wait, which would also hold up this rank's own heartbeat. Peers' counters are read once
    # a second, to stay light on the store with many ranks. Each poll first asks whether the
    # store's host still listens (a look at a connection kept open, no new one: progress.host_listening):
    # a read of a store whose host died makes torch's C++ client log a stack trace before it raises.
    delay, next_liveness_check = 0.001, start
    while _store_host_alive(store, what) and not store.check(keys):
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
            elif now - last[1] > timeout_s:
                message = (
                    f"rank {rank} stopped responding (died or stalled) while the workers waited for {what}: "
                    f"no sign of life for {now - last[1]:.0f} s (launch.timeout_s={timeout_s:g})"
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


def decided_by_rank0(work, key: str, slow_timeout_s: float = 3600.0) -> str:
    """`work()` (a string) computed on rank 0 only, returned on every rank: the others wait on the
    store for it, as in `after_rank0`. For a decision every rank must follow (whether the job's
    inputs passed the one validation pass)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    key = _unique("decided_by_rank0", key)
    if rank == 0:
        value = work()
        if world > 1:
            dist.distributed_c10d._get_default_store().set(key, value)
        return value
    wait_on_store([key], f"rank 0's {key.rsplit('/', 1)[-1]}", slow_timeout_s)
    return dist.distributed_c10d._get_default_store().get(key).decode()


def leave_the_store(timeout_s: float | None = None) -> None:
    """At the end of a run, before the process group goes: every rank but 0 says it is done with
    the rendezvous store (its last store operation), and rank 0, the store's host unless torchrun
    hosts it, waits for all of them before it may exit. Else a rank still polling for rank 0's
    last one-off work (the model it saves) found the store gone: a C++ stack trace and exit 1 on
    a run that had finished (seen at 125M on 4 workers). A rank that died is waited for at most
    `timeout_s` (the collective timeout). Then the connection kept open to watch the store's host
    (progress.host_listening) is closed: a process may join another group after this one."""
    import torch.distributed as dist

    from acco.engine.progress import forget_hosts

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, world, key = dist.distributed_c10d._get_default_store(), dist.get_world_size(), _unique("left", "")
    try:
        if dist.get_rank() != 0:
            store.add(key, 1)
            return
        deadline = time.monotonic() + (timeout_s or _heartbeat.get("timeout_s") or 60.0)
        while store.add(key, 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # a poll: the others leave within moments of rank 0
    finally:
        forget_hosts()
