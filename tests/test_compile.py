"""``compile`` (acco/engine/compiling.py): compiled and eager training give the same losses, gradient
norms and parameters, for every method on 2 gloo workers, with no recompile after the first update;
the GPT-Neo blocks and the loss's per-chunk pass are compiled in place (state dict, saved model
unchanged). backend="aot_eager" traces and runs the same aten ops without generating code, which
keeps these tests to seconds; inductor's code generation runs on a GPU (acco-bench gpu)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo
from distributed import run_distributed
from engine_helpers import assert_close, config, loss_fn, make_model, stream
from torch._dynamo.utils import counters
from torch.nn.utils import parameters_to_vector

import acco.loss
from acco.config import TrainArgs
from acco.engine import ConfigError, EngineConfig, build_engine
from acco.engine.compiling import blocks, compile_options
from acco.loss import causal_lm_loss
from acco.models import build_model


@contextlib.contextmanager
def no_recompiles(active: bool):
    """Inside: a recompile raises (torch._dynamo.config.error_on_recompile)."""
    before = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = active
    try:
        yield
    finally:
        torch._dynamo.config.error_on_recompile = before


def _train(engine, model, batches, loss):
    """Every record, with recompiles refused from the second update on."""
    records = []
    run = engine.run(batches, loss)
    records.append(next(run))
    with no_recompiles(engine.cfg.compile is not False):
        records.extend(run)
    engine.close()
    return records


def _methods(rank, world, compiled_first):
    out = {}
    n, updates = 2, 3
    budget = n * world * updates
    cfgs = {
        "ddp": config(method="ddp", n_grad_accumulation=n, nb_steps_tot=budget),
        "torch-ddp": config(method="torch-ddp", n_grad_accumulation=n, nb_steps_tot=budget),
        "torch-hsdp": config(method="torch-hsdp", n_grad_accumulation=n, nb_steps_tot=budget),
        "acco": config(method="acco", n_grad_accumulation=n // 2, nb_steps_tot=budget),
        "dpu": config(method="dpu", n_grad_accumulation=n, nb_steps_tot=budget),
        "wp": config(method="wp", n_grad_accumulation=n, nb_steps_tot=budget),
        "diloco": config(method="diloco", n_grad_accumulation=1, nb_steps_tot=world * 4, sync_every=2),
        "streaming-diloco": config(method="streaming-diloco", n_grad_accumulation=1, nb_steps_tot=world * 4,
                                   sync_every=2, num_fragments=2),
    }  # fmt: skip
    for method, cfg in cfgs.items():
        cfg.max_grad_norm = 100.0  # no clipping, but the records carry the gradient norm
        for compiled in (compiled_first, not compiled_first):
            cfg.compile = "aot_eager" if compiled else False
            model = make_model("block")
            engine = build_engine(model, cfg)
            assert getattr(model, "_compiled_call_impl", None) is not None or not compiled
            records = _train(engine, model, stream("block", rank, world), loss_fn)
            out[method, compiled] = (parameters_to_vector(model.parameters()).detach(), records)
    return out


def test_every_method_trains_the_same_compiled():
    results = run_distributed(_methods, 2, True)[0]
    for method in ("ddp", "torch-ddp", "torch-hsdp", "acco", "dpu", "wp", "diloco", "streaming-diloco"):
        (eager, eager_rec), (compiled, compiled_rec) = results[method, False], results[method, True]
        assert len(compiled_rec) == len(eager_rec) >= 2, method
        assert_close(compiled, eager, f"{method}: parameters")
        assert_close(
            torch.tensor([r.loss for r in compiled_rec]), torch.tensor([r.loss for r in eager_rec]), method
        )
        norms = [r.grad_norm for r in compiled_rec], [r.grad_norm for r in eager_rec]
        assert_close(torch.tensor(norms[0]), torch.tensor(norms[1]), f"{method}: gradient norms")
    assert not torch.allclose(results["ddp", True][0], results["acco", True][0])  # not vacuous


NEO = dict(
    arch="gpt_neo", hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64, window_size=8
)
LLAMA = dict(NEO, arch="llama", num_kv_heads=2, intermediate_size=64)
del LLAMA["window_size"]
REPEATED_BLOCKS = {"gpt_neo": lambda m: list(m.transformer.h), "llama": lambda m: list(m.model.layers)}


def _run(compile_setting, tmp_path=None, arch=NEO, scope="blocks"):
    torch.manual_seed(0)
    model = build_model(arch, vocab_size=97)
    keys = list(model.state_dict())
    cfg = EngineConfig(
        method="ddp",
        n_grad_accumulation=2,
        nb_steps_tot=6,
        compile=compile_setting,
        compile_scope=scope,
        accumulate_while_waiting=False,
    )
    engine = build_engine(model, cfg)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(6):
        # 48 positions: 2 chunks of 24; 24 = 3 local windows: the local layer blocked
        ids = torch.randint(0, 97, (2, 24), generator=gen)
        batches.append({"input_ids": ids, "labels": ids})
    records = _train(engine, model, iter(batches), causal_lm_loss)
    assert list(model.state_dict()) == keys  # no _orig_mod. anywhere
    with torch.no_grad():  # evaluation compiles its own variant, once
        evaluation = causal_lm_loss(model.eval(), batches[0])[0]
    return model, records, evaluation


@pytest.mark.parametrize(
    "backend, arch, scope",
    [
        ("aot_eager", NEO, "blocks"),
        ("aot_eager", LLAMA, "blocks"),
        ("aot_eager", NEO, "model"),
        ("aot_eager", LLAMA, "model"),
        pytest.param("inductor", NEO, "blocks", marks=pytest.mark.slow),
    ],
    ids=["aot_eager-gpt_neo", "aot_eager-llama", "aot_eager-gpt_neo-model", "aot_eager-llama-model",
         "inductor-gpt_neo"],
)
def test_the_blocks_and_the_loss_compile_in_place(monkeypatch, tmp_path, backend, arch, scope):
    """GPT-Neo's and Llama's repeated blocks, or (compile_scope "model") their whole body; aot_eager
    in make test, inductor (C++ code generated for the CPU) in the slow tier. Each compiled function
    is one graph: a graph break would split a block in two and cost the fusions across it, silently."""
    monkeypatch.setattr(acco.loss, "CHUNK_POSITIONS", 24)
    eager, eager_rec, eager_eval = _run(False, arch=arch)
    assert eager.acco_compile is None
    calls, real = [], acco.loss._compiled_pass

    def spy(**options):
        compiled_pass = real(**options)
        assert hasattr(compiled_pass, "_torchdynamo_orig_callable")  # what torch.compile returns

        def counted(*args):
            calls.append(args[-1])  # whether it computed the logits' gradient
            return compiled_pass(*args)

        return counted

    monkeypatch.setattr(acco.loss, "_compiled_pass", spy)
    torch._dynamo.reset()  # traced anew (an earlier test's cached frames are not), counted from zero
    counters.clear()
    model, records, evaluation = _run(backend, arch=arch, scope=scope)
    assert not counters["graph_break"], list(counters["graph_break"])
    assert model.acco_compile == {"backend": backend}
    repeated = blocks(model)
    assert repeated == REPEATED_BLOCKS[arch["arch"]](model)
    if scope == "blocks":
        assert all(block._compiled_call_impl is not None for block in repeated)
    else:  # the body in one graph (training's and evaluation's), beside the loss's pass (with and
        # without the gradient): its blocks are traced inside it, not compiled on their own
        assert model.base_model._compiled_call_impl is not None and counters["stats"]["unique_graphs"] == 4
        assert all(getattr(block, "_compiled_call_impl", None) is None for block in repeated)
    assert calls.count(True) == 6 * 2 and calls.count(False) == 2  # the per-chunk pass ran compiled
    torch.testing.assert_close([r.loss for r in records], [r.loss for r in eager_rec], rtol=1e-6, atol=0)
    torch.testing.assert_close(
        parameters_to_vector(model.parameters()),
        parameters_to_vector(eager.parameters()),
        rtol=1e-5,
        atol=1e-6,
    )
    torch.testing.assert_close(evaluation, eager_eval, rtol=1e-6, atol=0)
    model.save_pretrained(tmp_path)
    reloaded = build_model(arch | {"pretrained": str(tmp_path)}, vocab_size=97)
    assert reloaded.state_dict().keys() == model.state_dict().keys()


def test_the_setting():
    assert compile_options("auto", "cuda") == {"backend": "inductor"}
    assert compile_options("auto", "cpu") is None
    assert compile_options(True, "cpu") == {"backend": "inductor"}
    assert compile_options(False, "cuda") is None
    assert compile_options("aot_eager", "cpu") == {"backend": "aot_eager"}
    assert EngineConfig().compile == "auto"
    assert (
        TrainArgs.from_any({"compile": "aot_eager"}).engine_config().compile == "aot_eager"
    )  # train.compile
    for bad in ("", 3, None):
        with pytest.raises(ConfigError, match="compile must be"):
            EngineConfig(compile=bad)
    assert TrainArgs.from_any({"compile_scope": "model"}).engine_config().compile_scope == "model"
    with pytest.raises(ConfigError, match="compile_scope must be one of blocks, model, got 'layers'"):
        EngineConfig(compile_scope="layers")


def test_the_compile_mode_reaches_inductor_and_nothing_else(monkeypatch):
    """train.compile_mode (CUDA graphs, autotuning) is inductor's: passed to torch.compile with it,
    refused with another backend or an unknown mode; "auto" on the CPU still compiles nothing."""
    cuda_graphs = {"backend": "inductor", "mode": "reduce-overhead"}
    assert compile_options(True, "cpu", "reduce-overhead") == cuda_graphs
    assert compile_options("auto", "cuda", "max-autotune") == {"backend": "inductor", "mode": "max-autotune"}
    assert compile_options("auto", "cpu", "reduce-overhead") is None
    args = TrainArgs.from_any({"compile": "auto", "compile_mode": "reduce-overhead"})
    assert args.engine_config().compile_mode == "reduce-overhead"  # train.compile_mode
    with pytest.raises(ConfigError, match="compile_mode=reduce-overhead is inductor's; compile=aot_eager"):
        EngineConfig(compile="aot_eager", compile_mode="reduce-overhead")
    with pytest.raises(ConfigError, match="compile_mode must be null or one of default, reduce-overhead"):
        EngineConfig(compile=True, compile_mode="fast")
    seen = []  # what build_engine hands torch.compile, without compiling
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: seen.append(options))
    model = make_model("block")
    build_engine(model, config(method="ddp", compile=True, compile_mode="max-autotune-no-cudagraphs")).close()
    assert seen and all(o == {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"} for o in seen)
    assert model.acco_compile == seen[0]  # the loss's per-chunk pass compiles alike


@pytest.mark.parametrize("length, local", [
    (20, [(False, False)]),  # 20 positions > window 8, no multiple of it: the local layer's full mask
    (24, [(True, True), (False, False)]),  # 3 windows: blocked, block 0 causal, the rest banded
])  # fmt: skip
def test_the_body_compiled_whole_keeps_the_flash_path(monkeypatch, length, local):
    """Compiled whole (compile_scope "model"), transformers still builds no mask for a batch without
    padding, as in eager: global layers take SDPA's is_causal (flash on a GPU) and local layers
    their window's mask; a dense (B, 1, T, T) mask in every layer would give the same loss, slower."""
    import torch.nn.functional as F

    from acco.engine.compiling import compile_module

    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        seen.append((attn_mask is None, is_causal))  # recorded while dynamo traces
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = build_model(NEO, vocab_size=97)
    ids = torch.randint(0, 97, (2, length))
    model.base_model(input_ids=ids)
    eager, seen[:] = list(seen), []
    assert eager == [(True, True), *local]  # global: is_causal, no mask; local: its window
    torch._dynamo.reset()
    compile_module(model, {"backend": "aot_eager"}, scope="model")
    model.base_model(input_ids=ids)
    assert seen == eager


@pytest.mark.slow
def test_blocked_local_layers_with_attention_dropout_compile_with_inductor():
    """A local layer blocked (12 positions, window 4) with attention dropout, its blocks compiled by
    inductor: it trains (an unfold in the key pairs made inductor's CPU code corrupt the heap here)
    and the dropout is applied (another seed, another loss), with no graph break."""
    from acco.engine.compiling import compile_module

    torch.manual_seed(0)
    model = build_model(NEO | {"window_size": 4}, vocab_size=97).train()
    for module in model.modules():
        if hasattr(module, "attn_dropout"):
            module.attn_dropout.p = 0.1
    torch._dynamo.reset()
    counters.clear()
    compile_module(model, {"backend": "inductor"})
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert not counters["graph_break"], list(counters["graph_break"])
    assert losses[0] != losses[2]


def test_compiled_blocked_local_layers_run_no_attention_forward_in_backward(monkeypatch):
    """Compiled, the selective checkpoint's policy reaches the partitioner: the local layer's
    backward graph runs SDPA's backward only, where recomputing everything would run its
    forward again (the partitioner's choice without the policy, checked here as the control)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils.checkpoint import CheckpointPolicy

    import acco.attention
    from acco.engine.compiling import compile_module

    def forwards_in_backward() -> list[int]:
        counts = []

        def sdpa(node) -> bool:  # the op, or the op replayed with its RNG state (run_with_rng_state)
            return node.target in acco.attention.SDPA_KERNELS or any(
                a in acco.attention.SDPA_KERNELS for a in node.args if isinstance(a, torch._ops.OpOverload)
            )

        def backward(gm, _inputs):
            counts.append(sum(map(sdpa, gm.graph.nodes)))
            return gm

        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(NEO | {"window_size": 4}, vocab_size=97).train()
        compile_module(model, {"backend": aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=backward)})
        ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        return sorted(counts)  # one backward graph per layer kind: global, local

    assert forwards_in_backward() == [0, 0]
    monkeypatch.setattr(acco.attention, "keep_attention", lambda *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
    assert forwards_in_backward() == [0, 2]  # block 0 and the later blocks, again


def test_compiled_blocks_under_activation_checkpointing_give_eager_gradients():
    """train.gradient_checkpointing with train.compile: transformers' checkpoint around each compiled
    block, the blocked local layers' selective one nested inside it, traced together."""
    import copy

    from acco.engine.compiling import compile_module
    from acco.models import checkpoint_activations

    torch.manual_seed(0)
    eager = build_model(NEO | {"window_size": 4}, vocab_size=97).train()
    compiled = copy.deepcopy(eager)
    checkpoint_activations(compiled)
    assert compiled.is_gradient_checkpointing
    torch._dynamo.reset()
    compile_module(compiled, {"backend": "aot_eager"})
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    for model in (eager, compiled):
        model(input_ids=ids, labels=ids).loss.backward()
    for got, want in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)
