"""Shared by the GPU tests (test_cuda.py on 2+ GPUs, test_cuda_one_gpu.py on one): the overlap
check, acco with a sleep in every comm round on the side stream (the compute goes on) or on the
compute stream (the control: it does not), and the toy micro-batches on a device."""

from __future__ import annotations

import itertools
import time

import torch
from engine_helpers import config, loss_fn, make_model, micro_batch


def device_stream(kind: str, rank: int, device, world: int):
    """Worker `rank` reads global micro-batches rank, rank + W, ... (as the gloo tests), on `device`."""
    j = 0
    while True:
        x, y = micro_batch(kind, j * world + rank)
        yield x.to(device), y.to(device)
        j += 1


# The overlap check runs a fixed number of updates, not a fixed budget: with a fast GPU a 50 ms
# round leaves time for hundreds of micro-batches, and a budget of 400 was spent in the first
# update, leaving nothing to compare. The budget is now far out of reach
# and every rank stops after OVERLAP_UPDATES updates (between two records no round is in flight).
OVERLAP_UPDATES = 12
OVERLAP_BUDGET = 10**7  # micro-batches over all workers
MIN_UPDATES = 5


def overlap_run(rank, device, delay_ms: float, on_side_stream: bool, world: int = 2):
    """acco with accumulate-while-waiting, a sleep of `delay_ms` in every comm round (on the side
    stream, or on the compute stream: the control); the parameters and this rank's micro-batches
    per update. On the CPU (a check of the stopping logic) the comm thread itself sleeps."""
    from acco.engine import build_engine
    from acco_bench.gpu import calibrate_sleep

    if device.type == "cuda":
        cycles = int(delay_ms * calibrate_sleep(device))
        compute = torch.cuda.current_stream(device)

        def sleep():  # called by the comm thread, inside the round (on the side stream by default)
            if on_side_stream:
                torch.cuda._sleep(cycles)
            else:
                with torch.cuda.stream(compute):
                    torch.cuda._sleep(cycles)
    else:
        assert on_side_stream, "the CPU has no compute stream to delay"

        def sleep():
            time.sleep(delay_ms / 1000)

    cfg = config(  # uncapped: how many micro-batches a delayed round gathers is what is measured
        method="acco",
        n_grad_accumulation=1,
        nb_steps_tot=OVERLAP_BUDGET,
        accumulate_while_waiting=True,
        accumulate_cap=None,
    )
    model = make_model("mlp").to(device)
    engine = build_engine(model, cfg)
    engine.comm.delay_hook = sleep
    run = engine.run(device_stream("mlp", rank, device, world), loss_fn)
    records = list(itertools.islice(run, OVERLAP_UPDATES))
    run.close()
    engine.close()
    theta = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    return theta, [r.micro_batches[rank] for r in records]


def assert_overlap(side: list[int], control: list[int]) -> None:
    """Micro-batches per update (after the warm start) with the side stream delayed, against the control."""
    assert min(len(side), len(control)) >= MIN_UPDATES, (
        f"too few updates to compare: {len(side)}, {len(control)}"
    )
    per_update = sum(side[1:]) / (len(side) - 1)
    per_update_control = sum(control[1:]) / (len(control) - 1)
    # An update is 2 rounds of >= 1 micro-batch; a 50 ms sleep per round on the side stream leaves
    # time for many more tiny micro-batches, on the compute stream it holds them up.
    assert per_update >= 10, f"micro-batches per update with the side stream delayed: {per_update:.1f}"
    assert per_update > 3 * per_update_control, (per_update, per_update_control)
