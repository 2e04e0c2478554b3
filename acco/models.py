"""The model registry: GPT-Neo and Llama causal LMs through transformers.

A model config (``acco/conf/model/*.yaml``) is a flat mapping::

    name, arch, hidden_size, num_layers, num_heads, num_kv_heads (llama),
    intermediate_size (llama), max_position_embeddings, window_size (gpt_neo),
    rope_theta (llama), pretrained, tokenizer, vocab_size

``build_model`` turns it into a freshly initialised ``transformers`` model whose vocabulary is the
tokenizer's, or, when ``pretrained`` is set (a local folder or a hub name), loads that model with
``AutoModelForCausalLM.from_pretrained`` and checks that it fits the tokenizer and the sequence
length. Optional keys, not in the shipped files: ``attention_types`` (gpt_neo, EleutherAI's form),
``tie_word_embeddings`` (default true for both architectures, as in GPT-Neo and Llama-3.2-1B),
``rope_scaling`` (llama), ``attn_implementation`` and, for gpt_neo, ``intermediate_size``.

``count_parameters`` and ``flops_per_token`` feed the MFU estimate (nanoGPT / PaLM appendix B).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

import acco.conf  # noqa: F401  (model configs loaded straight from their YAML use its resolver)
from acco.config import ARCHS, GPT_NEO_WINDOW, ModelError, check_model_config, gpt_neo_attention_types

__all__ = [
    "ARCHS",
    "ModelError",
    "build_model",
    "count_parameters",
    "attention_of",
    "flops_per_token",
    "fuse_gelu",
    "model_config",
]

# The oldest transformers the suite passes on (pyproject.toml; the lent GPU machines' 5.17): acco reaches
# into its GPT-Neo attention and mask builder, and 5.0 built GPT-Neo 125M with an untied head (163M
# parameters), a wrong model without an error.
MIN_TRANSFORMERS = "5.17"


def check_transformers(version: str = transformers.__version__) -> None:
    from packaging.version import Version

    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"acco needs transformers >= {MIN_TRANSFORMERS}, this environment has {version}: "
                          f"pip install 'transformers>={MIN_TRANSFORMERS}'")


check_transformers()

# SDPA is exact and, unlike eager, keeps no T x T scores for the backward pass. Llama has it in
# transformers; GPT-Neo has only eager and flash-attention-2 there, so for GPT-Neo "sdpa" is
# acco's (acco/attention.py): the eager modules with their product swapped for SDPA.
_DEFAULT_ATTN = {"gpt_neo": "sdpa", "llama": "sdpa"}


def _transformers_attention(arch: str | None, attn: str | None) -> str | None:
    """What transformers is asked for: GPT-Neo's "sdpa" is built eager, then swapped (`_finish_model`)."""
    return "eager" if arch == "gpt_neo" and attn == "sdpa" else attn


def _finish_model(model: PreTrainedModel, attn: str | None) -> PreTrainedModel:
    """acco's fast paths on a built or loaded model, none of which changes its state dict or config:
    GPT-Neo's SDPA, the fused tanh GELU, and no host sync in the mask builder (acco/attention.py)."""
    from acco.attention import skip_packing_check, use_sdpa

    if getattr(model.config, "model_type", None) == "gpt_neo" and attn == "sdpa":
        use_sdpa(model)
    fuse_gelu(model)
    skip_packing_check(model)
    return model


def fuse_gelu(model: nn.Module) -> int:
    """Every ``gelu_new`` activation (GPT-Neo's default, or any config naming it) becomes
    ``gelu_pytorch_tanh``: the same function (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))) in one
    kernel instead of eight ops, equal within rounding. The config keeps ``gelu_new``, so a saved
    model loads anywhere as before. Returns how many were swapped."""
    from transformers import activations
    from transformers.activations import NewGELUActivation

    fused = getattr(activations, "GELUTanh", None) or activations.PytorchGELUTanh  # its older name
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is NewGELUActivation:
                setattr(parent, name, fused())
                swapped += 1
    return swapped


def checkpoint_activations(model: nn.Module) -> None:
    """transformers' activation checkpointing, non-reentrant (parameter gradients reach the engine's
    flat buffer as usual). transformers 5 renamed gradient_checkpointing_enable, now a deprecated alias."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError(
            "train.gradient_checkpointing needs a transformers model (activation_checkpointing_enable)"
        )


def attention_of(model: nn.Module) -> str:
    """The attention a built model runs ("sdpa" for GPT-Neo through acco's swap)."""
    from acco.attention import GPTNeoSDPAttention

    if any(isinstance(m, GPTNeoSDPAttention) for m in model.modules()):
        return "sdpa"
    return model.config._attn_implementation


def attention_for(arch: str | None, device_type: str, half_precision: bool) -> str:
    """The attention kernel for this architecture on this device: flash_attention_2 for Llama on
    CUDA in bf16 where the flash-attn package is installed, SDPA otherwise (transformers' for Llama,
    acco's for GPT-Neo), eager for an unknown architecture. Never flash_attention_2 for GPT-Neo:
    transformers' GPT-Neo flash path passes no sliding window, so its local layers would attend to
    every earlier token once a sequence outgrows window_size (another model than the one trained
    or evaluated under eager or SDPA); acco's SDPA takes the flash kernel where GPT-Neo allows it."""
    import importlib.util

    flash = device_type == "cuda" and half_precision and importlib.util.find_spec("flash_attn") is not None
    if arch == "llama" and flash:
        return "flash_attention_2"
    return _DEFAULT_ATTN.get(arch or "", "eager")


def _to_dict(cfg: Any) -> dict:
    """A model config as a dict, keys left null by the schema dropped (their defaults apply)."""
    if cfg is None:
        raise ModelError("model config is missing")
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if v is not None}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise ModelError(f"model config must be a mapping, got {type(cfg).__name__}")


def model_config(
    cfg: Any,
    vocab_size: int | None = None,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> PretrainedConfig:
    """The ``transformers`` config described by an acco model config (no weights).

    ``vocab_size`` is the tokenizer's; when None, the config's ``vocab_size`` key is used.
    """
    c = _to_dict(cfg)
    vocab_size = check_model_config(
        c, vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id
    )
    arch, hidden, layers, heads, positions = (
        c[k] for k in ("arch", "hidden_size", "num_layers", "num_heads", "max_position_embeddings")
    )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        max_position_embeddings=positions,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=c.get("tie_word_embeddings") is not False,
        use_cache=False,
    )
    if arch == "gpt_neo":
        attention_types = c.get("attention_types") or gpt_neo_attention_types(layers)
        config = transformers.GPTNeoConfig(
            num_layers=layers,
            num_heads=heads,
            attention_types=attention_types,
            window_size=c.get("window_size") or GPT_NEO_WINDOW,
            intermediate_size=c.get("intermediate_size"),
            **common,
        )
    else:
        kv_heads = c.get("num_kv_heads") or heads
        extra = {}
        if c.get("rope_scaling"):
            extra["rope_scaling"] = dict(c["rope_scaling"])
        config = transformers.LlamaConfig(
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=c["intermediate_size"],
            rope_theta=float(c.get("rope_theta") or 10000.0),
            rms_norm_eps=float(c.get("rms_norm_eps") or 1e-5),
            **common,
            **extra,
        )
    config._attn_implementation = _transformers_attention(
        arch, c.get("attn_implementation") or _DEFAULT_ATTN[arch]
    )
    return config


def _dtype_kwarg() -> str:
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _looks_local(name: str) -> bool:
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or os.path.exists(name)


def _check_max_length(config: PretrainedConfig, max_length: int | None, label: str) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if max_length is not None and limit is not None and max_length > limit:
        raise ModelError(
            f"max_length {max_length} exceeds the model's max_position_embeddings ({limit}) "
            f"for model {label!r}"
        )


# The transformers config keys that make two models of as many parameters compute differently.
ARCHITECTURE_KEYS = (
    "model_type", "hidden_size", "num_layers", "num_hidden_layers", "num_heads", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "window_size", "attention_layers", "rope_theta",
    "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "vocab_size",
)  # fmt: skip


def unknown_attention(name: str) -> list[str] | None:
    """None when transformers knows the attention implementation `name` (eager, its registry, or a
    Hub kernel's "org/repo" and "paged|" forms it loads by name), else the names it knows."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = ["eager", *(k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if "|" not in k)]
    return None if name in names or "/" in name or "|" in name else names


def token_rows(model: nn.Module) -> int | None:
    """The token ids the model takes: its input embedding's rows (None for a module without one)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embedding, "num_embeddings", None)


def check_fits(model: nn.Module, vocab_size: int | None, max_length: int) -> None:
    """A model the user built (DecoupledTrainer) is a causal LM, and takes this tokenizer's ids and
    sequences of ``max_length``, as the command line checks its own models: a ModelError now rather
    than an IndexError in the first forward, or an encoder that trains under the next-token loss
    (it sees the tokens it predicts: the loss falls, the model learns nothing)."""
    if isinstance(model, PreTrainedModel):  # a module of the user's own: its forward is theirs
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        if not any(cls.__name__ in causal for cls in type(model).__mro__):
            raise ModelError(
                f"{type(model).__name__} is not a causal language model (acco trains with the "
                "next-token loss): load one with AutoModelForCausalLM"
            )
    rows = token_rows(model)
    if vocab_size is not None and rows is not None and vocab_size > rows:
        raise ModelError(
            f"the tokenizer has {vocab_size} tokens, more than the {rows} rows of the model's input embedding"
        )
    config = getattr(model, "config", None)
    if config is not None:
        _check_max_length(config, max_length, getattr(config, "model_type", None) or type(model).__name__)


def _load_pretrained(
    name: str,
    dtype: torch.dtype | None,
    vocab_size: int | None,
    max_length: int | None,
    attn: str | None = None,
) -> PreTrainedModel:
    """Checks what the checkpoint's config can tell before loading any weights."""
    name = os.path.expanduser(str(name))
    if _looks_local(name) and not os.path.isdir(name):
        raise ModelError(f"pretrained model folder {name!r} not found")
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot load pretrained model {name!r}: {first}") from e
    _check_max_length(config, max_length, name)
    rows = getattr(config, "vocab_size", None)
    if vocab_size is not None and rows is not None and vocab_size > rows:
        raise ModelError(
            f"tokenizer vocabulary ({vocab_size} tokens) is larger than the embedding of pretrained model "
            f"{name!r} ({rows} rows)"
        )
    # None: the checkpoint's own dtype (transformers' "auto"); the engine casts what it trains.
    kwargs: dict[str, Any] = {_dtype_kwarg(): dtype or "auto"}
    attn = attn or _DEFAULT_ATTN.get(config.model_type)
    if attn is not None:
        kwargs["attn_implementation"] = _transformers_attention(config.model_type, attn)
    try:
        return _finish_model(AutoModelForCausalLM.from_pretrained(name, **kwargs), attn)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot load pretrained model {name!r}: {first}") from e


def build_model(
    cfg: Any,
    vocab_size: int | None,
    max_length: int | None = None,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """A causal LM for the model config ``cfg`` and a tokenizer of ``vocab_size`` tokens.

    - ``cfg.pretrained`` null: a new model from the config, its embedding sized to ``vocab_size``
      (the config's ``vocab_size`` when None), with the given special-token ids. Initialised by
      transformers from torch's RNG: seed before calling. Under ``with torch.device("meta")``
      nothing is allocated.
    - ``cfg.pretrained`` a folder or hub name: ``AutoModelForCausalLM.from_pretrained`` in the
      checkpoint's own dtype unless ``dtype`` is given (transformers' ``dtype="auto"``); special-token
      ids given here override the checkpoint's. Why not bf16 when mixed precision is on: the engine
      takes its fp32 master shard from the weights before it casts them, so an fp32 checkpoint
      must arrive in fp32 or fine-tuning loses its low bits; a bf16 checkpoint arrives in bf16 (the
      file has no more bits to keep, and loading takes half the memory). The engine then casts the
      trainable parameters to the training dtype (bf16 with mixed precision; fp32 otherwise, bf16
      weights widened exactly), and torch-ddp keeps fp32 parameters under autocast.

    Raises ``ModelError`` for an unknown arch, a tokenizer vocabulary larger than the pretrained
    embedding, or ``max_length`` beyond ``max_position_embeddings``.
    """
    c = _to_dict(cfg)
    pretrained = c.get("pretrained")
    if pretrained:
        model = _load_pretrained(str(pretrained), dtype, vocab_size, max_length, c.get("attn_implementation"))
        rows = model.get_input_embeddings().num_embeddings
        if vocab_size is not None and vocab_size > rows:  # the weights disagree with their config
            raise ModelError(
                f"tokenizer vocabulary ({vocab_size} tokens) is larger than the embedding of pretrained "
                f"model {pretrained!r} ({rows} rows)"
            )
        for key, tid in (
            ("bos_token_id", bos_token_id),
            ("eos_token_id", eos_token_id),
            ("pad_token_id", pad_token_id),
        ):
            if tid is not None:
                if not 0 <= tid < rows:
                    raise ModelError(
                        f"{key} {tid} is outside the embedding of pretrained model {pretrained!r} "
                        f"({rows} rows)"
                    )
                setattr(model.config, key, tid)
    else:
        config = model_config(
            c, vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id
        )
        _check_max_length(config, max_length, c.get("name") or "?")
        model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
        _finish_model(model, c.get("attn_implementation") or _DEFAULT_ATTN[c["arch"]])
        if dtype is not None:
            model = model.to(dtype)
    return model


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _lookup_only_parameters(model: nn.Module) -> int:
    """Parameters used as table lookups only (no matmul): position embeddings, and the input
    embedding when it is not tied to the output projection."""
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = inp is not None and out is not None and inp.weight is out.weight
    n = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding) and (module is not inp or not tied):
            n += module.weight.numel()
    return n


def flops_per_token(model_or_config: Any, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the PaLM / nanoGPT estimate:
    ``6 * N + 12 * L * H * Q * T`` with N the parameters that take part in matmuls (lookup-only
    embeddings excluded; a tied input/output embedding counts once, as the output projection),
    L layers, H query heads of size Q, and T = ``seq_len``. Every layer is counted with full
    causal attention over T, the usual convention (GPT-Neo's local layers are computed that way
    by transformers, too).

    Accepts a model, a ``transformers`` config (counted on the meta device) or an acco model
    config mapping (with its own ``vocab_size``).
    """
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
        config = model.config
    else:
        config = (
            model_or_config
            if isinstance(model_or_config, PretrainedConfig)
            else model_config(model_or_config)
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    n = count_parameters(model) - _lookup_only_parameters(model)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return float(6 * n + 12 * layers * heads * head_dim * seq_len)


def trainable_parameters(
    cfg: Any,
    vocab_size: int | None,
    max_length: int | None = None,
    pretrained_config: PretrainedConfig | None = None,
) -> int:
    """The trainable parameters of the model ``build_model(cfg, vocab_size, max_length)`` builds,
    counted on the meta device (nothing allocated, no weights read); for a pretrained model, from
    its ``pretrained_config`` (the checks of a job's validation pass: a resumed checkpoint's size)."""
    with torch.device("meta"):
        if pretrained_config is not None:
            model = AutoModelForCausalLM.from_config(pretrained_config)
        else:
            model = build_model(cfg, vocab_size=vocab_size, max_length=max_length)
    return count_parameters(model, trainable_only=True)
