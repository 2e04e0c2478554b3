"""SDPA for GPT-Neo, which transformers (5.x) runs eager or with flash-attention-2 only.

Eager attention keeps the softmax of the batch x heads x T x T scores, in fp32, for the backward
pass of each layer: 2.4 GB for GPT-Neo 125M at 4 x 1024 tokens. ``torch.nn.functional.
scaled_dot_product_attention`` computes the same result in tiles on CPU and GPU (its fused kernels
keep O(T) per row), so `use_sdpa` swaps it into a built model: each layer's attention module
becomes a :class:`GPTNeoSDPAttention`, the same module (same parameters and buffers, same state
dict) whose ``_attn`` calls SDPA with GPT-Neo's conventions: no 1/sqrt(head_dim) scaling, and the
local layers' sliding window. It returns no attention weights (``output_attentions``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention


class GPTNeoSDPAttention(GPTNeoSelfAttention):
    def _attn(self, query, key, value, attention_mask=None):
        q_len, k_len = query.size(-2), key.size(-2)
        dropout = self.attn_dropout.p if self.training else 0.0
        # The model passes its 4-D mask (it is configured as eager); SDPA's fused CPU and GPU
        # kernels take it as attn_mask without materialising the scores.
        allowed = self.bias[:, :, k_len - q_len : k_len, :k_len]  # causal, and the window for local layers
        if attention_mask is None:
            mask = allowed
        else:  # the model's additive mask (padding), restricted to this layer's window
            if attention_mask.dtype == torch.bool:
                attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill_(~attention_mask, torch.finfo(query.dtype).min)
            mask = attention_mask.to(query.dtype).masked_fill(~allowed, torch.finfo(query.dtype).min)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=1.0)
        return out, None


def use_sdpa(model: nn.Module) -> int:
    """Swap SDPA into every GPT-Neo attention module of `model`; returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is GPTNeoSelfAttention:
            module.__class__ = GPTNeoSDPAttention
            swapped += 1
    return swapped
