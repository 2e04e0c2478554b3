"""The fused, chunked cross-entropy (acco/loss.py's linear_cross_entropy): exact against the
textbook formula in fp64 (padded head, bias, ignored targets, chunks that do not divide the rows),
equal to the loss acco computed before it in fp32 and within bf16 rounding in bf16, no gradient
work under no_grad and none in the backward pass."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from op_passes import Passes
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from trainer_helpers import loss_test_config

import acco.loss
from acco.loss import IGNORE_INDEX, causal_lm_loss, linear_cross_entropy
from acco.models import build_model

MATMULS = {"mm", "addmm", "addmm_", "bmm", "matmul"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def matmuls(self) -> int:
        return sum(op in MATMULS for op in self.ops)


def _problem(vocab: int, bias: bool, dtype=torch.float64, rows: int = 37, width: int = 16):
    gen = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(rows, width, dtype=dtype, generator=gen).requires_grad_()
    weight = torch.randn(vocab, width, dtype=dtype, generator=gen).requires_grad_()
    b = torch.randn(vocab, dtype=dtype, generator=gen).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[3:9] = IGNORE_INDEX  # a masked prompt
    targets[-1] = vocab - 1  # the last real column, next to the padded ones
    return hidden, weight, b, targets


def _grads(loss, tensors):
    (0.37 * loss).backward()  # the engine scales by 1 / tokens: the backward pass must scale too
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


@pytest.mark.parametrize("vocab", [203, 256])  # padded to 256 (53 masked columns), and not padded
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [8, 64])  # 5 chunks, the last partial; one chunk
@pytest.mark.parametrize("chunk_pass", ["in place", "pointwise"])  # eager's; the one train.compile compiles
def test_fp64_equals_the_textbook_formula(monkeypatch, vocab, bias, chunk, chunk_pass):
    hidden, weight, b, targets = _problem(vocab, bias)
    tensors = [t for t in (hidden, weight, b) if t is not None]
    options = None
    if chunk_pass == "pointwise":  # its values, uncompiled (test_compile.py compiles it)
        monkeypatch.setattr(acco.loss, "_compiled_pass", lambda **o: acco.loss._pointwise_chunk_pass)
        options = {"backend": "inductor"}
    loss = linear_cross_entropy(hidden, weight, b, targets, chunk=chunk, compile_options=options)
    assert loss.dtype == torch.float64
    got = _grads(loss, tensors)
    expected = F.cross_entropy(
        F.linear(hidden, weight, b), targets, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    want = _grads(expected, tensors)
    torch.testing.assert_close(loss, expected, rtol=1e-13, atol=0)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_no_gradient_work_without_grad_and_none_in_backward():
    hidden, weight, _, targets = _problem(203, False)
    chunks = -(-hidden.shape[0] // 8)
    with torch.no_grad(), OpCounter() as plain:
        loss = linear_cross_entropy(hidden, weight, None, targets, chunk=8)
    assert not loss.requires_grad and plain.matmuls() == chunks  # the logits only
    with OpCounter() as forward:
        loss = linear_cross_entropy(hidden, weight, None, targets, chunk=8)
    assert forward.matmuls() == 3 * chunks  # logits, d hidden, d head: once each per chunk
    with OpCounter() as backward:
        loss.backward()
    assert backward.matmuls() == 0  # nothing recomputed
    hidden.grad = weight.grad = None
    frozen = weight.detach()  # a frozen head: no d head
    with OpCounter() as forward:
        linear_cross_entropy(hidden, frozen, None, targets, chunk=8).backward()
    assert forward.matmuls() == 2 * chunks and weight.grad is None and hidden.grad is not None


def test_the_head_gradient_is_written_by_the_first_chunk_not_added_to_zeros(monkeypatch):
    """dW is allocated, never zeroed: the first chunk's product overwrites whatever the memory
    held (NaN here), and the gradients stay exact."""
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real(*a, **k).fill_(float("nan")))
    hidden, weight, _, targets = _problem(203, False)
    got = _grads(linear_cross_entropy(hidden, weight, None, targets, chunk=8), [hidden, weight])
    monkeypatch.setattr(torch, "empty_like", real)
    want = _grads(F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum"),
                  [hidden, weight])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    empty = linear_cross_entropy(hidden[:0], weight, None, targets[:0])  # no chunk at all: dW is 0
    empty.backward()
    assert float(empty.detach()) == 0.0 and torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("vocab", [203, 256])
def test_the_head_s_passes_over_its_weights(vocab):
    """Per micro-batch, on tensors of the head's size: no pad copy where the vocabulary needs none,
    no zeroing of dW, and in the backward pass one op per gradient (scaled and cast to bf16 at once)."""
    hidden, weight, _, targets = _problem(vocab, False, dtype=torch.bfloat16, rows=24)
    head_sized = 200 * 16

    with Passes(head_sized) as forward:
        loss = linear_cross_entropy(hidden, weight, None, targets, chunk=8)
    with Passes(head_sized) as backward:
        loss.backward()
    pad = ["constant_pad_nd"] if vocab % 128 else []
    assert forward.ops == pad + ["mm", "mm", "addmm_"] * 3, forward.ops  # logits, d hidden, d head
    assert backward.ops == ["mul"], backward.ops
    assert weight.grad.dtype == torch.bfloat16


def test_a_backward_that_creates_a_graph_still_works():
    hidden, weight, _, targets = _problem(203, False)
    loss = linear_cross_entropy(hidden, weight, None, targets, chunk=8)
    scale = torch.tensor(0.37, dtype=torch.float64, requires_grad=True)
    (g_hidden,) = torch.autograd.grad(scale * loss, [hidden], create_graph=True)
    assert g_hidden.requires_grad  # through the scale
    want = _grads(F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum"),
                  [hidden])[0]
    torch.testing.assert_close(g_hidden.detach(), want, rtol=1e-12, atol=1e-14)


def _batch(vocab: int = 97):
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, vocab, (3, 40), generator=gen)
    labels[0, :7] = IGNORE_INDEX
    labels[2, 30:] = IGNORE_INDEX
    return {"input_ids": torch.randint(0, vocab, (3, 40), generator=gen), "labels": labels}


def todays_loss(model, batch, chunk=16):
    """The loss acco computed before the fused one: checkpointed head and fp32 cross-entropy per chunk."""
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX).flatten()
    hidden = model.base_model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state.flatten(0, 1)
    head = model.get_output_embeddings()

    def part(h, t):
        return F.cross_entropy(head(h).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")

    return sum(
        checkpoint(part, h, t, use_reentrant=False) for h, t in zip(hidden.split(chunk), targets.split(chunk))
    )


def _loss_and_grads(fn, model, batch):
    model.zero_grad(set_to_none=True)
    loss = fn(model, batch)
    loss = loss[0] if isinstance(loss, tuple) else loss
    (loss / 100).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt_neo", "llama"])
def test_equals_todays_loss_in_fp32(monkeypatch, arch):
    """Loss and every parameter's gradient (the head, tied to the embedding in GPT-Neo, included)."""
    monkeypatch.setattr(acco.loss, "CHUNK_POSITIONS", 16)
    torch.manual_seed(0)
    model = build_model(loss_test_config(arch), vocab_size=97, max_length=64)
    loss, grads = _loss_and_grads(causal_lm_loss, model, _batch())
    want_loss, want = _loss_and_grads(todays_loss, model, _batch())
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-4)
    assert grads.keys() == want.keys()
    for name in grads:
        torch.testing.assert_close(
            grads[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def _errors(grads: dict, exact: dict) -> torch.Tensor:
    return torch.stack([(grads[n].double() - exact[n]).norm() / exact[n].norm() for n in exact])


@pytest.mark.parametrize("arch", ["gpt_neo", "llama"])
def test_as_exact_as_todays_loss_in_bf16(monkeypatch, arch):
    """bf16 parameters: against the fp64 value, the fused loss's gradients are as close as today's
    (each rounds differently: the logits' gradient is rounded before, not after, its scale)."""
    monkeypatch.setattr(acco.loss, "CHUNK_POSITIONS", 16)
    torch.manual_seed(0)
    model = build_model(loss_test_config(arch), vocab_size=97, max_length=64).to(torch.bfloat16)
    exact_loss, exact = _loss_and_grads(todays_loss, copy.deepcopy(model).double(), _batch())
    loss, grads = _loss_and_grads(causal_lm_loss, model, _batch())
    want_loss, want = _loss_and_grads(todays_loss, model, _batch())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=0)
    ours, todays = _errors(grads, exact), _errors(want, exact)
    assert (ours < 1.5 * todays + 1e-3).all() and ours.mean() < 1.15 * todays.mean(), (ours, todays)
    assert ours.max() < 0.03  # bf16 rounding, a few units of 2^-8


def test_autocast_fp32_parameters(monkeypatch):
    """torch-ddp's case: fp32 parameters under bf16 autocast, the head's products in bf16 as
    nn.Linear's; fp32 gradients as close to the fp64 value as today's loss gives them."""
    monkeypatch.setattr(acco.loss, "CHUNK_POSITIONS", 16)
    torch.manual_seed(0)
    model = build_model(loss_test_config("gpt_neo"), vocab_size=97, max_length=64)
    exact_loss, exact = _loss_and_grads(todays_loss, copy.deepcopy(model).double(), _batch())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _loss_and_grads(causal_lm_loss, model, _batch())
        want_loss, want = _loss_and_grads(todays_loss, model, _batch())
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=0)
    assert all(g.dtype == torch.float32 for g in grads.values())
    ours, todays = _errors(grads, exact), _errors(want, exact)
    assert (ours < 1.5 * todays + 1e-3).all() and ours.mean() < 1.15 * todays.mean(), (ours, todays)
    assert 1e-4 < ours.max() < 0.03  # bf16 products (not fp32: autocast reached the head)


def test_autocast_computes_in_its_dtype():
    hidden, weight, _, targets = _problem(203, False, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, None, targets, chunk=8)
    got = _grads(loss, [hidden, weight])
    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    want_loss = linear_cross_entropy(h16, w16, None, targets, chunk=8)
    want = _grads(want_loss, [h16, w16])
    assert loss.dtype == torch.float32 and torch.equal(loss, want_loss)
    assert [g.dtype for g in got] == [torch.float32] * 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.float(), rtol=1e-2, atol=1e-3)


def test_the_head_gradient_in_bf16_is_as_exact_with_many_chunks_as_with_one():
    """dW sums one product per chunk: in fp32, so its error against fp64 stays that of a single
    GEMM (summed in bf16 it was 3.8x at 32 chunks)."""
    torch.manual_seed(0)
    n, width, vocab = 4096, 64, 512
    h = (torch.randn(n, width) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, width) * 0.05).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (n,))
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    F.cross_entropy(h64 @ w64.t(), t, reduction="sum").backward()
    errors = []
    for chunk in (n, n // 32):
        w.grad = None
        linear_cross_entropy(h, w, None, t, chunk=chunk).backward()
        errors.append(float((w.grad.double() - w64.grad).norm() / w64.grad.norm()))
    assert w.grad.dtype == torch.bfloat16
    assert errors[1] <= 1.1 * errors[0], errors


def test_the_fp32_accumulating_gemm_takes_bf16_inputs(monkeypatch):
    """The CUDA branch of the per-chunk sum (addmm with out_dtype), run on meta tensors, whose
    shape rules CUDA's kernel shares: it takes bf16 products into an fp32 sum in place."""
    if not acco.loss._FP32_ADDMM:
        pytest.skip("this torch has no addmm(..., out_dtype=): the widened product serves every device")
    try:
        torch.addmm(*(torch.zeros(2, 2, device="meta", dtype=d) for d in (torch.float32, torch.bfloat16,
                                                                            torch.bfloat16)),
                    out_dtype=torch.float32)
    except TypeError:  # its meta kernel reads out_dtype as beta (CUDA's kernel is checked on a GPU)
        pytest.skip(f"torch {torch.__version__}'s meta kernel of addmm with out_dtype is broken")
    calls, real = [], torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(k) or real(*a, **k))
    acc = torch.zeros(8, 4, device="meta")
    a, b = (torch.zeros(*shape, device="meta", dtype=torch.bfloat16) for shape in ((8, 16), (16, 4)))
    acco.loss._add_product(acc, a, b, first=True)
    acco.loss._add_product(acc, a, b)
    assert acc.dtype == torch.float32 and acc.shape == (8, 4)
    assert [k.get("out_dtype") for k in calls] == [torch.float32] * 2 and calls[0]["out"] is acc  # CUDA's
    assert [k["beta"] for k in calls] == [0, 1]  # the first chunk's product is written, the others added


@pytest.mark.parametrize("error", [
    RuntimeError("addmm: out_dtype is not supported here"),
    TypeError("unsupported operand type(s) for *: 'torch.dtype' and 'Tensor'"),  # torch 2.11's meta kernel
], ids=["refused", "torch-2.11-meta"])
def test_a_torch_whose_fp32_accumulating_gemm_fails_widens_instead(monkeypatch, error):
    """Where addmm with out_dtype raises (a build without it for these dtypes), the sum goes on
    with the inputs widened, says so once, and does not try again."""
    monkeypatch.setattr(acco.loss, "_FP32_ADDMM", True)
    real = torch.addmm

    def refuse(*args, **kwargs):
        if "out_dtype" in kwargs:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", refuse)
    acc = torch.zeros(8, 4, device="meta")
    a, b = (torch.zeros(*shape, device="meta", dtype=torch.bfloat16) for shape in ((8, 16), (16, 4)))
    with pytest.warns(UserWarning, match="addmm with out_dtype failed"):
        acco.loss._add_product(acc, a, b)
    assert acco.loss._FP32_ADDMM is False and acc.dtype == torch.float32


@pytest.mark.slow  # inductor's C++ build: seconds warm, more on a fresh machine
def test_inductor_writes_the_logits_gradient_in_the_logits_place():
    """The pass train.compile compiles, through inductor (C++ on the CPU): the chunk's only
    chunk-sized buffer is the logits GEMM's output, which the gradient overwrites; no fp32 copy.
    The in-place pass (eager's) compiled keeps an fp32 copy and writes it twice."""
    import re

    from torch._inductor.utils import run_and_get_code

    rows, vocab = 48, 200  # padded to 256
    h, w = torch.randn(rows, 16, dtype=torch.bfloat16), torch.randn(256, 16, dtype=torch.bfloat16)
    t = torch.randint(0, vocab, (rows,))
    t[5] = IGNORE_INDEX
    chunk_sized = {}
    passes = {
        "train.compile's": acco.loss._compiled_pass(backend="inductor"),
        "eager's, compiled": torch.compile(acco.loss._chunk_pass, backend="inductor"),
    }
    for name, compiled in passes.items():
        torch._dynamo.reset()  # compiled here, whatever ran before
        (loss, g), (code, *_) = run_and_get_code(compiled, h, w, None, t, vocab, True)
        want_loss, want_g = acco.loss._chunk_pass(h, w, None, t, vocab, True)
        torch.testing.assert_close(loss, want_loss)
        torch.testing.assert_close(g, want_g)
        allocated = re.findall(rf"= empty_strided_cpu\(\({rows}, 256\), \(256, 1\), (torch\.\w+)\)", code)
        chunk_sized[name] = allocated
    # torch 2.11's inductor (the GPU machine's) writes the gradient beside the logits: no fp32 copy
    # either, one more bf16 chunk (0.1 GB at 1024 x 50304)
    in_place = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
    assert chunk_sized == {
        "train.compile's": ["torch.bfloat16"] * (1 if in_place else 2),
        "eager's, compiled": ["torch.bfloat16", "torch.float32", "torch.bfloat16"],
    }
