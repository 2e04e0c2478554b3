"""The one exception type of the data package, and small helpers to word its messages."""

from __future__ import annotations

import os
from collections.abc import Mapping

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


# How a message names a value of each type that JSON (and so a table row) can hold; bool first,
# being an int too.
_KINDS = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (list, "a list"), (dict, "an object"))


def describe(value) -> str:
    """A value as a message names it: "null", "a number (3)", "a boolean (true)", "a list",
    "an object", or "of type NAME" for anything else."""
    if value is None:
        return "null"
    kind = next((name for t, name in _KINDS if isinstance(value, t)), None)
    if kind is None:
        return f"of type {type(value).__name__}"
    if isinstance(value, int | float):
        text = "true" if value is True else "false" if value is False else repr(value)
        return f"{kind} ({text[:40]})"
    return kind


def string_field_problem(record: Mapping, key: str) -> str | None:
    """What keeps `record[key]` from being a string field, in words ("'output' is null, not a
    string", "no 'output' field (fields: ...)"); None when it is a string."""
    if key not in record:
        return f"no {key!r} field (fields: {', '.join(map(str, record)) or 'none'})"
    value = record[key]
    return None if isinstance(value, str) else f"{key!r} is {describe(value)}, not a string"


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line, for wrapping library errors into a DataError."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}" if text else type(e).__name__
