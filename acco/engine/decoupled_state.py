"""What a DecoupledEngine (ddp, dpu, wp, acco) saves and restores, and the memory it holds.

The engine's `state_dict`, `load_state_dict` and `state_bytes` are these functions, kept beside
the training loop of decoupled.py rather than in it; they read and write that engine's own
attributes. A checkpoint is taken between two yielded updates, when no round is in flight.
"""

from __future__ import annotations

from collections.abc import Callable

from acco.engine.comm import MICRO_BATCHES
from acco.engine.config import CheckpointError
from acco.engine.flat import FLAT_ORDER, ShardLayout


def state_dict(engine) -> dict:
    """This worker's training state, each distinct tensor once across workers: its fp32 optimizer
    shard (master, moments), acco's estimate-error shard, wp's predicted-weights shard, and the
    gradient accumulator only where an exact resume needs it (a fixed batch, EngineConfig.fixed_batch:
    train=acco's default is one). The accumulator holds the next round's payload, computed while
    the last round ran (acco: at the estimate theta~): computing it again at a resume, at the
    committed parameters, gives other gradients. The parameters are not saved: the committed ones
    are the gathered master (`load_state_dict`). Where the micro-batch counts follow timing (a
    round's minimum can grow under accumulate_cap) a resume restarts the overlapped regime from
    its warm start and the accumulator's micro-batches are read again (``dropped_micro_batches``:
    the data position goes back by that many)."""
    opt = engine.comm.optimizer
    keep_accumulator = engine._in_overlap and engine.cfg.fixed_batch
    dropped = int(engine.stats[MICRO_BATCHES].item()) if engine._in_overlap and not keep_accumulator else 0
    return {
        "method": engine.cfg.method,
        "order": FLAT_ORDER,
        "numel": engine.flat.layout.numel,
        "world_size": engine.world_size,
        "rank": engine.rank,
        "samples": engine.comm.samples,
        "step": engine.comm.step,
        "wall_time": engine.last_wall_time,
        "master": opt.master,
        "exp_avg": opt.exp_avg,
        "exp_avg_sq": opt.exp_avg_sq,
        # wp: a copy of this shard of the predicted weights (torch.save writes a view's whole storage)
        "predicted": engine._prediction()[engine.flat.shard].clone() if engine._predicting else None,
        # Overlapped methods with a fixed batch: the gradients computed during the last round, the next
        # payload.
        "accumulator": engine.accumulator if keep_accumulator else None,
        "accumulator_stats": engine.stats if keep_accumulator else None,
        "dropped_micro_batches": dropped,
        # acco_estimate=lean: this shard's last estimate error (None for the other estimates)
        "estimate_error": engine.lookahead.estimate_error,
        "split": engine.split.state_dict(),  # acco: the accumulator's payload was computed with 2k - e
    }


def load_state_dict(engine, state: dict, old_state: Callable[[int], dict] | None = None) -> bool:
    """Restore a worker's state. On the world size it was saved with the run continues exactly
    (True); on another, `old_state(r)` gives old worker r's state (memory-mapped: only the
    slices of the old shards that overlap this worker's new one are read), the fp32 master and
    moments are resharded, and the overlapped regime restarts from its warm start (False).
    Every worker calls it together: the parameters are all-gathered from the master shards."""
    if state["method"] != engine.cfg.method:
        raise CheckpointError(
            f"checkpoint was written by method {state['method']!r}, this run is {engine.cfg.method!r}"
        )
    if state["numel"] != engine.flat.layout.numel:
        raise CheckpointError(
            f"checkpoint holds {state['numel']:,} parameters, the model has {engine.flat.layout.numel:,}"
        )
    if state.get("order") != FLAT_ORDER:
        raise CheckpointError(
            "checkpoint was written by an earlier acco that ordered the parameters otherwise; "
            "it cannot be resumed by this version"
        )
    opt = engine.comm.optimizer
    engine.comm.samples, engine.comm.step = int(state["samples"]), int(state["step"])
    opt.restore_step(engine.comm.step)
    engine.wall_time_offset = float(state["wall_time"])
    exact = state["world_size"] == engine.world_size and state["rank"] == engine.rank
    if not exact and old_state is None:
        raise CheckpointError(
            f"checkpoint was written by {state['world_size']} workers, this run has {engine.world_size}: "
            "resharding needs every worker's file"
        )
    if exact:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            getattr(opt, name).copy_(state[name])
    else:
        _reshard(engine, old_state, int(state["world_size"]))
    # wp computes at its prediction, saved by shard; every other model at the committed parameters
    predicted = state.get("predicted") if exact and engine.wp else None
    engine._gather(predicted if predicted is not None else opt.master, engine.flat.params)
    engine._predicting = predicted is not None
    # micro-batches the saved run had accumulated that this one computes again (their data is read again)
    engine.recomputed_micro_batches = int(state.get("dropped_micro_batches", 0))
    if not exact:
        return False
    if state.get("split") is not None:
        engine.split.load_state_dict(state["split"])
    error = engine.lookahead.estimate_error
    if error is not None:  # older checkpoints and other estimates: none
        saved = state.get("estimate_error")
        error.copy_(saved) if saved is not None else error.zero_()
    if state.get("accumulator") is not None:
        engine.accumulator.copy_(state["accumulator"])
        saved = state["accumulator_stats"]  # (4 numbers before the stop flag existed)
        engine.stats.zero_()[: saved.numel()].copy_(saved)
        engine._resume_overlap = True
    return True


def _reshard(engine, old_state: Callable[[int], dict], old_world: int) -> None:
    """This worker's new shard of the fp32 master and moments, copied slice by slice from the
    old shards that overlap it (at most a few old files are touched, each only in that range)."""
    opt, numel = engine.comm.optimizer, engine.flat.layout.numel
    old_size = ShardLayout(numel, old_world, 0).shard_numel
    lo, hi = engine.flat.shard.start, min(engine.flat.shard.stop, numel)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        getattr(opt, name).zero_()  # the padding stays zero
    for r in range(lo // old_size, -(-hi // old_size)) if hi > lo else ():
        old = old_state(r)
        a, b = max(lo, r * old_size), min(hi, (r + 1) * old_size)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            getattr(opt, name)[a - lo : b - lo].copy_(old[name][a - r * old_size : b - r * old_size])
        del old  # a memory-mapped file is released before the next one is touched


def state_bytes(engine) -> dict[str, int]:
    """Bytes this worker holds for training, by component, each storage counted once
    (numel x element size of the engine's tensors; activations and the module's buffers not
    included)."""
    comm, opt = engine.comm, engine.comm.optimizer
    parts = {
        "params": engine.flat.params,
        "grads": engine.flat.grads,
        "grad_accumulator_fp32": engine.accumulator,
        "payload": engine.payload if engine.overlapped else None,
        "master": opt.master,
        "exp_avg": opt.exp_avg,
        "exp_avg_sq": opt.exp_avg_sq,
        "grad_shard": comm.grad_shard,
        "trial_workspace": opt._work,
        "estimate_error": engine.lookahead.estimate_error,
        "wp_previous_master": engine.lookahead.previous_master,
        **(
            {
                "int8_send": comm.int8.send.words,
                "int8_recv": comm.int8.recv.words,
                "int8_work": comm.int8.work,
            }
            if comm.int8
            else {}
        ),
    }
    out, seen = {}, set()
    for name, t in parts.items():
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t.numel() * t.element_size()
    return out
