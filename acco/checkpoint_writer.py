"""Checkpoints written in the background, so that training pauses only for a copy to host memory.

A save at 125M on 4 CPU workers stalls every worker for about 4 s (BENCHMARKS.md, "Checkpoint
pause"): each writes a 500 MB shard and rank 0 then the model. With `train.async_save` (the
default) the training thread only copies the state it saves into host buffers (pinned on a GPU,
reused from one save to the next) and a writer thread does the rest: the files, the store
handshakes of `checkpoint.save` (no collective: nothing here can interleave with the engine's
rounds), meta.json and the atomic rename. One save is in flight at most: the next one, the end of
training and a stop on a signal wait for it, and its error is raised there. The snapshot is taken
at the same point as a blocking save's, so a resume is exactly as before; a crash mid-write
leaves a .tmp folder and the previous checkpoint, as before.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

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
                print(f"acco: the checkpoint being written was abandoned after {timeout_s:.0f} s", file=sys.stderr)
            self._thread = self._error = None
        self._buffers = {}
