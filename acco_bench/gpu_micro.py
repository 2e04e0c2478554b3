"""``acco-bench gpu``'s micro-benchmark: where a GPT-Neo micro-batch's time goes, piece by piece, at
the benchmark's shapes (batch x length rows, the model's width, heads, window and vocabulary), in
about a minute on a GPU. Each piece is timed forward and backward (median of ``repeats`` runs
after a warm-up that also compiles), milliseconds, or the error a piece raised:

- ``head_gemm``: the LM head's three GEMMs (logits, d hidden, d head) at the model's vocabulary
  and at it padded to a multiple of 128 (50257 -> 50304 for GPT-Neo): what the fused loss's padding
  buys;
- ``projections``: GPT-Neo's query, key and value projections as transformers calls them (three
  GEMMs forward, six backward and a sum of three input gradients) against acco's one GEMM on the
  weights stacked (acco/attention.py): fewer, larger kernels;
- ``gelu``: ``gelu_new`` (eight ops) against ``gelu_pytorch_tanh`` (one kernel) on the MLP's
  activations;
- ``local_attention``: a local layer (sliding window) through SDPA with the full explicit mask (what
  ran before), acco's blocked path (acco/attention.py's local_blocked, where the length is a
  multiple of the window: ``sdpa_blocked``, and ``sdpa_blocked_checkpointed`` as training runs it,
  its copies recomputed in backward, SDPA's results kept), SDPA ``is_causal`` (the flash kernel;
  a bound, it ignores the window), and
  ``flex_attention`` with a sliding-window causal block mask built in the graph (as acco runs it)
  and built once beforehand, compiled (on CUDA; the CPU runs its forward only, eagerly: torch 2.13
  has no flex backward there);
- ``loss``: the loss acco computed before (checkpointed head, fp32 cross-entropy per chunk) against
  the fused one, eager and compiled (chunks of acco's CHUNK_POSITIONS rows, and compiled at
  LOSS_CHUNKS' larger ones: what fewer, larger GEMMs buy), and nanoGPT's (``full_logits_compiled``:
  the padded head's full logits and ``F.cross_entropy``, compiled: the loss of the nanogpt-compiled
  anchor, where the fused loss trades its memory for chunked GEMMs);
- ``optimizer``: the comm round's optimizer on a shard of the whole model (world size 1): the
  commit (torch's fused AdamW, the gradient divided inside it) and acco's trial step at several
  chunk sizes (acco/engine/optim.py's TRIAL_CHUNK: the workspace small enough to stay in the
  cache, or the launches few), timed alone, not beside a micro-batch.

``--device cpu`` runs the same code at tiny shapes: a check of the code path, not a measurement.
"""

from __future__ import annotations

import statistics
import time


def _timer(device, repeats: int):
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def measure(fn) -> float | str:
        """Median milliseconds, or the error (one piece failing, a compile on an untried GPU, must
        not cost the throughput results the run already has)."""
        try:
            fn()  # warm-up, compiles
            sync()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 (reported in the results)
            return f"error: {type(e).__name__}: {e}"[:300]
        return 1000 * statistics.median(times)

    return measure


def window_mask(length: int, window: int, device):
    """GPT-Neo's local layers: key j is visible from query i when 0 <= i - j < window."""
    import torch

    i = torch.arange(length, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def todays_loss(hidden, weight, targets, chunk: int = 1024):
    """acco's loss before the fused one: per chunk a checkpointed head and an fp32 cross-entropy."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    def part(h, t):
        return F.cross_entropy(F.linear(h, weight).float(), t, ignore_index=-100, reduction="sum")

    pairs = zip(hidden.split(chunk), targets.split(chunk))
    return sum(checkpoint(part, h, t, use_reentrant=False) for h, t in pairs)


def full_logits_loss(hidden, weight, targets):
    """nanoGPT's loss, summed: the full (rows, vocab) logits, then an fp32 cross-entropy (fp64 stays)."""
    import torch
    import torch.nn.functional as F

    logits = F.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


LOSS_CHUNKS = (2048, 4096)  # rows per chunk of the fused loss, compiled, beside acco's CHUNK_POSITIONS


def run(
    device,
    rows: int,
    length: int,
    hidden: int,
    heads: int,
    vocab: int,
    window: int,
    backend: str | None,
    repeats: int = 20,
    shard: int = 0,
    keep=None,
) -> dict:
    """The breakdowns above; `backend` compiles flex attention and the fused loss (None: eager);
    `shard`: the optimizer's elements (0: no optimizer times); `keep(results so far)` is called as
    each group is timed, so that a run cut short by a time limit keeps what it measured (the
    compiled loss's larger chunks and nanoGPT's loss, each a compile more, come last)."""
    import torch

    measure = _timer(device, repeats)
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen).requires_grad_(grad)

    out: dict = {"rows": rows, "backend": backend}

    def kept(group: str, value: dict) -> None:
        out[group] = value
        if keep is not None:  # a snapshot: the loss's group grows after it is first kept
            keep({k: dict(v) if isinstance(v, dict) else v for k, v in out.items()})

    kept("head_gemm", _head_gemm(measure, randn, rows, hidden, vocab))
    kept("projections", _projections(measure, randn, rows, hidden))
    kept("gelu", _gelu(measure, randn, rows, hidden))
    batch = max(1, rows // length)
    q, k, v = (randn(batch, heads, length, hidden // heads, grad=True) for _ in range(3))
    do = randn(batch, heads, length, hidden // heads)
    kept("local_attention", _local_attention(measure, q, k, v, do, window, device)
         | _flex(measure, q, k, v, do, window, backend, device))  # fmt: skip
    targets = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    hg, wg = randn(rows, hidden, grad=True), randn(vocab, hidden, grad=True)
    loss = _loss(measure, hg, wg, targets, backend)
    kept("loss", loss)
    if shard:
        kept("optimizer", _optimizer(measure, device, shard))
    if backend:
        loss |= _loss_compiled_more(measure, randn, hg, wg, targets, backend)
        kept("loss", loss)
    return out


def _head_gemm(measure, randn, rows: int, hidden: int, vocab: int) -> dict:
    """The LM head's three GEMMs (forward, and backward's two), at the vocabulary and padded to 128."""
    h = randn(rows, hidden)
    head = {}
    for v in sorted({vocab, -(-vocab // 128) * 128}):
        w, g = randn(v, hidden), randn(rows, v)
        head[f"vocab_{v}"] = measure(lambda w=w, g=g: (h @ w.t(), g @ w, g.t() @ h))
    return head


def _gelu(measure, randn, rows: int, hidden: int) -> dict:
    from transformers.activations import GELUTanh, NewGELUActivation

    x, dy = randn(rows, 4 * hidden, grad=True), randn(rows, 4 * hidden)
    return {
        name: measure(lambda act=act: act(x).backward(dy))
        for name, act in (("gelu_new", NewGELUActivation()), ("gelu_pytorch_tanh", GELUTanh()))
    }


def _local_attention(measure, q, k, v, do, window: int, device) -> dict:
    """A local layer's attention by SDPA: masked, causal, and acco's blocked path where it applies."""
    import torch.nn.functional as F

    length = q.shape[2]
    mask = window_mask(length, window, device)
    attention = {
        "sdpa_masked": measure(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0).backward(do)
        ),
        "sdpa_is_causal": measure(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0).backward(do)
        ),
    }
    if length > window and length % window == 0:  # acco's path for local layers
        from acco.attention import blocked_local_layer, local_blocked

        band = mask[window : 2 * window, : 2 * window]
        attention["sdpa_blocked"] = measure(lambda: local_blocked(q, k, v, window, band).backward(do))
        attention["sdpa_blocked_checkpointed"] = measure(  # as the model trains it
            lambda: blocked_local_layer(q, k, v, window, band).backward(do)
        )
    return attention


def _loss(measure, hg, wg, targets, backend: str | None) -> dict:
    """todays_loss, acco's fused loss, and (with a backend) that compiled."""
    from acco.loss import linear_cross_entropy

    loss = {
        "todays": measure(lambda: todays_loss(hg, wg, targets).backward()),
        "fused": measure(lambda: linear_cross_entropy(hg, wg, None, targets).backward()),
    }
    if backend:
        options = {"backend": backend}
        loss["fused_compiled"] = measure(
            lambda: linear_cross_entropy(hg, wg, None, targets, compile_options=options).backward()
        )
    return loss


def _loss_compiled_more(measure, randn, hg, wg, targets, backend: str) -> dict:
    """The compiled fused loss at larger chunks, and nanoGPT's full-logits loss compiled: a
    compile each, so timed last."""
    import torch

    from acco.loss import linear_cross_entropy

    loss = {}
    static = {"backend": backend, "dynamic": False}  # each chunk size compiled for itself, as acco's 1024 is
    for chunk in LOSS_CHUNKS:
        loss[f"fused_compiled_{chunk}"] = measure(
            lambda chunk=chunk: linear_cross_entropy(
                hg, wg, None, targets, chunk=chunk, compile_options=static
            ).backward()
        )
    vocab, hidden = wg.shape
    padded = randn(-(-vocab // 128) * 128, hidden, grad=True)  # nanoGPT pads its vocabulary
    full = torch.compile(full_logits_loss, backend=backend)
    loss["full_logits_compiled"] = measure(lambda: full(hg, padded, targets).backward())
    return loss


def _projections(measure, randn, rows: int, hidden: int) -> dict:
    import torch
    import torch.nn.functional as F

    x = randn(rows, hidden, grad=True)
    weights = [randn(hidden, hidden, grad=True) for _ in range(3)]
    grads = [randn(rows, hidden) for _ in range(3)]

    def three():
        torch.autograd.backward([F.linear(x, w) for w in weights], grads)

    def stacked():
        torch.autograd.backward(list(F.linear(x, torch.cat(weights)).split(hidden, dim=-1)), grads)

    return {"three_gemms": measure(three), "stacked": measure(stacked)}


TRIAL_CHUNKS = (1 << 18, 1 << 20, 1 << 21, 1 << 22)


def _optimizer(measure, device, numel: int) -> dict:
    """The commit and the trial step (into a bf16 output, as the estimate round writes it) on an
    fp32 shard of `numel` elements, ms: ``trial_2^k`` with chunks of 2^k elements."""
    import torch

    from acco.engine.config import EngineConfig
    from acco.engine.optim import ShardedAdamW

    cfg = EngineConfig(learning_rate=1e-4, weight_decay=0.1)
    gen = torch.Generator(device=device).manual_seed(0)
    master = torch.randn(numel, device=device, generator=gen)
    grad = torch.randn(numel, device=device, generator=gen)
    out = torch.empty(numel, device=device, dtype=torch.bfloat16)
    times = {"elements": numel}
    # a divisor other than 1 takes the kernel's grad_scale path, as a round does; each call leaves
    # the gradient divided by it, so one this close to 1 keeps the gradient's size over the repeats
    divisor = 1.0 + 2.0**-20
    for chunk in TRIAL_CHUNKS:
        opt = ShardedAdamW(master, cfg, decayed=numel - numel // 100, chunk=chunk)
        trial = lambda opt=opt: opt.trial(grad, 1e-4, divisor, out=out)  # noqa: E731
        times[f"trial_2^{chunk.bit_length() - 1}"] = measure(trial)
        if chunk == TRIAL_CHUNKS[-1]:
            times["commit"] = measure(lambda opt=opt: opt.commit(grad, 1e-4, divisor))
        del opt
    return times


def _flex(measure, q, k, v, do, window: int, backend: str | None, device) -> dict:
    """acco's flex path for GPT-Neo's local layers (acco/attention.py's flex_local, its block mask
    built in the graph on every call: ``flex_sliding_window``) and the same with the mask built
    once beforehand (``flex_prebuilt_mask``; the difference is what caching the mask per length
    would buy): compiled forward and backward on CUDA, the eager forward on the CPU (a check that
    the mask and call are right, no timing to read)."""
    import torch

    from acco.attention import flex_local, sliding_window_block_mask

    mask = sliding_window_block_mask(q.size(-2), window, device)
    if device.type != "cuda":
        q, k, v = (t.detach() for t in (q, k, v))
        return {
            "flex_sliding_window": measure(lambda: flex_local(q, k, v, window)),
            "flex_prebuilt_mask": measure(lambda: flex_local(q, k, v, window, mask)),
        }
    flex = torch.compile(flex_local, backend=backend) if backend else flex_local
    return {
        "flex_sliding_window": measure(lambda: flex(q, k, v, window).backward(do)),
        "flex_prebuilt_mask": measure(lambda: flex(q, k, v, window, mask).backward(do)),
    }


def from_args(args, device, keep=None) -> dict:
    """`run` at acco-bench gpu's shapes: --model's width, heads, window and vocabulary, --batch-size
    x --max-length rows; compiled with --compile-backend on CUDA."""
    import torch

    from acco.config import GPT_NEO_WINDOW
    from acco.models import build_model, count_parameters
    from acco_bench.settings import model_settings

    m = model_settings(args.model)
    vocab = int(m.get("vocab_size") or 50257)
    with torch.device("meta"):  # its size only: nothing allocated
        numel = count_parameters(build_model(m, vocab_size=vocab))
    return run(
        device,
        args.batch_size * args.max_length,
        args.max_length,
        int(m["hidden_size"]),
        int(m["num_heads"]),
        vocab,
        int(m.get("window_size") or GPT_NEO_WINDOW),
        args.compile_backend if device.type == "cuda" else None,
        shard=numel if device.type == "cuda" else min(numel, 1 << 20),  # the CPU: a path check
        keep=keep,
    )


def markdown(m: dict) -> list[str]:
    lines = [
        "",
        f"Micro-benchmark ({m['rows']} rows, bf16, forward and backward, ms, median; compiled with "
        f"{m['backend'] or 'nothing'}):",
        "",
    ]
    for group in ("head_gemm", "projections", "gelu", "local_attention", "loss", "optimizer"):
        if group not in m:
            continue
        parts = ", ".join(
            f"{name} {ms:.3f}" if isinstance(ms, float) else f"{name} {ms}" for name, ms in m[group].items()
        )
        lines.append(f"- {group}: {parts}")
    return lines
