"""Messages in one line: an exception's text, the closest name to a misspelt one, a size."""

from __future__ import annotations

import difflib


def one_line_error(e: BaseException, limit: int = 1000) -> str:
    """An exception's message on one line (OmegaConf's trailers "full_key: ..." dropped)."""
    from omegaconf.errors import OmegaConfBaseException

    text = str(e)
    if isinstance(e, OmegaConfBaseException):
        text = text.strip().splitlines()[0] if text.strip() else ""
    text = " ".join(text.split())
    return text[:limit] + (" ..." if len(text) > limit else "")


def did_you_mean(name: str, names: list[str], prefix: str = "") -> str:
    """' (did you mean 'PREFIX.x'?)' for the closest of `names` to a mistyped `name`, else ''."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def size_text(n_bytes: float) -> str:
    """A file size for a person: GB from 0.1 GB, else MB (a tiny model's checkpoint is not 0.00 GB)."""
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB"
