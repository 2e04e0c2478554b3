"""Feeding micro-batches to data-parallel workers, and carving out an eval split.

`MicroBatchStream` is what one worker (rank) iterates over during training. For every epoch a
permutation of all samples is drawn from (seed, epoch), the same on every rank, and cut into
global batches of `batch_size * world_size` samples; rank r takes the r-th `batch_size` slice of
each global batch. So:

- ranks never see the same sample within an epoch, and together they cover it (except for the
  tail of fewer than one global batch, dropped so that every rank has as many micro-batches);
- the k-th global batch is the same set of samples whatever `world_size` is, for one
  `batch_size * world_size`: a 2-rank run and a 1-rank run with a doubled batch see the same data,
  which is what method-against-reference tests need;
- the stream is infinite (epochs follow each other) and its position is two integers, saved by
  `state_dict()`, so a resumed run continues with exactly the batches it would have seen.

Ranks may consume micro-batches at different rates (ACCO lets fast workers accumulate more);
each rank still only reads its own slices, so shards stay disjoint.

Datasets are `Rows`: columns (torch tensors or numpy arrays, memory-mapped ones included) seen
through an index array. The train/eval split and the shards select indices, never tokens; a
micro-batch reads its rows and widens them to int64 only when it is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from .errors import DataError

_KEYS = ("input_ids", "labels", "attention_mask")


def split_train_eval(n: int, eval_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (train_idx, eval_idx) LongTensors that partition range(n), for datasets without eval.

    The eval set is `round(n * eval_fraction)` samples, at least 1, drawn at random from `seed`,
    so the same (n, eval_fraction, seed) always gives the same split.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(
            f"train.eval_fraction must be between 0 and 1 (exclusive) to carve an eval set out of the "
            f"training data, got {eval_fraction} (give an eval set, or set train.eval=false)"
        )
    if seed < 0:
        raise DataError(f"seed must be >= 0, got {seed}")
    n_eval = max(1, round(n * eval_fraction))
    if n - n_eval < 1:
        raise DataError(f"cannot split {n} samples into train and eval with eval_fraction {eval_fraction}")
    perm = torch.from_numpy(np.random.default_rng([seed, n]).permutation(n))
    eval_idx, _ = torch.sort(perm[:n_eval])
    train_idx, _ = torch.sort(perm[n_eval:])
    return train_idx, eval_idx


Array = torch.Tensor | np.ndarray


def as_columns(data: Array | Mapping[str, Array]) -> dict[str, Array]:
    """The model inputs of a dataset as equally long arrays: input_ids, labels[, attention_mask].

    A single tensor or array is packed blocks: its labels are its input_ids (causal LMs shift
    labels inside the model). A dict without labels gets labels = input_ids too. Other keys are
    left out, so a batch can be passed to `model(**batch)` as it is.
    """
    if isinstance(data, torch.Tensor | np.ndarray):
        columns = {"input_ids": data, "labels": data}
    else:
        if "input_ids" not in data:
            raise DataError(f"dataset needs an 'input_ids' tensor (keys: {', '.join(data)})")
        columns = {k: data[k] for k in _KEYS if k in data}
        columns.setdefault("labels", columns["input_ids"])
    n = len(columns["input_ids"])
    for key, value in columns.items():
        if not isinstance(value, torch.Tensor | np.ndarray):
            raise DataError(
                f"dataset column {key!r} is a {type(value).__name__}, not a torch.Tensor or numpy array"
            )
        if len(value) != n:
            raise DataError(
                f"dataset columns differ in length: input_ids has {n} rows, {key} has {len(value)}"
            )
    return columns


class Rows:
    """A dataset's columns seen through an optional index array: row i is row index[i].

    `select` composes index arrays (a split or a shard costs 8 bytes a row, whatever the rows
    hold); `take` reads rows and returns them as int64 tensors.
    """

    def __init__(self, data: Array | Mapping[str, Array], index: np.ndarray | None = None):
        self.columns = as_columns(data)
        self.index = index
        self._n = len(self.columns["input_ids"]) if index is None else len(index)

    def __len__(self) -> int:
        return self._n

    def select(self, idx: torch.Tensor | np.ndarray | Sequence[int]) -> Rows:
        idx = np.asarray(idx, dtype=np.int64)
        rows = Rows.__new__(Rows)
        rows.columns, rows.index, rows._n = (
            self.columns,
            idx if self.index is None else self.index[idx],
            len(idx),
        )
        return rows

    def take(self, idx: torch.Tensor | np.ndarray | Sequence[int]) -> dict[str, torch.Tensor]:
        idx = np.asarray(idx, dtype=np.int64)
        if self.index is not None:
            idx = self.index[idx]
        read: dict[int, torch.Tensor] = {}  # a column given twice (packed blocks' labels) is read once
        for value in self.columns.values():
            if id(value) not in read:
                read[id(value)] = _read(value, idx)
        return {key: read[id(value)] for key, value in self.columns.items()}


def _read(column: Array, idx: np.ndarray) -> torch.Tensor:
    if isinstance(column, torch.Tensor):
        return column[torch.from_numpy(idx)].long()
    # Fancy indexing reads just these rows, also from a memory-mapped file.
    return torch.from_numpy(column[idx].astype(np.int64))


def as_rows(data: Rows | Array | Mapping[str, Array]) -> Rows:
    return data if isinstance(data, Rows) else Rows(data)


class MicroBatchStream:
    """Infinite, resumable iterator over this rank's micro-batches (dicts of int64 tensors)."""

    def __init__(
        self,
        data: Rows | Array | Mapping[str, Array],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        if batch_size < 1 or world_size < 1:
            raise DataError(f"batch_size and world_size must be >= 1, got {batch_size} and {world_size}")
        if not 0 <= rank < world_size:
            raise DataError(f"rank must be in [0, {world_size}), got {rank}")
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        self.rows = as_rows(data)
        self.num_samples = len(self.rows)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        if self.num_samples < self.global_batch_size:
            raise DataError(
                f"dataset has {self.num_samples} samples, fewer than one global batch: "
                f"batch_size {batch_size} x world_size {world_size} = {self.global_batch_size}"
            )
        self.epoch = 0
        self.position = 0  # micro-batches of this epoch already returned (= global batch index)
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per epoch for each rank (the same on every rank)."""
        return self.num_samples // self.global_batch_size

    @property
    def samples_per_epoch(self) -> int:
        """Samples all ranks together read per epoch: the dataset minus the dropped tail."""
        return self.batches_per_epoch * self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of all samples in `epoch`, identical on every rank."""
        if self._perm_epoch != epoch:
            # Seeding with the pair (seed, epoch), not seed + epoch: runs with seeds 0 and 1
            # must not see the same orders shifted by one epoch.
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = torch.from_numpy(rng.permutation(self.num_samples))
            self._perm_epoch = epoch
        return self._perm

    def indices(self, epoch: int, position: int) -> torch.Tensor:
        """Sample indices of this rank's micro-batch number `position` in `epoch`."""
        start = position * self.global_batch_size + self.rank * self.batch_size
        return self.permutation(epoch)[start : start + self.batch_size]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        idx = self.indices(self.epoch, self.position)
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return self.rows.take(idx)

    def state_dict(self) -> dict[str, int]:
        """Where the stream is, plus what must match for the position to mean the same data."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
        }

    def check_same_data(self, state: Mapping[str, int], keys=("seed", "num_samples")) -> None:
        """The saved stream `state` read the same dataset in the same order (a resharded resume
        converts its position by samples: the global batch may differ)."""
        for key in keys:
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume data stream: saved {key} {state[key]} differs from {getattr(self, key)}"
                    + (" (other data, or another train.eval_fraction)" if key == "num_samples" else "")
                )

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        # The position counts global batches, so a run may resume on another world_size as
        # long as the global batch, the dataset and the seed are those it was saved with.
        self.check_same_data(state, ("seed", "num_samples", "global_batch_size"))
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.batches_per_epoch:
            raise DataError(
                f"cannot resume data stream at epoch {epoch}, position {position}: "
                f"an epoch has {self.batches_per_epoch} micro-batches"
            )
        self.epoch, self.position = epoch, position


def eval_batches(
    data,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    collate: Callable[[list], Mapping[str, torch.Tensor]] | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Every sample once, in dataset order, in batches of `batch_size` (the last may be smaller).

    With `world_size > 1` rank r evaluates samples r, r + world_size, ...; the ranks' losses
    must then be combined weighted by their token counts. With `collate` (a data collator),
    `data` is a sequence of examples and each batch is `collate` of a list of them.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise DataError(f"rank must be in [0, {world_size}), got {rank}")
    # Checked here, outside the generator, so errors show at the call and not at first use.
    if collate is None:
        data = as_rows(data)
    return _eval_iter(data, batch_size, np.arange(rank, len(data), world_size), collate)


def eval_batch_count(n_samples: int, batch_size: int, rank: int = 0, world_size: int = 1,
                     most: int | None = None) -> int:
    """How many batches `eval_batches` gives rank `rank` of an eval set of `n_samples`, at most `most`."""
    count = -(-len(range(rank, n_samples, world_size)) // batch_size)
    return count if most is None else min(count, most)


def _eval_iter(data, batch_size: int, idx: np.ndarray, collate):
    for start in range(0, len(idx), batch_size):
        chunk = idx[start : start + batch_size]
        if collate is None:
            yield data.take(chunk)
        else:
            yield dict(collate([data[i] for i in chunk.tolist()]))
