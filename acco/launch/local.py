"""The launcher of a plain ``python main.py``: local workers, started, watched and stopped.

``launch_local(nproc, argv)`` starts ``nproc`` copies of the command with torchrun's variables
set and stops all of them as soon as one fails, blaming the root cause: a worker that crashed,
else the rank that the others found had stopped (``acco.engine.progress.report_lost_ranks``),
rather than whichever worker happened to exit first. With ``check``, the workers start at once
(importing torch and transformers takes seconds) and wait on a pipe (``wait_for_go``) while the
launcher checks the job's inputs: a bad input stops them before they have done anything, and once
the check has passed, what it returned (the validated job, as bytes) is what each worker reads
from its pipe after the go.

Why not ``torch.distributed.launcher.api.elastic_launch``: it restarts groups, rendezvous through
its own agent, and reports a failure as a multi-line ``ChildFailedError`` table after its own
monitoring interval. Here the contract is smaller and stricter (first failure ends the run within
a second, one line naming the rank, whole process trees killed, signals forwarded), and it is
a few short functions that tests can read.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection

from acco.config import EXIT_SAVED_ON_SIGNAL
from acco.engine.layout import WORKERS_PER_NODE_ENV
from acco.engine.progress import FAILURE_DIR_ENV, note_stopping
from acco.launch.env import free_port

# The signals that the workers save on (train.save_on_signal), for them to catch from their start.
SAVE_SIGNALS_ENV = "ACCO_SAVE_SIGNALS"
# The launcher's end of a worker's start gate: the worker blocks on a read of this fd until the
# launcher has checked the job (b"go" and the check's bytes), or exits when the pipe closes without it.
GO_FD_ENV = "ACCO_GO_FD"


REPORT_PREFIX = "acco-launch-"  # the launchers' report folders, in the temporary directory


def _report_folder() -> tuple[str, int]:
    """A report folder of this launcher's own, and the fd of the lock it holds on it while it runs.

    A launcher killed with SIGKILL runs no ``finally``: its folder stays. The kernel drops its lock
    with it, so each start removes the folders whose lock it can take (a flock, unlike a pid, holds
    across PID namespaces sharing one /tmp). The lock file is locked before it takes the name another
    launcher looks for, so a folder is never seen unlocked while its launcher lives."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), REPORT_PREFIX + "*")):
        try:
            fd = os.open(os.path.join(folder, ".lock"), os.O_RDONLY)
        except OSError:  # not yet locked, another user's, or already removed
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # its launcher runs
            pass
        finally:
            os.close(fd)
    folder = tempfile.mkdtemp(prefix=REPORT_PREFIX)
    fd = os.open(os.path.join(folder, ".lock-new"), os.O_WRONLY | os.O_CREAT, 0o600)  # not inherited
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(os.path.join(folder, ".lock-new"), os.path.join(folder, ".lock"))
    return folder, fd


def handed_job() -> bool:
    """Whether this process is a worker of ``launch_local(..., check=...)``: it will be handed
    what the check returned at its gate (``wait_for_go``)."""
    return GO_FD_ENV in os.environ


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


# When the first worker to fail only lost a peer, how long the launcher waits for the other exits
# before blaming: a dead peer makes its neighbours fail at once, and its own exit is the answer.
_ROOT_CAUSE_WAIT_S = 1.0


def _maybe_consequence(folder: str, rank: int, code: int) -> bool:
    """Whether this failure may be another worker's doing: the worker reported a lost peer, or it
    aborted (SIGABRT is how gloo and NCCL's watchdog end a process whose peer went away; that
    peer's own exit can reach the launcher later, while its interpreter still shuts down)."""
    return code == -signal.SIGABRT or _lost_report(folder, rank) is not None


def local_nproc(setting) -> int:
    """The number of local workers for ``launch.nproc`` (checked by LaunchConfig): "auto" is one
    per GPU, else 2."""
    if setting in (None, "auto"):
        if not glob.glob("/dev/nvidia[0-9]*") and not any(map(os.path.exists, ("/dev/kfd", "/dev/dxg"))):
            return 2  # no GPU device node (NVIDIA, ROCm, WSL): known without importing torch (2 s)
        import torch

        return torch.cuda.device_count() or 2
    return setting


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
    own (no lost-peer report) is the cause: one killed by a signal (OOM killer, segfault) first,
    then one that exited with an error, then one that aborted (often a lost peer's consequence);
    else every failure is a lost peer, and what the survivors found is relayed."""
    reports = {rank: r for rank in failed if (r := _lost_report(folder, rank)) is not None}
    crashed = [rank for rank in failed if rank not in reports]
    named = [r for r in reports.values() if r["lost"]]
    if crashed or not named:
        # min keeps the exit order among equals
        rank = min(crashed or failed, key=lambda r: (failed[r] == -signal.SIGABRT, failed[r] >= 0))
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
    check: Callable[[], bytes | None] | None = None,
    save_signals: Collection[int] = (),
    workers_per_node: int | None = None,
) -> int:
    """Run ``nproc`` local workers of ``argv`` (torchrun's variables set, master 127.0.0.1 on a
    free port) and wait for them, grouped into emulated nodes of ``workers_per_node`` (None: one
    node; each worker's ACCO_WORKERS_PER_NODE, acco/engine/layout.py).

    With ``check``, the workers are started first and ``check()`` runs here meanwhile; the workers
    go on past ``wait_for_go()`` only once it has returned, and that returns the bytes ``check()``
    returned (b"" for None). If it raises, the workers are stopped (they have done nothing but
    import) and the exception propagates.

    Returns 0 when every worker exits 0. As soon as one exits otherwise, one line naming the rank
    at fault goes to stderr, the others get SIGTERM and, after ``grace_s`` seconds, SIGKILL; the
    return value is the exit code of the worker blamed (128 + signal number when it was killed).
    The rank at fault is the worker that failed, unless it failed only because a peer died or
    stalled: it then reported the lost rank (``report_lost_ranks``) or aborted, the launcher waits
    a moment for a worker that failed on its own and, if none did, blames the abort or relays the
    report. SIGINT and SIGTERM received by the launcher are forwarded to the workers, which get
    ``grace_s`` seconds before SIGKILL (a second signal kills them at once); the launcher then
    returns 128 + signal number. A signal of ``save_signals`` (train.save_on_signal) is forwarded
    too, and then the launcher waits for the workers to checkpoint and exit (a second signal kills
    them at once); workers that exit with EXIT_SAVED_ON_SIGNAL (also on a signal of their own) are
    no failure, and the launcher returns that code (0 if every worker finished its run instead).
    Each worker runs in its own process group, killed whole at the end, so nothing is left behind;
    if the launcher itself is killed, the kernel sends the workers SIGTERM (Linux), and the next
    launch removes its report folder (``_report_folder``).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    report_dir, report_lock = _report_folder()
    base = _workers_env(nproc, env_extra, report_dir, save_signals, workers_per_node)
    launch = _Launch(save_signals, report_dir)
    checked = check is None
    try:
        preexec = _parent_death_signal_setter()
        if check is None:
            # Before the first worker starts: a signal that arrives once a worker runs (however
            # soon, and however long this process then waits for a core) is forwarded, not the
            # end of the launcher alone.
            launch.forward_signals()
        else:
            # A preemption notice while the job is checked is forwarded as well: each worker notes
            # it from its first moments (preemption.catch_early), and its run stops after the first
            # update, checkpointed. A Ctrl-C stays a KeyboardInterrupt until the check has passed.
            launch.forward_signals(save_signals)
        launch.start(nproc, argv, base, preexec, gated=check is not None)
        if check is not None:
            # a Ctrl-C here is a KeyboardInterrupt: the finally stops the workers
            handed = b"go" + (check() or b"")
            checked = True
            launch.forward_signals()
            launch.open_gates(handed)
        return launch.wait()
    finally:
        # A job refused by its check: its workers have only imported (and note SIGTERM as a
        # preemption notice while they start): killed at once, the error said without a wait.
        launch.stop(grace_s if checked else 0.0)
        shutil.rmtree(report_dir, ignore_errors=True)
        os.close(report_lock)
        launch.restore_signals()


def _workers_env(
    nproc: int, env_extra: dict | None, report_dir: str, save_signals: Collection[int],
    workers_per_node: int | None,
) -> dict:
    """The environment every worker shares: torchrun's variables, the layout of its emulated nodes,
    its report folder and the signals it saves on (each worker adds its RANK and LOCAL_RANK, its
    index on this machine: the GPU it takes, whatever its emulated node)."""
    base = dict(os.environ, **{WORKERS_PER_NODE_ENV: str(workers_per_node or nproc)})
    base.update({k: str(v) for k, v in (env_extra or {}).items()})
    saves = ",".join(signal.Signals(s).name for s in save_signals)
    base.update(
        {FAILURE_DIR_ENV: report_dir, SAVE_SIGNALS_ENV: saves},
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
    )
    return base


class _Launch:
    """One launch's workers, their start gates, and the signals it received: the signal handler
    appends to ``signals_received`` and forwards, the waiting loop reads it."""

    def __init__(self, save_signals: Collection[int], report_dir: str):
        self.save_signals, self.report_dir = save_signals, report_dir
        self.procs: list[subprocess.Popen] = []
        self.gates: list[int] = []  # write ends of the workers' start gates
        self.signals_received: list[int] = []
        self.signalled: set[int] = set()  # the workers that a forwarded signal has reached
        self.previous: dict = {}  # the launcher's caller's handlers, restored at the end
        self.forwarded = False  # a signal was forwarded to the workers: no SIGTERM of ours on top

    def on_signal(self, signum, _frame) -> None:  # forward; no locks taken here
        self.signals_received.append(signum)  # a second signal, or one that saves nothing, ends the run:
        # the workers say nothing (note_stopping)
        if signum not in self.save_signals or len(self.signals_received) > 1:
            note_stopping(self.report_dir)
        for p in self.procs:
            if p.returncode is None:
                _signal_group(p, signum if len(self.signals_received) == 1 else signal.SIGKILL)
                self.signalled.add(p.pid)

    def forward_signals(self, which: Collection[int] | None = None) -> None:
        if which is None:
            which = (signal.SIGINT, signal.SIGTERM, *self.save_signals)
        if threading.current_thread() is threading.main_thread():
            for sig in set(which):
                handler = signal.signal(sig, self.on_signal)
                self.previous.setdefault(sig, handler)

    def start(self, nproc: int, argv: list[str], base: dict, preexec, gated: bool) -> None:
        """Start the workers, each behind a start gate (a pipe) when `gated`."""
        for rank in range(nproc):
            if self.signals_received and not gated:  # no more workers: wait() returns 128 + signal
                break
            env, fds = dict(base, RANK=str(rank), LOCAL_RANK=str(rank)), ()
            if gated:
                read_end, write_end = os.pipe()
                self.gates.append(write_end)
                env[GO_FD_ENV], fds = str(read_end), (read_end,)
            try:
                self.procs.append(
                    subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=preexec, pass_fds=fds)
                )
            finally:
                for fd in fds:
                    os.close(fd)

    def open_gates(self, handed: bytes) -> None:
        """Hand every worker `handed` through its gate; closed once written: the worker reads to the end."""
        while self.gates:
            fd = self.gates.pop()
            try:
                _write_all(fd, handed)
            except BrokenPipeError:  # that worker has died: its exit is reported by wait()
                pass
            finally:
                os.close(fd)

    def wait(self) -> int:
        """Wait for the workers: the launch's exit code (see launch_local)."""
        exits: queue.Queue = queue.Queue()  # (rank, returncode) in the order the workers exit
        # waiter threads only once every fork is done (preexec_fn and threads do not mix)
        for rank, p in enumerate(self.procs):
            threading.Thread(target=lambda r=rank, p=p: exits.put((r, p.wait())), daemon=True).start()
        signals = self.signals_received
        running, saving, saved, failed, finished, result = len(self.procs), False, False, {}, 0, 0
        while running or signals:
            if signals and not (saving and len(signals) == 1):
                for p in self.procs:  # one that the signal came before (it arrived while the worker started)
                    if p.pid not in self.signalled and p.returncode is None:
                        _signal_group(p, signals[0])
                result, self.forwarded = 128 + signals[0], True
                # a save signal: the workers finish an update, checkpoint it and exit; wait for them
                saving = signals[0] in self.save_signals and len(signals) == 1 and running > 0
                if not saving:
                    break
            if not running:
                break
            try:
                rank, code = exits.get(timeout=0.2)
            except queue.Empty:
                continue
            running -= 1
            saved |= code == EXIT_SAVED_ON_SIGNAL
            finished += code == 0
            # checkpointed on a signal, or finished, or stopped by the signal forwarded to it (before
            # training began, or a signal that saves nothing; a second one kills): no failure, also
            # when its exit comes before the loop has seen the signal
            sig = signals[0] if signals else None
            by_signal = sig is not None and code in (0, -sig, 128 + sig)
            by_signal |= len(signals) > 1 and code == -signal.SIGKILL
            if code == EXIT_SAVED_ON_SIGNAL or by_signal:
                continue
            if code != 0:
                failed = {rank: code}
                result = self._blame(failed, exits, running)
                break
        if finished == len(self.procs):  # a save signal after the last update: the run completed
            return 0
        return EXIT_SAVED_ON_SIGNAL if saved and not failed else result

    def _blame(self, failed: dict[int, int], exits: queue.Queue, running: int) -> int:
        """A worker failed (`failed`): name the rank at fault in one line and return its code. A
        failure that may be a peer's consequence waits a moment for the cause to exit too."""
        rank, code = next(iter(failed.items()))
        if _maybe_consequence(self.report_dir, rank, code):  # wait a moment for the cause
            deadline = time.monotonic() + _ROOT_CAUSE_WAIT_S
            while running and time.monotonic() < deadline:
                try:
                    rank, code = exits.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                running -= 1
                if code != 0:
                    failed[rank] = code
        line, result = _root_cause(failed, self.report_dir, self.procs)
        alive = sum(p.returncode is None for p in self.procs)
        # one write of the whole line: the workers write to the same stderr, and print()
        # writes the newline separately where stderr is unbuffered (PYTHONUNBUFFERED=1)
        sys.stderr.write(f"acco.launch: {line}; stopping the other {alive} worker(s)\n")
        sys.stderr.flush()
        return result

    def stop(self, grace_s: float) -> None:
        """Close the gates not yet opened and stop every worker still running (``_stop``)."""
        for fd in self.gates:
            os.close(fd)
        _stop(self.procs, grace_s, terminate=not self.forwarded)

    def restore_signals(self) -> None:
        for sig, handler in self.previous.items():
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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def wait_for_go() -> bytes | None:
    """In a worker of ``launch_local(..., check=...)``: block until the launcher has checked the
    job, and return what its check returned (bytes). If the launcher closes the gate without a go
    (the check failed, or it died), exit at once and quietly: the launcher reports why. Returns
    None at once in any other process."""
    fd = os.environ.pop(GO_FD_ENV, None)
    if fd is None:
        return None
    chunks = []
    try:
        while chunk := os.read(int(fd), 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(int(fd))
    handed = b"".join(chunks)
    if not handed.startswith(b"go"):
        os._exit(0)
    return handed[2:]
