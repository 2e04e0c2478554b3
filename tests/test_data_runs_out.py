"""When a `build_engine` user's data runs out before `nb_steps_tot`, every method stops after its
last real update and reports only updates that happened: each record committed micro-batches
(never an empty one with a nan loss), and the records account for every micro-batch once.

The trainer's own data never runs out (it cycles through epochs), so only a caller of the engine
with a finite iterable meets this. The data ends exactly at an update's end, the case where a
worker learns that it is out only when it asks for the next update's first micro-batch."""

from __future__ import annotations

import math

import pytest
from distributed import run_distributed
from engine_helpers import config, loss_fn, make_model, micro_batch

from acco.engine import build_engine
from acco.engine.config import METHODS

PER_WORKER = 6  # micro-batches each worker has: 6 updates of ddp, 3 of acco, 6 inner steps of diloco


def _settings(method: str) -> dict:
    # diloco syncs every 4 inner steps: after the 6th, two inner steps without data keep the
    # schedule until the all-reduce (at the 8th) tells every worker that the data ran out
    local = {"sync_every": 4, "num_fragments": 2 if method == "streaming-diloco" else 1}
    return local if "diloco" in method else {}


def _finite_runs(rank: int, world: int) -> dict:
    out = {}
    for method in METHODS:
        cfg = config(method=method, nb_steps_tot=1000, n_grad_accumulation=1, **_settings(method))
        engine = build_engine(make_model("mlp"), cfg)
        data = [micro_batch("mlp", j * world + rank) for j in range(PER_WORKER)]
        records = [
            (r.step, r.committed_micro_batches, r.loss, r.micro_batches) for r in engine.run(data, loss_fn)
        ]
        engine.close()
        out[method] = records
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_no_record_for_an_update_without_data(world):
    runs = run_distributed(_finite_runs, world)
    for method in METHODS:
        records = runs[0][method]
        assert records, method
        steps = [step for step, *_ in records]
        assert steps == list(range(1, len(steps) + 1)), (method, records)
        assert all(sum(mb) > 0 and math.isfinite(loss) for _, _, loss, mb in records), (method, records)
        assert sum(sum(mb) for *_, mb in records) == world * PER_WORKER, (method, records)
        assert records[-1][1] == world * PER_WORKER, (method, records)  # samples: every micro-batch once
        for other in runs[1:]:  # every worker saw the same updates (diloco's loss is each worker's own)
            assert [(s, n, mb) for s, n, _, mb in other[method]] == [(s, n, mb) for s, n, _, mb in records]
