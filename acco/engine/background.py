"""The background worker that overlaps a comm round with the next micro-batches: one thread and
its own stream (acco/engine/device.py), and what it hands back on every device, `Timed`."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from acco.engine.device import device_ops

T = TypeVar("T")

COMM_THREAD_NAME = "acco-comm"  # the name top -H, py-spy and /proc/PID/task/TID/comm show
_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` at the OS level too (Linux; at most 15 bytes), so that the
    comm thread's CPU time can be told apart from the training thread's (acco-bench counts it)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


@dataclass
class Timed(Generic[T]):
    """What `BackgroundComm` hands back, on every device: the round's value and its busy seconds,
    the span on the comm stream from its payload being ready to its last kernel (on the CPU, the
    host clock's span of the round's work)."""

    value: T
    busy_s: float


class BackgroundComm:
    """Runs comm rounds on one background thread and its own stream (acco/engine/device.py).

    The compute stream only records an event for the comm stream to wait on: no host sync on the
    compute side. The comm thread waits for its own stream's work (a blocking event) before
    reporting a round done, so `Future.done()` means the new parameters are really there.
    """

    def __init__(self, device: torch.device):
        self.ops = device_ops(device)
        # High priority (lower is higher): the round's kernels go first when both streams have
        # work queued, so a round is not held up behind the next micro-batch's compute.
        self.stream = self.ops.new_stream(priority=-1)
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=COMM_THREAD_NAME, initializer=self._start_thread
        )

    def _start_thread(self) -> None:
        name_os_thread(COMM_THREAD_NAME)
        self.ops.bind_thread()

    def submit(self, round_fn: Callable[[], T]) -> Future[Timed[T]]:
        payload_ready = self.ops.event()
        payload_ready.record(self.ops.current_stream())

        def on_comm_stream() -> Timed[T]:
            with self.ops.use_stream(self.stream):
                self.stream.wait_event(payload_ready)
                started = self.ops.event(enable_timing=True)
                started.record(self.stream)
                value = round_fn()
                # the comm thread sleeps, it does not spin a core
                done = self.ops.event(enable_timing=True, blocking=True)
                done.record(self.stream)
            done.synchronize()
            # The round's span on its stream (the host's part alone would miss the kernels still queued).
            return Timed(value, started.elapsed_time(done) / 1000)

        return self.executor.submit(on_comm_stream)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
