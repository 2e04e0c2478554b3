"""Pre-tokenized datasets: rows of input_ids[, labels][, attention_mask], as run_clm.py leaves them.

Rows may differ in length: they are padded on the right to the longest one (pad id in
input_ids, -100 in labels, 0 in attention_mask). Labels default to input_ids; -100 labels given
by the user are kept. The result is int32 numpy arrays (half of int64's memory), widened per
micro-batch by `loader.Rows`.
"""

from __future__ import annotations

import itertools

import numpy as np

from .errors import DataError
from .instruct import IGNORE_INDEX
from .text import is_hf_dataset


def pad_token_ids(dataset, max_length: int, pad_token_id: int | None) -> dict[str, np.ndarray]:
    """Columns input_ids, labels[, attention_mask] as [n, width] arrays, width <= max_length.

    `dataset`: a `datasets.Dataset` or a list of dicts with an `input_ids` list per row.
    """
    ids, lengths = _ragged(dataset, "input_ids")
    if len(lengths) == 0:
        raise DataError("pre-tokenized dataset is empty")
    if (too_long := np.flatnonzero(lengths > max_length)).size:
        i = int(too_long[0])
        raise DataError(
            f"pre-tokenized example {i} has {lengths[i]} tokens, more than max_length {max_length} "
            f"({too_long.size} such examples): cut them or raise max_length"
        )
    if (empty := np.flatnonzero(lengths == 0)).size:
        raise DataError(f"pre-tokenized example {int(empty[0])} has no tokens")
    width = int(lengths.max())
    padded = bool((lengths < width).any())
    if padded and pad_token_id is None:
        raise DataError(
            "pre-tokenized examples differ in length: padding them needs a tokenizer with a pad token"
        )
    # Row-major boolean mask: its True cells, in order, are where the flat tokens go.
    mask = np.arange(width) < lengths[:, None]

    def pad(flat: np.ndarray, fill: int, dtype=np.int32) -> np.ndarray:
        out = np.full((len(lengths), width), fill, dtype=dtype)
        out[mask] = flat
        return out

    columns = {"input_ids": pad(ids, pad_token_id if padded else 0)}
    for key, fill in (("labels", IGNORE_INDEX), ("attention_mask", 0)):
        column = _ragged(dataset, key, required=False)
        if column is None:
            continue
        values, their_lengths = column
        if not np.array_equal(their_lengths, lengths):
            i = int(np.flatnonzero(their_lengths != lengths)[0])
            raise DataError(
                f"pre-tokenized example {i}: {key} has {their_lengths[i]} values, input_ids {lengths[i]}"
            )
        columns[key] = pad(values, fill, np.int8 if key == "attention_mask" else np.int32)
    columns.setdefault("labels", pad(ids, IGNORE_INDEX))
    if padded:
        columns.setdefault("attention_mask", mask.astype(np.int8))
    return columns


def _ragged(dataset, key: str, required: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
    """(all values of column `key` end to end, the length of each row); None if it is absent."""
    if is_hf_dataset(dataset):
        import pyarrow.compute as pc

        if key not in dataset.column_names:
            return None
        # Arrow reads the column without a Python object per token.
        column = dataset.select_columns([key]).with_format("arrow")[:][key]
        if column.null_count:
            raise DataError(f"pre-tokenized dataset has missing {key}")
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        return pc.list_flatten(column).to_numpy(zero_copy_only=False), lengths.astype(np.int64)
    if not all(key in row for row in dataset):
        if required or any(key in row for row in dataset):
            raise DataError(f"every pre-tokenized example needs {key!r}")
        return None
    rows = [row[key] for row in dataset]
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    return np.fromiter(itertools.chain.from_iterable(rows), np.int64, count=int(lengths.sum())), lengths
