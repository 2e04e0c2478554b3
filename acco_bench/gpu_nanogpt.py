"""``acco-bench gpu``'s ``nanogpt`` variants: GPT-2 as nanoGPT writes and trains it, at the geometry of
``--model`` (its width, layers and heads: GPT-2 124M at gptneo-125m's), in the same run as acco's
variants. The 34% MFU acco is held to at 8 x 1024 is nanoGPT's figure on an H200 on another day, and
the machines lent differ (BENCHMARKS.md, 10.0: its second H200 ran everything slower): this anchor,
measured beside acco on the same machine, says what that machine allows.

The model: learned positions; pre-LN blocks, each with one q/k/v projection, biases everywhere
(GPT-2's); SDPA with ``is_causal`` (a flash kernel, no mask); the tanh GELU; no dropout; the head
tied to the token embedding, the vocabulary padded to a multiple of 64 (50257 -> 50304, nanoGPT's);
GPT-2's initialisation (normal 0.02, the residual projections 0.02 / sqrt(2 L)). The module names are
transformers' GPT2LMHeadModel's, so its weights load as they are, bar Conv1D's transpose
(tests/test_gpu_nanogpt.py checks the logits against it: the anchor is GPT-2, not a lighter model).

The loop (gpu_variants.time_plain_loop): fp32 parameters under bf16 autocast, the full logits into
``F.cross_entropy``, fused AdamW with the engine's settings; ``nanogpt-compiled`` compiles the whole
model, as nanoGPT's ``torch.compile(model)`` does.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_MULTIPLE = 64  # nanoGPT's padding of GPT-2's 50257 tokens


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """GPT-2: ``forward(input_ids)`` -> logits over the padded vocabulary."""

    def __init__(self, vocab_size: int, width: int, layers: int, heads: int, max_length: int):
        super().__init__()
        padded = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(padded, width),
            wpe=nn.Embedding(max_length, width),
            h=nn.ModuleList(Block(width, heads) for _ in range(layers)),
            ln_f=nn.LayerNorm(width),
        ))
        self.lm_head = nn.Linear(width, padded, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        # what acco.models.flops_per_token reads: the same count as acco's models get
        self.config = SimpleNamespace(num_hidden_layers=layers, num_attention_heads=heads, hidden_size=width)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def loss_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, int]:
    """nanoGPT's loss, summed: cross-entropy of the full logits against the next tokens."""
    logits, targets = model(batch["input_ids"]), batch["targets"]
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="sum")
    return loss, targets.numel()


def build(args, vocab: int) -> NanoGPT:
    """The anchor at ``--model``'s width, layers and heads, random init (seed 0)."""
    from acco_bench.settings import model_settings

    m = model_settings(args.model)
    torch.manual_seed(0)
    return NanoGPT(vocab, m["hidden_size"], m["num_layers"], m["num_heads"], args.max_length)


def run_nanogpt(args, device, vocab: int, pool, compiled: bool = False, profile: bool = False) -> dict:
    """The anchor trained on `pool`'s tokens (each row's next tokens its targets, made once here,
    as nanoGPT's loader hands them): gpu_variants.time_plain_loop's figures, with its own FLOPs per
    token (6N + 12LHQT, acco.models.flops_per_token)."""
    from acco.engine.compiling import compile_module, compile_options
    from acco.models import flops_per_token
    from acco_bench.gpu_variants import time_plain_loop

    model = build(args, vocab).to(device).train()
    fpt = flops_per_token(model, args.max_length)
    options = compile_options(args.compile_backend, device.type, args.compile_mode) if compiled else None
    compile_module(model, options, scope="model")  # the whole model: it has no base_model
    batches = [{"input_ids": b["input_ids"], "targets": b["input_ids"].roll(-1, dims=1)} for b in pool]
    return time_plain_loop(args, device, model, batches, loss_sum, autocast=True, profile=profile) | {
        "flops_per_token": fpt}
