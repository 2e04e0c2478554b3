"""Ring reduce-scatter / all-gather on gloo against torch's own collectives, multi-process."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch
import torch.distributed as dist
from distributed import free_port, start_workers

from acco.engine import collectives
from acco.engine.collectives import all_gather, reduce_scatter, uses_ring

# torch 2.13 renamed the flat collectives and deprecated the old names
_native_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_native_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

SIZES = (1, 7, 4099)  # elements per rank
DTYPES = (torch.float32, torch.bfloat16)


def _inputs(rank: int, world: int, n: int, dtype: torch.dtype, integer: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * world + 10 * rank + n)
    if integer:  # small integers: every summation order is exact, even in bf16
        return torch.randint(-8, 9, (world * n,), generator=g).to(dtype)
    return torch.randn(world * n, generator=g).to(dtype)


def _check_group(group, rank: int, world: int) -> None:
    """Every check, for the calling rank (its rank ``rank`` in ``group`` of size ``world``)."""
    for dtype in DTYPES:
        for n in SIZES:
            # reduce-scatter against torch's, and against an fp32 sum
            x = _inputs(rank, world, n, dtype)
            x_copy = x.clone()
            out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            reduce_scatter(out, x, group=group)
            _native_rs(ref, x, group=group)
            assert torch.equal(x, x_copy), "input was modified"
            full = torch.stack([_inputs(r, world, n, dtype).float() for r in range(world)]).sum(0)
            exact = full[rank * n:(rank + 1) * n]
            if dtype == torch.float32:
                torch.testing.assert_close(out, ref)
                torch.testing.assert_close(out, exact)
            else:  # bf16 sums in bf16 in another order: a few bf16 ulps
                torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=3e-2)
                torch.testing.assert_close(out.float(), exact, rtol=2e-2, atol=3e-2)

            # exact integers: bit-identical to torch's
            xi = _inputs(rank, world, n, dtype, integer=True)
            reduce_scatter(out, xi, group=group)
            _native_rs(ref, xi, group=group)
            assert torch.equal(out, ref)

            # in place: output is this rank's own slice of the input
            xin = xi.clone()
            reduce_scatter(xin[rank * n:(rank + 1) * n], xin, group=group)
            assert torch.equal(xin[rank * n:(rank + 1) * n], ref)

            # all-gather: bit-identical (no arithmetic), also in place
            g_out, g_ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
            shard = _inputs(rank, world, n, dtype)[:n]
            all_gather(g_out, shard, group=group)
            _native_ag(g_ref, shard, group=group)
            assert torch.equal(g_out, g_ref)
            g_in = torch.zeros(world * n, dtype=dtype)
            g_in[rank * n:(rank + 1) * n] = shard
            all_gather(g_in, g_in[rank * n:(rank + 1) * n], group=group)
            assert torch.equal(g_in, g_ref)

            # 2-D output/input of the right numel are viewed flat
            out2 = torch.empty(1, n, dtype=dtype)
            reduce_scatter(out2, xi.view(world, n), group=group)
            assert torch.equal(out2.view(-1), ref)


def _check_background_thread(group, rank: int, world: int) -> None:
    """The ring runs in a thread while the main thread computes; scratch is reused, not regrown."""
    n = 50_000
    x = _inputs(rank, world, n, torch.float32, integer=True)
    out, ref = torch.empty(n), torch.empty(n)
    _native_rs(ref, x, group=group)
    scratch_before = None
    results = []

    def comm():
        for _ in range(3):
            reduce_scatter(out, x, group=group)
            results.append(torch.equal(out, ref))

    a = torch.randn(256, 256)
    reduce_scatter(out, x, group=group)  # allocates the scratch for this size
    scratch_before = len(collectives._scratch)
    t = threading.Thread(target=comm)
    t.start()
    for _ in range(20):
        a = torch.tanh(a @ a)
    t.join()
    assert results == [True, True, True]
    assert len(collectives._scratch) == scratch_before


def _worker(rank: int, world: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a broken ring fails, not hangs
    try:
        assert uses_ring(None, "cpu")
        _check_group(None, rank, world)
        _check_background_thread(None, rank, world)
        if world == 3:
            # sub-group {0, 2}: group ranks 0, 1 are global 0, 2 (p2p needs the global ranks)
            sub = dist.new_group([0, 2])
            single = dist.new_group([1])
            if rank in (0, 2):
                _check_group(sub, dist.get_rank(sub), 2)
                _check_background_thread(sub, dist.get_rank(sub), 2)
            else:
                # not a member of `sub`: a no-op, as torch's collectives
                out = torch.full((3,), -1.0)
                reduce_scatter(out, torch.ones(6), group=sub)
                all_gather(torch.ones(6), out, group=sub)
                assert torch.equal(out, torch.full((3,), -1.0))
                # world size 1: plain copies
                y, o = torch.arange(5.0), torch.empty(5)
                reduce_scatter(o, y, group=single)
                assert torch.equal(o, y)
                o2 = torch.empty(5)
                all_gather(o2, y, group=single)
                assert torch.equal(o2, y)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ring_matches_torch(world):
    start_workers(_worker, world, (world, free_port()))


def test_shape_errors_without_process_group():
    with pytest.raises(ValueError):
        collectives._check(torch.empty(3), torch.empty(7), 2, scatter=True)
    with pytest.raises(ValueError):
        collectives._check(torch.empty(7), torch.empty(3), 2, scatter=False)
    with pytest.raises(TypeError):
        collectives._check(torch.empty(3), torch.empty(6, dtype=torch.bfloat16), 2, scatter=True)
