"""GPT-Neo through SDPA (acco/attention.py) equals transformers' eager attention, global and local
layers, sequences longer than the local window and not, with and without padding, in value and
gradients, and with a KV cache; unpadded global layers take SDPA's mask-free causal path, and the
query, key and value projections run as one GEMM."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from acco.attention import GPTNeoSDPAttention, use_sdpa
from acco.models import build_model

LENGTH = 12
# window 4: the local layers' window cuts in (LENGTH > window), blocked (LENGTH a multiple of it);
# window 5: cuts in, the full mask; window 16: local = causal
NEO = dict(arch="gpt_neo", hidden_size=32, num_layers=4, num_heads=4, max_position_embeddings=32)


def _models(window: int):
    torch.manual_seed(0)
    config = NEO | {"window_size": window}
    eager = build_model(config | {"attn_implementation": "eager"}, vocab_size=100, max_length=LENGTH)
    assert eager.config.attention_layers == ["global", "local", "global", "local"]
    sdpa = copy.deepcopy(eager)
    assert use_sdpa(sdpa) == 4
    return eager, sdpa


def _batch(padded: bool):
    x = torch.randint(0, 100, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    if not padded:
        return x, None
    # right padding (instruction data): the last 5 positions of row 0, 2 of row 1; row 2 unpadded
    mask = torch.ones_like(x)
    mask[0, -5:] = 0
    mask[1, -2:] = 0
    return x, mask


@pytest.mark.parametrize("window", [4, 5, 16])
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_equals_eager_for_gpt_neo(window, padded):
    eager, sdpa = _models(window)
    assert sum(isinstance(m, GPTNeoSDPAttention) for m in sdpa.modules()) == 4
    assert sdpa.state_dict().keys() == eager.state_dict().keys()
    built = build_model(NEO | {"window_size": window}, vocab_size=100)  # the default swaps it in
    assert sum(isinstance(m, GPTNeoSDPAttention) for m in built.modules()) == 4
    x, mask = _batch(padded)
    labels = x if mask is None else x.masked_fill(mask == 0, -100)
    real = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    outs = []
    for model in (eager, sdpa):
        out = model(input_ids=x, attention_mask=mask, labels=labels)
        out.loss.backward()
        outs.append((out.logits[real].detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    for g_sdpa, g_eager in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(g_sdpa, g_eager, rtol=1e-4, atol=1e-6)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _layer_pass(layer, x, dy):
    """One forward and backward of an attention layer: (output, the gradients of x and of the
    projections' weights, the ops run)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with _Ops() as ops:
        out = layer(x)[0]
        out.backward(dy)
    weights = [p.weight.grad for p in (layer.q_proj, layer.k_proj, layer.v_proj)]
    return out.detach(), [x.grad, *weights], ops.names


def test_the_projections_run_as_one_gemm_equal_to_three_and_hooked_ones_as_transformers_calls_them():
    """q, k and v come out of one GEMM on the stacked weights (forward: that and out_proj's addmm;
    backward: one GEMM for the input's gradient, one for the weights'), equal in fp64 to
    transformers' three calls; a projection an adapter or a hook holds keeps those calls."""
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

    _, sdpa = _models(16)
    layer = sdpa.transformer.h[0].attn.attention.double()
    x = torch.randn(3, LENGTH, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    dy = torch.randn_like(x)
    got, got_grads, ops = _layer_pass(layer, x, dy)
    assert ops.count("mm") + ops.count("addmm") == 1 + 1 + 2 + 2  # fwd qkv, out_proj; bwd of each
    layer.forward = GPTNeoSelfAttention.forward.__get__(layer)  # transformers' own forward
    want, want_grads, reference_ops = _layer_pass(layer, x, dy)
    assert reference_ops.count("mm") + reference_ops.count("addmm") == 3 + 1 + 6 + 2
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    del layer.forward
    seen = []
    layer.k_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    hooked, hooked_grads, hooked_ops = _layer_pass(layer, x, dy)
    assert seen == [x.shape] and hooked_ops.count("mm") + hooked_ops.count("addmm") == 12
    torch.testing.assert_close(hooked, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("step", [1, 3])  # decoding one token, and a chunk: q_len < k_len
def test_sdpa_equals_eager_with_a_kv_cache(step):
    eager, sdpa = _models(4)
    x, _ = _batch(False)
    logits = []
    for model in (eager.eval(), sdpa.eval()):
        with torch.no_grad():
            past = model(input_ids=x[:, :6], use_cache=True).past_key_values
            logits.append(model(input_ids=x[:, 6 : 6 + step], past_key_values=past, use_cache=True).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


# per layer kind, the SDPA calls as (no mask, is_causal, key length); LENGTH 12
CAUSAL, MASKED = (True, True, LENGTH), (False, False, LENGTH)


@pytest.mark.parametrize("window, padded, local", [
    (4, False, [(True, True, 4), (False, False, 8)]),  # blocked: block 0 causal, blocks 1-2 banded
    (5, False, [MASKED]),  # the window cuts in, LENGTH no multiple of it: the full mask
    (16, False, [CAUSAL]),  # the window holds every key: causal
    (4, True, [MASKED]),
    (16, True, [MASKED]),
])  # fmt: skip
def test_unpadded_causal_layers_call_sdpa_without_a_mask(monkeypatch, window, padded, local):
    import acco.attention

    eager, sdpa = _models(window)
    x, mask = _batch(padded)
    if mask is None:  # no attention_mask, and an all-ones one (pre-tokenized data): the same call
        masks = [None, torch.ones_like(x)]
    else:
        masks = [mask]
    real, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recorder(query, key, *args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal, key.size(-2)))
        return real(query, key, *args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorder)
    per_kind = {"global": [MASKED] if padded else [CAUSAL], "local": local}
    for attention_mask in masks:
        calls.clear()
        sdpa(input_ids=x, attention_mask=attention_mask)
        assert calls == [c for kind in sdpa.config.attention_layers for c in per_kind[kind]]
    if local != [CAUSAL]:  # LOCAL_KERNEL "mask" (acco-bench gpu's -mask variants): the full mask
        monkeypatch.setattr(acco.attention, "LOCAL_KERNEL", "mask")
        calls.clear()
        logits = sdpa(input_ids=x, attention_mask=mask).logits
        assert calls == [c for kind in sdpa.config.attention_layers for c in ([MASKED] if kind == "local"
                                                                               else per_kind[kind])]
        real = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()  # padding: any value
        reference = eager(input_ids=x, attention_mask=mask).logits
        torch.testing.assert_close(logits[real], reference[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, window", [(8, 4), (12, 4), (12, 3), (64, 16)])
def test_local_blocked_equals_the_masked_local_attention_in_fp64(length, window):
    """Only the blocks the window reaches, and the same values and gradients as SDPA on GPT-Neo's
    whole T x T local mask (built here from its definition, 0 <= i - j < window)."""
    from acco.attention import local_blocked

    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(2, 3, length, 8, dtype=torch.float64, generator=g) for _ in range(4))
    i = torch.arange(length)
    full = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < window)
    band = full[window : 2 * window, : 2 * window]
    outs = []
    for attend in (
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=1.0),
        lambda q, k, v: local_blocked(q, k, v, window, band),
    ):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = attend(*inputs)
        outs.append((out, torch.autograd.grad(out, inputs, dy)))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-12, atol=1e-12)
    for got, want in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_flex_is_off_by_default_and_never_taken_by_heads_under_16(monkeypatch):
    """flex_attention for local layers is opt-in (slower than masked SDPA on an H200 at GPT-Neo's
    shapes), and never taken with heads inductor's flex kernels refuse (the tiny models' 8)."""
    from types import SimpleNamespace

    import acco.attention

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    def query(head_dim):  # a CUDA query under compile, as far as _use_flex looks
        return SimpleNamespace(size=lambda dim: head_dim, is_cuda=True)

    assert not acco.attention._use_flex(query(64), 0.0)
    monkeypatch.setattr(acco.attention, "LOCAL_KERNEL", "flex")
    assert acco.attention._use_flex(query(64), 0.0) and acco.attention._use_flex(query(16), 0.0)
    assert not acco.attention._use_flex(query(8), 0.0)
    assert not acco.attention._use_flex(query(64), 0.1)  # dropout: SDPA


@pytest.mark.parametrize("window, compiled", [(4, False), (16, False), (4, True)])
def test_flex_local_layers_equal_eager_forward(monkeypatch, window, compiled):
    """The flex_attention path of local layers (taken on CUDA under compile: forced here) equals
    eager attention in the forward pass (torch 2.13 has no flex backward on the CPU), also traced
    inside the compiled blocks (dynamo's graph, the block mask built in it); a local layer whose
    window holds every key keeps SDPA's causal path."""
    from torch._dynamo.utils import counters

    import acco.attention
    from acco.engine.compiling import compile_module

    eager, sdpa = _models(window)
    graphs = []
    torch._dynamo.reset()  # traced anew, graph breaks counted from zero
    counters.clear()
    if compiled:  # dynamo's graphs, run as traced
        compile_module(sdpa, {"backend": lambda gm, inputs: graphs.append(gm) or gm.forward})
    assert not acco.attention._use_flex(torch.zeros(1), 0.0)  # the CPU, not compiling: never
    calls = []
    real = acco.attention.flex_local
    monkeypatch.setattr(acco.attention, "_use_flex", lambda query, dropout: True)
    if not compiled:  # (a call counter would be traced, not run, inside a compiled block)
        monkeypatch.setattr(acco.attention, "flex_local", lambda *a: calls.append(a[-1]) or real(*a))
    x, _ = _batch(False)
    with torch.no_grad():
        want, got = eager(input_ids=x).logits, sdpa(input_ids=x).logits
    assert calls == ([window, window] if window < LENGTH and not compiled else [])  # the two local layers
    if compiled:  # the local layer's graph holds flex_attention
        assert graphs and any("flex_attention" in str(n.target) for gm in graphs for n in gm.graph.nodes)
        assert not counters["graph_break"], list(counters["graph_break"])  # the mask built in-graph
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_blocked_local_layer_keeps_sdpa_s_results_and_recomputes_only_copies(monkeypatch):
    """Selective checkpointing: the layer's autograd keeps q, k and v (and its mask buffer), the
    checkpoint keeps SDPA's results, and the copies (the key pairs, about 10% of GPT-Neo's
    activations if kept) are recomputed; backward runs no second forward of SDPA, and the
    gradients are those of the layer without a checkpoint."""
    from torch.utils.checkpoint import CheckpointPolicy

    import acco.attention

    _, sdpa = _models(4)
    layers = [m for m in sdpa.modules() if isinstance(m, GPTNeoSDPAttention)]
    local = next(m for m in layers if m.attention_type == "local")
    q, k, v = (torch.randn(3, 4, LENGTH, 8, requires_grad=True) for _ in range(3))
    allowed = {t.untyped_storage().data_ptr() for t in (q, k, v, local.bias)}
    saved, decided = [], []

    def pack(t):
        saved.append(t)
        return t

    def policy(ctx, op, *args, **kwargs):
        decision = real_policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:
            decided.append((op.__name__.split(".")[0], decision == CheckpointPolicy.MUST_SAVE))
        return decision

    real_policy = acco.attention.keep_attention
    monkeypatch.setattr(acco.attention, "keep_attention", policy)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = local._attn(q, k, v)
    # (torch 2.11's checkpoint also saves an empty tensor of its own: it holds no memory)
    assert saved and {t.untyped_storage().data_ptr() for t in saved if t.numel()} <= allowed
    kept = sorted(op for op, keep in decided if keep)
    assert kept == ["_scaled_dot_product_flash_attention_for_cpu"] * 2  # block 0, and the later blocks
    assert "cat" in {op for op, keep in decided if not keep}  # the key pairs: recomputed
    with _Ops() as backward_ops:
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    ran = backward_ops.names
    assert ran and not [op for op in ran if op.startswith("_scaled_dot") and not op.endswith("_backward")]
    band = local.bias[:, :, 4:8, :8]
    want = torch.autograd.grad(acco.attention.local_blocked(q, k, v, 4, band).sum(), (q, k, v))
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_blocked_local_layers_under_gradient_checkpointing_give_the_same_gradients(reentrant):
    """transformers' gradient checkpointing recomputes each block, with the blocked local layers'
    own recomputation nested inside it: the gradients are those of a run without either."""
    _, sdpa = _models(4)
    checkpointed = copy.deepcopy(sdpa)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    x, _ = _batch(False)
    for model in (sdpa.train(), checkpointed.train()):
        model(input_ids=x, labels=x).loss.backward()
    for got, want in zip(checkpointed.parameters(), sdpa.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)


def test_torch_s_in_place_note_on_the_selective_checkpoint_is_not_printed():
    """Under compile torch logs, once, that a checkpoint with a context_fn must hold no in-place op;
    the blocked layer's holds none (its gradients equal eager's, tests/test_compile.py), so acco
    filters that one record out of torch's logger, and nothing else."""
    import inspect
    import logging

    from torch._higher_order_ops import wrap

    import acco.attention  # noqa: F401  (installs the filter)

    note = "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile."
    assert note in inspect.getsource(wrap.tag_activation_checkpoint_impl)  # torch's text, this version

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord(wrap.log.name, logging.WARNING, __file__, 1, message, None, None)

    assert not wrap.log.filter(record(f"\n{note}\nPlease make sure the checkpointed region ..."))
    assert wrap.log.filter(record("any other warning"))
