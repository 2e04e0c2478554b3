"""Save on the cluster's signal: a preemption notice (SLURM's SIGTERM, or `--signal=USR1@90` ahead of
the time limit) turns into a request to stop, not a kill.

The handler only sets a flag (`request_stop` of the engine, signal-safe): the engine sends it with
its next round's statistics, every worker learns it in the same round, the trainer writes a
checkpoint after that update and the job exits with EXIT_SAVED_ON_SIGNAL. So a signal may reach one
rank or all of them, at any moment (during a save, an evaluation, the warm start): nothing is
issued from the handler, and no collective of its own decides where to stop. Before training, from
a worker's first moments (`catch_early`), a signal is noted, and training then stops after its
first update.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

# Signals of train.save_on_signal caught before training began (catch_early): the run stops after
# its first update, checkpointed, as if they had come then.
_noted: list[str] = []


def catch_early(names) -> None:
    """From a worker's first moments until training (where `save_on_signals` takes over), a signal
    of `names` is noted instead of ending the process: a preemption notice during start-up
    (tokenizing, building the model) then checkpoints the first update and exits as any other."""
    if threading.current_thread() is not threading.main_thread():
        return
    owner = os.getpid()

    def note(signum, _frame):
        if os.getpid() != owner:  # a child forked since (a multiprocessing pool): the default, as before
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _noted.append(signal.Signals(signum).name)

    for name in names:
        signal.signal(signal.Signals[name], note)


def stop_catching_early(names) -> None:
    """The default action again for `names` (catch_early's), and no note left behind."""
    if threading.current_thread() is threading.main_thread():
        for name in names:
            signal.signal(signal.Signals[name], signal.SIG_DFL)
    _noted.clear()


@contextlib.contextmanager
def save_on_signals(names: list[str], request_stop: Callable[[], None]) -> Iterator[list[str]]:
    """Inside, each signal of `names` calls `request_stop` (once) instead of ending the process; the
    list yielded holds the names of the signals caught. Outside the main thread (where Python
    cannot set handlers) nothing is installed."""
    caught: list[str] = []
    if not names or threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def on_signal(signum, _frame):
        if not caught:
            request_stop()
        caught.append(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.Signals[name] for name in names)}
    if _noted:  # a notice during start-up: stop after the first update
        request_stop()
        caught.extend(_noted)
        _noted.clear()
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
