"""The multi-GPU check: on a machine with two or more GPUs, 2 processes on NCCL check what the gloo
tests check. Elsewhere every test skips with its reason. Run it with

    .venv/bin/python -m pytest -q tests/test_cuda.py -rs

- ddp and acco, in fp32, equal the plain single-process references (acco_bench/reference.py);
- every rank ends with the same parameters after several updates;
- the overlap is real: a sleep put on the comm side stream in every round (torch.cuda._sleep, as
  acco-bench gpu does) lets compute go on (many micro-batches per round), the same sleep on the
  compute stream (the control) does not (overlap_helpers.py); test_cuda_one_gpu.py runs it on one GPU.

The processes set TORCH_NCCL_HIGH_PRIORITY=1 before their NCCL group, as acco's init_distributed
does: the group's own stream (async collectives; before torch 2.8 synchronous ones too) is then
as high-priority as the comm round's side stream.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed import free_port
from engine_helpers import Reference, assert_close, config, loss_fn, make_model, reference_acco
from overlap_helpers import OVERLAP_UPDATES, assert_overlap, device_stream, overlap_run

WORLD = 2


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (a CPU-only torch build or no GPU visible)"
    if torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} GPUs, {torch.cuda.device_count()} visible"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _entry(rank: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_NCCL_HIGH_PRIORITY="1")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls, to compare with the CPU references
    dist.init_process_group(
        "nccl", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300), device_id=device
    )
    try:
        torch.save(fn(rank, device, *args), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_nccl(fn, *args) -> list:
    """fn(rank, device, *args) on 2 NCCL processes, one GPU each; the per-rank results (on the CPU)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(free_port(), fn, args, out_dir), nprocs=WORLD, start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def _train(rank, device, kind, cfgs):
    from acco.engine import build_engine

    out = []
    for cfg in cfgs:
        model = make_model(kind).to(device)
        engine = build_engine(model, cfg)
        records = list(engine.run(device_stream(kind, rank, device, WORLD), loss_fn))
        engine.close()
        theta = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
        out.append((theta, [(r.step, r.loss, r.micro_batches) for r in records]))
    return out


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_ddp_and_acco_equal_their_references_on_nccl(kind):
    n, updates = 2, 6
    budget = n * WORLD * updates
    cfgs = [
        config(method="ddp", n_grad_accumulation=n, nb_steps_tot=budget),
        config(method="acco", n_grad_accumulation=n // 2, nb_steps_tot=budget, acco_estimate="paper"),
    ]
    results = run_nccl(_train, kind, cfgs)
    for (theta, _), (theta0, _) in zip(results[1], results[0]):
        assert torch.equal(theta, theta0), "the ranks' parameters differ after training"
    (ddp, ddp_rec), (acco, acco_rec) = results[0]
    ref = Reference(kind, cfgs[0], WORLD, [n] * WORLD)
    assert_close(ddp, ref.ddp(updates), "ddp on NCCL vs AdamW on the global batches")
    assert_close(torch.tensor([loss for _, loss, _ in ddp_rec]), torch.tensor(ref.losses), "ddp losses")
    ref = Reference(kind, cfgs[1], WORLD, [n // 2] * WORLD)
    assert_close(acco, reference_acco(ref, updates), "acco on NCCL vs the estimate/update reference")
    assert [mb for _, _, mb in acco_rec] == [[n] * WORLD] * updates


def test_the_overlap_is_real_with_a_delayed_side_stream():
    side = run_nccl(overlap_run, 50.0, True)
    control = run_nccl(overlap_run, 50.0, False)
    assert torch.equal(side[0][0], side[1][0]), "the ranks' parameters differ after training"
    assert len(side[0][1]) == len(side[1][1]) == OVERLAP_UPDATES
    assert_overlap(side[0][1], control[0][1])
