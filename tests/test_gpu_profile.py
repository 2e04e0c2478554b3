"""acco-bench gpu --profile: the device's busy share and top kernels from the profiler's records
(the arithmetic on made-up intervals; the plumbing on the CPU, where no device work is recorded)."""

from __future__ import annotations

import json
import re

import pytest
from bench_helpers import TINY_ON_CPU

from acco_bench.cli import main
from acco_bench.gpu_profile import busy_us, summarise


def test_busy_is_the_union_of_the_streams_intervals():
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (20, 30)]) == 20  # a gap: the device idles 10 us
    assert busy_us([(0, 10), (5, 15)]) == 15  # two streams overlapping count once
    assert busy_us([(0, 30), (5, 10), (12, 20)]) == 30  # nested
    assert busy_us([(20, 30), (0, 10), (10, 20)]) == 30  # back to back, out of order


def test_summary_per_micro_batch_and_the_top_kernels():
    kernels = [("gemm", 0, 400), ("gemm", 500, 900), ("softmax", 900, 1000), ("comm", 100, 300)]
    s = summarise(kernels, wall_s=0.002, micro_batches=2)
    assert s["busy"] == pytest.approx(0.9 / 2)  # 900 us of 2000: idle from 400 to 500 and after 1000
    assert s["device_busy_ms_per_micro_batch"] == pytest.approx(0.45)
    assert s["wall_ms_per_micro_batch"] == pytest.approx(1.0)
    assert s["kernels_per_micro_batch"] == 2
    assert [(k["kernel"], k["calls"]) for k in s["top"]] == [("gemm", 2), ("comm", 1), ("softmax", 1)]
    assert s["top"][0]["ms_per_micro_batch"] == pytest.approx(0.4)
    assert summarise([], 0.001, 1)["busy"] is None
    assert s["host"] is None and s["process_cpu"] is None  # not measured
    timed = summarise(kernels, wall_s=0.002, micro_batches=2, thread_cpu_s=0.0019, process_cpu_s=0.003)
    assert timed["host"] == pytest.approx(0.95) and timed["process_cpu"] == pytest.approx(1.5)


def test_the_window_tells_a_host_that_works_from_one_that_waits():
    """The training thread's CPU share over the window: near 1 while it computes (a host-bound GPU
    run: Python and launches), near 0 while it waits (a sync); the wait here is the thing measured."""
    import time

    import torch

    from acco_bench.gpu_profile import Window, markdown

    shares = {}
    for kind in ("works", "waits"):
        window = Window(torch.device("cpu"))
        window.start()
        # works: until this thread has used 0.2 s of CPU (not of wall time: on a loaded machine
        # the wall second holds less of it); waits: 0.2 s asleep
        end = time.thread_time() + 0.2
        while kind == "works" and time.thread_time() < end:
            sum(range(1000))
        if kind == "waits":
            time.sleep(0.2)
        shares[kind] = window.stop(micro_batches=1)
    # loose: two suites side by side on 2 cores left the busy thread 0.23 of a core
    works, waits = shares["works"]["host"], shares["waits"]["host"]
    assert works > max(0.05, 10 * waits) and waits < 0.15
    assert shares["works"]["process_cpu"] >= shares["works"]["host"] * 0.9
    assert "the training thread on the CPU" in " ".join(markdown(shares["works"] | {"variant": "v"}))


@pytest.mark.slow
def test_profiled_variants_keep_their_timed_updates_and_report_their_windows(tmp_path):
    out = tmp_path / "gpu"
    variants = "engine-acco,plain-bf16,engine-ddp"
    argv = [*TINY_ON_CPU, "--variants", variants, "--micro", "off", "--out", str(out)]
    assert main([*argv, "--profile", "engine-acco,plain-bf16"]) == 0  # the engine and the plain loop
    result = json.loads((out / "gpu.json").read_text())
    assert list(result["profiles"]) == ["engine-acco", "plain-bf16"]
    for variant, profile in result["profiles"].items():
        assert profile["variant"] == variant and profile["micro_batches"] == 2 * 4  # 2 updates of 4
        assert profile["busy"] is None and profile["wall_ms_per_micro_batch"] > 0  # the CPU: no device work
        assert 0 < profile["host"] <= 1.05  # the training thread's CPU share of the window
        assert result["variants"][variant]["updates_timed"] == 2  # the profiled updates are not timed
        assert "profile" not in result["variants"][variant]
        assert f"Profile of {variant}" in (out / "gpu.md").read_text()
    assert result["variants"]["engine-ddp"]["updates_timed"] == 2 and "engine-ddp" not in result["profiles"]
    assert main([*argv, "--profile", "engine-acco,engine-acco-compiled"]) == 2  # one not among the variants


def test_on_cuda_the_window_records_the_device_alone_and_keeps_its_events(monkeypatch):
    """The CUDA branch, on a made-up profiler: CUDA activity only (no CPU ops, little host cost of
    the profiler's own), the device's events kept and the host's left out."""
    from types import SimpleNamespace

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from acco_bench import gpu_profile

    def event(name, device, start, end):
        span = SimpleNamespace(start=start, end=end)
        return SimpleNamespace(name=name, device_type=device, time_range=span)

    asked = []

    class FakeProfile:
        def __init__(self, activities):
            asked.append(activities)

        start = stop = lambda self: None

        def events(self):
            return [event("gemm", DeviceType.CUDA, 0, 600), event("aten::mm", DeviceType.CPU, 0, 900),
                    event("cudaLaunchKernel", DeviceType.CPU, 0, 5)]  # fmt: skip

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    window = gpu_profile.Window(torch.device("cuda"))
    window.start()
    s = window.stop(micro_batches=1)
    assert asked == [[ProfilerActivity.CUDA]]
    assert [k["kernel"] for k in s["top"]] == ["gemm"] and s["kernels_per_micro_batch"] == 1
    assert s["device_busy_ms_per_micro_batch"] == pytest.approx(0.6)


def test_a_profiler_that_fails_costs_the_variant_nothing(tmp_path, monkeypatch):
    import torch

    def no_cupti(*a, **k):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(torch.profiler, "profile", no_cupti)
    out = tmp_path / "gpu"
    argv = [*TINY_ON_CPU, "--variants", "engine-acco", "--micro", "off", "--out", str(out)]
    assert main([*argv, "--profile", "engine-acco"]) == 0
    result = json.loads((out / "gpu.json").read_text())
    assert result["variants"]["engine-acco"]["tokens_per_s"] > 0
    assert "CUPTI_ERROR_NOT_INITIALIZED" in result["profiles"]["engine-acco"]["error"]
    assert "the profiler failed: RuntimeError('CUPTI_ERROR_NOT_INITIALIZED')" in (out / "gpu.md").read_text()


def test_the_compile_mode_reaches_the_compiled_variants_and_is_checked_first(tmp_path, monkeypatch):
    """--compile-mode (train.compile_mode) for the -compiled variants, engine and plain loop alike;
    refused before anything runs with a backend that has no modes."""
    import torch

    import acco.loss

    seen, loss_passes = [], []  # what torch.compile would be handed, without compiling
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: seen.append(options))
    plain_pass = acco.loss._chunk_pass
    monkeypatch.setattr(acco.loss, "_compiled_pass", lambda **o: loss_passes.append(o) or plain_pass)
    out = tmp_path / "gpu"
    argv = [*TINY_ON_CPU, "--micro", "off", "--out", str(out), "--compile-mode", "reduce-overhead"]
    assert main([*argv, "--variants", "engine-acco-compiled,plain-bf16-compiled,engine-acco"]) == 0
    assert seen and all(o == {"backend": "inductor", "mode": "reduce-overhead"} for o in seen)
    assert loss_passes and all(o == seen[0] for o in loss_passes)  # the loss's pass compiles alike
    assert "inductor's reduce-overhead mode" in (out / "gpu.md").read_text()
    blocks = len(seen)
    assert main([*argv, "--variants", "engine-acco-compiled", "--compile-backend", "aot_eager"]) == 2
    assert len(seen) == blocks  # nothing ran


def test_a_window_never_started_says_so():
    """A run that ends before its profiled updates (fewer records than asked) reports it, no crash."""
    import torch

    from acco_bench import gpu_profile

    said = gpu_profile.Window(torch.device("cpu")).stop(micro_batches=4)
    assert said == {"micro_batches": 4, "error": "the run ended before the profiled updates"}


def test_the_compile_scope_reaches_the_engine_and_the_plain_loop(tmp_path, monkeypatch):
    """--compile-scope model (train.compile_scope): both compile the model's body, not its blocks;
    a scope it does not know is refused before anything runs."""
    import torch

    import acco.loss

    compiled = []  # which modules torch.compile would be handed, without compiling
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **o: compiled.append(type(self).__name__))
    plain_pass = acco.loss._chunk_pass
    monkeypatch.setattr(acco.loss, "_compiled_pass", lambda **o: plain_pass)
    out = tmp_path / "gpu"
    variants = "engine-acco-compiled,plain-bf16-compiled"
    argv = [*TINY_ON_CPU, "--micro", "off", "--out", str(out), "--variants", variants]
    assert main([*argv, "--compile-scope", "model"]) == 0
    assert compiled == ["GPTNeoModel", "GPTNeoModel"]  # the engine's model's body, then the plain loop's
    assert "compile the model's body whole" in (out / "gpu.md").read_text()
    compiled.clear()
    assert main(argv) == 0  # the default: each block (the tiny model has 2)
    assert compiled == ["GPTNeoBlock"] * 4
    assert main([*argv, "--compile-scope", "layers"]) == 2 and not compiled[4:]


@pytest.mark.parametrize("mode, kept", [("reduce-overhead", True), (None, False)])
def test_under_cuda_graphs_plain_loops_accumulate_into_grads_of_their_own(monkeypatch, tmp_path, mode, kept):
    """A replayed CUDA graph writes its backward's outputs where it wrote them before: a .grad
    autograd took from one replay is overwritten by the next, so under reduce-overhead the plain
    loop and nanoGPT's accumulate into .grad buffers made before the first backward and zeroed per
    update; otherwise they free them (set_to_none), the best plain loop. Under reduce-overhead
    gpu.md counts, per variant, the graphs inductor compiled without CUDA graphs."""
    import torch

    import acco.engine.compiling

    models, seen = [], []  # per backward: (model, every grad there, their storages)
    compile_module = acco.engine.compiling.compile_module
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: None)  # eager, marked alike
    monkeypatch.setattr(acco.engine.compiling, "compile_module",
                        lambda m, *a, **k: models.append(m) or compile_module(m, *a, **k))
    backward = torch.Tensor.backward

    def recording_backward(self, *args, **kwargs):
        grads = [p.grad for p in models[-1].parameters()]
        seen.append((len(models), all(g is not None for g in grads),
                     tuple(g.untyped_storage().data_ptr() if g is not None else 0 for g in grads)))
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", recording_backward)
    argv = [*TINY_ON_CPU, "--micro", "off", "--no-stream-check", "--out", str(tmp_path / "gpu")]
    argv += ["--variants", "plain-bf16-compiled,nanogpt-compiled"]
    argv += ["--compile-mode", mode] if mode else []
    assert main(argv) == 0
    assert len(models) == 2 and len(seen) > 4
    md = (tmp_path / "gpu" / "gpu.md").read_text()
    counts = re.search(r"cudagraph_skips\): plain-bf16-compiled (\d+), nanogpt-compiled (\d+)\.", md)
    assert (counts is not None) is kept
    if kept:  # the loss's pass, the one graph compiled for real here, is on the CPU: no CUDA graphs
        assert int(counts[1]) >= 1 and int(counts[2]) == 0
    for n in (1, 2):
        runs = [(there, ptrs) for m, there, ptrs in seen if m == n]
        assert all(there for there, _ in runs) is kept
        assert (len({ptrs for _, ptrs in runs}) == 1) is kept
