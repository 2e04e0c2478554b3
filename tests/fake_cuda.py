"""A fake CUDA device: acco's CUDA branches (acco/engine/device.py's `CudaOps` contract) run on CPU
tensors, and CUDA's rules are checked as they go, so `make test` reaches the code written for the
GPU and fails where a GPU would misbehave.

    with fake_cuda.installed() as fake:   # every device_ops(...) in this process is `fake`
        ... build and run an engine, a trainer ...
    assert fake.counts["rounds"] ...

Work runs at once on the CPU, but the fake keeps the order a GPU would guarantee: each stream has a
vector clock; an op issued on stream S advances S; an event records S's clock, a stream's
`wait_event` takes it in, and a host wait (an event's or a stream's `synchronize`, an `.item()`)
makes it known to everything issued afterwards. Every aten op is seen (a TorchDispatchMode, in each
thread that issues work) with the storages it reads and writes. It raises `StreamRuleError` when

- a stream reads or writes memory that another stream wrote (or read, for a write) with no event
  or host wait ordering the two: a race on a GPU;
- a tensor made on a side stream (a prefetch copy, a round's temporary) is used on another stream
  before ``record_stream`` hands it over (the caching allocator could give its memory out again);
- a stream waits on, or the host synchronises, an event that was never recorded;
- ``elapsed_time`` is taken between events without timing, recorded on different streams, or
  before the later one is known to have completed.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from acco.engine import collectives
from acco.engine import device as device_module


class StreamRuleError(AssertionError):
    """A use of streams or events that would be wrong on a GPU."""


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class FakeStream:
    def __init__(self, fake: FakeCuda, name: str):
        self.fake, self.name = fake, name
        self.clock = {name: 0}

    def wait_event(self, event: FakeEvent) -> None:
        with self.fake.lock:
            if event.clock is None:
                self.fake.fail(f"stream {self.name} waits on an event that was never recorded")
            _merge(self.clock, event.clock)
            self.fake.counts["waits"] += 1

    def synchronize(self) -> None:
        with self.fake.lock:
            _merge(self.fake.host, self.clock)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, fake: FakeCuda, enable_timing: bool, blocking: bool):
        self.fake, self.enable_timing, self.blocking = fake, enable_timing, blocking
        self.clock: dict | None = None
        self.stream: FakeStream | None = None
        self.time_s = 0.0
        self.completed = False  # the host knows that the work before it is done

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.fake.current_stream()
        with self.fake.lock:
            _merge(stream.clock, self.fake.host)
            self.clock, self.stream, self.completed = dict(stream.clock), stream, False
            self.time_s = time.perf_counter()

    def synchronize(self) -> None:
        with self.fake.lock:
            if self.clock is None:
                self.fake.fail("the host waits on an event that was never recorded")
            _merge(self.fake.host, self.clock)
            self.completed = True

    def query(self) -> bool:
        self.synchronize()
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        for e in (self, end):
            if not e.enable_timing:
                self.fake.fail("elapsed_time on an event made without enable_timing")
            if e.clock is None:
                self.fake.fail("elapsed_time on an event that was never recorded")
        if self.stream is not end.stream:
            self.fake.fail(f"elapsed_time between events on streams {self.stream.name} and {end.stream.name}")
        if not end.completed:
            self.fake.fail("elapsed_time before the host waited for the later event")
        self.fake.counts["timings"] += 1
        return (end.time_s - self.time_s) * 1000


class _Record:
    """What the fake knows of one storage: where it was made, its last write, the reads since."""

    __slots__ = ("made_on", "handed_to", "write", "reads")

    def __init__(self, made_on: str | None):
        self.made_on = made_on  # a side stream's name, or None (the default stream, or before the fake)
        self.handed_to: set[str] = set()  # streams named by record_stream
        self.write: tuple[str, int] | None = None
        self.reads: dict[str, int] = {}


class _Seen(TorchDispatchMode):
    def __init__(self, fake: FakeCuda):
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, FakeTensor) for t in types):
            # DTensor's sharding propagation runs the op on fake tensors (shapes only, no memory):
            # nothing a stream touches, and with this mode popped here their own dispatch runs it.
            return func(*args, **(kwargs or {}))
        if any(t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ for t in types):
            # A wrapper subclass (torch-hsdp's DTensors) has no storage of its own: its own
            # dispatch runs the op on its local tensors, which come back here.
            return NotImplemented
        kwargs = kwargs or {}
        self.fake.before(func, args, kwargs)
        out = func(*args, **kwargs)
        self.fake.after(func, out)
        return out


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


class FakeCuda(device_module.HostOps):
    """One fake GPU for the whole process (every `device_ops` call returns it)."""

    streams = True

    def __init__(self, device: torch.device | None = None):
        super().__init__(torch.device("cpu"))
        self.lock = threading.RLock()
        self.default = FakeStream(self, "default")
        self.host: dict = {}  # what the host knows to be done
        self.records: dict[int, _Record] = {}
        self.local = threading.local()
        self.rng = torch.Generator().manual_seed(0)
        self.counts = {"ops": 0, "waits": 0, "timings": 0, "streams": 0, "handovers": 0}
        self._schemas: dict = {}

    def fail(self, message: str) -> None:
        raise StreamRuleError(f"fake-cuda: {message}")

    # ---- acco/engine/device.py's contract --------------------------------------------------

    def new_stream(self, priority: int = 0) -> FakeStream:
        with self.lock:
            self.counts["streams"] += 1
            return FakeStream(self, f"side{self.counts['streams']}")

    def current_stream(self) -> FakeStream:
        return getattr(self.local, "stream", None) or self.default

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream):
        previous = getattr(self.local, "stream", None)
        self.local.stream = stream
        try:
            with self.seen():
                yield
        finally:
            self.local.stream = previous

    def event(self, enable_timing: bool = False, blocking: bool = False) -> FakeEvent:
        return FakeEvent(self, enable_timing, blocking)

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self.lock:
            self._record(tensor).handed_to.add(stream.name)
            self.counts["handovers"] += 1

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.lock:  # `tensor` is host memory: the host's own writes to it are done
            rec = self._record(tensor)
            if rec is not None:
                rec.write, rec.reads = None, {}
        with self.seen():
            return tensor.clone()  # a new storage, made on the current stream

    def rng_state(self) -> torch.Tensor:
        return self.rng.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.rng.set_state(state)

    def peak_memory(self) -> tuple[str, float]:
        return "peak_gpu_mem_mb", 0.0  # no device memory to measure

    def name(self) -> str:
        return "fake-cuda"

    # ---- the checks ------------------------------------------------------------------------

    @contextlib.contextmanager
    def seen(self):
        """Every op this thread issues inside is checked (entered once per thread)."""
        if getattr(self.local, "seen", False):
            yield
            return
        self.local.seen = True
        try:
            with _Seen(self):
                yield
        finally:
            self.local.seen = False

    def _record(self, t: torch.Tensor, made_on: str | None = None, fresh: bool = False) -> _Record | None:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return None
        try:
            key = storage.data_ptr()
        except RuntimeError:  # a storage with no memory (FSDP2's custom ops' fake outputs)
            return None
        rec = self.records.get(key)
        if rec is None or fresh:
            rec = self.records[key] = _Record(made_on)
            weakref.finalize(storage, self._forget, key, rec)
        return rec

    def _forget(self, key: int, rec: _Record) -> None:
        with self.lock:
            if self.records.get(key) is rec:
                del self.records[key]

    def _accesses(self, func, args, kwargs):
        """(tensor, is_write) for each tensor argument of an op, from its schema; torch's collectives
        (namespace c10d) declare no aliasing: they write their outputs, and in-place ones (allreduce_,
        recv_ ...) their tensors."""
        schema = func._schema
        c10d = func.namespace == "c10d"
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if c10d:
                write = arg.name.startswith("output") or (arg.name == "tensors" and schema.name.endswith("_"))
            else:
                write = arg.alias_info is not None and arg.alias_info.is_write
            for t in _tensors(value):
                yield t, write

    def before(self, func, args, kwargs) -> None:
        returns = func._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return  # a view: no kernel reads or writes anything
        with self.lock:
            stream = self.current_stream()
            _merge(stream.clock, self.host)
            stream.clock[stream.name] += 1
            now = stream.clock[stream.name]
            self.counts["ops"] += 1
            for t, write in self._accesses(func, args, kwargs):
                rec = self._record(t)
                if rec is not None:
                    self._check(rec, stream, write, func)
                    if write:
                        rec.write, rec.reads = (stream.name, now), {}
                    else:
                        rec.reads[stream.name] = now

    def _check(self, rec: _Record, stream: FakeStream, write: bool, func) -> None:
        what = "writes" if write else "reads"
        if rec.made_on is not None and rec.made_on != stream.name and stream.name not in rec.handed_to:
            self.fail(f"{func} on stream {stream.name} {what} a tensor made on stream {rec.made_on} "
                      "without record_stream")
        if (
            rec.write is not None
            and rec.write[0] != stream.name
            and stream.clock.get(rec.write[0], 0) < rec.write[1]
        ):
            self.fail(f"{func} on stream {stream.name} {what} memory written on stream {rec.write[0]} "
                      "with no event or host wait in between")
        if write:
            for other, at in rec.reads.items():
                if other != stream.name and stream.clock.get(other, 0) < at:
                    self.fail(f"{func} on stream {stream.name} writes memory that stream {other} reads, "
                              "with no event or host wait in between")

    def after(self, func, out) -> None:
        with self.lock:
            stream = self.current_stream()
            if func is torch.ops.aten._local_scalar_dense.default:  # .item(): the host waits for the stream
                _merge(self.host, stream.clock)
            # collectives return their inputs
            returns = [] if func.namespace == "c10d" else func._schema.returns
            made_on = None if stream is self.default else stream.name
            fresh = [
                t
                for r, value in zip(returns, out if isinstance(out, tuple) else (out,))
                if r.alias_info is None
                for t in _tensors(value)
            ]
            for t in fresh:
                rec = self._record(t, made_on, fresh=True)
                if rec is not None:
                    rec.write = (stream.name, stream.clock[stream.name])


@contextlib.contextmanager
def installed():
    """Every `device_ops(...)` in this process is one FakeCuda while inside; ops of this thread are
    checked (the comm thread's are, inside its stream). The collectives take torch's own path, as
    on NCCL (on gloo and CPU tensors acco runs its p2p ring, which never meets a GPU stream)."""
    fake = FakeCuda()
    device_module.simulate(lambda device: fake)
    ring, collectives.uses_ring = collectives.uses_ring, lambda *args, **kwargs: False
    try:
        with fake.seen():
            yield fake
    finally:
        device_module.simulate(None)
        collectives.uses_ring = ring


DEVICES = ["host", "fake-cuda"]


def maybe_installed(device: str):
    """`installed()` for "fake-cuda", nothing for "host" (tests parametrized over DEVICES)."""
    return installed() if device == "fake-cuda" else contextlib.nullcontext()
