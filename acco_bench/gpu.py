"""``acco-bench gpu``: the single-device compute path on a GPU.

1. Throughput: tokens/s and MFU of GPT-Neo 125M (random init, random tokens) in bf16
   - through acco's engine, world size 1, method acco (the comm worker runs every round on its
     side stream and thread) and method ddp (the same pieces with no overlap);
   - a plain loop on the same model and data: bf16 parameters with fused AdamW (the engine's
     arithmetic), and fp32 parameters under bf16 autocast with fused AdamW (the usual recipe);
   - a variant name ending in ``-gc`` (``engine-acco-gc``, ``plain-bf16-gc``) runs the same with
     gradient checkpointing (transformers' non-reentrant, as ``train.gradient_checkpointing``):
     each variant's peak GPU memory is measured from a reset, so the two can be compared;
   - ``-compiled`` (``engine-acco-compiled``, ``plain-bf16-compiled``): blocks and the loss's
     per-chunk pass compiled as ``train.compile`` does (``--compile-backend``); the others eager
     (the side-stream check below runs compiled where ``engine-acco-compiled`` is asked);
     ``-compiled-flex``: the same with GPT-Neo's local layers through flex_attention, which acco
     leaves off (acco/attention.py), to weigh it in the whole model; ``-mask`` (``-compiled-mask``):
     the local layers' full T x T under the mask, against which acco's blocked layers are weighed;
   - ``nanogpt`` and ``nanogpt-compiled``: the anchor, GPT-2 as nanoGPT writes and trains it at
     ``--model``'s width, layers and heads (gpu_nanogpt.py), its MFU from its own FLOPs per token;
   Every variant does ``2 * grad_accum`` micro-batches of ``batch_size x max_length`` tokens per
   update (acco: ``grad_accum`` per round, two per update), timed over ``--steps`` after ``--warmup``
   (the runners: gpu_variants.py).
2. Side-stream overlap: the engine runs acco with ``accumulate_while_waiting`` on, once as is,
   once with ``engine.comm.delay_hook`` putting ``torch.cuda._sleep`` of ``--delay-ms`` on the comm
   side stream in every round, and once (negative control) with the same sleep on the compute
   stream. The first two must compute micro-batches at the same pace (ratio <= 1.10) while the
   delayed rounds really last longer (more micro-batches per round); the control must slow down.
3. On CUDA (or ``--micro on``): a one-minute micro-benchmark of the pieces (gpu_micro.py).

MFU = tokens/s x training FLOPs per token (``acco.models.flops_per_token``: 6N + 12 L H Q T) /
the device's dense bf16 peak (a table of known devices, or ``--peak-tflops``).

``--nproc 2`` (or more) runs the engine variants and the side-stream check on that many processes,
one GPU each, joined on NCCL through acco's own ``init_distributed`` (its NCCL timeout, error
handling and ``device_id``): tokens/s are over all workers, the comm rounds really cross GPUs. The
plain and nanogpt variants are single-process and are left out. Fewer GPUs than ``--nproc``:
skipped, with why (``--device cpu --nproc 2``: the same processes on gloo, to check the code path).

Without CUDA it says so and exits 0 (``--require-cuda``: exit 3), the reason in ``gpu.json``.
``--device cpu``: the throughput part on the CPU, a check of the code path (no MFU, no stream check).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from acco_bench.gpu_nanogpt import run_nanogpt
from acco_bench.gpu_variants import graphs_note, parse_variants, random_batches, run_engine, run_plain

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), from the vendors' data sheets.
PEAK_BF16_TFLOPS = [
    ("H200", 989.4), ("H100 SXM", 989.4), ("H100 NVL", 835.0), ("H100 PCIE", 756.0), ("H100", 989.4),
    ("GH200", 989.4), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
    ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0), ("A6000", 154.8),
]

RATIOS = (  # (a, b): a's tokens/s over b's, where both ran
    ("engine-acco", "plain-bf16"),
    ("engine-acco", "plain-autocast"),
    ("engine-ddp", "plain-bf16"),
    ("engine-acco-gc", "plain-bf16-gc"),
    ("engine-acco-compiled", "plain-bf16-compiled"),
    ("engine-acco-compiled", "engine-acco"),
    ("engine-acco-compiled-flex", "engine-acco-compiled"),
    ("engine-acco-compiled", "engine-acco-compiled-mask"),  # the blocked local layers against the full mask
    ("plain-bf16-compiled", "nanogpt-compiled"),
    ("engine-acco-compiled", "nanogpt-compiled"),
)

SKIP_EXIT = 0
NO_CUDA_EXIT = 3


def add_arguments(p) -> None:
    p.add_argument("--out", default="outputs/bench/gpu", help="output folder")
    p.add_argument("--model", default="gptneo-125m", help="model config name (acco/conf/model)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--grad-accum", type=int, default=2,
                   help="micro-batches per acco round; every variant does twice that per update")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer updates per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed updates first")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="side-stream sleep per comm round for the overlap check (0: 3 x a round's compute)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, for MFU")
    p.add_argument(
        "--variants",
        default="engine-acco,engine-ddp,plain-bf16,plain-autocast,engine-acco-gc,plain-bf16-gc,"
        "engine-acco-compiled,plain-bf16-compiled",
        help="throughput variants to run (suffix -compiled: train.compile; -gc: gradient checkpointing)",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend, -compiled variants")
    p.add_argument("--compile-mode", default=None, help="inductor's mode of -compiled variants "
                   "(train.compile_mode; reduce-overhead: gpu.md says which ran graphs without CUDA graphs)")
    p.add_argument("--compile-scope", default="blocks",
                   help="what the -compiled variants compile: blocks, or the model's body as one graph "
                        "(train.compile_scope)")
    p.add_argument(
        "--micro", choices=("auto", "on", "off"), default="auto", help="the micro-benchmark (auto: CUDA)"
    )
    p.add_argument("--no-stream-check", action="store_true", help="skip the side-stream check")
    p.add_argument("--profile", default=None, metavar="VARIANTS",
                   help="profile a few more updates of these variants (comma-separated): the device's busy "
                        "share, top kernels")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (code-path check only)")
    p.add_argument(
        "--require-cuda", action="store_true", help=f"exit {NO_CUDA_EXIT} when there is no CUDA device"
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes, one GPU each, on NCCL (2 or more: the multi-GPU path; engine variants only)",
    )


def peak_tflops(name: str) -> float | None:
    upper = name.upper()
    for key, value in PEAK_BF16_TFLOPS:
        if key in upper:
            return value
    return None


def calibrate_sleep(device) -> float:
    """GPU cycles per millisecond of torch.cuda._sleep, measured with events."""
    import torch

    torch.cuda._sleep(1000)  # load the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def stream_check(args, device, vocab: int, pool, ms_per_micro_batch: float) -> dict:
    import torch

    cycles_per_ms = calibrate_sleep(device)
    delay_ms = args.delay_ms or 3.0 * args.grad_accum * ms_per_micro_batch
    cycles = int(delay_ms * cycles_per_ms)
    # The same budget for the three runs: the delayed ones make fewer, bigger updates.
    budget = (args.warmup + max(8, args.steps)) * 2 * args.grad_accum * 2

    def side_stream_sleep():  # runs in the comm thread, on the comm stream (BackgroundComm)
        torch.cuda._sleep(cycles)

    def compute_stream_sleep():  # negative control: the same sleep, on the compute stream
        with torch.cuda.stream(torch.cuda.default_stream(device)):
            torch.cuda._sleep(cycles)

    kw = dict(accumulate=True, budget=budget, compiled="engine-acco-compiled" in args.variants)  # as it runs
    base = run_engine(args, "acco", device, vocab, pool, **kw)
    side = run_engine(args, "acco", device, vocab, pool, delay=side_stream_sleep, **kw)
    ctrl = run_engine(args, "acco", device, vocab, pool, delay=compute_stream_sleep, **kw)
    ratio = side["s_per_micro_batch"] / base["s_per_micro_batch"]
    ctrl_ratio = ctrl["s_per_micro_batch"] / base["s_per_micro_batch"]
    round_grew = side["micro_batches_per_round"] > base["micro_batches_per_round"] + 0.5
    return {
        "delay_ms_per_round": delay_ms,
        "cycles_per_ms": cycles_per_ms,
        "no_delay": base,
        "side_stream_delay": side,
        "compute_stream_delay_control": ctrl,
        "compute_slowdown_side_stream": ratio,
        "compute_slowdown_control": ctrl_ratio,
        "rounds_lasted_longer": round_grew,
        "passed": ratio <= 1.10 and round_grew and ctrl_ratio > ratio,
    }


# --------------------------------------------------------------------------------------------


def _skip(args, reason: str) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps({"skipped": True, "reason": reason}, indent=2) + "\n")
    print(f"acco-bench gpu: SKIPPED: {reason}", file=sys.stderr)
    print("acco-bench gpu: run it on a machine with an NVIDIA GPU and a CUDA build of torch, e.g. "
          "`acco-bench gpu --out outputs/bench/gpu`.", file=sys.stderr)
    return NO_CUDA_EXIT if args.require_cuda else SKIP_EXIT


def main(args) -> int:
    try:  # before anything runs: a typo found after minutes of compiling wastes a GPU's time
        names = [name for name, *_ in parse_variants(args.variants)]
        if unknown := [v for v in _profiled(args) if v not in names]:
            raise ValueError(f"--profile {','.join(unknown)}: not among --variants ({', '.join(names)})")
        if args.compile_mode is not None or args.compile_scope != "blocks":  # EngineConfig's own checks
            from acco.engine import EngineConfig

            EngineConfig(compile=args.compile_backend, compile_mode=args.compile_mode,
                         compile_scope=args.compile_scope)
    except ValueError as e:  # ConfigError is one
        print(f"acco-bench gpu: {e}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:  # pragma: no cover
        return _skip(args, "torch is not installed")
    if args.device == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda
        reason = (
            "no CUDA device: this torch is a CPU-only build"
            if built is None
            else f"no CUDA device visible (torch built for CUDA {built}, torch.cuda.is_available() is False)"
        )
        return _skip(args, reason)
    if args.nproc > 1:
        visible = torch.cuda.device_count() if args.device == "cuda" else args.nproc
        if visible < args.nproc:
            return _skip(args, f"--nproc {args.nproc} needs {args.nproc} CUDA devices, {visible} visible")
        return _spawn(args)
    return _measure(args, torch.device(args.device))


def _spawn(args) -> int:
    """Run `_measure` on --nproc processes joined on NCCL; rank 0 writes the results."""
    import torch.multiprocessing as mp

    from acco.launch import free_port

    mp.start_processes(_worker, args=(args, free_port()), nprocs=args.nproc, start_method="spawn")
    sc = json.loads((Path(args.out) / "gpu.json").read_text()).get("stream_check")
    return 1 if sc is not None and not sc["passed"] else 0


def _worker(rank: int, args, port: int) -> None:
    import os

    import torch.distributed as dist

    from acco.launch.process_group import init_distributed

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.nproc),
        LOCAL_WORLD_SIZE=str(args.nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # --device cpu: the same processes on gloo, a check of the code path only
    _, _, _, device = init_distributed(60.0, backend="nccl" if args.device == "cuda" else "gloo")
    try:
        _measure(args, device, rank, args.nproc)
    finally:
        dist.destroy_process_group()


def _profiled(args) -> list[str]:
    return [v.strip() for v in (args.profile or "").split(",") if v.strip()]


def _measure(args, device, rank: int = 0, world: int = 1) -> int:
    import torch

    variants = parse_variants(args.variants)  # checked by main
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from acco.models import flops_per_token, model_config
    from acco_bench.settings import model_settings

    vocab = int(model_settings(args.model).get("vocab_size") or 50257)
    fpt = flops_per_token(model_config(model_settings(args.model), vocab), args.max_length)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or (peak_tflops(name) if device.type == "cuda" else None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    pool = random_batches(vocab, args.batch_size, args.max_length, device, seed=rank)
    say = print if rank == 0 else (lambda *a, **k: None)
    result = _result_header(args, name, world, vocab, fpt, peak)
    say(f"acco-bench gpu: {name} x {world}, {args.model}, {args.batch_size}x{args.max_length} tokens per "
        f"micro-batch, {2 * args.grad_accum} per update, peak {peak} TFLOP/s")
    for variant, base, gc, compiled, local in variants:
        if world > 1 and not base.startswith("engine-"):
            continue  # single-process loops
        if device.type == "cuda":  # this variant's own peak (the batch pool stays allocated)
            torch.cuda.reset_peak_memory_stats(device)
        kw = dict(checkpointing=gc, compiled=compiled, profile=variant in _profiled(args))
        try:  # a variant that fails (a compile on an untried GPU) is reported, the others still run
            r = _run_variant(args, base, device, vocab, pool, local, kw)
        except Exception as e:  # noqa: BLE001
            result.setdefault("failed", {})[variant] = (
                say(f"  {variant}: FAILED: {e!r}"[:500]) or repr(e)[:2000]
            )
            continue
        if "profile" in r:
            result.setdefault("profiles", {})[variant] = {"variant": variant} | r.pop("profile")
        own_fpt = r.get("flops_per_token", fpt)  # the anchor's model is not --model's
        r["mfu"] = r["tokens_per_s"] * own_fpt / (peak * 1e12 * world) if peak else None  # per GPU
        if device.type == "cuda":
            r["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        result["variants"][variant] = r
        mfu = f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
        say(f"  {variant:15s} {r['tokens_per_s']:>12,.0f} tokens/s{mfu}")
        if rank == 0:  # so far: what a run cut short by a time limit still leaves
            _write(out, result)
    if device.type == "cuda" and not args.no_stream_check:
        _check_side_stream(args, device, vocab, pool, result, say)
        if rank == 0:
            _write(out, result)
    if rank == 0 and (args.micro == "on" or (args.micro == "auto" and device.type == "cuda")):
        from acco_bench.gpu_micro import from_args

        result["micro"] = from_args(args, device, keep=lambda m: _write(out, result | {"micro": m}))
    if rank == 0:
        _write(out, result)
        print(f"acco-bench gpu: wrote {out}/gpu.json and gpu.md")
    sc = result.get("stream_check")
    return 1 if (sc is not None and not sc["passed"]) or result.get("failed") else 0


def _result_header(args, name: str, world: int, vocab: int, fpt: float, peak: float | None) -> dict:
    """gpu.json before any variant: the device, the versions, the model and batch, the peak."""
    import torch

    return {
        "device": name,
        "nproc": world,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": args.model,
        "vocab_size": vocab,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "micro_batches_per_update": 2 * args.grad_accum,
        "flops_per_token": fpt,
        "peak_bf16_tflops": peak,
        "compile_mode": args.compile_mode,
        "compile_scope": args.compile_scope,
        "variants": {},
    }


def _run_variant(args, base: str, device, vocab: int, pool, local, kw: dict) -> dict:
    """One variant's loop (the engine's, nanoGPT's or the plain one) with its local-attention kernel."""
    import acco.attention

    local_default = acco.attention.LOCAL_KERNEL
    acco.attention.LOCAL_KERNEL = local  # read while tracing: each variant compiles its own model
    try:
        if base.startswith("engine-"):
            return run_engine(args, base.removeprefix("engine-"), device, vocab, pool, **kw)
        if base == "nanogpt":
            return run_nanogpt(args, device, vocab, pool, compiled=kw["compiled"], profile=kw["profile"])
        return run_plain(args, device, vocab, pool, autocast=base == "plain-autocast", **kw)
    finally:
        acco.attention.LOCAL_KERNEL = local_default


def _check_side_stream(args, device, vocab: int, pool, result: dict, say) -> None:
    """The side-stream check (stream_check), at acco's measured micro-batch time, into `result`."""
    ms = 1000 * result["variants"].get("engine-acco", {}).get("s_per_micro_batch", 0.05)
    result["stream_check"] = stream_check(args, device, vocab, pool, ms)
    sc = result["stream_check"]
    say(f"  side-stream check: compute x{sc['compute_slowdown_side_stream']:.3f} with a "
        f"{sc['delay_ms_per_round']:.0f} ms sleep per round on the comm stream (control on the compute "
        f"stream: x{sc['compute_slowdown_control']:.2f}); {'PASSED' if sc['passed'] else 'FAILED'}")


def summarise(result: dict) -> None:
    """The ratios between the variants measured so far, and the memory accounting, into `result`."""
    v = result["variants"]
    for a, b in RATIOS:
        if a in v and b in v:
            result[f"ratio_{a}_over_{b}"] = v[a]["tokens_per_s"] / v[b]["tokens_per_s"]
    result["memory_accounting"] = memory_accounting(v)
    for a in list(v):  # what checkpointing saves: peak memory with it over without
        if a + "-gc" in v and v[a].get("peak_gpu_mem_mb"):
            result[f"ratio_{a}-gc_over_{a}_peak_gpu_mem"] = (
                v[a + "-gc"]["peak_gpu_mem_mb"] / v[a]["peak_gpu_mem_mb"]
            )


def _write(out: Path, result: dict) -> None:
    summarise(result)
    (out / "gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gpu.md").write_text(gpu_markdown(result))


def memory_accounting(variants: dict) -> dict:
    """The engine's peak memory over the plain loop's, against the state it holds beyond the plain
    loop's (docs/algorithm.md's bytes per parameter: acco 6 + 24/W in bf16, the plain loop 8): the
    two should agree within 10%; activations, the batches and the loss are the same in both."""
    out = {}
    for a, b in (("engine-acco", "plain-bf16"), ("engine-acco-compiled", "plain-bf16-compiled")):
        peaks = [variants.get(x, {}).get("peak_gpu_mem_mb") for x in (a, b)]
        if all(peaks):
            peak = peaks[0] - peaks[1]
            state = variants[a]["state_mb"] - variants[b]["state_mb"]
            out[f"{a}_over_{b}"] = {"peak_difference_mb": peak, "state_difference_mb": state,
                                    "ratio": peak / state if state else None}
    return out


def gpu_markdown(r: dict) -> str:
    from acco_bench.report import fmt, md_table

    lines = [
        f"# acco-bench gpu: {r['device']}" + (f" x {r['nproc']} (NCCL)" if r.get("nproc", 1) > 1 else ""),
        "",
        f"{r['model']} (random init, vocab {r['vocab_size']}), bf16, micro-batch {r['batch_size']} x "
        f"{r['max_length']} tokens, {r['micro_batches_per_update']} micro-batches per update, "
        f"{fmt(r['flops_per_token'] / 1e6, 1)} MFLOP per token, peak {r['peak_bf16_tflops']} TFLOP/s, "
        f"torch {r['torch']} (CUDA {r['cuda']})"
        + (f"; -compiled variants in inductor's {r['compile_mode']} mode" if r.get("compile_mode") else "")
        + ("; -compiled variants compile the model's body whole" if r.get("compile_scope") == "model" else "")
        + ".",
        "",
    ]
    rows = [[k, fmt(v["tokens_per_s"], 0), fmt(100 * v["mfu"], 1, "%") if v.get("mfu") is not None else "-",
             fmt(v["step_time_s"]), fmt(v.get("peak_gpu_mem_mb"), 0), fmt(v.get("state_mb"), 0)]
            for k, v in r["variants"].items()]
    lines.append(md_table(["variant", "tokens/s", "MFU", "s/update", "peak MB", "state MB"], rows))
    lines += graphs_note(r["variants"])
    for pair, m in r.get("memory_accounting", {}).items():
        lines.append(f"\npeak memory, {pair.replace('_', ' ')}: {m['peak_difference_mb']:.0f} MB more, "
                     f"the state held {m['state_difference_mb']:.0f} MB more (x{fmt(m['ratio'])})")
    lines += [f"\nFAILED {k}: {e}" for k, e in r.get("failed", {}).items()]
    for key, val in r.items():
        if key.startswith("ratio_"):
            lines.append(f"\n{key[6:].replace('_', ' ')}: {val:.3f}")
    sc = r.get("stream_check")
    if sc:
        lines += [
            "",
            f"Side-stream check ({'PASSED' if sc['passed'] else 'FAILED'}): a {sc['delay_ms_per_round']:.0f} "
            f"ms sleep per comm round on the side stream changed the compute time per micro-batch by "
            f"x{sc['compute_slowdown_side_stream']:.3f} (micro-batches per round "
            f"{sc['no_delay']['micro_batches_per_round']:.1f} -> "
            f"{sc['side_stream_delay']['micro_batches_per_round']:.1f}); the same sleep on the compute "
            f"stream (control): x{sc['compute_slowdown_control']:.2f}.",
        ]
    for profile in r.get("profiles", {}).values():
        from acco_bench.gpu_profile import markdown

        lines += markdown(profile)
    if r.get("micro"):
        from acco_bench.gpu_micro import markdown

        lines += markdown(r["micro"])
    return "\n".join(lines) + "\n"

