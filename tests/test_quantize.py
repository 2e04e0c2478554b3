"""estimate_comm=int8's quantizer (acco/engine/quantize.py), on one process: the round trip and its
bound, the packed rows a worker sends, and the setting's validation. The engine with it, against a
plain reference: tests/test_estimate_int8.py."""

from __future__ import annotations

import pytest
import torch

from acco.engine import ConfigError, EngineConfig
from acco.engine import quantize as qz


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
    assert (
        qz.row_bytes(n) == 4 * 1 + 1000 and qz.row_bytes(1001) == 4 + 1004 and qz.row_bytes(5000) == 12 + 5000
    )
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_is_the_written_out_formula_bit_for_bit(dtype):
    """quantize_ against the formula written out block by block, element for element: q =
    round(x / s) (ties to even), s = amax|x| / 127, on a zero block, a NaN block, an inf block, exact
    ties and a short last block. A faster kernel must not move one rounding: the int8 references of
    tests/test_estimate_int8.py call the engine's own quantizer."""
    gen = torch.Generator().manual_seed(3)
    n, block = 5 * 2048 + 300, 2048
    x = (torch.randn(n, generator=gen) * torch.logspace(-4, 2, n)).to(dtype)
    x[2048:4096] = 0.0
    x[4096 + 7] = float("nan")
    x[6144 + 9] = float("-inf")
    x[8192:10240].clamp_(-1.0, 1.0)
    x[8192:8195] = torch.tensor([-127.0, 2.5, -3.5])  # s = 1 exactly: 2.5 -> 2, -3.5 -> -4
    x[10240 + 5] = -1000.0  # the short block's largest magnitude is negative
    q, scales = torch.empty(n, dtype=torch.int8), torch.empty(qz.n_blocks(n, block))
    qz.quantize_(x, q, scales, torch.empty(n), block)
    for b, start in enumerate(range(0, n, block)):
        xb = x[start : start + block].float()
        s = xb.abs().max() / 127
        assert torch.equal(scales[b], s) or (s.isnan() and scales[b].isnan()), b
        if not torch.isfinite(s):  # the block reads back as NaN whatever q holds
            continue
        expected = torch.zeros_like(xb) if s == 0 else torch.round(xb / s)
        assert torch.equal(q[start : start + block].float(), expected), b
    assert q[8192:8195].tolist() == [-127, 2, -4]
    assert q[10240 + 5] == -127
    if dtype == torch.float32:  # the work buffer may be the input itself (the all-gather's delta)
        y, q2, scales2 = x.clone(), torch.empty_like(q), torch.empty_like(scales)
        qz.quantize_(y, q2, scales2, y, block)
        assert torch.equal(q2, q) and torch.equal(scales2.nan_to_num(), scales.nan_to_num())
