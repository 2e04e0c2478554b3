"""CUDA graphs (``train.compile_mode=reduce-overhead``) on one GPU, on a one-rank NCCL group as in
tests/test_cuda_one_gpu.py, skipped where there is no CUDA device. Inductor makes CUDA graphs on
CUDA only: on the CPU (one gloo rank; GPT-Neo's in the slow tier) the same tests run the mode
without them, which checks the tests themselves.

A replayed graph reads its inputs from, and writes its outputs to, the addresses it was recorded
with: the parameters (views of the engine's flat buffer, made once), the .grad views the backward
accumulates into, and each chunk of the fused loss, whose outputs are consumed before the next
chunk's replay. A wrong address or an output overwritten while still needed gives wrong numbers,
not an error, so the tests compare against the references:

- every method in fp32, its blocks and loss compiled with CUDA graphs, equals its single-process
  reference (the eps of engine_helpers.config makes AdamW see a gradient's scale: a gradient
  summed twice would show);
- GPT-Neo in bf16 through the fused loss (four chunks per micro-batch), acco, blocks and body
  scopes: the losses and parameters of the graphed runs equal those compiled without graphs;
- in both, inductor compiled no graph without CUDA graphs (cudagraph_skips stays 0) and graphs
  were recorded, so the figures of ``acco-bench gpu --compile-mode reduce-overhead`` are graphs'.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import assert_close, config, loss_fn, make_model
from one_rank_helpers import (
    expected,
    gpt_neo_tokens,
    method_configs,
    mlp_batches,
    needs_gpu,
    run_one_rank,
    tiny_gpt_neo,
    train_each,
)

GRAPHS = "reduce-overhead"
METHODS = ("acco",)  # every method's graphs against its reference: the fp32 test
ON_GPU = pytest.param("cuda", id="nccl-gpu", marks=needs_gpu)
ON_CPU = pytest.param("cpu", id="gloo-cpu")


def _as_expected(on: str, skips: int, roots: int) -> None:
    """On the GPU every graph replays (no skip, trees recorded); on the CPU none is recorded."""
    assert (skips == 0 and roots > 0) if on == "cuda" else roots == 0, (on, skips, roots)


def _graphed(train):
    """train()'s result, the graphs inductor compiled without CUDA graphs meanwhile, and how many
    graph trees this thread recorded."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    skips = counters["inductor"]["cudagraph_skips"]
    out = train()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), False) if cuda else None
    roots = 0 if manager is None else sum(1 for _ in manager.get_roots())
    return out, counters["inductor"]["cudagraph_skips"] - skips, roots


def _every_method_graphed(device):
    cfgs = [dataclasses.replace(c, compile=True, compile_mode=GRAPHS) for c in method_configs()]
    return _graphed(lambda: train_each(device, lambda: make_model("mlp"), cfgs, mlp_batches, loss_fn))


@pytest.mark.parametrize("on", [ON_CPU, ON_GPU])
def test_every_method_under_cuda_graphs_equals_its_reference_in_fp32(on):
    results, skips, roots = run_one_rank(on, _every_method_graphed)
    _as_expected(on, skips, roots)
    for cfg, (method, theta, records, _) in zip(method_configs(), results):
        name = f"{method} ({cfg.acco_estimate})" if method == "acco" else method
        want, losses = expected(cfg)
        assert len(records) == len(losses), name
        assert_close(theta, want, f"{name} under CUDA graphs vs its reference")
        assert_close(torch.tensor([loss for loss, _, _ in records]), torch.tensor(losses), f"{name} losses")


def _train_gpt_neo(device, cfg):
    import acco.loss

    return train_each(device, tiny_gpt_neo, [cfg], gpt_neo_tokens, acco.loss.causal_lm_loss)[0]


def _gpt_neo_both_ways(device):
    import acco.loss

    acco.loss.CHUNK_POSITIONS = 32  # 4 x 32 positions per micro-batch: four chunks
    common = dict(nb_steps_tot=12, use_mixed_precision=True, learning_rate=1e-2, scheduler_name="constant",
                  n_grad_accumulation=1, compile=True)
    runs = {}
    for method in METHODS:
        for scope in ("blocks", "model"):
            cfg = config(method=method, compile_scope=scope, **common)
            runs[method, scope, None] = _train_gpt_neo(device, cfg)
            graphed = dataclasses.replace(cfg, compile_mode=GRAPHS)
            runs[method, scope, GRAPHS], skips, roots = _graphed(lambda c=graphed: _train_gpt_neo(device, c))
            runs[method, scope, "graphs"] = (skips, roots)
    return runs


@pytest.mark.parametrize("on", [pytest.param(*ON_CPU.values, marks=pytest.mark.slow, id="gloo-cpu"), ON_GPU])
def test_gpt_neo_in_bf16_trains_alike_with_and_without_cuda_graphs(on):
    runs = run_one_rank(on, _gpt_neo_both_ways)
    for method in METHODS:
        for scope in ("blocks", "model"):
            _as_expected(on, *runs[method, scope, "graphs"])
            (_, plain, plain_records, _), (_, graphed, graphed_records, _) = (
                runs[method, scope, mode] for mode in (None, GRAPHS))
            losses = [torch.tensor([r[0] for r in records]) for records in (plain_records, graphed_records)]
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(graphed, plain, rtol=1e-2, atol=2e-3)
