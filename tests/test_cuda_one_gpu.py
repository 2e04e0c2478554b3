"""What one GPU can prove. NCCL refuses two ranks on one GPU, so tests/test_cuda.py (2+ GPUs)
cannot run on a one-GPU machine; here one process joins a one-rank NCCL group on its GPU. The
collectives have nobody to talk to, but every comm round still runs on the comm thread and its
side stream, torch-ddp still runs DDP's reducer on NCCL, and the GPU's own arithmetic (fp32
without TF32, bf16) is what the engine trains with. Run it with

    .venv/bin/python -m pytest -q tests/test_cuda_one_gpu.py -rs -s

- every method (acco/engine/config.py METHODS) in fp32 equals its single-process reference
  (acco_bench/reference.py, as test_engine_methods.py and test_diloco.py check on gloo);
- a tiny GPT-Neo trains in bf16 under every method with a falling loss;
- the overlap is real: test_cuda.py's sleep check (a sleep in every comm round on the side stream
  lets compute go on, the same sleep on the compute stream does not), on one rank;
- GPT-Neo 125M (acco/conf/model/gptneo-125m.yaml, never a hub) at 4 x 1024 tokens in bf16:
  acco-bench gpu's peak GPU memory with and without gradient checkpointing, and its tokens/s and
  MFU against a plain fused-AdamW loop on the same model (printed for BENCHMARKS.md with -s).

The first two also run here on one gloo rank on the CPU (the same code, in this process), which
checks the tests themselves; the GPU variants skip with their reason where there is no CUDA or NCCL.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from engine_helpers import assert_close, config, loss_fn, make_model
from one_rank_helpers import (
    MICRO_BATCHES,
    UPDATES,
    N,
    expected,
    gpt_neo_tokens,
    issued,
    method_configs,
    mlp_batches,
    needs_gpu,
    run_one_rank,
    tiny_gpt_neo,
    train_each,
)
from overlap_helpers import OVERLAP_UPDATES, assert_overlap, overlap_run
from torch.nn.utils import parameters_to_vector

import acco.loss
from acco.engine.config import METHODS

# fake-cuda: the GPU's code paths (streams, events, prefetch) on the CPU, CUDA's rules checked
# (tests/fake_cuda.py)
ON = [pytest.param("cpu", id="gloo-cpu"), pytest.param("fake-cuda", id="fake-cuda"),
      pytest.param("cuda", id="nccl-gpu", marks=needs_gpu)]


@pytest.fixture
def one_thread():
    """Intra-op threads that wait on each other on shared cores make tiny ops 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# What each method's rounds issue at world size 1 where the collectives are the backend's own (NCCL,
# and the fake GPU's): ddp runs its rounds on the main thread, the overlapped methods on the comm
# thread. torch-ddp's all-reduce is DDP's reducer, in C++, and torch-hsdp's FSDP2 issues neither
# collective on one rank: not seen here.
ROUND_COLLECTIVES = {
    m: {("main" if m == "ddp" else "comm", c) for c in ("reduce_scatter", "all_gather")}
    for m in METHODS
    if m not in ("torch-ddp", "torch-hsdp")
}


# --------------------------------------------------------------------------- fp32: the references


def _every_method_fp32(device):
    return train_each(device, lambda: make_model("mlp"), method_configs(), mlp_batches, loss_fn)


@needs_gpu
def test_the_loss_sums_the_heads_bf16_products_in_fp32_on_the_gpu():
    """acco/loss.py's _add_product on CUDA: one fp32 GEMM onto what acc holds (first chunk: over it)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    acc = torch.randn(256, 64, device="cuda", generator=g)
    a, b = (torch.randn(*shape, device="cuda", generator=g).bfloat16() for shape in ((256, 512), (512, 64)))
    want = acc.double() + a.double() @ b.double()
    acco.loss._add_product(acc, a, b)
    torch.testing.assert_close(acc.double(), want, rtol=1e-5, atol=1e-4)  # exact bf16 products, fp32 sums
    assert acco.loss._FP32_ADDMM, "this torch refused addmm with out_dtype: the loss widened instead"
    acc.fill_(float("nan"))  # the first chunk's product: written (beta 0), whatever acc held
    acco.loss._add_product(acc, a, b, first=True)
    torch.testing.assert_close(acc.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("on", ON)
def test_every_method_on_one_rank_equals_its_reference_in_fp32(on, one_thread):
    results = run_one_rank(on, _every_method_fp32)
    cfgs = method_configs()
    assert {method for method, *_ in results} == set(METHODS)
    finals = {}
    for cfg, (method, theta, records, seen) in zip(cfgs, results):
        name = f"{method} ({cfg.acco_estimate})" if method == "acco" else method
        want, losses = expected(cfg)
        assert len(records) == len(losses), name
        assert_close(theta, want, f"{name} on one {on} rank vs its reference")
        assert_close(torch.tensor([loss for loss, _, _ in records]), torch.tensor(losses), f"{name} losses")
        if cfg.method not in ("diloco", "streaming-diloco"):
            assert [mb for _, mb, _ in records] == [
                [2 * cfg.n_grad_accumulation if method == "acco" else cfg.n_grad_accumulation]
            ] * UPDATES, name
        finals[name] = theta
        if on != "cpu":  # NCCL's own collectives, issued on one rank too (gloo's ring copies instead)
            assert ROUND_COLLECTIVES.get(method, set()) <= seen, (name, seen)
    # The methods differ from each other: the comparisons above are not vacuous.
    for a, b in (
        ("ddp", "dpu"),
        ("dpu", "wp"),
        ("acco (paper)", "acco (lean)"),
        ("diloco", "streaming-diloco"),
    ):
        assert not torch.allclose(finals[a], finals[b], atol=1e-4), (a, b)


def _acco_int8_auto(device):
    """acco with the int8 estimate round and the split from measured round durations; each round's
    duration as the compute side notes it (on the GPU: its side stream's span, timed by events)."""
    from acco.engine import build_engine

    k2 = 2 * N * 2
    cfg = config(method="acco", n_grad_accumulation=k2 // 2, nb_steps_tot=k2 * UPDATES, estimate_comm="int8",
                 estimate_micro_batches="auto")
    model = make_model("mlp").to(device)
    engine = build_engine(model, cfg)
    noted, note = [], engine.split.note_round

    def noting(kind, busy_s):
        noted.append((kind.value, busy_s))
        note(kind, busy_s)

    engine.split.note_round = noting
    with issued() as seen:
        records = list(engine.run(mlp_batches(device), loss_fn))
    split = engine.split.e
    engine.close()
    theta = parameters_to_vector(model.parameters()).detach().float().cpu()
    return k2, [r.micro_batches for r in records], noted, split, theta, seen


@pytest.mark.parametrize("on", ON)
def test_acco_int8_with_the_auto_split_times_its_rounds(on, one_thread):
    k2, micro_batches, noted, split, theta, seen = run_one_rank(on, _acco_int8_auto)
    assert ("comm", "all_to_all") in seen  # the estimate round's int8 all-to-all, also on one rank
    assert micro_batches == [[k2]] * UPDATES  # the committed batch, whatever the split
    assert [kind for kind, _ in noted] == ["estimate round", "update round"] * UPDATES
    assert all(0 < s < 60 for _, s in noted), noted  # every round measured
    assert 1 <= split <= k2 - 1 and bool(torch.isfinite(theta).all())


# --------------------------------------------------------------------------- bf16: GPT-Neo learns


def _every_method_bf16(device):
    from acco.engine import EngineConfig
    from acco.loss import causal_lm_loss

    common = dict(
        nb_steps_tot=MICRO_BATCHES,
        use_mixed_precision=True,
        learning_rate=1e-2,
        scheduler_name="constant",
        accumulate_while_waiting=False,
        weight_decay=0.0,
    )
    cfgs = [
        EngineConfig(
            method=m,
            n_grad_accumulation=1,
            sync_every=4,
            num_fragments=2 if m == "streaming-diloco" else 1,
            fragment_sync_delay=1 if m == "streaming-diloco" else 0,
            **common,
        )
        for m in METHODS
    ]
    return train_each(device, tiny_gpt_neo, cfgs, gpt_neo_tokens, causal_lm_loss)


@pytest.mark.parametrize("on", [on for on in ON if on.id != "fake-cuda"])  # (the fake's op checks: 10 s more)
def test_every_method_trains_gpt_neo_in_bf16_with_a_falling_loss(on, one_thread):
    results = run_one_rank(on, _every_method_bf16)
    assert [method for method, *_ in results] == list(METHODS)
    for method, theta, records, _ in results:
        losses = [loss for loss, _, _ in records]
        assert records[-1][2] == MICRO_BATCHES, method
        assert all(math.isfinite(x) for x in losses) and bool(torch.isfinite(theta).all()), method
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert first > 3.5 and last < first - 0.5, f"{method}: loss {first:.2f} -> {last:.2f} ({losses})"


# --------------------------------------------------------------------------- the GPU alone


def _overlap_one_rank(device, delay_ms: float, on_side_stream: bool):
    return overlap_run(0, device, delay_ms, on_side_stream, world=1)


def test_the_overlap_check_stops_after_its_updates_on_the_cpu(one_thread):
    """The overlap check's run on one CPU rank (the comm thread sleeps 20 ms a round): it stops
    after OVERLAP_UPDATES updates, far from its budget, and compute went on during the rounds."""
    theta, counts = run_one_rank("cpu", _overlap_one_rank, 20.0, True)
    assert len(counts) == OVERLAP_UPDATES and bool(torch.isfinite(theta).all())
    assert sum(counts[1:]) > 2 * (OVERLAP_UPDATES - 1), counts  # more than 2 rounds of 1 micro-batch


@needs_gpu
def test_the_overlap_is_real_on_one_rank():
    side_theta, side = run_one_rank("cuda", _overlap_one_rank, 50.0, True)
    _, control = run_one_rank("cuda", _overlap_one_rank, 50.0, False)
    assert len(side) == OVERLAP_UPDATES and bool(torch.isfinite(side_theta).all())
    print(f"\nmicro-batches per update, side stream delayed: {side}; control: {control}")
    assert_overlap(side, control)


@needs_gpu
def test_gpt_neo_125m_memory_and_throughput_against_a_plain_fused_adamw_loop(tmp_path):
    from acco_bench.cli import main

    out = tmp_path / "gpu"
    variants = ["engine-acco", "plain-bf16", "plain-autocast", "engine-acco-gc", "plain-bf16-gc"]
    assert main(["gpu", "--model", "gptneo-125m", "--batch-size", "4", "--max-length", "1024",
                 "--grad-accum", "2", "--steps", "10", "--warmup", "3", "--variants", ",".join(variants),
                 "--no-stream-check", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads((out / "gpu.json").read_text())
    print("\n" + (out / "gpu.md").read_text())
    v = result["variants"]
    assert list(v) == variants
    for name, r in v.items():
        assert r["gradient_checkpointing"] is name.endswith("-gc"), name
        assert r["tokens_per_s"] > 0 and r["peak_gpu_mem_mb"] > 0 and math.isfinite(r["final_loss"]), name
        if result["peak_bf16_tflops"]:  # a device of the table (or --peak-tflops)
            assert 0 < r["mfu"] < 1, (name, r["mfu"])
    assert v["plain-bf16"]["fused_adamw"] and v["plain-autocast"]["fused_adamw"]
    # Checkpointing keeps one activation per layer instead of all of them: the plain loop's peak,
    # weights and optimizer state included, falls by a fifth at least; the engine saves about as much.
    saved_plain = v["plain-bf16"]["peak_gpu_mem_mb"] - v["plain-bf16-gc"]["peak_gpu_mem_mb"]
    saved_engine = v["engine-acco"]["peak_gpu_mem_mb"] - v["engine-acco-gc"]["peak_gpu_mem_mb"]
    assert saved_plain > 0.2 * v["plain-bf16"]["peak_gpu_mem_mb"], v
    assert saved_engine > 0.5 * saved_plain, (saved_engine, saved_plain)
    # The engine at world size 1 (acco: two rounds per update on the comm thread) against the plain
    # loop on the same model and batches: its overhead must stay well below the plain loop's time.
    assert v["engine-acco"]["tokens_per_s"] > 0.5 * v["plain-bf16"]["tokens_per_s"], v
    # The engine's peak over the plain loop's is the state it holds beyond the plain loop's, within
    # 10% (docs/algorithm.md: acco 30 bytes per parameter and a 48 MiB workspace at W = 1 in bf16,
    # the plain loop 8)
    memory = result["memory_accounting"]["engine-acco_over_plain-bf16"]
    assert 0.9 <= memory["ratio"] <= 1.1, memory


# --------------------------------------------------------------------------- the NCCL environment, on the CPU


def test_init_distributed_asks_for_high_priority_nccl_streams_before_the_group(monkeypatch):
    """TORCH_NCCL_HIGH_PRIORITY=1 is in the environment when the NCCL group is made (torch reads
    it as each communicator is created); a value the user exported wins; gloo sets nothing."""
    import acco.launch.process_group as pg

    seen = []
    for key in ("TORCH_NCCL_HIGH_PRIORITY", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.setenv(key, "")  # restored (unset) after the test
        monkeypatch.delenv(key)
    monkeypatch.setattr(pg, "dist_env", lambda: None)  # no launcher: a one-process group
    monkeypatch.setattr(pg, "_device_for", lambda local_rank, use_cuda: torch.device("cpu"))
    monkeypatch.setattr(pg, "_check_gpu_for", lambda backend: None)  # as if a GPU were visible
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        dist,
        "init_process_group",
        lambda backend, **kw: seen.append((backend, os.environ.get("TORCH_NCCL_HIGH_PRIORITY"))),
    )
    pg.init_distributed(30, backend="nccl")
    monkeypatch.setenv("TORCH_NCCL_HIGH_PRIORITY", "0")
    pg.init_distributed(30, backend="nccl")
    monkeypatch.delenv("TORCH_NCCL_HIGH_PRIORITY")
    pg.init_distributed(30, backend="gloo")
    assert seen == [("nccl", "1"), ("nccl", "0"), ("gloo", None)]
