"""``compile``: torch.compile on each repeated block of the model, in place.

`build_engine` calls `compile_module` once the engine has made the parameters views of its flat
buffers (compiled code keeps no parameter of its own: they are inputs to the graph, so the views
are what it reads). Each block of the largest ``nn.ModuleList`` of one class (a transformer's
layers: GPT-Neo's ``transformer.h``, Llama's ``model.layers``) is compiled with
``nn.Module.compile``, which keeps the module and its parameter names: no ``_orig_mod.`` prefix,
``state_dict``, ``save_pretrained`` and checkpoints unchanged. A module without such a list (the
engine tests' toy models) is compiled whole, in place, the same way. The engine, its comm thread
and the optimizer stay eager.

Each block class is compiled once per variant it runs in: GPT-Neo's global and local layers,
training and evaluation (grad mode, dropout), and a new shape (then compiled with dynamic shapes).
That can pass dynamo's default of 8 entries per function, after which it would run eagerly without
a word: `compile_module` raises the limit to RECOMPILE_LIMIT. Training itself compiles in its first
update and never again (tests/test_compile.py, with ``error_on_recompile``).

With ``compile_scope`` "model" the model's body (``base_model``: embeddings, every block, the
final norm) is compiled instead, as one graph: one compiled call per micro-batch instead of one per
block, and fusions across the blocks' boundaries; its first compile takes longer. transformers
builds the same masks under compile as without (no mask for a batch without padding, tested), so
the attention kernels are the same.

The options are left on the module as ``acco_compile`` (a dict of torch.compile keywords), so that
the loss compiles its per-chunk pass alike (acco/loss.py); None when nothing is compiled.
"""

from __future__ import annotations

import torch
from torch import nn

RECOMPILE_LIMIT = 64


def compile_options(setting, device_type: str, mode: str | None = None) -> dict | None:
    """torch.compile's keywords for a ``compile`` setting on this device, or None (eager):
    "auto" compiles on CUDA only (inductor), True everywhere (inductor), False never; any other
    string is a torch.compile backend ("aot_eager" keeps a CPU test to seconds). `mode` is
    inductor's (``compile_mode``; EngineConfig refuses it with another backend)."""
    if setting is False or (setting == "auto" and device_type != "cuda"):
        return None
    backend = "inductor" if setting is True or setting == "auto" else str(setting)
    return {"backend": backend} | ({"mode": mode} if mode is not None and backend == "inductor" else {})


def blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the longest ModuleList whose children are all of one class; else [module]."""
    best: list[nn.Module] = []
    for child in module.modules():
        if isinstance(child, nn.ModuleList) and len(child) > len(best):
            kinds = {type(m) for m in child}
            if len(kinds) == 1:
                best = list(child)
    return best or [module]


def body(module: nn.Module) -> nn.Module:
    """The transformer body: a transformers model's ``base_model`` (all but the LM head, which the
    loss computes), else the module itself."""
    base = getattr(module, "base_model", None)
    return base if isinstance(base, nn.Module) else module


def compile_module(module: nn.Module, options: dict | None, scope: str = "blocks") -> int:
    """Compile `module` in place with `options` (torch.compile's keywords; None: nothing): its
    blocks, or with `scope` "model" its body as one graph; returns how many modules were compiled."""
    module.acco_compile = options
    if options is None:
        return 0
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = blocks(module) if scope == "blocks" else [body(module)]
    for block in compiled:
        block.compile(**options)
    return len(compiled)
