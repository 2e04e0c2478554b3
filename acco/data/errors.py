"""The one exception type of the data package, and small helpers to word its messages."""

from __future__ import annotations

import os

# File types that the loaders read from local disk.
LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A data input (corpus, tokenizer, records, batch settings) cannot be used.

    Subclasses ValueError so callers that already catch bad values keep working; the message is
    one line that says what was wrong and where (file, line, record index, numbers).
    """


def looks_like_local_path(spec: str) -> bool:
    """True when `spec` can only be meant as a local path, not a Hub name ("name" or "org/name").

    Used to answer "no such file" at once instead of asking the Hub about a mistyped path.
    """
    return (
        spec.startswith(("/", "./", "../", "~", ".\\"))
        or os.path.isabs(spec)
        or spec.count("/") > 1
        or spec.lower().endswith(LOCAL_SUFFIXES)
    )


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line, for wrapping library errors into a DataError."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}" if text else type(e).__name__
