"""estimate_comm=int8 (acco/engine/quantize.py): acco's engine against a plain reference that
quantizes the estimate round alone, with the bytes it sends (the quantizer on its own:
tests/test_quantize.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from engine_helpers import Reference, assert_close, config, loss_fn, make_model, stream
from int8_helpers import BLOCK, engine_order, reference_int8, train_counting
from torch.nn.utils import parameters_to_vector

from acco.engine import build_engine, collectives
from acco.engine import quantize as qz
from acco.engine.comm import N_SENT, RoundKind


def _configs(updates, world, **kw):
    k = 2
    int8 = config(
        method="acco", n_grad_accumulation=k, nb_steps_tot=2 * k * world * updates, estimate_comm="int8", **kw
    )
    return [int8, config(method="acco", n_grad_accumulation=k, nb_steps_tot=int8.nb_steps_tot,
                         acco_estimate="paper", estimate_comm="int8", **kw)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_engine_equals_the_quantized_reference(world):
    kind, updates = "mlp", 5
    cfgs = _configs(updates, world)
    if world == 1:
        results = [train_counting(0, 1, kind, cfgs, BLOCK)]
    else:
        results = run_distributed(train_counting, world, kind, cfgs, BLOCK)
    qz.BLOCK = 2048  # (the in-process run set it)
    numel = sum(p.numel() for p in make_model(kind).parameters())
    shard = -(-numel // world)
    order = engine_order(make_model(kind))
    for cfg, (params, records, rounds, estimates, _) in zip(cfgs, results[0]):
        bounds, ref_estimates = [], []
        expected = reference_int8(kind, cfg, world, updates, BLOCK, bounds, ref_estimates)
        assert len(records) == updates
        assert_close(params, expected, f"int8 estimate, {cfg.acco_estimate}, W={world}")
        # each estimate theta~ the model computed at is the reference's to float noise, but for the
        # rare element whose rounding float noise flips (by one quantum); unquantized, most differ
        assert len(estimates) == len(ref_estimates) == updates
        for t, (got, (want, unquantized, quantum)) in enumerate(zip(estimates, ref_estimates)):
            got = got[torch.argsort(order)]  # into the reference's order
            diff = (got - want).abs()
            assert (diff <= 1.01 * quantum + 1e-6).all() and int((diff > 1e-6).sum()) <= max(
                2, numel // 100
            ), (t, int((diff > 1e-6).sum()))
            assert int(((got - unquantized).abs() > 1e-6).sum()) > numel // 2, t
        # every quantized quantity within its bound (the reference checks its own rounds)
        assert bounds and max(ratio for _, ratio in bounds) <= 1.0, bounds
        # bytes this worker sent per round: the estimate's two int8 collectives, the update's exact ones
        est = 2 * (world - 1) * qz.row_bytes(shard, BLOCK)
        upd = 2 * (world - 1) * shard * 4
        assert rounds == [(RoundKind.ESTIMATE, est), (RoundKind.UPDATE, upd)] * updates
        if world > 1:
            assert est < 0.3 * upd
        # the quantization shows: the unquantized reference is not what the engine computed
        exact = Reference(kind, cfg, world, [cfg.n_grad_accumulation] * world).acco(
            updates, lean=cfg.acco_estimate == "lean")
        assert (params - exact).abs().max() > 1e-6
    for r in range(1, world):  # every worker holds the same parameters
        torch.testing.assert_close(results[r][0][0], results[0][0][0], rtol=0, atol=0)


@pytest.mark.parametrize("world", [1, 2])
def test_engine_in_bf16_equals_the_quantized_reference(world):
    """Mixed precision rounds in places fp32 does not: the payload is bf16, and theta~'s delta is taken
    against the bf16 parameters every worker holds, not against the fp32 master (whose delta the
    others, adding it to their bf16 copy, would get wrong by up to half a bf16 step)."""
    kind, updates = "mlp", 5
    cfgs = _configs(updates, world, use_mixed_precision=True)
    run = train_counting(0, 1, kind, cfgs, BLOCK) if world == 1 else None
    results = [run] if world == 1 else run_distributed(train_counting, world, kind, cfgs, BLOCK)
    qz.BLOCK = 2048  # (the in-process run set it)
    order = engine_order(make_model(kind))
    to_reference, numel, shard = torch.argsort(order), order.numel(), -(-order.numel() // world)
    for i, cfg in enumerate(cfgs):
        params, records, rounds, estimates, _ = results[0][i]
        master = torch.cat([results[r][i][4] for r in range(world)])[:numel][to_reference]
        bounds, ref_estimates = [], []
        expected = reference_int8(
            kind, cfg, world, updates, BLOCK, bounds, ref_estimates, dtype=torch.bfloat16
        )
        assert len(records) == updates
        # the committed fp32 master is the reference's, and the model holds it rounded to bf16
        assert_close(master, expected, f"int8 estimate in bf16, {cfg.acco_estimate}, W={world}")
        assert params.dtype == torch.bfloat16 and torch.equal(params, master.bfloat16())
        # each bf16 theta~ is the reference's, but for the rare element that float noise in the master
        # moves by one quantum or one bf16 step; unquantized, nearly every element differs
        assert len(estimates) == len(ref_estimates) == updates
        for t, (got, (want, unquantized, quantum)) in enumerate(zip(estimates, ref_estimates)):
            assert got.dtype == torch.bfloat16
            got = got.float()[to_reference]
            diff = (got - want).abs()
            assert (diff <= 1.01 * quantum + 2.0**-7 * want.abs() + 1e-6).all(), t
            assert int((diff > 0).sum()) <= max(2, numel // 100), (t, int((diff > 0).sum()))
            assert int(((got - unquantized).abs() > 1e-6).sum()) > numel // 2, t
        # the gradient's and theta~'s errors within their bounds (theta~'s with its bf16 rounding)
        assert bounds and max(ratio for _, ratio in bounds) <= 1.0, bounds
        # bytes per round: the estimate's int8 collectives as in fp32, the update's in 2-byte elements
        est = 2 * (world - 1) * qz.row_bytes(shard, BLOCK)
        assert (
            rounds == [(RoundKind.ESTIMATE, est), (RoundKind.UPDATE, 2 * (world - 1) * shard * 2)] * updates
        )
    for r in range(1, world):  # every worker holds the same parameters
        torch.testing.assert_close(results[r][0][0], results[0][0][0], rtol=0, atol=0)


# ---- the native collectives' path (nccl), run on gloo ------------------------------------------

_COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
                "all_gather_single", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single", "barrier", "all_to_all", "all_to_all_single", "send", "recv",
                "isend", "irecv", "batch_isend_irecv", "all_gather_object",
                "broadcast_object_list")  # fmt: skip


def _describe(name, args, kw, rank):
    """(name, per tensor argument (dtype, numel, contiguous), the all-to-all's split sizes, whether a
    gather's input is the output's own slice ``rank``, whether an all-to-all's buffers overlap)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    splits, aliased, overlap = None, None, None
    if name == "all_to_all_single":
        splits = (kw.get("output_split_sizes", args[2] if len(args) > 2 else None),
                  kw.get("input_split_sizes", args[3] if len(args) > 3 else None))
        (o, i), span = tensors[:2], lambda t: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        overlap = span(o)[0] < span(i)[1] and span(i)[0] < span(o)[1]
    if name in ("all_gather_single", "all_gather_into_tensor"):
        o, i = tensors[:2]
        aliased = i.data_ptr() == o.data_ptr() + rank * i.numel() * i.element_size()
    return name, tuple((t.dtype, t.numel(), t.is_contiguous()) for t in tensors), splits, aliased, overlap


def _native_path(rank, world, cfg, block):
    """Every rank: train with collectives.uses_ring as on gloo (the p2p ring), then patched to say no
    (the native collectives nccl takes); final parameters and, per round, its kind and every
    torch.distributed call it issued."""
    qz.BLOCK = block
    state = {"calls": None, "depth": 0}

    def wrap(name, fn):
        def recorded(*args, **kw):
            if state["calls"] is None or state["depth"]:  # outside a round, or called by a recorded one
                return fn(*args, **kw)
            state["calls"].append(_describe(name, args, kw, rank))
            state["depth"] += 1
            try:
                return fn(*args, **kw)
            finally:
                state["depth"] -= 1

        return recorded

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    out, ring = [], collectives.uses_ring
    for native in (False, True):
        collectives.uses_ring = (lambda *a, **k: False) if native else ring
        model = make_model("mlp")
        engine = build_engine(model, cfg)
        rounds, run = [], engine.comm.run

        def recorded_round(payload, stats, new_params, kind, *args, run=run, rounds=rounds):
            rounds.append((kind, []))
            state["calls"] = rounds[-1][1]
            try:
                return run(payload, stats, new_params, kind, *args)
            finally:
                state["calls"] = None

        engine.comm.run = recorded_round
        list(engine.run(stream("mlp", rank, world), loss_fn))
        engine.close()
        out.append((parameters_to_vector(model.parameters()).detach(), rounds))
    collectives.uses_ring = ring
    return out


def test_native_collectives_path_as_on_nccl():
    """On nccl collectives.all_gather calls the native all-gather, not gloo's ring: pinned on gloo by
    patching uses_ring. The estimate round must then issue one all-to-all of int8 with equal splits
    (contiguous, send and receive apart: nccl has no in-place all-to-all), the statistics'
    all-gather and one int8 all-gather whose input is this rank's own row of the output (nccl's
    in-place all-gather), nothing else; the update round's all-gather is in place too (the new
    shard is written into its own slice of the output); and train as the ring does."""
    world, updates = 2, 3
    cfg = _configs(updates, world)[0]
    results = run_distributed(_native_path, world, cfg, BLOCK)
    shard = -(-sum(p.numel() for p in make_model("mlp").parameters()) // world)
    row = qz.row_bytes(shard, BLOCK)
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    i8, f32, f64 = torch.int8, torch.float32, torch.float64
    # (name, (dtype, numel, contiguous) per tensor, all-to-all splits, input is own slice, buffers overlap)
    a2a = ("all_to_all_single", ((i8, world * row, True), (i8, world * row, True)), (None, None), None, False)
    stats = (gather, ((f64, world * N_SENT, True), (f64, N_SENT, True)), None, False, None)
    estimate = [a2a, stats, (gather, ((i8, world * row, True), (i8, row, True)), None, True, None)]
    update = [(scatter, ((f32, shard, True), (f32, world * shard, True)), None, None, None), stats,
              (gather, ((f32, world * shard, True), (f32, shard, True)), None, True, None)]
    for rank, ((ring_params, ring_rounds), (params, rounds)) in enumerate(results):
        assert [kind for kind, _ in rounds] == [RoundKind.ESTIMATE, RoundKind.UPDATE] * updates
        for t, (kind, calls) in enumerate(rounds):
            assert calls == (estimate if kind is RoundKind.ESTIMATE else update), (rank, t, calls)
        # the ring's estimate rounds instead: the same all-to-all and statistics, then the int8 rows by p2p
        for kind, calls in ring_rounds[::2]:
            assert kind is RoundKind.ESTIMATE and calls[:2] == estimate[:2]
            assert [c[:2] for c in calls[2:]] == [
                ("irecv", ((i8, row, True),)),
                ("isend", ((i8, row, True),)),
            ]
        # the same training (every sum at W = 2 is one addition, whichever collective makes it), on every rank
        assert torch.equal(params, ring_params) and torch.equal(params, results[0][1][0])
    assert_close(
        results[0][1][0], reference_int8("mlp", cfg, world, updates, BLOCK), "int8, native collectives"
    )
