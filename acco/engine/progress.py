"""Which rank stopped? Every rank's progress on the rendezvous store, read when a collective fails.

A collective that times out (or loses a connection) only tells a rank which peer it was waiting
for, and in a ring every rank waits on a neighbour: the rank that times out first is usually a
healthy one. To name the rank that really stopped, each rank calls :func:`mark` just before it
enters a collective phase (a comm round, an evaluation's all-reduce, a checkpoint). ``mark``
bumps a counter in memory and wakes a publisher thread, which writes ``"<counter> <label>"`` under
``acco/progress/<rank>`` on the c10d store that ``init_process_group`` rendezvoused on. The store
write is a round trip to rank 0's host (hundreds of microseconds across nodes): off the critical
path, a round never waits for it. Marks made while a write is on its way are folded into the next
one (only the latest matters); never a device sync.

Every rank runs the same phases in the same order, so the counters line up across ranks. When a
collective fails, :func:`explain` reads every rank's counter and names the ranks furthest behind:
they never reached the collective that the others are stuck in, so they are the ones that died or
stalled (``rank 2 stopped responding (died or stalled): its last progress was update 3 (update
round); rank 0 reached update 4 (estimate round)``). Not every rank merely behind this one: a
broadcast lets some ranks through while others still wait on the lost one, so healthy ranks may be
one mark apart. If this rank is itself among the furthest behind, its error is its own and
nothing is said about the others.

:func:`names_lost_ranks` wraps the functions that run collectives (training, evaluation) so that
such a failure leaves them as a :class:`LostWorkerError` with that line, which is all a user of
torchrun or srun sees, and tells acco's local launcher too: :func:`report_lost_ranks` writes the
finding into the folder the launcher names in ``ACCO_FAILURE_DIR``, and the launcher
(acco/launch/local.py) then blames the lost rank rather than whichever worker exited first. This
module is the one place where failures are detected and reported; the engine, the store waits and
the launcher all use it, and it imports none of them.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import threading
import time
from datetime import timedelta

# torch.distributed is imported where it is used: the local launcher imports this module for
# FAILURE_DIR_ENV without paying for torch, which only its workers need.


__all__ = ["FAILURE_DIR_ENV", "LostWorkerError", "explain", "host_listening", "launcher_is_stopping", "mark",
           "names_lost_ranks", "note_stopping", "report_lost_ranks", "store_listening"]

_KEY = "acco/progress/{}"
_lock = threading.Lock()  # the main thread and the comm thread both mark
_count = 0
_label = "nothing yet"
_published = 0  # the count the store holds for this rank
_wake = threading.Event()  # a mark is waiting to be published
_publisher: threading.Thread | None = None
_publish_lock = threading.Lock()
PROBE_EVERY_S = 1.0  # the publisher checks that the store's host is still there this often
_listening_at = -math.inf  # when it last found it there
_closing = False  # the interpreter is exiting: no more writes

# After a failure, how long ranks that are behind get to catch up before they are named: a rank
# that died makes its neighbours fail at once, while another healthy rank may still be computing.
SETTLE_S = 2.0
# Reading the record must not hang on a store whose host is frozen.
_READ_TIMEOUT = timedelta(seconds=5)


class LostWorkerError(RuntimeError):
    """A collective failed because other ranks died or stalled; ``lost`` names them (empty when
    the progress record could not be read)."""

    def __init__(self, message: str, lost: list[int]):
        super().__init__(message)
        self.lost = lost


# A worker that fails because a peer died or stalled writes what it found (which rank stopped)
# into this folder before it exits, so that the launcher blames that rank.
FAILURE_DIR_ENV = "ACCO_FAILURE_DIR"


# What the launcher writes into that folder before it forwards a signal that ends the run (a
# Ctrl-C): a worker that fails afterwards (a peer that stopped first, while this one was inside a
# collective, where no signal handler runs) has nothing to say; the launcher says why the run ended.
_STOPPING = "stopping"


def note_stopping(folder: str) -> None:
    """The launcher's side: the workers of this folder are being stopped on purpose."""
    try:
        open(os.path.join(folder, _STOPPING), "w").close()
    except OSError:
        pass  # the workers then report what they find, as they would without the note


def launcher_is_stopping() -> bool:
    """In a worker of acco's local launcher: whether the launcher is stopping the run on a signal."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    return bool(folder) and os.path.exists(os.path.join(folder, _STOPPING))


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


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def mark(label: str) -> None:
    """Record that this rank reached `label` ("update 7 (estimate round)"): call it just before a
    collective phase that every rank runs. Nothing happens in a one-process run."""
    global _count, _label, _publisher
    if _world() == 1:
        return
    with _lock:
        _count += 1
        _label = label
        if _publisher is None:
            _publisher = threading.Thread(target=_publish_forever, name="acco-progress", daemon=True)
            _publisher.start()
            atexit.register(_stop_publishing)
    _wake.set()


def publish() -> None:
    """Write this rank's latest mark to the store now (the publisher thread does it on its own;
    `explain` calls it before comparing ranks)."""
    import torch.distributed as dist

    global _published, _listening_at
    with _publish_lock:  # one writer at a time: an older mark never overwrites a newer one
        with _lock:
            count, label = _count, _label
        if count != _published and not _closing:
            store = dist.distributed_c10d._get_default_store()
            # a write to a store whose host has exited fails after torch's C++ client has logged a
            # stack trace: look first, at most once a PROBE_EVERY_S (a mark comes every round)
            if time.monotonic() - _listening_at >= PROBE_EVERY_S:
                if not store_listening(store):
                    raise ConnectionError("the store's host has exited")
                _listening_at = time.monotonic()
            store.set(_KEY.format(dist.get_rank()), f"{count} {label}")
            _published = count


def _stop_publishing() -> None:
    """At exit: let a store write on its way finish, and start no other. The publisher is a daemon
    thread, and one still inside the store's C++ client when the interpreter finalises aborts the
    process ("terminate called without an active exception"): its exit code would say SIGABRT."""
    global _closing
    _closing = True  # read under the lock: a write that takes it after this one is never made
    if _publish_lock.acquire(timeout=10):
        _publish_lock.release()


def _publish_forever() -> None:
    while True:
        _wake.wait()
        _wake.clear()
        try:
            publish()
        except Exception:  # the process group is gone (the run ended): nothing to tell until a new one
            pass


def _read(store, rank: int) -> tuple[int, str]:
    key = _KEY.format(rank)
    if not store.check([key]):
        return 0, "nothing yet"  # it never reached a collective phase
    count, label = store.get(key).decode().split(" ", 1)
    return int(count), label


def store_listening(store, timeout_s: float = 1.0) -> bool:
    """False when nothing listens any more at the address of `store` (a TCPStore, or a PrefixStore
    over one): its host, rank 0 unless torchrun hosts the store, has exited. A read would fail too,
    but only after torch's C++ client has logged a stack trace of its failure; a connection of our
    own finds it out in silence. True for other stores, and for a host that does not answer within
    `timeout_s` (the read's own timeout then)."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return True
    return host_listening(store.host, store.port, timeout_s)


_probes: dict[tuple[int, str, int], object] = {}  # (pid, host, port) -> the socket kept open to it
_probes_lock = threading.Lock()


def host_listening(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a server still listens at (host, port), asked without a new connection each time.

    One connection per process and address, opened once, kept open and never written to: the
    server closing its end says its process exited. A connection per look made the store's host
    look up each one's name (torch's store servers, libuv's and the older one, log every new
    client's address), a reverse DNS query on the thread that serves every rank's store
    operations: with a resolver that did not answer, each such query held them all for its 5 s
    timeout, one look in 60 here (BENCHMARKS-history.md, "From the test suite"). When the kept connection
    has closed, one fresh connection tells a store that was started again (torchrun's restarts)
    from one that is gone."""
    import socket

    key = (os.getpid(), host, port)  # a forked child opens its own
    with _probes_lock:
        kept = _probes.get(key)
        if kept is not None:
            if not _closed_by_peer(kept):
                return True
            kept.close()
            del _probes[key]
        try:
            _probes[key] = socket.create_connection((host, port), timeout=timeout_s)
        except TimeoutError:
            return True
        except OSError:  # refused, reset, unreachable: no server there any more
            return False
        return True


def forget_hosts() -> None:
    """Close this process's kept connections (host_listening): its run has left the store."""
    with _probes_lock:
        for key in [k for k in _probes if k[0] == os.getpid()]:
            _probes.pop(key).close()


def _closed_by_peer(sock) -> bool:
    """The server never writes to a connection that sent nothing: readable means closed (EOF or
    an error)."""
    import select
    import socket

    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _furthest_behind(settle_s: float) -> dict[int, str]:
    """{rank: last label} of the ranks furthest behind, if behind this one, once every rank had
    `settle_s` to catch up; {} when this rank is among the furthest behind."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if not store_listening(store):
        raise ConnectionError("the store's host has exited")
    store.set_timeout(_READ_TIMEOUT)  # the run is ending: the store is used for nothing else now
    publish()  # the others compare themselves with this rank's latest mark too
    me, deadline = dist.get_rank(), time.monotonic() + settle_s
    while True:
        others = {rank: _read(store, rank) for rank in range(_world()) if rank != me}
        lowest = min(count for count, _ in others.values())
        if lowest >= _count:
            return {}
        if time.monotonic() >= deadline:
            return {rank: label for rank, (count, label) in others.items() if count == lowest}
        time.sleep(0.25)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


# Words of the errors that gloo, nccl, the c10d store and acco's ring raise when a peer is gone
# (plain RuntimeErrors, mostly): an error of this rank's own (out of memory, a bad shape) must not
# become "rank N stopped responding" because a slower healthy rank had not caught up yet.
_COMM_WORDS = ("gloo", "nccl", "ring exchange", "timed out", "timeout", "connection", "closed by peer",
               "pair closure", "store")


def _is_comm_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", ())  # nccl's and the store's errors, in recent torch
    return isinstance(error, dist_error) or any(w in str(error).lower() for w in _COMM_WORDS)


def explain(error: BaseException, settle_s: float = SETTLE_S) -> LostWorkerError | None:
    """A LostWorkerError naming the ranks furthest behind when `error`, a failed collective, was
    caused by them; None when it is not a communication failure, or no rank is behind this one
    (the error is this rank's own, or the ranks stopped inside the same collective, which the
    record cannot tell apart)."""
    import torch.distributed as dist

    if _world() == 1 or _count == 0 or not _is_comm_failure(error):
        return None
    first_line = (str(error).splitlines() or [""])[0]
    try:
        behind = _furthest_behind(settle_s)
    except Exception:  # the store is gone: it lives in rank 0's process unless torchrun hosts it
        return LostWorkerError(
            f"{first_line} (which rank stopped is unknown: the progress record on the rendezvous store "
            "cannot be read, its host has exited)",
            lost=[],
        )
    if not behind:
        return None
    lost = sorted(behind)  # all at the same mark: one label says where they stopped
    whose = "its" if len(lost) == 1 else "their"
    return LostWorkerError(
        f"{_ranks(lost)} stopped responding (died or stalled): {whose} last progress was "
        f"{behind[lost[0]]}; rank {dist.get_rank()} reached {_label}",
        lost=lost,
    )


def names_lost_ranks(fn):
    """Decorator for a function that runs collectives: a failure caused by ranks that died or
    stalled leaves it as a LostWorkerError naming them (see :func:`explain`), also reported to
    acco's local launcher, which then blames them rather than the first worker that exited."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch.distributed as dist

        try:
            return fn(*args, **kwargs)
        except LostWorkerError:
            raise  # already explained by an inner call
        except RuntimeError as e:  # what gloo, nccl, the store and the ring raise
            if launcher_is_stopping():  # a peer stopped on the launcher's signal: no one to blame
                raise
            lost = explain(e)
            if lost is None:
                raise
            report_lost_ranks(dist.get_rank(), lost.lost, str(lost))
            raise lost from e

    return wrapper
