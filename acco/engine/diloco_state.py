"""What a DiLoCoEngine (diloco, streaming-diloco) saves and restores, and the memory it holds.

The engine's `state_dict`, `load_state_dict` and `state_bytes` are these functions, kept beside
the training loop of diloco.py rather than in it; they read and write that engine's own
attributes. Every worker's local parameters and inner moments are its own, not sharded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from acco.engine.config import CheckpointError
from acco.engine.flat import FLAT_ORDER


def state_bytes(engine) -> dict[str, int]:
    """Bytes this worker holds for training, by component."""

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    out = {
        "params": size(engine.flat.params),
        "grads": size(engine.flat.grads),
        "local_fp32": size(engine.local),
        "exp_avg": size(engine.inner.exp_avg),
        "exp_avg_sq": size(engine.inner.exp_avg_sq),
        "global_params": size(engine.global_params),
        "outer_momentum": size(engine.outer_momentum),
        "wire": size(engine.wire) + size(engine.wire_shard),
        "averaged": size(engine.averaged),
    }
    if engine.grad is not engine.flat.grads:
        out["grad_fp32"] = size(engine.grad)
    return out


def state_dict(engine) -> dict:
    """This worker's local parameters and inner AdamW state (its own: not sharded); rank 0 alone
    saves what every worker holds identically: the global parameters, the outer momentum and a
    landed all-reduce result not yet applied."""
    engine.quiesce()
    shared = engine.rank == 0
    averaged = engine.averaged_fragment
    n = sum(s.stop - s.start for s in engine.fragments[averaged]) if averaged is not None else 0
    landed = engine.averaged[:n] if shared and n else None
    if landed is not None and n < engine.averaged.numel():  # torch.save writes a view's whole storage:
        landed = landed.clone()  # a fragment shorter than the buffer (the largest one's) is copied out
    return {
        "method": engine.cfg.method,
        "order": FLAT_ORDER,
        "numel": engine.flat.layout.numel,
        "world_size": engine.world_size,
        "rank": engine.rank,
        "samples": engine.samples,
        "step": engine.step,
        "wall_time": engine.last_wall_time,
        "fragments": engine.cfg.num_fragments,
        "sync_every": engine.cfg.sync_every,
        "last_merge": list(engine.last_merge),
        "inner_steps": engine.inner.step_count,
        "master": engine.local,
        "exp_avg": engine.inner.exp_avg,
        "exp_avg_sq": engine.inner.exp_avg_sq,
        "global_params": engine.global_params if shared else None,
        "outer_momentum": engine.outer_momentum if shared else None,
        "averaged_fragment": averaged,
        "averaged": landed,
        "stop": engine._stop,
        # the next step's micro-batches, computed ahead of this record: a resume reads them again
        "dropped_micro_batches": engine.computed_ahead,
    }


def load_state_dict(engine, state: dict, old_state=None) -> bool:
    """Restore a worker's state exactly; only on the world size it was saved with (every
    worker's local parameters and inner moments are its own). Every worker calls it together:
    the shared tensors are broadcast from rank 0."""
    if state["method"] != engine.cfg.method:
        raise CheckpointError(
            f"checkpoint was written by method {state['method']!r}, this run is {engine.cfg.method!r}"
        )
    if state["numel"] != engine.flat.layout.numel or state.get("order") != FLAT_ORDER:
        raise CheckpointError(
            f"checkpoint holds {state['numel']:,} parameters in another order or number; "
            f"the model has {engine.flat.layout.numel:,}"
        )
    if state["world_size"] != engine.world_size or state["rank"] != engine.rank:
        raise CheckpointError(
            f"{engine.cfg.method} resumes only on the world size it was saved with "
            f"({state['world_size']} workers; every worker's local state is its own)"
        )
    if (state["fragments"], state["sync_every"]) != (engine.cfg.num_fragments, engine.cfg.sync_every):
        raise CheckpointError(
            f"checkpoint synchronised {state['fragments']} fragment(s) every {state['sync_every']} "
            f"steps; this run: {engine.cfg.num_fragments} every {engine.cfg.sync_every}"
        )
    engine.samples, engine.step = int(state["samples"]), int(state["step"])
    engine.wall_time_offset = float(state["wall_time"])
    engine.last_merge = list(state["last_merge"])
    engine._stop = bool(state.get("stop", False))
    engine.local.copy_(state["master"])
    engine.inner.exp_avg.copy_(state["exp_avg"])
    engine.inner.exp_avg_sq.copy_(state["exp_avg_sq"])
    engine.inner.restore_step(int(state["inner_steps"]))
    if engine.rank == 0:
        engine.global_params.copy_(state["global_params"])
        engine.outer_momentum.copy_(state["outer_momentum"])
    engine.averaged_fragment = state["averaged_fragment"]
    n = (
        sum(s.stop - s.start for s in engine.fragments[engine.averaged_fragment])
        if engine.averaged_fragment is not None
        else 0
    )
    if engine.rank == 0 and n:
        engine.averaged[:n].copy_(state["averaged"])
    if engine.world_size > 1:
        src = dist.get_global_rank(engine.group, 0) if engine.group is not None else 0
        for t in (
            (engine.global_params, engine.outer_momentum, engine.averaged[:n])
            if n
            else (engine.global_params, engine.outer_momentum)
        ):
            dist.broadcast(t, src=src, group=engine.group)
    engine.flat.params.copy_(engine.local)
    return True
