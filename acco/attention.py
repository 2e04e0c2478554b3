"""SDPA for GPT-Neo, which transformers (5.x) runs eager or with flash-attention-2 only.

Eager attention keeps the softmax of the batch x heads x T x T scores, in fp32, for the backward
pass of each layer: 2.4 GB for GPT-Neo 125M at 4 x 1024 tokens. ``torch.nn.functional.
scaled_dot_product_attention`` computes the same result in tiles on CPU and GPU (its fused kernels
keep O(T) per row), so `use_sdpa` swaps it into a built model: each layer's attention module
becomes a :class:`GPTNeoSDPAttention`, the same module (same parameters and buffers, same state
dict) whose ``_attn`` calls SDPA with GPT-Neo's conventions: no 1/sqrt(head_dim) scaling, and the
local layers' sliding window. It returns no attention weights (``output_attentions``). Its
forward computes the query, key and value projections as one GEMM on their stacked weights where
they are plain ``nn.Linear`` (no adapter, no hook): fewer and larger kernels, the same values.

Where attention is plain causal (no padding, and a global layer or a local one whose keys all fit
in its window) SDPA gets ``is_causal=True`` and no mask, which lets it take its flash kernel on
GPU; an explicit mask rules that kernel out. Whether a batch has padding is decided once per
forward by transformers' mask builder (see `use_sdpa`), never by reading a GPU tensor per layer.

A local layer whose window cuts in (no padding, T > window_size) computes only what its window
sees where T is a multiple of the window (`local_blocked`): the first window-long block of queries
is plain causal, every later block attends to its own key block and the one before, under one
window x 2 window band mask shared by all blocks. At T = 1024 and window 256 that is 0.42 of the
T x T scores; in training the layer is checkpointed selectively (`blocked_local_layer`): the key
pairs' copies are recomputed in backward and SDPA's results kept (outputs and log-sum-exps, what
the masked path's SDPA keeps too), so that backward runs no second forward of the blocks. Other lengths,
padding and a KV cache take SDPA's explicit mask (the full T x T, masked). On the CPU the blocked
layer is 1.75x the masked one, forward and backward (1.5x when it recomputed SDPA too); on a GPU
it is not measured yet.

`flex_local` (``flex_attention`` with a sliding-window causal block mask, which skips the key
blocks the window masks) is there for CUDA under compile (``train.compile``) but off (LOCAL_KERNEL =
"blocked"): on an H200 at GPT-Neo 125M's shapes (T = 1024, window 256, head dim 64) it was slower than
the masked SDPA kernel alone (0.91 against 0.35 ms forward and backward per layer at 4 x 1024) and
no faster in the compiled model (BENCHMARKS.md, "GPU (one H200)"); acco-bench gpu's
``-compiled-flex`` variants weigh it (and its ``-mask`` variants the full mask against the blocks).
Inductor's flex kernels need a head dimension of 16 or more; smaller heads keep SDPA. torch 2.13
has no flex backward on the CPU: its forward is tested there against eager attention
(tests/test_attention.py).

`skip_packing_check` removes the host sync that the mask builder itself costs (every model acco
builds, GPT-Neo and Llama): with no attention mask, transformers reads ``.all()`` of a tensor made
from the position ids to tell packed sequences apart, a sync per forward on a GPU that also rules
out CUDA graphs. Where the model makes its own position ids (none given, no mask, no KV cache)
they are 0..T-1 in every row, one sequence per row: the answer is known without reading anything.
In those forwards it also keeps eager's "no mask" answer when torch.compile traces the mask
builder, where transformers would build a dense mask (5.17, and later releases on torch < 2.14).
"""

from __future__ import annotations

import functools
import logging
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoModel, GPTNeoSelfAttention

# How local layers of a length the window divides run (the module docstring): "blocked"; "flex",
# flex_attention where it can (CUDA under compile), else blocked; "mask", the full T x T under the mask.
LOCAL_KERNEL = "blocked"
FLEX_MIN_HEAD_DIM = 16  # inductor's flex kernels: "NYI: embedding dimension ... must be at least 16"


def sliding_window_block_mask(length: int, window: int, device):
    """flex_attention's block mask for GPT-Neo's local layers: key j is visible from query i when
    0 <= i - j < window."""
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding_window_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return create_block_mask(sliding_window_causal, None, None, length, length, device=device)


def flex_local(query, key, value, window: int, block_mask=None):
    """GPT-Neo's local attention (no scaling) through flex_attention; without `block_mask` the mask
    is built in the caller's graph on every call: a few small kernels under compile, and one graph
    with dynamic shapes serves every length. A mask built once per length outside the graph and
    handed in (a module attribute) made each new length recompile the local layers (dynamo guards
    on the mask's lengths; tried on the CPU with the flex path forced), so acco builds it in the
    graph; acco-bench gpu's micro-benchmark weighs that cost (flex_prebuilt_mask against
    flex_sliding_window)."""
    from torch.nn.attention.flex_attention import flex_attention

    if block_mask is None:
        block_mask = sliding_window_block_mask(query.size(-2), window, query.device)
    return flex_attention(query, key, value, block_mask=block_mask, scale=1.0)


def local_blocked(query, key, value, window: int, band, dropout: float = 0.0):
    """GPT-Neo's local attention (no scaling, key j seen from query i when 0 <= i - j < window) for
    a length T that is a multiple of `window`, computing only the blocks the window reaches. Query
    block 0 sees key block 0, causally; query block k > 0 sees key blocks k-1 and k, through `band`,
    the (window, 2 window) mask that is the same for every such block (rows i = window..2 window-1
    and keys 0..2 window-1 of the layer's own mask). The later blocks go to SDPA as one batch of
    (heads x blocks) rows: the key pairs are copied once, small beside the T x T scores they
    avoid."""
    n = query.size(-2) // window - 1  # query blocks after the first
    first = F.scaled_dot_product_attention(
        query[:, :, :window], key[:, :, :window], value[:, :, :window],
        dropout_p=dropout, is_causal=True, scale=1.0,
    )

    def pairs(x):  # (B, H, T, D) -> (B, H * n, 2 window, D): key blocks k-1 and k for block k
        # (not x.unfold: its backward compiled by inductor on the CPU with dropout corrupted the
        # heap, torch 2.13; slices and a cat are plain copies everywhere)
        blocks = x.unflatten(2, (n + 1, window))
        return torch.cat((blocks[:, :, :-1], blocks[:, :, 1:]), dim=3).flatten(1, 2)

    queries = query[:, :, window:].unflatten(2, (n, window)).flatten(1, 2)
    rest = F.scaled_dot_product_attention(
        queries, pairs(key), pairs(value), attn_mask=band, dropout_p=dropout, scale=1.0
    )
    return torch.cat((first, rest.unflatten(1, (query.size(1), n)).flatten(2, 3)), dim=2)


# SDPA's kernels (CUDA's flash, memory-efficient and cuDNN ones, the CPU's, a backend's): what a
# blocked local layer keeps for backward (`blocked_local_layer`); the math fallback is recomputed.
SDPA_KERNELS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(torch.ops.aten, name)
)


class _NoInPlaceNote(logging.Filter):
    """torch's note, once per process under compile, that a checkpoint given a context_fn must hold
    no in-place op: `local_blocked` holds none (slices, cats, SDPA), so its workers do not print it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_NoInPlaceNote())


def keep_attention(ctx, op, *args, **kwargs):
    """The selective checkpoint's policy: SDPA's results saved, everything else recomputed."""
    return CheckpointPolicy.MUST_SAVE if op in SDPA_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


def blocked_local_layer(query, key, value, window: int, band, dropout: float = 0.0):
    """`local_blocked` as a local layer runs it: where a gradient is wanted, checkpointed
    selectively. Saved for backward, the key and value pairs (copies, 1.5 q each) and the block
    queries would add 10% to GPT-Neo 125M's activations: those copies are recomputed in backward,
    and SDPA's results (the blocks' outputs and log-sum-exps, what the full mask's SDPA keeps too)
    are saved, so that backward runs no second forward of the blocks."""
    if not (torch.is_grad_enabled() and query.requires_grad):
        return local_blocked(query, key, value, window, band, dropout)
    return checkpoint(
        local_blocked, query, key, value, window, band, dropout, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, keep_attention),
    )


def _use_flex(query, dropout: float) -> bool:
    return (
        LOCAL_KERNEL == "flex"
        and dropout == 0.0
        and query.size(-1) >= FLEX_MIN_HEAD_DIM
        and query.is_cuda
        and torch.compiler.is_compiling()
    )


class GPTNeoSDPAttention(GPTNeoSelfAttention):
    def forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        """transformers' forward, with the three projections as one GEMM where they are plain."""
        if not _plain_projections(self):
            return super().forward(
                hidden_states, attention_mask, layer_past, use_cache, output_attentions, **kwargs
            )
        # One product against the weights stacked (a copy of 3 x H x H, small beside the
        # activations): a third of the projections' kernels forward, and in backward one GEMM for
        # the input's gradient (no sum of three) and one for the weights'.
        weight = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        query, key, value = F.linear(hidden_states, weight).split(self.embed_dim, dim=-1)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        if layer_past is not None:
            key, value = layer_past.update(key, value, self.layer_id)
        attn_output, attn_weights = self._attn(query, key, value, attention_mask)
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        return self.resid_dropout(self.out_proj(attn_output)), attn_weights

    def _attn(self, query, key, value, attention_mask=None):
        q_len, k_len = query.size(-2), key.size(-2)
        dropout = self.attn_dropout.p if self.training else 0.0
        # No mask: no padding. SDPA's is_causal is top-left aligned, GPT-Neo's mask bottom-right:
        # the same only when q_len == k_len (no KV cache), so other shapes take the mask below.
        window = self.config.window_size
        windowless = self.attention_type == "global" or k_len <= window
        if attention_mask is None and q_len == k_len and windowless:
            out = F.scaled_dot_product_attention(
                query, key, value, dropout_p=dropout, is_causal=True, scale=1.0
            )
            return out, None
        if attention_mask is None and q_len == k_len and _use_flex(query, dropout):  # a local layer
            return flex_local(query, key, value, window), None
        blockable = LOCAL_KERNEL != "mask" and k_len % window == 0
        if attention_mask is None and q_len == k_len and blockable:  # a local layer, blocked
            band = self.bias[:, :, window : 2 * window, : 2 * window]  # query block k, key blocks k-1 and k
            return blocked_local_layer(query, key, value, window, band, dropout), None
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


def _plain_projections(attention: GPTNeoSelfAttention) -> bool:
    """q, k and v are bare nn.Linear without bias or hooks (not adapters, say LoRA's, nor hooked
    for inspection), their weights alike: then one GEMM computes what their three calls would."""
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    weight = attention.q_proj.weight
    return all(
        type(p) is nn.Linear and p.bias is None and not (p._forward_hooks or p._forward_pre_hooks)
        and p.weight.dtype == weight.dtype and p.weight.device == weight.device
        for p in projections
    )


def use_sdpa(model: nn.Module) -> int:
    """Swap SDPA into every GPT-Neo attention module of `model`; returns how many were swapped.

    The model's config then says "sdpa" (never saved: transformers does not serialise it), so that
    transformers builds SDPA's masks rather than eager's: None for a batch without padding (no
    attention_mask, or an all-ones one: read once per forward, a host sync on a GPU, which is why
    the trainer drops an all-ones mask on the host, acco/data/on_device.py; no mask at all costs
    none, see `skip_packing_check`), a boolean 4-D mask otherwise.
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


_OWN_POSITIONS = threading.local()  # .depth > 0: inside a forward whose position ids the model makes


def skip_packing_check(model: nn.Module) -> bool:
    """Make transformers skip its packed-sequence check (a host sync) in forwards of `model` that
    pass no position ids, no attention mask and no KV cache: the base model's own position ids
    0..T-1 pack nothing. In those forwards the causal mask is also skipped as in eager (SDPA's
    is_causal, no mask) when the forward is traced by torch.compile: transformers builds a dense
    mask whenever it traces (5.17 always; later releases on torch before 2.14), which took every
    layer of a body compiled whole (``train.compile_scope=model``) off the flash kernel and the
    local layers off their blocks. Other forwards keep both checks. Nothing in the state dict or
    config changes; True when the model's base model was hooked."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or getattr(base, "_acco_own_positions_hooked", False):
        return False
    from transformers import masking_utils

    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return False
    for name, wrap in (("find_packed_sequence_indices", _wrap_packing_check),
                       ("_ignore_causal_mask_sdpa", _wrap_causal_skip)):
        check = getattr(masking_utils, name, None)
        if check is not None and not getattr(check, "acco_wrapped", False):
            setattr(masking_utils, name, wrap(check))
    # The hooks' stack lives on the module from here on: created inside the hook (dict.setdefault), torch
    # 2.11's dynamo broke the graph there when the body was compiled whole.
    base._acco_own_positions = []
    base.register_forward_pre_hook(_enter, with_kwargs=True)
    base.register_forward_hook(_leave, always_call=True)
    base._acco_own_positions_hooked = True
    return True


def _own_positions() -> bool:
    return getattr(_OWN_POSITIONS, "depth", 0) > 0


def _wrap_packing_check(check):
    def find_packed_sequence_indices(position_ids):
        if _own_positions():
            return None  # one sequence per row: the model's own 0..T-1
        return check(position_ids)

    find_packed_sequence_indices.acco_wrapped = True
    return find_packed_sequence_indices


def _wrap_causal_skip(decide):
    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, *rest, **kwargs):
        if _own_positions() and padding_mask is None and q_length == kv_length:
            # eager's answer, traced or not: is_causal unless a sliding window must be drawn in the mask
            local = kwargs.get("local_attention_size", rest[2] if len(rest) > 2 else None)
            return local is None or kv_length < local
        return decide(padding_mask, q_length, kv_length, *rest, **kwargs)

    _ignore_causal_mask_sdpa.acco_wrapped = True
    return _ignore_causal_mask_sdpa


def _enter(module, args, kwargs):
    own = len(args) <= 1 and all(
        kwargs.get(k) is None for k in ("attention_mask", "position_ids", "past_key_values")
    )
    module._acco_own_positions.append(own)
    _OWN_POSITIONS.depth = getattr(_OWN_POSITIONS, "depth", 0) + own


def _leave(module, args, output):
    _OWN_POSITIONS.depth -= module._acco_own_positions.pop()
