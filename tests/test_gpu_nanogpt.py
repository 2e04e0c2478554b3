"""The nanoGPT anchor of ``acco-bench gpu`` (acco_bench/gpu_nanogpt.py) is GPT-2: its logits equal
transformers' GPT2LMHeadModel's on the same weights, its FLOPs per token are GPT-2's count, and its
variants run through acco-bench on the CPU (eager and compiled train alike)."""

from __future__ import annotations

import json

import pytest
import torch
from bench_helpers import TINY_ON_CPU, one_thread

from acco_bench import gpu_nanogpt
from acco_bench.cli import main
from acco_bench.gpu import parse_variants


def _gpt2_weights_into(anchor: gpu_nanogpt.NanoGPT, gpt2) -> None:
    """GPT2LMHeadModel's state into the anchor: the same names, Conv1D's (in, out) transposed."""
    ours = anchor.state_dict()
    theirs = {k: v for k, v in gpt2.state_dict().items() if v.dtype != torch.bool}  # no causal-mask buffer
    assert set(theirs) == set(ours)  # every weight has its place: none is left at its initial value
    with torch.no_grad():
        for name, value in theirs.items():
            conv1d = value.dim() == 2 and name.startswith("transformer.h.")
            ours[name].copy_(value.t() if conv1d else value)


def test_the_anchor_is_gpt2_its_logits_equal_transformers_on_the_same_weights():
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, width, layers, heads, length = 128, 32, 2, 4, 16  # a multiple of 64: no padded column
    config = GPT2Config(vocab_size=vocab, n_positions=length, n_embd=width, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(config).double().eval()
    anchor = gpu_nanogpt.NanoGPT(vocab, width, layers, heads, length).double().eval()
    assert anchor.lm_head.weight is anchor.transformer.wte.weight
    _gpt2_weights_into(anchor, gpt2)
    x = torch.randint(0, vocab, (3, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = gpt2(input_ids=x).logits
        got = anchor(x)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    # the same as transformers' loss, which shifts the labels: the anchor's targets are the next tokens
    batch = {"input_ids": x, "targets": x.roll(-1, dims=1)}
    with torch.no_grad():
        total, count = gpu_nanogpt.loss_sum(anchor, batch)
        wrapped = torch.nn.functional.cross_entropy(got[:, -1], x[:, 0], reduction="sum")  # the roll's last
        hf_mean = gpt2(input_ids=x, labels=x).loss  # transformers takes it in fp32
    assert count == 3 * length
    torch.testing.assert_close((total - wrapped) / (3 * (length - 1)), hf_mean.double(), rtol=1e-6, atol=0)


def test_the_anchor_s_flops_per_token_are_gpt2_124m_s_count():
    """6N + 12LHQT with N GPT-2's parameters at a vocabulary of 50304 (positions excluded, the tied
    head once): the count acco's own models get, from acco.models.flops_per_token."""
    from acco.models import flops_per_token

    with torch.device("meta"):
        anchor = gpu_nanogpt.NanoGPT(50257, 768, 12, 12, 1024)
    assert anchor.lm_head.weight.shape == (50304, 768)  # nanoGPT's padding of GPT-2's vocabulary
    h, layers, t, vocab = 768, 12, 1024, 50304
    n = layers * (12 * h * h + 13 * h) + vocab * h + 2 * h  # per layer: 12 H^2 weights, 9 H biases, 2 LNs
    assert n == 123_689_472  # nanoGPT prints 123.69M (its count without the positions)
    assert flops_per_token(anchor, t) == 6 * n + 12 * layers * h * t


@pytest.mark.parametrize(
    "bad",
    ["nanogpt-gc", "nanogpt-compiled-flex", "nanogpt-mask", "nanogpt-compiled-mask", "nanogpt-compiled-gc"],
)
def test_the_anchor_takes_compiled_only(bad):
    assert parse_variants("nanogpt,nanogpt-compiled") == [
        ("nanogpt", "nanogpt", False, False, "blocked"),
        ("nanogpt-compiled", "nanogpt", False, True, "blocked"),
    ]
    with pytest.raises(ValueError, match="nanogpt with -compiled only"):
        parse_variants(bad)


@pytest.mark.slow
def test_the_anchor_runs_through_acco_bench_gpu_eager_and_compiled_alike(tmp_path):
    out = tmp_path / "gpu"
    variants = ["plain-bf16", "nanogpt", "nanogpt-compiled"]
    argv = [*TINY_ON_CPU, "--compile-backend", "aot_eager", "--micro", "off", "--out", str(out)]
    compiled_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with one_thread():
        assert main([*argv, "--variants", ",".join(variants)]) == 0
    # nanogpt-compiled compiled (plain-bf16 and nanogpt run eager): its equal loss is not eager's own
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > compiled_before
    result = json.loads((out / "gpu.json").read_text())
    v = result["variants"]
    assert list(v) == variants and all(r["tokens_per_s"] > 0 and r["updates_timed"] == 2 for r in v.values())
    assert v["nanogpt-compiled"]["final_loss"] == pytest.approx(v["nanogpt"]["final_loss"], rel=1e-4)
    assert v["nanogpt"]["fused_adamw"] is True
    with torch.device("meta"):  # its own count: GPT-2 at the tiny model's geometry, not GPT-Neo's
        from acco.models import flops_per_token

        fpt = flops_per_token(gpu_nanogpt.NanoGPT(2048, 64, 2, 4, 16), 16)
    assert v["nanogpt"]["flops_per_token"] == fpt != result["flops_per_token"]
    assert "ratio_plain-bf16-compiled_over_nanogpt-compiled" not in result  # only pairs that both ran
    assert "| nanogpt-compiled |" in (out / "gpu.md").read_text()
