"""SDPA for GPT-Neo, which transformers (5.x) runs eager or with flash-attention-2 only.

Eager attention keeps the softmax of the batch x heads x T x T scores, in fp32, for the backward
pass of each layer: 2.4 GB for GPT-Neo 125M at 4 x 1024 tokens. ``torch.nn.functional.
scaled_dot_product_attention`` computes the same result in tiles on CPU and GPU (its fused kernels
keep O(T) per row), so `use_sdpa` swaps it into a built model: each layer's attention module
becomes a :class:`GPTNeoSDPAttention`, the same module (same parameters and buffers, same state
dict) whose ``_attn`` calls SDPA with GPT-Neo's conventions: no 1/sqrt(head_dim) scaling, and the
local layers' sliding window. It returns no attention weights (``output_attentions``).

Where attention is plain causal (no padding, and a global layer or a local one whose keys all fit
in its window) SDPA gets ``is_causal=True`` and no mask, which lets it take its flash kernel on
GPU; an explicit mask rules that kernel out. Whether a batch has padding is decided once per
forward by transformers' mask builder (see `use_sdpa`), never by reading a GPU tensor per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoModel, GPTNeoSelfAttention


class GPTNeoSDPAttention(GPTNeoSelfAttention):
    def _attn(self, query, key, value, attention_mask=None):
        q_len, k_len = query.size(-2), key.size(-2)
        dropout = self.attn_dropout.p if self.training else 0.0
        # No mask: no padding. SDPA's is_causal is top-left aligned, GPT-Neo's mask bottom-right:
        # the same only when q_len == k_len (no KV cache), so other shapes take the mask below.
        windowless = self.attention_type == "global" or k_len <= self.config.window_size
        if attention_mask is None and q_len == k_len and windowless:
            out = F.scaled_dot_product_attention(
                query, key, value, dropout_p=dropout, is_causal=True, scale=1.0
            )
            return out, None
        allowed = self.bias[:, :, k_len - q_len : k_len, :k_len]  # causal, and the window for local layers
        if attention_mask is None:
            mask = allowed
        else:  # the model's mask (padding), restricted to this layer's window; additive, so that a
            # row with no key left (a left-padded position) is uniform, as in eager, not NaN
            low = torch.finfo(query.dtype).min
            if attention_mask.dtype == torch.bool:
                attention_mask = torch.where(attention_mask, 0.0, low)
            mask = attention_mask.to(query.dtype).masked_fill(~allowed, low)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=1.0)
        return out, None


def use_sdpa(model: nn.Module) -> int:
    """Swap SDPA into every GPT-Neo attention module of `model`; returns how many were swapped.

    The model's config then says "sdpa" (never saved: transformers does not serialise it), so that
    transformers builds SDPA's masks rather than eager's: None for a batch without padding (no
    attention_mask, or an all-ones one: checked once per forward), a boolean 4-D mask otherwise.
    Eager's mask is a float T x T tensor even for an unpadded batch, which would hide that case."""
    swapped = 0
    for module in model.modules():
        if type(module) is GPTNeoSelfAttention:
            module.__class__ = GPTNeoSDPAttention
            swapped += 1
    if swapped:
        for module in model.modules():
            if isinstance(module, GPTNeoModel):
                module.config._attn_implementation = "sdpa"
    return swapped
