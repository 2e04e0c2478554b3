"""Messages in one line: an exception's text, the closest name to a misspelt one (or the acco key
for a transformers.TrainingArguments name), a size."""

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


def meant_train_key(name: str, names: list[str], prefix: str = "") -> str:
    """did_you_mean for a train key, and for transformers' name of one, acco's key and where its
    unit is said (nb_steps_tot counts micro-batches where max_steps counts updates)."""
    meant = TRAINER_NAMES.get(name)
    if meant in names:
        return (f" (transformers' name: acco's key is {prefix + meant!r}; docs/training.md, 'Glossary', "
                "gives its unit)")
    return did_you_mean(name, names, prefix)


def size_text(n_bytes: float) -> str:
    """A file size for a person: GB from 0.1 GB, else MB (a tiny model's checkpoint is not 0.00 GB)."""
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB"
