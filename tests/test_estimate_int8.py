"""estimate_comm=int8 (acco/engine/quantize.py): the quantizer's round trip and its bound, and acco's
engine against a plain reference that quantizes the estimate round alone, with the bytes it sends."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from engine_helpers import Reference, assert_close, config, loss_fn, make_model, stream

from acco.engine import ConfigError, EngineConfig, build_engine
from acco.engine import quantize as qz
from acco.engine.comm import RoundKind

BLOCK = 64  # the engine tests' block: several per shard, the last one short (the toy models have ~500 parameters)


# ---- the quantizer -------------------------------------------------------------------------------


def test_round_trip_within_bound_zero_blocks_and_short_last_block():
    gen = torch.Generator().manual_seed(0)
    n, block = 3 * 2048 + 300, 2048  # three full blocks and a short one
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 2, n).flip(0)
    x[2048:4096] = 0.0  # a block of zeros
    out, scales = qz.fake_quantize(x, block)
    assert scales.shape == (4,) and scales[1] == 0 and torch.isfinite(out).all()
    assert (out[2048:4096] == 0).all()
    amax = torch.stack([x[i : i + block].abs().max() for i in range(0, n, block)])
    torch.testing.assert_close(scales, amax / 127)
    bound = qz.error_bound(scales, n, block)
    assert ((x - out).abs() <= bound).all()
    assert ((x - out).abs() <= amax.repeat_interleave(block)[:n] / 254 * (1 + 1e-4)).all()  # ~ amax / 254
    assert (x - out).abs().max() > 0.3 * bound.max()  # the bound is not vacuous
    # the block's largest element reads back exactly as +-127 quanta
    q = torch.empty(n, dtype=torch.int8)
    qz.quantize_(x, q, torch.empty(4), torch.empty(n), block)
    assert q.abs().max() == 127 and q[2048:4096].abs().max() == 0
    # a NaN is not hidden: its block reads back as NaN, the others do not
    y = x.clone()
    y[10] = float("nan")
    back, _ = qz.fake_quantize(y, block)
    assert back[:2048].isnan().all() and not back[2048:].isnan().any()
    # bf16 input, shard shorter than a block
    z = torch.randn(100, generator=gen).bfloat16()
    back, s = qz.fake_quantize(z, block)
    assert s.shape == (1,) and ((z.float() - back).abs() <= qz.error_bound(s, 100, block)).all()


def test_packed_rows_and_one_worker_round_trip():
    n = 1000  # a shard shorter than a block, not a multiple of 4 bytes
    assert qz.row_bytes(n) == 4 * 1 + 1000 and qz.row_bytes(1001) == 4 + 1004 and qz.row_bytes(5000) == 12 + 5000
    comm = qz.Int8EstimateComm(1, 0, n, torch.device("cpu"), None)
    assert comm.send.raw.shape == (1, qz.row_bytes(n)) and comm.send.data.shape == (1, n)
    gen = torch.Generator().manual_seed(1)
    payload = torch.randn(n, generator=gen)
    out = torch.empty(n)
    comm.reduce_scatter(payload, out)
    expected, _ = qz.fake_quantize(payload)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    theta, estimate = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    estimate += theta
    new = torch.empty(n)
    comm.all_gather_delta(new, estimate, theta)
    delta, scales = qz.fake_quantize(estimate - theta)
    torch.testing.assert_close(new, theta + delta, rtol=0, atol=0)
    assert ((new - estimate).abs() <= qz.error_bound(scales, n) + 1e-6).all()


def test_config():
    assert EngineConfig().estimate_comm == "full"
    EngineConfig(method="acco", estimate_comm="int8")
    with pytest.raises(ConfigError, match="estimate_comm must be one of full, int8"):
        EngineConfig(estimate_comm="fp8")
    with pytest.raises(ConfigError, match="acco's estimate round only; method ddp"):
        EngineConfig(method="ddp", estimate_comm="int8")
    from acco.config import TrainArgs

    assert TrainArgs().estimate_comm == "full"


# ---- the engine against the plain reference --------------------------------------------------


def _engine_order(model) -> torch.Tensor:
    """Index, in parameters_to_vector's order, of each element of the engine's flat vector
    (FlatParams: the matrices first, then the vectors)."""
    spans, start = [], 0
    for p in model.parameters():
        spans.append((p.dim() >= 2, torch.arange(start, start + p.numel())))
        start += p.numel()
    return torch.cat([idx for big, idx in spans if big] + [idx for big, idx in spans if not big])


def reference_int8(kind, cfg, world, updates, block, bounds=None, estimates=None):
    """acco with the estimate round quantized as the engine does it, written out: the estimate's
    gradient is each worker's own sum, quantized shard by shard (blocks per shard) and summed in
    fp32; theta~ = theta_t + dequantized (theta~_exact - theta_t); the update round commits
    Opt(theta_t, exact mean of g~_t + g_t). ``bounds``: a list that receives, per estimate round,
    the largest error / bound ratio of the gradient and of the gathered estimate; ``estimates``:
    a list that receives (theta~ as gathered, theta~ before the all-gather's quantization, each
    element's quantum)."""
    counts = [cfg.n_grad_accumulation] * world
    ref = Reference(kind, cfg, world, counts)
    order = _engine_order(ref.model)
    numel = order.numel()
    shard = -(-numel // world)

    def shards(v):  # [W, S] in the engine's order, zero-padded
        out = torch.zeros(world * shard)
        out[:numel] = v[order]
        return out.view(world, shard)

    def back(u):
        v = torch.empty(numel)
        v[order] = u.reshape(-1)[:numel]
        return v

    def per_worker_grads(theta):
        chunk = ref.next_chunk()
        sums, start = [], 0
        for n in counts:
            sums.append(ref.grad_sum(theta, chunk[start : start + n])[0])
            start += n
        return sums

    def reduce_scatter(grads):
        total, bound = torch.zeros(world, shard), torch.zeros(world, shard)
        for g in grads:  # rank order, fp32
            for r, row in enumerate(shards(g)):
                q, s = qz.fake_quantize(row, block)
                total[r] += q
                bound[r] += qz.error_bound(s, shard, block)
        exact = shards(sum(grads))
        if bounds is not None:
            bounds.append(("grad", float(((total - exact).abs() / bound.clamp_min(1e-30)).max())))
        return back(total)

    def gather_delta(estimate, theta):
        out, base, quantum = torch.empty(world, shard), shards(theta), torch.empty(world, shard)
        for r, row in enumerate(shards(estimate) - base):
            q, s = qz.fake_quantize(row, block)
            out[r] = base[r] + q
            quantum[r] = s.repeat_interleave(block)[:shard]
            if bounds is not None:
                ratio = (out[r] - shards(estimate)[r]).abs() / (qz.error_bound(s, shard, block) + 1e-7)
                bounds.append(("estimate", float(ratio.max())))
        return back(out), back(quantum)

    lean = cfg.acco_estimate == "lean"
    theta = ref.theta()
    g_est = per_worker_grads(theta)  # warm start: g~_0 at theta_0
    n_est = sum(counts)
    error = torch.zeros_like(theta)
    for _ in range(updates):
        exact = ref.trial(theta, reduce_scatter(g_est), n_est, update_batch=n_est + sum(counts))
        if lean:
            exact = exact + 0.5 * error
        theta_est, quantum = gather_delta(exact, theta)
        if estimates is not None:
            estimates.append((theta_est, exact, quantum))
        g, _ = ref.grad_sum(theta, ref.next_chunk())  # g_t at theta_t, exact
        theta = ref.commit(theta, sum(g_est) + g, n_est + sum(counts))
        error = exact - theta
        g_est = per_worker_grads(theta_est)
    return theta


def _train(rank, world, kind, cfgs, block):
    """Every rank: train with each config; final parameters, records and the bytes this rank sent per
    round, by kind (the all-to-all and the ring's sends; the statistics' small all-gather apart)."""
    import torch.distributed as dist

    qz.BLOCK = block
    sent = {"bytes": 0}
    if world > 1:
        a2a, isend = dist.all_to_all_single, dist.isend

        def all_to_all_single(output, input, *args, **kw):
            sent["bytes"] += input.numel() * input.element_size() * (world - 1) // world
            return a2a(output, input, *args, **kw)

        def counted_isend(tensor, *args, **kw):
            sent["bytes"] += tensor.numel() * tensor.element_size()
            return isend(tensor, *args, **kw)

        dist.all_to_all_single, dist.isend = all_to_all_single, counted_isend
    out = []
    for cfg in cfgs:
        model = make_model(kind)
        engine = build_engine(model, cfg)
        rounds, estimates, run = [], [], engine.comm.run
        numel = sum(p.numel() for p in model.parameters())

        def counted(payload, stats, new_params, round_kind, *args, run=run, rounds=rounds, estimates=estimates,
                    numel=numel):
            sent["bytes"] = 0
            result = run(payload, stats, new_params, round_kind, *args)
            rounds.append((round_kind, sent["bytes"]))
            if round_kind is RoundKind.ESTIMATE:  # theta~ as every worker swaps it in (engine order)
                estimates.append(new_params[:numel].clone())
            return result

        engine.comm.run = counted
        records = list(engine.run(stream(kind, rank, world), loss_fn))
        engine.close()
        out.append((torch.nn.utils.parameters_to_vector(model.parameters()).detach(), records, rounds, estimates))
    return out


def _configs(updates, world):
    k = 2
    int8 = config(method="acco", n_grad_accumulation=k, nb_steps_tot=2 * k * world * updates, estimate_comm="int8")
    return [int8, config(method="acco", n_grad_accumulation=k, nb_steps_tot=int8.nb_steps_tot,
                         acco_estimate="paper", estimate_comm="int8")]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_engine_equals_the_quantized_reference(world):
    kind, updates = "mlp", 5
    cfgs = _configs(updates, world)
    if world == 1:
        results = [_train(0, 1, kind, cfgs, BLOCK)]
    else:
        results = run_distributed(_train, world, kind, cfgs, BLOCK)
    qz.BLOCK = 2048  # (the in-process run set it)
    numel = sum(p.numel() for p in make_model(kind).parameters())
    shard = -(-numel // world)
    order = _engine_order(make_model(kind))
    for cfg, (params, records, rounds, estimates) in zip(cfgs, results[0]):
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
            assert (diff <= 1.01 * quantum + 1e-6).all() and int((diff > 1e-6).sum()) <= max(2, numel // 100), \
                (t, int((diff > 1e-6).sum()))
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
