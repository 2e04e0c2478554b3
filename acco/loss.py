"""The causal LM loss: a fused, chunked cross-entropy over the model's last hidden states.

``causal_lm_loss(model, batch)`` returns (sum of next-token losses, number of target tokens); the
engine divides by the tokens summed over micro-batches and workers, so a padded or masked batch
counts each token once. It is the value of the textbook formula

    cross_entropy(logits[:, :-1].float(), labels[:, 1:], ignore_index=-100, reduction="sum")

computed without its copies: the labels are shifted instead of the logits being sliced, and for
the models whose logits are known to be exactly ``head(last hidden state)`` (FUSED_LOSS_MODELS:
GPT-Neo, Llama, ...) the loss never makes the full logits. `linear_cross_entropy` takes the
hidden states chunk by chunk (CHUNK_POSITIONS rows); for each chunk one pass computes the logits
(hidden @ W^T, in the compute dtype), their fp32 log-sum-exp, the loss and, when gradients are
wanted, the gradient of the logits (softmax - one-hot, in the compute dtype), from which the
gradients of the hidden states and of the head are taken at once (dW accumulated over chunks).
The backward pass only scales what the forward pass computed: no fp32 logits are kept, no head
GEMM is recomputed, and with gradients off (evaluation, `torch.no_grad`) only the logits and the
loss are computed.

The head is padded to a multiple of VOCAB_MULTIPLE rows inside the loss only (50257 -> 50304 for
GPT-Neo: rows of an odd number of bf16 elements keep a GPU's fast GEMM kernels off); the padded
columns are masked to -inf, so they take no probability and get no gradient, and the model's
vocabulary is unchanged. With ``train.compile`` the per-chunk pass (logits to the logits'
gradient) is compiled too: the engine marks the model (acco/engine/compiling.py) and the loss
reads the mark.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from acco.data.instruct import IGNORE_INDEX

CHUNK_POSITIONS = 1024  # positions per chunk: 1024 x 50304 fp32 logits are 0.2 GB
VOCAB_MULTIPLE = 128  # the head is padded to a multiple of this many rows, inside the loss only

# The transformers causal LMs whose logits are exactly lm_head(base_model(...).last_hidden_state),
# each checked against its own loss and gradients on a tiny config (tests/test_loss.py): the fused
# loss is taken for these classes only. Any other model (one that scales or caps its logits, as
# Cohere, Gemma 2 or Granite do; a subclass or a module of the user's own) goes through its own
# logits: right whatever its forward does, with the full logits in memory.
FUSED_LOSS_MODELS = frozenset(
    {"GPT2LMHeadModel", "GPTNeoForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
     "Qwen3ForCausalLM"}
)  # fmt: skip


def causal_lm_loss(model, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels = batch["labels"]
    # Position i predicts token i + 1; the last position predicts nothing.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).flatten()
    n_targets = (targets != IGNORE_INDEX).sum()
    head = _output_head(model)
    if head is None:
        logits = model(**inputs, use_cache=False).logits.flatten(0, 1)  # a view: no copy
        return _loss_sum(logits, targets), n_targets
    hidden = model.base_model(**inputs, use_cache=False).last_hidden_state.flatten(0, 1)
    compiled = getattr(model, "acco_compile", None)
    return linear_cross_entropy(hidden, head.weight, head.bias, targets, compile_options=compiled), n_targets


def _output_head(model):
    """The LM head of a model of FUSED_LOSS_MODELS (transformers' own class), else None: the loss
    then goes through the model's own logits."""
    cls = type(model)
    if cls.__name__ not in FUSED_LOSS_MODELS or not cls.__module__.startswith("transformers.models."):
        return None
    head = model.get_output_embeddings()
    return head if isinstance(head, torch.nn.Linear) else None


def loss_note(model) -> str | None:
    """The line that says a model's loss goes through its own logits (None: the fused loss)."""
    if _output_head(model) is not None:
        return None
    return (
        f"loss: through {type(model).__name__}'s own logits (the fused loss is proven on "
        f"{', '.join(sorted(FUSED_LOSS_MODELS))} only: docs/training.md)"
    )


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: int | None = None,
    compile_options: Mapping | None = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, targets, ignore_index=-100, reduction="sum")`` in
    fp32, for hidden (N, H), weight (V, H), bias (V,) or None and targets (N,), without the (N, V)
    logits: chunk by chunk, gradients computed in the same pass (module docstring). Under autocast
    the matrix products run in the autocast dtype, as ``nn.Linear`` would."""
    chunk = chunk or CHUNK_POSITIONS
    pass_fn = _chunk_pass if not compile_options else _compiled_pass(**compile_options)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    if not wants_grad:
        return _forward(hidden, weight, bias, targets, chunk, pass_fn, (False, False, False))[0]
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk, pass_fn)


def _chunk_pass(h, w, b, t, vocab: int, grad: bool):
    """One chunk: (sum of its losses in fp32, the gradient of its logits in h's dtype or None).
    w (and b) are padded to a multiple of VOCAB_MULTIPLE rows; the rows from `vocab` on are masked.
    Eager: in place on one fp32 copy of the logits, so a run holds one chunk-sized tensor (and the
    bf16 logits), not one per step."""
    z = _fp32_logits(h, w, b)  # a copy of bf16 logits, the logits themselves otherwise: our own
    if vocab < z.shape[1]:
        z[:, vocab:] = float("-inf")
    loss, lse, valid, safe = _losses(z, t)
    if not grad:
        return loss, None
    probs = z.sub_(lse.unsqueeze(1)).exp_()  # the softmax, in z's place
    probs.scatter_add_(1, safe, -torch.ones_like(safe, dtype=probs.dtype))  # minus the one-hot
    return loss, probs.mul_(valid.unsqueeze(1)).to(h.dtype)


def _pointwise_chunk_pass(h, w, b, t, vocab: int, grad: bool):
    """`_chunk_pass`'s values, written as pointwise steps for compile: inductor then makes one
    reduction (the log-sum-exp and the loss) and one pointwise kernel that reads the logits and
    writes their gradient in their place. The in-place mask and scatter make it keep an fp32 copy
    and write it twice (8 kernels against 5; on the CPU 1.7x the time, BENCHMARKS.md)."""
    z = _fp32_logits(h, w, b)
    cols = torch.arange(z.shape[1], device=z.device)
    if vocab < z.shape[1]:
        z = torch.where(cols < vocab, z, float("-inf"))
    loss, lse, valid, safe = _losses(z, t)
    if not grad:
        return loss, None
    g = torch.where(cols == safe, 1.0, 0.0)  # the one-hot
    return loss, torch.where(valid.unsqueeze(1), (z - lse.unsqueeze(1)).exp() - g, 0.0).to(h.dtype)


def _fp32_logits(h, w, b):
    """The chunk's logits in fp32 (fp64 stays fp64)."""
    logits = h @ w.t() if b is None else torch.addmm(b, h, w.t())
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _losses(z, t):
    """The chunk's summed loss, and what its gradient needs: log-sum-exp, valid targets, safe ids."""
    lse = torch.logsumexp(z, dim=1)
    valid = t != IGNORE_INDEX
    safe = torch.where(valid, t, 0).unsqueeze(1)
    return torch.where(valid, lse - z.gather(1, safe).squeeze(1), 0.0).sum(), lse, valid, safe


_COMPILED: dict = {}


def _compiled_pass(**options):
    key = tuple(sorted(options.items()))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_pointwise_chunk_pass, **options)
    return _COMPILED[key]


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _forward(hidden, weight, bias, targets, chunk, pass_fn, needs):
    """The loss and, where `needs` (hidden, weight, bias) asks, the unscaled gradients."""
    dtype = _compute_dtype(hidden, weight)
    vocab = weight.shape[0]
    pad = -vocab % VOCAB_MULTIPLE
    with torch.autocast(hidden.device.type, enabled=False):
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        if pad:  # F.pad copies even when it pads nothing (Llama's 128256 rows: 0.5 GB)
            w, b = F.pad(w, (0, 0, 0, pad)), None if b is None else F.pad(b, (0, pad))
        h = hidden.to(dtype)
        grad = any(needs)
        loss = torch.zeros((), dtype=torch.promote_types(dtype, torch.float32), device=hidden.device)
        dh = torch.empty_like(h) if needs[0] else None
        # dW sums over chunks: in fp32 (a bf16 sum rounds once per chunk, its error growing with them);
        # the first chunk's product is written, not added, so dW is zeroed only when there is none
        fresh = torch.empty_like if h.shape[0] else torch.zeros_like
        dw = fresh(w, dtype=torch.promote_types(w.dtype, torch.float32)) if needs[1] else None
        db = torch.zeros(w.shape[0], dtype=loss.dtype, device=w.device) if needs[2] else None
        for start in range(0, h.shape[0], chunk):
            h_c, t_c = h[start : start + chunk], targets[start : start + chunk]
            chunk_loss, g = pass_fn(h_c, w, b, t_c, vocab, grad)
            loss = loss + chunk_loss
            if dh is not None:
                torch.mm(g, w, out=dh[start : start + chunk])
            if dw is not None:
                _add_product(dw, g.t(), h_c, first=start == 0)
            if db is not None:
                db += g.sum(0, dtype=db.dtype)
    return loss, dh, None if dw is None else dw[:vocab], None if db is None else db[:vocab]


def _has_fp32_addmm() -> bool:
    schemas = torch._C._jit_get_schemas_for_operator("aten::addmm")
    return any(s.overload_name == "dtype_out" for s in schemas)


_FP32_ADDMM = _has_fp32_addmm()  # addmm(..., out_dtype=): CUDA's, and meta's shape rules


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = False) -> None:
    """acc += a @ b (`first`: acc = a @ b, acc's contents ignored, NaN included: addmm's beta 0),
    with acc wider than a and b (fp32 against bf16): one GEMM that accumulates
    into fp32 where the device has it (CUDA's addmm with out_dtype), else a and b widened first
    (the CPU). dW's error in bf16 then stays that of one GEMM whatever the number of chunks; summed
    in bf16 it was 2x at 8 chunks and 3.8x at 32, and the bf16 product added to fp32 1.4x
    (tests/test_loss_fused.py)."""
    global _FP32_ADDMM
    beta = 0 if first else 1
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=beta)
        return
    if _FP32_ADDMM and acc.device.type in ("cuda", "meta"):
        try:
            torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
            return
        # a build without it for these dtypes; TypeError: torch 2.11's meta kernel for it, which
        # reads out_dtype as beta (tests/test_loss_fused.py)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            _FP32_ADDMM = False
            warnings.warn(f"addmm with out_dtype failed ({e}); the loss widens its inputs", stacklevel=2)
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, pass_fn):
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        loss, dh, dw, db = _forward(hidden, weight, bias, targets, chunk, pass_fn, needs)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(dh, dw, db)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = []
        for g, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            if g is not None and torch.is_grad_enabled():  # create_graph: out= has no autograd
                g = (g * grad_loss.to(g.dtype)).to(dtype)
            elif g is not None:  # scaled and cast in one pass (fp32 dW into bf16: read 4 bytes, write 2)
                g = torch.mul(g, grad_loss.to(g.dtype), out=torch.empty_like(g, dtype=dtype))
            grads.append(g)
        return *grads, None, None, None
