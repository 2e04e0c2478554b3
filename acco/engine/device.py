"""The device-specific calls of acco, in one place: streams, events, pinned copies, RNG, peak memory.

Engines, the trainer and checkpoints ask `device_ops(device)` and call what it returns; nothing else
branches on ``device.type == "cuda"``. Both implementations have one contract, so the code that
uses them has one path:

- `CudaOps`: torch.cuda's streams and events; a tensor made on one stream and used on another is
  handed over with ``record_stream``; host copies go through pinned memory.
- `HostOps` (the CPU): work runs when it is issued, so a stream is a name, a wait is a no-op, an
  event's time is the host clock's (`time.perf_counter`) when it is recorded and its
  ``elapsed_time`` the span between two of them.

`simulate(factory)` replaces the choice for tests: tests/fake_cuda.py runs the CUDA contract on CPU
tensors and checks CUDA's rules as it goes (`make test` reaches every branch written for the GPU).
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable

import torch


class HostStream:
    """A stream on the host: work issued on it has run by the time the call returns."""

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HostEvent:
    """An event on the host: recorded when the work before it is done (always, there)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False):
        self.enable_timing = enable_timing
        self.time_s: float | None = None

    def record(self, stream=None) -> None:
        self.time_s = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to `end`, as torch.cuda.Event.elapsed_time."""
        return (end.time_s - self.time_s) * 1000


class HostOps:
    """The CPU: no streams to overlap, no device memory, the process's own RNG only."""

    streams = False  # whether work is queued on streams that run apart from the host (prefetch pays off)

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = HostStream()

    def new_stream(self, priority: int = 0):
        return HostStream()

    def current_stream(self):
        return self._stream

    def use_stream(self, stream):
        """Context: the calling thread issues its work on `stream`."""
        return contextlib.nullcontext()

    def event(self, enable_timing: bool = False, blocking: bool = False):
        return HostEvent(enable_timing, blocking)

    def bind_thread(self) -> None:
        """Run first in every thread that issues work (the comm thread). On the host the comm
        thread's round computes beside the training thread: it gets one intra-op thread (the
        setting is per thread), or the two threads' OpenMP teams share the cores and spin against
        each other (acco at 0.82-0.85 of ddp's tokens/s on 2 cores with GPT-Neo tiny at 8 x 256,
        0.96-0.97 with this: BENCHMARKS-history.md, "From 1: the comm thread's cores on the CPU")."""
        torch.set_num_threads(1)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """`tensor` was made on another stream and is used on `stream` from now on."""

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor's copy on the device, queued on the current stream (asynchronous on CUDA)."""
        return tensor.to(self.device)

    def host_buffer(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor that device work may copy into asynchronously (pinned on CUDA)."""
        return torch.zeros(*shape, dtype=dtype)

    def rng_state(self) -> torch.Tensor | None:
        """The device's own RNG state (None: the device has none apart from torch's CPU RNG)."""
        return None

    def set_rng_state(self, state: torch.Tensor) -> None:
        pass

    def peak_memory(self) -> tuple[str, float]:
        """(metric name, MiB): the process's peak resident memory on the host (Linux: ru_maxrss in KiB)."""
        return "peak_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def name(self) -> str:
        return "cpu"


class CudaOps(HostOps):
    """One CUDA device: torch.cuda's streams and events."""

    streams = True

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self, priority: int = 0):
        return torch.cuda.Stream(device=self.device, priority=priority)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def event(self, enable_timing: bool = False, blocking: bool = False):
        return torch.cuda.Event(enable_timing=enable_timing, blocking=blocking)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def host_buffer(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, pin_memory=True)

    def rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def peak_memory(self) -> tuple[str, float]:
        """The caching allocator's peak of allocated GPU memory (not the host's)."""
        return "peak_gpu_mem_mb", torch.cuda.max_memory_allocated(self.device) / 2**20

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)


def mesh_device_type(device: torch.device) -> str:
    """The device type of a DeviceMesh over `device`'s workers: its own, but for a module on the meta
    device (built only to count what it would hold) the host's: FSDP2 takes no "meta" mesh, and
    shards meta parameters as they are."""
    return "cpu" if device.type == "meta" else device.type


_factory: Callable[[torch.device], HostOps] | None = None


def device_ops(device: torch.device) -> HostOps:
    """The device calls for `device` (CudaOps on a GPU, HostOps on the CPU, or what `simulate` set)."""
    if _factory is not None:
        return _factory(device)
    return CudaOps(device) if device.type == "cuda" else HostOps(device)


def simulate(factory: Callable[[torch.device], HostOps] | None) -> None:
    """Tests: `device_ops` returns `factory(device)` from now on (None: the real choice again)."""
    global _factory
    _factory = factory
