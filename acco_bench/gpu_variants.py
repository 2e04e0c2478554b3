"""The throughput variants of ``acco-bench gpu`` (gpu.py): each trains GPT-Neo (random init, random
tokens) for ``--warmup`` + ``--steps`` updates of ``2 * grad_accum`` micro-batches and returns its
tokens/s and timings.

- ``parse_variants``: the names ``--variants`` takes, as (base, checkpointing, compiled, local kernel);
- ``run_engine``: through acco's engine (method acco or ddp, world size 1 or the processes
  gpu.py spawns), optionally with gradient checkpointing, compiled, or with a delay hook on the
  comm round (the side-stream check);
- ``run_plain``: a plain loop on the same model and data, fused AdamW with the engine's settings,
  bf16 parameters or fp32 under bf16 autocast (``time_plain_loop``, which the nanoGPT anchor of
  gpu_nanogpt.py runs too).
"""

from __future__ import annotations

import itertools
import statistics
import time

from acco_bench.gpu_profile import UPDATES, Window

LR = 1e-4  # the engine's and the plain loop's, constant
BASE_VARIANTS = ("engine-acco", "engine-ddp", "plain-bf16", "plain-autocast", "nanogpt")


def parse_variants(text: str) -> list[tuple[str, str, bool, bool, str]]:
    """--variants as (name, base, gradient checkpointing, compiled, local kernel); a ValueError names
    an unknown one. The local layers' kernel (acco.attention.LOCAL_KERNEL, "blocked" by default):
    ``-flex`` (after ``-compiled``) flex_attention, taken on CUDA under compile only; ``-mask`` the
    full T x T under GPT-Neo's mask, the blocks' in-model reference."""
    parsed = []
    for variant in [v.strip() for v in text.split(",") if v.strip()]:
        base = variant.removesuffix("-gc")
        gc = base != variant
        local = next((k for k in ("flex", "mask") if base.endswith(f"-{k}")), "blocked")
        base = base.removesuffix(f"-{local}")
        compiled, base = base.endswith("-compiled"), base.removesuffix("-compiled")
        local_ok = local != "flex" or compiled
        if base not in BASE_VARIANTS or not local_ok or (base == "nanogpt" and (gc or local != "blocked")):
            raise ValueError(f"unknown variant {variant!r} (known: {', '.join(BASE_VARIANTS)}, each with "
                             "-compiled, -compiled-flex, -mask and/or -gc; nanogpt with -compiled only)")
        parsed.append((variant, base, gc, compiled, local))
    return parsed


def random_batches(vocab: int, batch_size: int, max_length: int, device, n: int = 16, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(0, vocab, (batch_size, max_length), generator=g).to(device) for _ in range(n)]
    return [{"input_ids": x, "labels": x} for x in pool]


def _cycle(pool):
    return itertools.cycle(pool)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh_model(args, vocab: int, device, dtype, checkpointing: bool = False):
    """The model from its local config (acco/conf/model, never a hub), in training mode."""
    import torch

    from acco.models import build_model, checkpoint_activations
    from acco_bench.settings import model_settings

    torch.manual_seed(0)
    model = build_model(model_settings(args.model), vocab_size=vocab, max_length=args.max_length)
    model = model.to(device=device, dtype=dtype).train()  # checkpointing acts in training mode only
    if checkpointing:
        checkpoint_activations(model)
    return model


def cudagraph_skips() -> int:
    """How many graphs inductor compiled so far without CUDA graphs though asked for them
    (reduce-overhead falls back per graph, with a logged reason): 0 means every graph replays."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def graphs_note(variants: dict) -> list[str]:
    """gpu.md's line under reduce-overhead: per variant, how many graphs ran without CUDA graphs."""
    counts = [f"{k} {v['cudagraph_skips']}" for k, v in variants.items() if "cudagraph_skips" in v]
    return ["", "Graphs compiled without CUDA graphs (inductor's cudagraph_skips): " + ", ".join(counts)
            + "."] if counts else []


def _checkpointing(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def run_engine(args, method: str, device, vocab: int, pool, accumulate: bool = False, delay=None,
               budget: int | None = None, checkpointing: bool = False, compiled: bool = False,
               profile: bool = False) -> dict:
    """Train through the engine at world size 1; tokens/s over the timed updates, and the
    per-micro-batch compute time; `profile`: gpu_profile.UPDATES more updates, profiled."""
    import torch

    from acco.engine import EngineConfig, build_engine

    model = _fresh_model(args, vocab, device, torch.float32, checkpointing)
    skips = cudagraph_skips()
    k = args.grad_accum
    per_update = 2 * k
    extra = UPDATES if profile else 0
    budget = budget or (args.warmup + args.steps + extra) * per_update  # micro-batches of one worker
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    budget *= world  # nb_steps_tot counts every worker's micro-batches
    cfg = EngineConfig(method=method, n_grad_accumulation=k if method == "acco" else per_update,
                       nb_steps_tot=budget, use_mixed_precision=True,
                       accumulate_while_waiting=accumulate, accumulate_cap=None,  # the stream check counts
                       scheduler_name="constant", learning_rate=LR,
                       compile=args.compile_backend if compiled else False,
                       compile_mode=args.compile_mode if compiled else None,
                       compile_scope=args.compile_scope)
    engine = build_engine(model, cfg)
    if delay is not None:
        engine.comm.delay_hook = delay
    tokens_per_mb = args.batch_size * args.max_length
    records = []
    window = Window(device) if profile else None
    from acco.loss import causal_lm_loss as loss_fn
    try:
        for rec in engine.run(_cycle(pool), loss_fn):
            records.append(rec)
            if window is not None and len(records) == args.warmup + args.steps:
                window.start()
        profiled = window.stop(extra * per_update) if window is not None else None
        _sync(device)
    finally:
        engine.close()
    records = records[: len(records) - extra]  # the timed ones
    if len(records) < 3:
        raise RuntimeError(f"only {len(records)} updates: raise --steps")
    warm = max(0, min(args.warmup, len(records) - 3))
    timed = records[warm + 1:]
    t0, t1 = records[warm].wall_time, records[-1].wall_time
    samples = records[-1].committed_micro_batches - records[warm].committed_micro_batches
    computed = sum(r.micro_batches[0] for r in timed)
    compute_s = sum(r.compute_s for r in timed)
    checkpointed = _checkpointing(model)
    state_bytes = sum(engine.state_bytes().values())
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "updates_timed": len(timed),
        "tokens_per_s": samples * tokens_per_mb / (t1 - t0),
        "step_time_s": statistics.median(
            b.wall_time - a.wall_time for a, b in zip(records[warm:], records[warm + 1 :])
        ),
        "s_per_micro_batch": compute_s / max(1, computed),
        "micro_batches_per_round": computed / max(1, len(timed)) / (2 if method == "acco" else 1),
        "comm_s_per_update": statistics.median(r.comm_s for r in timed),
        "wait_s_per_update": statistics.median(r.wait_s for r in timed),
        "final_loss": records[-1].loss,
        "gradient_checkpointing": checkpointed,
        "state_mb": state_bytes / 2**20,  # what the engine holds for training (docs/algorithm.md)
        **_graphs(cfg.compile_mode, skips),
        **({"profile": profiled} if profiled else {}),
    }


def run_plain(
    args, device, vocab: int, pool, autocast: bool, checkpointing: bool = False, compiled: bool = False,
    profile: bool = False,
) -> dict:
    """A plain loop on acco's model and loss: forward/backward 2k micro-batches, fused AdamW step
    (CUDA, and the CPU since torch 2.4), zero_grad; `profile`: gpu_profile.UPDATES more updates,
    profiled."""
    import torch

    from acco.engine.compiling import compile_module, compile_options
    from acco.loss import causal_lm_loss

    dtype = torch.float32 if autocast else torch.bfloat16
    model = _fresh_model(args, vocab, device, dtype, checkpointing)
    options = compile_options(args.compile_backend, device.type, args.compile_mode) if compiled else None
    compile_module(model, options, args.compile_scope)  # as build_engine does
    return time_plain_loop(args, device, model, pool, causal_lm_loss, autocast, profile)


def time_plain_loop(args, device, model, pool, loss_fn, autocast: bool, profile: bool = False) -> dict:
    """`model` trained by a plain loop on `pool` (``loss_fn(model, batch)`` -> (loss sum, tokens)),
    bf16 autocast or not, fused AdamW with the engine's settings: tokens/s over ``--steps`` updates
    after ``--warmup``, then (`profile`) gpu_profile.UPDATES more, profiled."""
    import contextlib

    import torch

    from acco.engine.config import EngineSettings

    s = EngineSettings()  # the engine's AdamW, its defaults
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps,
                            weight_decay=s.weight_decay, fused=True)
    per_update = 2 * args.grad_accum
    # CUDA graphs (inductor's reduce-overhead) replay the backward into the same memory: a .grad that
    # autograd took from one replay would be overwritten by the next micro-batch's, so accumulating
    # needs .grad buffers of its own, made before the first capture and zeroed, not freed, per update.
    mode = (getattr(model, "acco_compile", None) or {}).get("mode")
    keep_grads, skips = mode == "reduce-overhead", cudagraph_skips()
    if keep_grads:
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    it = _cycle(pool)
    loss = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            _sync(device)
            start = time.perf_counter()
        loss = _update(model, opt, it, loss_fn, ctx, per_update, keep_grads)
    _sync(device)
    elapsed = time.perf_counter() - start
    tokens = args.steps * per_update * args.batch_size * args.max_length
    final = float(loss.detach()) * per_update if loss is not None else None
    profiled = None
    if profile:
        window = Window(device)
        window.start()
        for _ in range(UPDATES):
            _update(model, opt, it, loss_fn, ctx, per_update, keep_grads)
        profiled = window.stop(UPDATES * per_update)
    checkpointed, fused = _checkpointing(model), bool(opt.defaults["fused"])
    # parameters, their gradients (freed by zero_grad, held through each update) and AdamW's moments
    held = sum(2 * p.numel() * p.element_size() + sum(t.numel() * t.element_size()
               for t in opt.state[p].values() if t.dim() > 0) for p in model.parameters())
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "updates_timed": args.steps,
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed / args.steps,
        "final_loss": final,
        "gradient_checkpointing": checkpointed,
        "fused_adamw": fused,
        "state_mb": held / 2**20,
        **_graphs(mode, skips),
        **({"profile": profiled} if profiled else {}),
    }


def _graphs(mode: str | None, skips_before: int) -> dict:
    return {"cudagraph_skips": cudagraph_skips() - skips_before} if mode == "reduce-overhead" else {}


def _update(model, opt, batches, loss_fn, ctx, per_update: int, keep_grads: bool = False):
    """One update of the plain loop; returns the last micro-batch's scaled loss. `keep_grads`:
    zero the .grad buffers instead of freeing them (CUDA graphs: see time_plain_loop)."""
    for _ in range(per_update):
        with ctx():
            loss_sum, tokens = loss_fn(model, next(batches))
        loss = loss_sum / (tokens * per_update)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=not keep_grads)
    return loss
