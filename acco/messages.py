"""Messages in one line: an exception's text, the closest name to a misspelt one, an unknown key's
hint (the closest keys, or the acco key for a transformers.TrainingArguments name), a size."""

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


# transformers.TrainingArguments' names that a Trainer user writes, and acco's train key for each
TRAINER_NAMES = {
    "per_device_train_batch_size": "batch_size", "per_device_eval_batch_size": "eval_batch_size",
    "max_steps": "nb_steps_tot", "warmup_steps": "warmup", "lr_scheduler_type": "scheduler_name",
    "logging_steps": "log_step", "save_steps": "save_step", "eval_steps": "eval_step",
    "bf16": "use_mixed_precision", "adam_epsilon": "adam_eps",
}


def key_hint(name: str, names: list[str], where: str, prefix: str = "") -> str:
    """What follows "unknown key NAME" in its line, for `where` ("of train", "at the top level")
    holding `names`: acco's key for a transformers.TrainingArguments name (where its unit is said:
    nb_steps_tot counts micro-batches where max_steps counts updates); else the closest name if one
    is close, and the keys themselves where there are a few, the three closest (difflib) where
    there are many: the line stays short whatever the group."""
    meant = TRAINER_NAMES.get(name)
    if meant in names:
        return (f" (transformers' name: acco's key is {prefix + meant!r}; docs/training.md, 'Glossary', "
                "gives its unit)")
    if len(names) <= FEW_KEYS:
        return f"{did_you_mean(name, names, prefix)}; keys {where}: {', '.join(names)}"
    closest = difflib.get_close_matches(name, names, n=3, cutoff=0.0)
    return f"{did_you_mean(name, names, prefix)}; closest keys {where}: {', '.join(closest)}"


FEW_KEYS = 5  # a group with so few keys has them all listed (the top level: train, model, data, launch)


def size_text(n_bytes: float) -> str:
    """A file size for a person: GB from 0.1 GB, else MB (a tiny model's checkpoint is not 0.00 GB)."""
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB"
