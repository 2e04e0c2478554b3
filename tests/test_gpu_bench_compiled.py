"""acco-bench gpu's compiled variants and micro-benchmark reach their code on the CPU (tiny shapes,
aot_eager), so that the first GPU run does not crash in them; the attention it times for a local
layer is GPT-Neo's (forward, on the CPU)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from bench_helpers import TINY_ON_CPU, one_thread

import acco.loss as loss_module
from acco_bench import gpu_micro
from acco_bench.cli import main


@pytest.mark.slow  # an acco-bench run (20 s on the loaded 2-core VM); the pieces below stay in make test
def test_compiled_variants_and_the_micro_benchmark_on_the_cpu(tmp_path):
    out = tmp_path / "gpu"
    variants = ["engine-acco-compiled", "plain-bf16-compiled", "engine-acco"]
    argv = [*TINY_ON_CPU, "--variants", ",".join(variants), "--micro", "on", "--out", str(out)]
    with one_thread():
        assert main([*argv, "--compile-backend", "aot_eager"]) == 0
    result = json.loads((out / "gpu.json").read_text())
    v = result["variants"]
    assert list(v) == variants and all(r["tokens_per_s"] > 0 for r in v.values())
    assert v["engine-acco-compiled"]["final_loss"] == pytest.approx(v["engine-acco"]["final_loss"], rel=1e-3)
    assert result["ratio_engine-acco-compiled_over_plain-bf16-compiled"] > 0
    micro = result["micro"]
    assert set(micro["head_gemm"]) == {"vocab_2048"}  # already a multiple of 128
    assert set(micro["gelu"]) == {"gelu_new", "gelu_pytorch_tanh"}
    assert set(micro["projections"]) == {"three_gemms", "stacked"}
    assert set(micro["local_attention"]) == {
        "sdpa_masked", "sdpa_is_causal", "flex_sliding_window", "flex_prebuilt_mask"
    }
    assert set(micro["loss"]) == {"todays", "fused"}  # compiled on CUDA only
    # the tiny model's whole shard, at its config's vocabulary of 2048 (on the CPU at most 2^20 elements)
    assert micro["optimizer"].pop("elements") == 247_168
    assert set(micro["optimizer"]) == {"commit", "trial_2^18", "trial_2^20", "trial_2^21", "trial_2^22"}
    assert all(
        isinstance(ms, float) and ms > 0  # not an error's text
        for group in ("head_gemm", "projections", "gelu", "local_attention", "loss", "optimizer")
        for ms in micro[group].values()
    )
    md = (out / "gpu.md").read_text()
    assert "- local_attention: sdpa_masked" in md and "- optimizer: elements 247168, trial_2^18" in md


def test_the_micro_benchmark_pads_the_head_and_compiles_the_loss():
    kept = []
    m = gpu_micro.run(
        torch.device("cpu"),
        rows=32,
        length=16,
        hidden=16,
        heads=2,
        vocab=203,
        window=4,
        backend="aot_eager",
        repeats=1,
        shard=3000,
        keep=kept.append,
    )
    assert set(m["head_gemm"]) == {"vocab_203", "vocab_256"}
    assert m["optimizer"]["elements"] == 3000 and isinstance(m["optimizer"]["trial_2^18"], float), m
    assert set(m["loss"]) == {
        "todays", "fused", "fused_compiled", "fused_compiled_2048", "fused_compiled_4096",
        "full_logits_compiled",
    }
    # each group kept as it is timed (a run cut short keeps them), the loss's extra compiles last
    groups = [[k for k in partial if k not in ("rows", "backend")] for partial in kept]
    assert groups[:3] == [["head_gemm"], ["head_gemm", "projections"], ["head_gemm", "projections", "gelu"]]
    assert groups[-1] == ["head_gemm", "projections", "gelu", "local_attention", "loss", "optimizer"]
    assert set(kept[-3]["loss"]) == {"todays", "fused", "fused_compiled"} and kept[-1] == m
    # the larger chunks' pass compiled static (dynamic=False), not as a dynamic-shape graph
    assert (("backend", "aot_eager"), ("dynamic", False)) in loss_module._COMPILED
    assert set(m["projections"]) == {"three_gemms", "stacked"}
    assert all(isinstance(ms, float) for g in ("head_gemm", "projections", "loss") for ms in m[g].values()), m
    blocked = ("sdpa_blocked", "sdpa_blocked_checkpointed")  # length 16, 4 windows: acco's local path
    assert all(isinstance(m["local_attention"][k], float) for k in blocked), m["local_attention"]


def test_the_micro_benchmarks_full_logits_loss_is_the_fused_loss():
    """nanoGPT's loss as the micro-benchmark times it computes what acco's fused loss does (fp64;
    the fused loss at chunks smaller than the rows, as the micro-benchmark's larger chunks are)."""
    from acco.loss import linear_cross_entropy

    gen = torch.Generator().manual_seed(0)
    h, w = (torch.randn(*s, dtype=torch.float64, generator=gen).requires_grad_() for s in ((40, 8), (37, 8)))
    targets = torch.randint(0, 37, (40,), generator=gen)
    targets[::7] = -100
    full = gpu_micro.full_logits_loss(h, w, targets)
    expected = torch.autograd.grad(full, (h, w))
    for chunk in (7, 16, 64):
        fused = linear_cross_entropy(h, w, None, targets, chunk=chunk)
        torch.testing.assert_close(fused, full, rtol=1e-12, atol=1e-12)
        for got, want in zip(torch.autograd.grad(fused, (h, w)), expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [4, 16])
def test_the_micro_benchmarks_masks_are_gpt_neos_local_attention(window):
    """The explicit mask the micro-benchmark gives SDPA is GPT-Neo's local bias, and acco's flex path
    (acco/attention.py's flex_local, which it times, with its mask built in the call or beforehand)
    and its blocked path (with the band cut from that mask) compute the same attention, forward only."""
    from acco.attention import flex_local, local_blocked, sliding_window_block_mask

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen) for _ in range(3))
    mask = gpu_micro.window_mask(16, window, q.device)
    causal = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    assert torch.equal(mask, causal ^ torch.tril(causal, -window))  # GPT-Neo's local bias in transformers
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    torch.testing.assert_close(flex_local(q, k, v, window), expected, rtol=1e-5, atol=1e-5)
    prebuilt = sliding_window_block_mask(16, window, q.device)
    torch.testing.assert_close(flex_local(q, k, v, window, prebuilt), expected, rtol=1e-5, atol=1e-5)
    if window < 16:  # the blocked path, with the band the micro-benchmark cuts from its mask
        band = mask[window : 2 * window, : 2 * window]
        torch.testing.assert_close(local_blocked(q, k, v, window, band), expected, rtol=1e-5, atol=1e-5)


def test_a_failing_variant_is_reported_and_the_others_kept(tmp_path):
    out = tmp_path / "gpu"
    argv = [*TINY_ON_CPU, "--variants", "plain-bf16-compiled,plain-bf16", "--out", str(out)]
    assert main([*argv, "--compile-backend", "no_such_backend"]) == 1
    result = json.loads((out / "gpu.json").read_text())
    assert (
        list(result["variants"]) == ["plain-bf16"]
        and "no_such_backend" in result["failed"]["plain-bf16-compiled"]
    )
    assert "FAILED plain-bf16-compiled" in (out / "gpu.md").read_text()


@pytest.mark.slow
def test_a_llama_runs_through_acco_bench_gpu_compiled_and_eager(tmp_path):
    """The Llama path the first GPU run measures (`--model llama3`), here at llama-tiny's size: its
    blocks and the fused loss compiled (aot_eager) give the eager engine's loss, and the plain loop
    runs the same model compiled."""
    out = tmp_path / "gpu"
    variants = ["engine-acco-compiled", "engine-acco", "plain-bf16-compiled"]
    argv = [*TINY_ON_CPU, "--variants", ",".join(variants), "--micro", "off", "--out", str(out)]
    argv[argv.index("tiny")] = "llama-tiny"
    assert main([*argv, "--compile-backend", "aot_eager"]) == 0
    result = json.loads((out / "gpu.json").read_text())
    v = result["variants"]
    assert list(v) == variants and all(r["tokens_per_s"] > 0 for r in v.values())
    assert v["engine-acco-compiled"]["final_loss"] == pytest.approx(v["engine-acco"]["final_loss"], rel=1e-3)


def test_flex_and_mask_variants_set_the_local_kernel_for_their_own_run_only(tmp_path, monkeypatch):
    """``-compiled-flex`` weighs flex_attention for local layers (off in acco) in the whole model, and
    ``-mask`` the full mask against the blocks: set while that variant runs and compiles, back to
    "blocked" for the next; flex without -compiled is refused."""
    import acco.attention
    import acco_bench.gpu

    seen = []

    def record(args, method, device, vocab, pool, **kw):
        seen.append((kw["compiled"], acco.attention.LOCAL_KERNEL))
        return {"tokens_per_s": 1.0, "step_time_s": 1.0}

    monkeypatch.setattr(acco_bench.gpu, "run_engine", record)
    argv = [*TINY_ON_CPU, "--micro", "off", "--out", str(tmp_path / "gpu")]
    variants = "engine-acco-compiled-flex,engine-acco-compiled,engine-acco-compiled-mask,engine-acco-mask"
    assert main([*argv, "--variants", variants]) == 0
    assert seen == [(True, "flex"), (True, "blocked"), (True, "mask"), (False, "mask")]
    assert acco.attention.LOCAL_KERNEL == "blocked"
    assert main([*argv, "--variants", "engine-acco-flex"]) == 2 and len(seen) == 4
