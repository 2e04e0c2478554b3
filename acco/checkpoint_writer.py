"""Checkpoints written in the background, so that training pauses only for a copy to host memory.

A save at 125M on 4 CPU workers stalls every worker for about 4 s (BENCHMARKS.md, "Checkpoint
pause"): each writes a 500 MB shard and rank 0 then the model. With `train.async_save` (the
default) the training thread only copies the state it saves into host buffers (pinned on a GPU,
reused from one save to the next) and a writer thread does the rest: the files and their
fsyncs, the store handshakes of `checkpoint.save` (no collective: nothing here can interleave with
the engine's rounds), meta.json and the atomic rename. One save is in flight at most: the next one, the end of
training and a stop on a signal wait for it, and its error is raised there. The snapshot is taken
at the same point as a blocking save's, so a resume is exactly as before; a crash mid-write
leaves a .tmp folder and the previous checkpoint, as before.

Here too, the check a save makes first (`non_finite`): no NaN or inf in any worker's state, one
all-reduced flag, so that every rank refuses the same checkpoint.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from acco.engine.device import device_ops


class CheckpointWriter:
    """Writes one checkpoint at a time: in a background thread (`background`) or at once."""

    def __init__(self, device: torch.device, background: bool):
        self.ops = device_ops(device)
        self.background = background
        self._buffers: dict[str, torch.Tensor] = {}  # name -> host buffer, reused by the next save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written: Path | None = None  # the newest checkpoint written, once waited for

    def host_copy(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """`tensor`'s value now, on the host, where training cannot change it. Queued on the current
        stream (non-blocking on a GPU); `submit` hands it to the writer once the copy is done."""
        if not self.background:  # written before training goes on: a plain copy, not kept
            return tensor.detach().to("cpu", copy=True)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.ops.host_buffer(tensor.numel(), dtype=tensor.dtype).view(tensor.shape)
            self._buffers[name] = buffer
        return buffer.copy_(tensor.detach(), non_blocking=True)

    def snapshot(self, state, name: str = ""):
        """A nested state (dicts, lists, tensors, numbers) whose tensors are host copies (in the
        background) or the state itself (written at once: nothing changes it meanwhile)."""
        if not self.background:
            return state
        if isinstance(state, torch.Tensor):
            return self.host_copy(state, name)
        if isinstance(state, Mapping):
            return {k: self.snapshot(v, f"{name}.{k}") for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.snapshot(v, f"{name}.{i}") for i, v in enumerate(state))
        return state

    def submit(self, write: Callable[[], Path]) -> None:
        """Run `write` (it reads only snapshots): now, or in the writer thread once the snapshot's
        copies queued so far have landed. The caller waited for the previous save (`wait`)."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint is still being written: wait() for it first")
        if not self.background:
            self.written = write()
            return
        copied = self.ops.event()
        copied.record()

        def run() -> None:
            try:
                copied.synchronize()
                self.written = write()
            except BaseException as e:  # raised in the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="acco-checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the save in flight is on disk; raise its error. Returns the newest checkpoint."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self.written

    def close(self, timeout_s: float) -> None:
        """The end of training: free the host buffers. After a failure, give the save in flight
        `timeout_s` to finish (it fails by itself within the collective timeout when a peer is
        gone), and never raise its error over the one that is propagating."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                print(
                    f"acco: the checkpoint being written was abandoned after {timeout_s:.0f} s",
                    file=sys.stderr,
                )
            self._thread = self._error = None
        self._buffers = {}


# --------------------------------------------------------------------------- the state's check before a save


def floating_tensors(state, name: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every floating-point tensor in a nested state (dicts, lists)."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point():
            yield name, state
    elif isinstance(state, Mapping):
        for k, v in state.items():
            yield from floating_tensors(v, f"{name}.{k}" if name else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from floating_tensors(v, f"{name}.{i}" if name else str(i))


def _non_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool: `t` holds NaN or +-inf. By its min and max (torch.aminmax propagates NaN; an
    inf is the min or the max): one pass, two scalars, where torch.isfinite(t) would allocate a
    bool per element (the accumulator: P bytes) and a sum or a norm could overflow on finite values."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return ~torch.isfinite(torch.stack(torch.aminmax(t))).all()


def non_finite(state, device, world_size: int) -> list[str]:
    """[] when every floating tensor of every worker's `state` is finite; else this worker's
    offending names (or a note that another worker has them). One all-reduced flag; the tensors
    are summed up on their device, with no host sync per tensor."""
    tensors = list(floating_tensors(state))
    bad = torch.zeros(1, device=device)
    for _, t in tensors:
        bad += _non_finite(t).to(device=device, dtype=bad.dtype)
    if world_size > 1:
        dist.all_reduce(bad)
    if bad.item() == 0:
        return []
    return [name for name, t in tensors if _non_finite(t)] or ["(on another worker)"]
