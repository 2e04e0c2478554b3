"""Bandwidth-optimal reduce-scatter and all-gather for flat tensors, on gloo as well as nccl.

Gloo's ``reduce_scatter_tensor`` moves as many bytes as a full all-reduce (about twice what a
reduce-scatter needs), and its ``all_gather_into_tensor`` is slower than a ring too (measured in
``acco_bench.collectives_bench``). On gloo these functions therefore run a ring of point-to-point
``isend``/``irecv``: ``world - 1`` steps, each sending one chunk (``numel / world`` elements) to
the next rank while receiving one from the previous rank, so every rank sends and receives
``(world - 1) / world`` of the tensor, the minimum. On other backends (nccl) they call
``dist.reduce_scatter_tensor`` / ``dist.all_gather_into_tensor``, which are already
bandwidth-optimal.

Both functions are synchronous and may be called from a background thread while the main thread
computes, provided no other collective or point-to-point operation runs concurrently on the same
group. The reduce-scatter sums in the input dtype (bf16 stays bf16, as NCCL does), using two
scratch chunks that are allocated once per (group, chunk numel, dtype, device) and then reused;
:func:`clear_scratch` frees them. The all-gather needs no scratch: it receives straight into the
output's slices.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

__all__ = ["all_gather", "clear_scratch", "reduce_scatter", "uses_ring"]

# Tag of the ring's point-to-point messages; a user's own p2p on the same group with tag 0 cannot
# be matched with ours by mistake.
_TAG = 0xACC0

_scratch_lock = threading.Lock()
_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def clear_scratch() -> None:
    """Free the cached scratch buffers of :func:`reduce_scatter`."""
    with _scratch_lock:
        _scratch.clear()


def _get_scratch(group, numel: int, dtype: torch.dtype, device: torch.device):
    # The group is part of the key so that calls on two different groups running concurrently
    # (e.g. from two threads) never share a buffer; within one group calls are sequential.
    key = (id(group), numel, dtype, device)
    with _scratch_lock:
        bufs = _scratch.get(key)
        if bufs is None:
            bufs = (torch.empty(numel, dtype=dtype, device=device),
                    torch.empty(numel, dtype=dtype, device=device))
            _scratch[key] = bufs
        return bufs


def _backend_for(group, device: torch.device) -> str:
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # e.g. "cpu:gloo,cuda:nccl"
        mapping = dict(item.split(":", 1) for item in backend.split(","))
        return mapping.get(device.type, "")
    return backend


def uses_ring(group=None, device: torch.device | str = "cpu") -> bool:
    """Whether :func:`reduce_scatter`/:func:`all_gather` run the p2p ring (gloo, CPU tensors) for
    tensors on ``device`` in ``group``, rather than the backend's own collective."""
    device = torch.device(device)
    return device.type == "cpu" and _backend_for(group, device) == "gloo"


def _native(name: str, old_name: str):
    # torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single and
    # deprecated the old names; older torch only has the old ones.
    return getattr(dist, name, None) or getattr(dist, old_name)


def _flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t.view(-1)


def _check(output: torch.Tensor, input: torch.Tensor, world: int, scatter: bool) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"output dtype {output.dtype} != input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"output on {output.device}, input on {input.device}")
    big, small = (input, output) if scatter else (output, input)
    if big.numel() != world * small.numel():
        what = "input" if scatter else "output"
        raise ValueError(f"{what}.numel() = {big.numel()} must be world size ({world}) x "
                         f"{small.numel()}")


def _copy(output: torch.Tensor, input: torch.Tensor) -> None:
    """One rank's collective: the output is the input (in place when they are one memory)."""
    if output.data_ptr() != input.data_ptr():
        output.view(-1).copy_(input.view(-1))


def _ring_peers(group, rank: int, world: int) -> tuple[int, int]:
    """Global ranks of the next and previous group ranks (p2p calls take global ranks)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if group is None or group is dist.GroupMember.WORLD:
        return nxt, prv
    return dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)


def _exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group) -> None:
    # The receive is posted FIRST: gloo's isend to a peer that has already posted its receive
    # writes the whole message from the calling thread before returning, so with the send first
    # both ranks of a 2-rank ring could post their receives only after their sends, and the two
    # directions ran one after the other (measured: 2x the time, at 100 Mbit/s, for every call).
    reqs = [dist.irecv(recv, prv, group=group, tag=_TAG), dist.isend(send, nxt, group=group, tag=_TAG)]
    try:
        for r in reqs:
            r.wait()
    except RuntimeError as e:  # timeout or closed connection: say which peers were involved
        raise RuntimeError(
            f"ring exchange failed (receiving from rank {prv}, sending to rank {nxt}): a worker died or "
            f"stalled, not necessarily one of these (in a ring every rank waits on its neighbour). "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from e


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Sum ``input`` over the ranks of ``group`` and leave slice ``rank`` of the sum in ``output``.

    ``input`` is a contiguous tensor of ``world * output.numel()`` elements, viewed flat; rank
    ``r`` (its rank in ``group``) receives elements ``[r * n, (r + 1) * n)``, ``n = output.numel()``.
    ``input`` is not modified; ``output`` may be a view of ``input``'s own slice. Same semantics
    as ``dist.reduce_scatter_tensor(output, input, op=SUM, group=group)``.
    """
    if not dist.is_initialized():  # one process, no group: the sum is its own input
        _check(output, input, 1, scatter=True)
        return _copy(output, input)
    if dist.get_rank(group) < 0:  # not a member, as torch's collectives do
        return
    world = dist.get_world_size(group)
    _check(output, input, world, scatter=True)
    if not uses_ring(group, input.device):  # NCCL: also on one rank (its communicator copies)
        _native("reduce_scatter_single", "reduce_scatter_tensor")(output, input, group=group)
        return
    if world == 1:
        return _copy(output, input)
    out, inp = _flat(output, "output"), _flat(input, "input")
    rank, n = dist.get_rank(group), out.numel()
    if n == 0:
        return
    chunks = inp.view(world, n)
    nxt, prv = _ring_peers(group, rank, world)
    send_buf, recv_buf = _get_scratch(group, n, inp.dtype, inp.device)
    # Step s sends the partial sum of chunk (rank - s - 1) to the next rank and receives the
    # partial sum of chunk (rank - s - 2) from the previous one, adding this rank's share. After
    # world - 1 steps the chunk received last is chunk `rank`, summed over every rank.
    send = chunks[(rank - 1) % world]  # step 0 sends this rank's own share, no copy
    for step in range(world - 1):
        _exchange(send, recv_buf, nxt, prv, group)
        idx = (rank - step - 2) % world
        if step == world - 2:
            torch.add(recv_buf, chunks[idx], out=out)
        else:
            torch.add(recv_buf, chunks[idx], out=send_buf)
            send = send_buf


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Concatenate every rank's ``input`` into ``output`` in rank order (rank ``r``'s ``input``
    lands in slice ``r``): the inverse of :func:`reduce_scatter`, with the semantics of
    ``dist.all_gather_into_tensor(output, input, group=group)``. ``input`` may be a view of
    ``output``'s own slice (in-place all-gather)."""
    if not dist.is_initialized():
        _check(output, input, 1, scatter=False)
        return _copy(output, input)
    if dist.get_rank(group) < 0:
        return
    world = dist.get_world_size(group)
    _check(output, input, world, scatter=False)
    if not uses_ring(group, input.device):
        _native("all_gather_single", "all_gather_into_tensor")(output, input, group=group)
        return
    if world == 1:
        return _copy(output, input)
    out, inp = _flat(output, "output"), _flat(input, "input")
    rank, n = dist.get_rank(group), inp.numel()
    if n == 0:
        return
    chunks = out.view(world, n)
    if chunks[rank].data_ptr() != inp.data_ptr():
        chunks[rank].copy_(inp)
    nxt, prv = _ring_peers(group, rank, world)
    # Step s forwards chunk (rank - s), received the step before (or this rank's own at s = 0),
    # and receives chunk (rank - s - 1) straight into its place in the output.
    for step in range(world - 1):
        _exchange(chunks[(rank - step) % world], chunks[(rank - step - 1) % world], nxt, prv, group)


def all_gather_small(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """torch's own all-gather into one tensor, for a few numbers (latency-bound: one call, no ring)."""
    if not dist.is_initialized():
        return _copy(output, input)
    _native("all_gather_single", "all_gather_into_tensor")(output, input, group=group)


def any_worker(flag: bool, device: torch.device, group=None, label: str = "the start of training") -> bool:
    """Whether any worker of `group` raised `flag`: one all-reduce, read on the host (progress marks
    `label` first, so that a rank that never joins it is named). Before training starts, once."""
    from acco.engine import progress

    raised = torch.tensor([float(flag)], device=device)
    progress.mark(label)
    dist.all_reduce(raised, group=group)
    return raised.item() > 0
