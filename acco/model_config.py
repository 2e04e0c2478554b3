"""A new model's config values (the ``model`` group's keys), checked without transformers.

``check_model_config`` is what the validation pass (acco/validate.py) and ``acco.models`` both
run on a model that is built rather than loaded; the defaults an architecture fills in where the
config leaves a key out are declared here once (``gpt_neo_attention_types``, ``GPT_NEO_WINDOW``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ARCHS = ("gpt_neo", "llama")
# GPT-Neo's local attention window where model.window_size is not set (transformers' default too)
GPT_NEO_WINDOW = 256


class ModelError(ValueError):
    """A model config or a pretrained model that cannot serve the requested run."""


def _require(cfg: dict, key: str) -> Any:
    value = cfg.get(key)
    if value is None:
        raise ModelError(f"model config {cfg.get('name', '?')!r} (arch {cfg.get('arch')!r}) needs {key!r}")
    return value


def _positive_int(cfg: dict, key: str) -> int:
    value = _require(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelError(
            f"model config {cfg.get('name', '?')!r}: {key} must be a positive integer, got {value!r}"
        )
    return value


def gpt_neo_attention_types(num_layers: int) -> list:
    """EleutherAI's alternating pattern: global, local, global, local, ... (one per layer)."""
    types: list = []
    if num_layers // 2:
        types.append([["global", "local"], num_layers // 2])
    if num_layers % 2:
        types.append([["global"], 1])
    return types


def check_model_config(c: Mapping, vocab_size: int | None = None, *, bos_token_id: int | None = None,
                       eos_token_id: int | None = None, pad_token_id: int | None = None) -> int:  # fmt: skip
    """The values of a new model's config (a mapping of the ``model`` group's keys), checked without
    transformers; returns the vocabulary size (``vocab_size``, else the config's)."""
    arch = c.get("arch")
    name = c.get("name", "?")
    if arch not in ARCHS:
        raise ModelError(
            f"unknown model arch {arch!r} in model config {name!r}; expected one of {', '.join(ARCHS)}"
        )
    if vocab_size is None:
        vocab_size = c.get("vocab_size")
        if vocab_size is None:
            raise ModelError(f"model config {name!r}: no vocab_size given and none in the config")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ModelError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    for key, tid in (
        ("bos_token_id", bos_token_id),
        ("eos_token_id", eos_token_id),
        ("pad_token_id", pad_token_id),
    ):
        if tid is not None and not 0 <= tid < vocab_size:
            raise ModelError(f"{key} {tid} is outside the vocabulary (size {vocab_size})")
    hidden, layers, heads = (_positive_int(c, k) for k in ("hidden_size", "num_layers", "num_heads"))
    _positive_int(c, "max_position_embeddings")
    if hidden % heads:
        raise ModelError(
            f"model config {name!r}: hidden_size {hidden} is not a multiple of num_heads {heads}"
        )
    if arch == "gpt_neo":
        attention_types = c.get("attention_types") or gpt_neo_attention_types(layers)
        n_types = sum(len(kinds) * n for kinds, n in attention_types)
        if n_types != layers:
            raise ModelError(
                f"model config {name!r}: attention_types describe {n_types} layers, num_layers is {layers}"
            )
        if c.get("window_size") is not None:
            _positive_int(c, "window_size")
    else:
        kv_heads = c.get("num_kv_heads") or heads
        if heads % kv_heads:
            raise ModelError(
                f"model config {name!r}: num_heads {heads} is not a multiple of num_kv_heads {kv_heads}"
            )
        _positive_int(c, "intermediate_size")
    return vocab_size
