"""Shared by the tests of sharding inside the node (acco/engine/node_shards.py): the whole model's
parameters of a module whose blocks FSDP2 shards over the node, a run trained straight through,
and a worker's stream that counts what was taken from it (a resume goes back from there)."""

from __future__ import annotations

import itertools

import torch
from engine_helpers import loss_fn, make_model, stream

from acco.engine import build_engine


def full_params(model) -> torch.Tensor:
    """The whole model's parameters, in the plain module's order (all-gathered inside the node)."""
    return torch.cat([p.full_tensor().detach().float().flatten() for p in model.parameters()])


def straight(kind: str, rank: int, world: int, cfg) -> torch.Tensor:
    """The full final parameters of `cfg`'s run on a fresh model, uninterrupted."""
    model = make_model(kind)
    engine = build_engine(model, cfg)
    list(engine.run(stream(kind, rank, world), loss_fn))
    engine.close()
    return full_params(model)


class Counted:
    """Worker `rank`'s stream, counting the micro-batches taken from it (`taken`)."""

    def __init__(self, kind: str, rank: int, world: int):
        self.taken, self.batches = 0, stream(kind, rank, world)

    def __iter__(self):
        for batch in self.batches:
            self.taken += 1
            yield batch


def interrupted(rank, world, kind, cfg, stop_after, look=None):
    """Every rank: the full final parameters of an uninterrupted run, and of one whose state was
    taken after `stop_after` updates (or inner steps) and loaded into a fresh engine and model of
    other initial weights, the stream going back by what the saved engine had taken ahead (as
    checkpoint.save_run rewinds it); whether that load was exact, the micro-batches taken ahead,
    and `look(engine)` at the save."""
    whole = straight(kind, rank, world, cfg)
    counted = Counted(kind, rank, world)
    model = make_model(kind)
    engine = build_engine(model, cfg)
    for record in engine.run(counted, loss_fn):
        if record.step == stop_after:
            looked = look(engine) if look is not None else None
            saved = engine.state_dict().items()
            state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved}
            break
    engine.finish()
    engine.close()
    back = state["fetched_ahead"] + state["dropped_micro_batches"]
    model = make_model(kind)
    torch.manual_seed(99)  # other initial weights: the state alone must bring the run back
    for p in model.parameters():
        p.data.normal_()
    engine = build_engine(model, cfg)
    exact = engine.load_state_dict(state)
    list(engine.run(itertools.islice(stream(kind, rank, world), counted.taken - back, None), loss_fn))
    engine.close()
    return whole, full_params(model), exact, state["fetched_ahead"], looked


def refusals(rank, world, sharded_cfg, plain_cfg) -> list:
    """Every rank: the line load_state_dict refuses a state of one config with, in an engine of the
    other, both ways (a single file: no resharding); None where it took it."""
    from acco.engine import CheckpointError

    out = []
    for saved, resumed in ((sharded_cfg, plain_cfg), (plain_cfg, sharded_cfg)):
        engine = build_engine(make_model("stack"), saved)
        state = engine.state_dict()
        engine.close()
        engine = build_engine(make_model("stack"), resumed)
        try:
            engine.load_state_dict(state)
            out.append(None)
        except CheckpointError as e:
            out.append(str(e))
        engine.close()
    return out
