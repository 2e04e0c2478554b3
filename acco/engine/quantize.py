"""int8 with per-block scales, for acco's estimate round (``estimate_comm: int8``; docs/algorithm.md,
"The cheap estimate round").

A vector is cut into blocks of ``BLOCK`` elements (the last one may be shorter); block b is sent
as ``q = clamp(round(x / s_b), -127, 127)`` (int8) with its fp32 scale ``s_b = amax_b / 127``
(amax_b: the block's largest magnitude) and read back as ``q * s_b``. Per element
``|x - q s_b| <= s_b (1/2 + 2^-16)``: half a quantum, plus the fp32 roundings of the division and
the product (each at most 127 s_b 2^-24) -- about ``amax_b / 254``. A block of zeros has scale 0
and reads back as zeros; a NaN or inf in a block makes its scale non-finite, so the block reads
back as NaN (a broken gradient is not hidden).

The kernels are flat tensor operations on a ``[blocks, BLOCK]`` view (the short last block is a
second view), with preallocated outputs. :class:`Int8EstimateComm` runs the estimate round's two
collectives on them, with buffers allocated once:

* reduce-scatter: each worker quantizes its whole payload, shard by shard (blocks are per shard),
  and one all-to-all gives worker W the W int8 copies of its shard with their scales, which it
  dequantizes and sums in fp32 (rank order): each worker's quantization error enters once, none
  piles up along a ring (DeepSpeed ZeRO++'s qgZ);
* all-gather: the delta ``theta~_{t+1} - theta_t`` of this worker's shard, quantized, is gathered
  and added to the ``theta_t`` that every worker holds (its model parameters during the round).

What one worker sends per estimate round: ``2 (W - 1) row_bytes(S)`` with ``S`` the shard size,
``row_bytes(S) = 4 ceil(S / BLOCK) + 4 ceil(S / 4)`` (scales, then int8 elements padded to 4
bytes), against ``2 (W - 1) S e`` for the full round (``e``: the model dtype's bytes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from acco.engine import collectives

__all__ = ["BLOCK", "Int8EstimateComm", "Packed", "dequantize_", "error_bound", "fake_quantize", "n_blocks",
           "quantize_", "row_bytes"]

BLOCK = 2048
QMAX = 127


def n_blocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


def row_bytes(n: int, block: int = BLOCK) -> int:
    """Bytes of one packed row of ``n`` elements: fp32 scales, int8 elements, zero padding to 4 bytes."""
    return 4 * n_blocks(n, block) + 4 * -(-n // 4)


def _parts(n: int, block: int):
    """(element slice, block slice, [blocks, block] shape) of the full blocks and of the short last one."""
    full = n // block
    if full:
        yield slice(0, full * block), slice(0, full), (full, block)
    if full * block < n:
        yield slice(full * block, n), slice(full, full + 1), (1, n - full * block)


def quantize_(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, work: torch.Tensor, block: int = BLOCK
) -> None:
    """``q`` (int8, ``n``) and ``scales`` (fp32, ``n_blocks(n)``) of ``x`` (``n`` elements, any float
    dtype). ``work``: an fp32 scratch of ``n`` elements, which may be ``x`` itself (then ``x`` is
    overwritten)."""
    for xs, bs, shape in _parts(x.numel(), block):
        xb, s = x[xs].view(shape), scales[bs]
        # amax and amin, two passes: torch.aminmax over the rows took 20x as long on a CPU (1.0
        # against 0.05 ms on 465k elements), the most of the whole quantization
        hi, lo = torch.amax(xb, dim=1), torch.amin(xb, dim=1)
        torch.maximum(hi.float(), lo.float().neg_(), out=s)
        s.div_(QMAX)
        safe = torch.where(s == 0, 1.0, s)  # a zero block: q = 0 (NaN stays NaN)
        w = work[xs].view(shape)
        torch.div(xb, safe.unsqueeze(1), out=w)
        w.round_().clamp_(-QMAX, QMAX)
        q[xs].view(shape).copy_(w)


def dequantize_(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int = BLOCK) -> None:
    """``out`` (fp32, ``n``) = ``q * scale`` of its block."""
    for xs, bs, shape in _parts(q.numel(), block):
        torch.mul(q[xs].view(shape), scales[bs].unsqueeze(1), out=out[xs].view(shape))


def fake_quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(what ``x`` reads back as after a round trip, in fp32; its block scales). Allocates: for tests
    and references."""
    n = x.numel()
    q = torch.empty(n, dtype=torch.int8, device=x.device)
    scales = torch.empty(n_blocks(n, block), dtype=torch.float32, device=x.device)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    quantize_(x.reshape(-1), q, scales, out, block)
    dequantize_(q, scales, out, block)
    return out, scales


def error_bound(scales: torch.Tensor, n: int, block: int = BLOCK) -> torch.Tensor:
    """Per element of a vector of ``n``: the round trip's bound ``s_b (1/2 + 2^-16)``."""
    return (scales.abs() * (0.5 + 2.0**-16)).repeat_interleave(block)[:n]


class Packed:
    """``rows`` packed rows of ``n`` elements in one contiguous buffer, each row one message:
    ``scales`` (fp32, ``[rows, n_blocks]``), then ``data`` (int8, ``[rows, n]``), then zeros up to a
    multiple of 4 bytes; ``raw`` is the whole buffer as int8, ``[rows, row_bytes(n)]``."""

    def __init__(self, rows: int, n: int, device: torch.device, block: int = BLOCK):
        nb = n_blocks(n, block)
        self.words = torch.zeros(rows, row_bytes(n, block) // 4, dtype=torch.float32, device=device)
        self.raw = self.words.view(torch.int8)
        self.scales = self.words[:, :nb]
        self.data = self.raw[:, 4 * nb : 4 * nb + n]


class Int8EstimateComm:
    """The estimate round's reduce-scatter and all-gather in int8 for one worker (its buffers:
    two packed ``[W, S]`` buffers, about 2 P bytes, and one fp32 shard, 4 P / W bytes)."""

    def __init__(self, world_size: int, rank: int, shard_numel: int, device: torch.device, group,
                 block: int = BLOCK):
        self.world, self.rank, self.n, self.group, self.block = world_size, rank, shard_numel, group, block
        self.send = Packed(world_size, shard_numel, device, block)  # row r: this worker's part of shard r
        self.recv = Packed(world_size, shard_numel, device, block)  # row w: from worker w
        self.work = torch.empty(shard_numel, dtype=torch.float32, device=device)

    def reduce_scatter(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (fp32 shard) = sum over workers of their dequantized part of this shard."""
        rows = payload.view(self.world, self.n)
        for r in range(self.world):
            quantize_(rows[r], self.send.data[r], self.send.scales[r], self.work, self.block)
        # issued at world size 1 too (NCCL runs a one-rank communicator); no group: a copy
        if dist.is_initialized():
            dist.all_to_all_single(self.recv.raw, self.send.raw, group=self.group)
        else:
            self.recv.raw.copy_(self.send.raw)
        for w in range(self.world):
            target = out if w == 0 else self.work
            dequantize_(self.recv.data[w], self.recv.scales[w], target, self.block)
            if w:
                out.add_(self.work)

    def all_gather_delta(
        self, new_params: torch.Tensor, estimate: torch.Tensor, params: torch.Tensor
    ) -> None:
        """``new_params`` = ``params`` (theta_t, held by every worker, model dtype) + the gathered,
        dequantized deltas ``estimate - theta_t`` of every shard (``estimate``: this worker's fp32
        shard of theta~_{t+1}). The delta is taken against this worker's shard of ``params``, the
        base every worker adds to (in fp32 it is the master shard itself)."""
        base, out = params.view(self.world, self.n), new_params.view(self.world, self.n)
        torch.sub(estimate, base[self.rank], out=self.work)
        buf = self.recv
        quantize_(self.work, buf.data[self.rank], buf.scales[self.rank], self.work, self.block)
        collectives.all_gather(buf.raw.view(-1), buf.raw[self.rank], group=self.group)
        for w in range(self.world):
            dequantize_(buf.data[w], buf.scales[w], self.work, self.block)
            torch.add(base[w], self.work, out=out[w])
