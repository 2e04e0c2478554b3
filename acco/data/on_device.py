"""Micro-batches on their way to the device: copied (and prefetched on a GPU) by `OnDevice`, and
the data position a checkpoint saves, moved back by what was read but not yet computed (`rewind`,
`Rewound`)."""

from __future__ import annotations

import contextlib
import time

import torch

from acco.data.errors import DataError
from acco.data.instruct import IGNORE_INDEX
from acco.engine.config import ConfigError
from acco.engine.device import device_ops

_NONE = object()


def without_full_mask(batch: dict) -> dict:
    """`batch` without its attention_mask when that mask, still on the host, is all ones: the model
    then takes its mask-free path (SDPA's ``is_causal``), and transformers does not read the mask on
    the device to find out the same (a host sync per forward on a GPU). Any padding keeps the mask."""
    mask = batch.get("attention_mask")
    if mask is None or mask.device.type != "cpu" or not bool(mask.all()):
        return batch
    return {k: v for k, v in batch.items() if k != "attention_mask"}


def check_token_ids(batch: dict, vocab_size: int | None) -> None:
    """Refuse, on the host, a token id the model has no embedding (input_ids) or logit (labels,
    -100 aside) for: on a GPU it would end in a device-side assert that kills the process and names
    no data; on the CPU in an IndexError deep in the model. Pre-tokenized data or a token cache made
    for another vocabulary. A few microseconds per micro-batch, before the copy."""
    if vocab_size is None:
        return
    ids, labels = batch.get("input_ids"), batch.get("labels")
    for name, t in (("input_ids", ids), ("labels", None if labels is ids else labels)):
        if t is None or t.device.type != "cpu" or t.numel() == 0:
            continue
        allowed = (t >= 0) & (t < vocab_size)
        if name == "labels":
            allowed |= t == IGNORE_INDEX
        if not bool(allowed.all()):
            bad = t[~allowed]
            raise DataError(
                f"{name} holds token id {int(bad[0])} ({bad.numel()} such in this micro-batch), outside "
                f"the model's vocabulary of {vocab_size} (ids 0 to {vocab_size - 1}): the data was "
                "tokenized for another vocabulary, or the model's embedding is smaller than its tokenizer"
            )


class OnDevice:
    """Moves each micro-batch to the device (and, for benchmarks, slows this worker down).

    On CUDA the next micro-batch is prefetched: its host-to-device copy is queued on a side
    stream when the current one is handed out, so it runs while the current one computes, and the
    compute stream waits for it only when it uses it (an event, no host sync). `ahead` micro-batches
    have then been read from `stream` but not handed out; a checkpoint's data position goes back
    by that many. On CPU nothing is read ahead (`prefetch=True` there runs the same bookkeeping
    without streams, for tests).
    """

    def __init__(self, stream, device: torch.device, slowdown: float = 1.0, prefetch: bool | None = None,
                 vocab_size: int | None = None):
        if slowdown > 1 and device.type != "cpu":
            # The stretch is this thread's CPU time: on an accelerator that is launch overhead, not compute.
            raise ConfigError(f"train.slowdown emulates a slower worker on the CPU only; this worker runs on "
                              f"{device.type}: leave train.slowdown at 1 there (use a slower device instead)")
        self.stream, self.device, self.slowdown = stream, device, slowdown
        self.vocab_size = vocab_size  # token ids checked against it (check_token_ids); None: not
        self._last = None
        self.ops = device_ops(device)
        self.prefetch = self.ops.streams if prefetch is None else prefetch
        self.copy_stream = self.ops.new_stream() if self.prefetch else None
        self._next = _NONE  # the prefetched (micro-batch, copy done) pair; None once the stream ended

    @property
    def ahead(self) -> int:
        return int(self._next is not _NONE and self._next is not None)

    def __iter__(self):
        return self

    def _move(self, batch: dict) -> dict:
        # Each distinct tensor is sent once (packed blocks: the labels are the input_ids); on CUDA
        # from pinned memory, so that the copy runs asynchronously to the host.
        moved: dict[int, torch.Tensor] = {}
        for v in batch.values():
            if id(v) not in moved:
                moved[id(v)] = self.ops.to_device(v)
        return {k: moved[id(v)] for k, v in batch.items()}

    def _fetch(self):
        batch = next(self.stream, _NONE)
        if batch is _NONE:
            return None
        check_token_ids(batch, self.vocab_size)
        batch = without_full_mask(batch)  # a host read, before anything is queued on the copy stream
        with self.ops.use_stream(self.copy_stream):
            moved = self._move(batch)
            done = self.ops.event()
            done.record(self.copy_stream)
        return moved, done

    @contextlib.contextmanager
    def not_compute(self):
        """What runs in here between two micro-batches (an evaluation, a checkpoint) is left out of
        the compute that `slowdown` stretches: the race times training without the evaluations."""
        start = time.thread_time()
        try:
            yield
        finally:
            if self._last is not None:
                self._last += time.thread_time() - start

    def __next__(self):
        if self.slowdown > 1 and self._last is not None:
            # Emulate a slower worker: stretch what this thread computed since it took the last
            # micro-batch. Its CPU time, not the wall time: a wait on a round in between (ddp's
            # all-reduce, acco at its cap) is not compute and must not be stretched.
            time.sleep((self.slowdown - 1) * (time.thread_time() - self._last))
        if not self.prefetch:
            batch = next(self.stream)
            check_token_ids(batch, self.vocab_size)
            batch = self._move(without_full_mask(batch))
            self._last = time.thread_time()
            return batch
        current = self._fetch() if self._next is _NONE else self._next
        if current is None:
            self._next = None
            raise StopIteration
        self._next = self._fetch()  # its copy overlaps the compute of `current`
        self._last = time.thread_time()
        batch, done = current
        compute = self.ops.current_stream()
        compute.wait_event(done)
        for t in {id(t): t for t in batch.values()}.values():
            # made on the copy stream, used on the compute stream: the allocator must not hand
            # the memory out again before the compute stream is done with it
            self.ops.record_stream(t, compute)
        return batch


class Rewound:
    """A data position `back` micro-batches behind `position` (those read ahead, not computed)."""

    def __init__(self, position, back: int):
        self.position, self.back = position, back

    def state_dict(self) -> dict:
        return rewind(self.position.state_dict(), self.back)


def rewind(data: dict, n: int) -> dict:
    """A MicroBatchStream state moved back by `n` micro-batches (read ahead, not yet computed)."""
    per_epoch = data["num_samples"] // data["global_batch_size"]
    epoch, position = divmod(data["epoch"] * per_epoch + data["position"] - n, per_epoch)
    return {**data, "epoch": epoch, "position": position}
