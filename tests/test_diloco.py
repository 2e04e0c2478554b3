"""diloco and streaming-diloco, on real gloo processes, equal a plain single-process reference.

The reference (acco_bench/reference.py, Reference.diloco) keeps W copies of the model, each with
torch.optim.AdamW (ddp's parameter groups), and a global copy with torch.optim.SGD(nesterov=True):
torchft's local_sgd.py recurrence written out with whole parameters, fragment by fragment.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import re

import pytest
import torch
from distributed import run_distributed
from engine_helpers import assert_close, config, loss_fn, make_model, reference_diloco, run_engine, stream
from fake_cuda import DEVICES, maybe_installed
from torch import nn
from torch.nn.utils import parameters_to_vector

from acco.engine import CheckpointError, ConfigError, EngineConfig, build_engine
from acco.engine.diloco import DiLoCoEngine, fragment_slices
from acco.engine.flat import FlatParams


# Budgets that are not a multiple of a sync cycle: the end-of-run synchronisation is exercised too.
@pytest.mark.parametrize(
    "kind,world,device", [("mlp", 2, "host"), ("block", 3, "host"), ("mlp", 2, "fake-cuda")]
)
def test_diloco_and_streaming_equal_their_reference(kind, world, device):
    n = 2
    cfgs = [
        config(method="diloco", n_grad_accumulation=n, nb_steps_tot=n * world * 10, sync_every=3,
               max_grad_norm=0.5),
        config(method="streaming-diloco", n_grad_accumulation=n, nb_steps_tot=n * world * 11, sync_every=4,
               num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5, outer_lr=0.5,
               outer_momentum=0.8),
    ]  # fmt: skip
    results = run_distributed(run_engine, world, kind, cfgs, 0.0, None, device)
    for rank_result in results[1:]:  # the final model is the global one, the same everywhere
        for (theta, _), (theta0, _) in zip(rank_result, results[0]):
            assert torch.equal(theta, theta0)
    finals = []
    for cfg, (theta, records) in zip(cfgs, results[0]):
        expected, losses = reference_diloco(kind, cfg, world)
        assert [r.step for r in records] == list(range(1, len(losses) + 1))
        assert records[-1].committed_micro_batches == cfg.nb_steps_tot
        assert_close(theta, expected, f"{cfg.method} vs its reference")
        assert_close(torch.tensor([r.loss for r in records]), torch.tensor(losses), f"{cfg.method} losses")
        finals.append(theta)
    assert not torch.allclose(finals[0], finals[1], atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_pseudo_gradient_is_global_minus_local_with_a_fake_all_reduce(device):
    """One worker, the all-reduce replaced by a fake that records the wire and adds a second
    worker's pseudo-gradient: the outer step with lr 1 and no momentum lands exactly on the
    average of the two workers' local parameters (a flipped sign lands far from it)."""
    cfg = config(
        method="diloco",
        n_grad_accumulation=1,
        nb_steps_tot=2,
        sync_every=2,
        outer_lr=1.0,
        outer_momentum=0.0,
        learning_rate=0.05,
    )
    with maybe_installed(device):
        engine, records, sent, theta0, other = _pseudo_gradient_run(cfg)
    assert len(records) == 2 and len(sent) == 1
    wire, local = sent[0]
    assert (local - theta0).abs().max() > 1e-3  # the inner steps moved it
    torch.testing.assert_close(wire, theta0 - local, rtol=0, atol=0)  # worker 0 sent global - local
    torch.testing.assert_close(engine.global_params, (local + other) / 2, rtol=0, atol=1e-6)
    torch.testing.assert_close(engine.flat.params, engine.global_params, rtol=0, atol=0)  # the model holds it


def _pseudo_gradient_run(cfg):
    model = make_model("mlp")
    engine = DiLoCoEngine(model, cfg)
    theta0 = engine.global_params.clone()
    other = theta0 + 0.01 * torch.randn(theta0.shape, generator=torch.Generator().manual_seed(0))
    sent = []

    def fake_all_reduce(i, step, n, m):
        assert n == theta0.numel()
        sent.append((engine.wire[:n].clone(), engine.local.clone()))
        # as if a second worker's pseudo-gradient were summed in and the sum divided by two
        engine.wire[:n] = (engine.wire[:n] + theta0 - other) / 2
        return False, False

    engine._all_reduce = fake_all_reduce
    records = list(engine.run(stream("mlp", 0, 1), loss_fn))
    engine.close()
    return engine, records, sent, theta0, other


def test_fragments_are_runs_of_layers_of_about_equal_size():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)], nn.LayerNorm(16))
    flat = FlatParams(model, torch.float32, 1, 0)
    for f in (1, 3, 4, 17):
        fragments = fragment_slices(flat, model, f)
        assert len(fragments) == f and all(fragments)
        covered = torch.zeros(flat.layout.numel, dtype=torch.int64)
        for slices in fragments:
            for s in slices:
                covered[s] += 1
        assert torch.equal(covered, torch.ones_like(covered))  # a partition of the parameters
        offsets, offset = {}, 0
        for p in flat.trainable:
            offsets[id(p)], offset = offset, offset + p.numel()
        which = [
            next(i for i, sl in enumerate(fragments) for s in sl if s.start <= offsets[id(p)] < s.stop)
            for p in model.parameters()
        ]
        assert which == sorted(which)  # contiguous in registration order (the order of the layers)
        sizes = [sum(s.stop - s.start for s in sl) for sl in fragments]
        if f <= 4:
            assert max(sizes) - min(sizes) <= 2 * 16 * 17, sizes
    with pytest.raises(ValueError, match="num_fragments=30"):
        fragment_slices(flat, model, 30)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_resume_is_exact_with_an_all_reduce_in_flight(device):
    world, n = 2, 1
    cfg = config(
        method="streaming-diloco",
        n_grad_accumulation=n,
        nb_steps_tot=world * 14,
        sync_every=4,
        num_fragments=2,
        fragment_sync_delay=1,
        fragment_update_alpha=0.25,
    )
    # Fragments sync at offsets 2 and 4 of every 4 steps: fragment 0's all-reduce is launched at step 6
    # and applied at step 7, so the checkpoint after step 6 is taken with it in flight.
    results = run_distributed(_resume_run, world, cfg, 6, device)
    for straight, resumed, in_flight, _ in results:
        assert in_flight
        assert torch.equal(straight, resumed)


def test_one_replica_per_node_resumes_exactly_and_not_on_another_layout():
    """rounds=nodes on 2 x 2 (a replica per node): a checkpoint taken with a fragment's round in
    flight (landed, gathered in the node and kept by the save) resumes exactly; it is refused, with
    one line, by a run of 4 replicas of one worker (rounds=flat), and a flat one's (its header's
    workers_per_node 0) by the node layout."""
    cfg = config(method="streaming-diloco", n_grad_accumulation=1, nb_steps_tot=4 * 14, sync_every=4,
                 num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.25,
                 rounds="nodes", workers_per_node=2)  # fmt: skip
    results = run_distributed(_resume_across_layouts, 4, cfg, 6)
    for straight, resumed, in_flight, refusals in results:
        assert in_flight
        assert torch.equal(straight, resumed)
        assert refusals == [
            "streaming-diloco resumes only on the replica layout it was saved with: the checkpoint has "
            "2 replicas of 2 workers (one per node), this run 4 replicas of one worker (train.rounds, "
            "launch.workers_per_node or the launcher's)",
            "streaming-diloco resumes only on the replica layout it was saved with: the checkpoint has "
            "4 replicas of one worker, this run 2 replicas of 2 workers (one per node) (train.rounds, "
            "launch.workers_per_node or the launcher's)",
        ]


def _resume_across_layouts(rank, world, cfg, stop_at):
    straight, resumed, in_flight, state = _resume_runs(rank, world, cfg, stop_at)
    flat = dataclasses.replace(cfg, rounds="flat")
    refusals = []
    for saved, run in ((state, flat), ({**state, "workers_per_node": 0}, cfg)):
        engine = build_engine(make_model("block"), run)
        with pytest.raises(CheckpointError) as refused:
            engine.load_state_dict(saved)
        refusals.append(str(refused.value))
        engine.close()
    return straight, resumed, in_flight, refusals


def _resume_run(rank, world, cfg, stop_at, device):
    with maybe_installed(device):
        return _resume_runs(rank, world, cfg, stop_at)


def _resume_runs(rank, world, cfg, stop_at):
    straight_model = make_model("block")
    engine = build_engine(straight_model, cfg)
    list(engine.run(stream("block", rank, world), loss_fn))
    engine.close()
    model = make_model("block")
    engine = build_engine(model, cfg)
    batches = stream("block", rank, world)
    for record in engine.run(batches, loss_fn):
        if record.step == stop_at:
            in_flight = engine.pending is not None
            state = copy.deepcopy(engine.state_dict())
            break
    engine.close()
    model = make_model("block")
    engine = build_engine(model, cfg)
    engine.load_state_dict(state)
    # The stream continues where the saved state was: the next step's micro-batches, computed
    # ahead of the record, are read again.
    assert state["dropped_micro_batches"] == cfg.n_grad_accumulation
    batches = itertools.islice(stream("block", rank, world), stop_at * cfg.n_grad_accumulation, None)
    list(engine.run(batches, loss_fn))
    engine.close()
    vec = parameters_to_vector
    return vec(straight_model.parameters()).detach(), vec(model.parameters()).detach(), in_flight, state


_INITIAL = "global parameters: the initial ones, no sync yet; next sync at step 3"
_STREAMING = "global parameters, fragments 1-2 as synced at steps"


@pytest.mark.parametrize("method, budget, notes", [
    # diloco, H 3: syncs at 3 and 6, and at the run's last step, 8
    ("diloco", 8, [_INITIAL] * 2 + ["global parameters as synced at step 3; next sync at step 6"] * 3
     + ["global parameters as synced at step 6; next sync at step 8"] * 2
     + ["global parameters as synced at step 8; the run's last sync"]),
    # streaming, H 4, 2 fragments prepared at 2 and 4 (every 4), each applied one step later
    ("streaming-diloco", 9, [_INITIAL] * 2 + [f"{_STREAMING} 3, - (-: not yet); next sync at step 5"] * 2
     + [f"{_STREAMING} 3, 5; next sync at step 7"] * 2 + [f"{_STREAMING} 7, 5; next sync at step 9"] * 2
     + [f"{_STREAMING} 9, 9; the run's last sync"]),
])  # fmt: skip
def test_the_sync_note_says_which_global_parameters_an_evaluation_sees(method, budget, notes):
    """After every inner step, the note that the log lines carry names the steps at which the global
    parameters (what an evaluation sees) last changed, fragment by fragment, and the next step at
    which they change: checked against the global parameters themselves."""
    more = dict(sync_every=3) if method == "diloco" else dict(sync_every=4, num_fragments=2,
                                                              fragment_sync_delay=1)  # fmt: skip
    cfg = config(method=method, n_grad_accumulation=1, nb_steps_tot=budget, **more)
    engine = DiLoCoEngine(make_model("mlp"), cfg)
    said, changed_at = [], [0] * len(engine.fragments)
    before = engine.global_params.clone()
    for record in engine.run(stream("mlp", 0, 1), loss_fn):
        for i, fragment in enumerate(engine.fragments):
            if any(not torch.equal(engine.global_params[s], before[s]) for s in fragment):
                changed_at[i] = record.step
        before = engine.global_params.clone()
        said.append((record.step, engine.sync_note(), list(changed_at)))
    engine.close()
    assert [note for _, note, _ in said] == notes
    changes = sorted({step for _, _, seen in said for step in seen if step})
    for step, note, seen in said:
        synced = ", ".join(str(s) if s else "-" for s in seen)
        assert (synced in note if any(seen) else "the initial ones" in note), (step, note, seen)
        later = [s for s in changes if s > step]
        then = f"next sync at step {later[0]}" if later else "the run's last sync"
        assert note.endswith(then), (step, note)


def test_the_console_says_what_diloco_s_evaluations_see(tmp_path, capsys):
    """The eval lines (and the line before the first step) of a diloco run say that evaluations see
    the global parameters, as of which sync, and when the next one comes: an eval loss that stays
    at the initial model's until the first sync is then read as what it is."""
    from trainer_helpers import tiny_args, tiny_data, tiny_model

    from acco.trainer import DecoupledTrainer

    args = tiny_args("diloco", tmp_path / "run", nb_steps_tot=16, eval=True, eval_step=2, save_step=0)
    data = tiny_data()
    DecoupledTrainer(model=tiny_model(), train_dataset=data, eval_dataset=data, args=args).train()
    out = capsys.readouterr().out.splitlines()
    assert "evaluations see the global parameters: the initial ones, no sync yet; next sync at step 3" in out
    evals = [re.sub(r"eval_loss \d+\.\d{4}", "eval_loss L", x) for x in out if x.startswith("eval  step")]
    assert evals == [  # sync_every 3, 2 micro-batches a step on one worker: 8 steps
        "eval  step 2  samples 4  eval_loss L  (global parameters: the initial ones, no sync yet; next sync "
        "at step 3)",
        "eval  step 4  samples 8  eval_loss L  (global parameters as synced at step 3; next sync at step 6)",
        "eval  step 6  samples 12  eval_loss L  (global parameters as synced at step 6; next sync at step 8)",
        "eval  step 8  samples 16  eval_loss L  (global parameters as synced at step 8; the run's last sync)",
    ]


@pytest.mark.parametrize("kw,message", [
    (dict(method="diloco", num_fragments=2), "num_fragments=1"),
    (dict(method="streaming-diloco", sync_every=8, num_fragments=4, fragment_sync_delay=2),
     r"fragment_sync_delay must be in \[0, sync_every // num_fragments = 2\)"),
    (dict(method="streaming-diloco", fragment_update_alpha=1.5), "fragment_update_alpha"),
    (dict(method="diloco", outer_momentum=1.0), "outer_momentum"),
    (dict(method="diloco", sync_every=0), "sync_every must be a positive integer"),
])  # fmt: skip
def test_bad_settings_are_refused_with_one_line(kw, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kw)


def _bf16_run(rank, world, device):
    with maybe_installed(device):
        return _bf16_train(rank, world)


def _bf16_train(rank, world):
    cfg = config(
        method="streaming-diloco",
        n_grad_accumulation=1,
        nb_steps_tot=world * 8,
        sync_every=4,
        num_fragments=2,
        fragment_sync_delay=1,
        use_mixed_precision=True,
    )
    model = make_model("mlp")
    engine = build_engine(model, cfg)
    records = list(
        engine.run(stream("mlp", rank, world), lambda m, b: loss_fn(m, (b[0].bfloat16(), b[1].bfloat16())))
    )
    engine.close()
    return (
        engine.wire.dtype,
        engine.local.dtype,
        engine.flat.params.clone(),
        engine.global_params.clone(),
        records,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_precision_sends_bf16_and_keeps_fp32_state(device):
    results = run_distributed(_bf16_run, 2, device)
    wire, local, params, global_params, records = results[0]
    assert wire == torch.bfloat16 and local == torch.float32 and params.dtype == torch.bfloat16
    assert torch.equal(params, global_params.to(torch.bfloat16))  # the final model is the global one
    assert torch.equal(global_params, results[1][3])  # and the same on every worker
    assert all(math.isfinite(r.loss) for r in records) and records[-1].committed_micro_batches == 16


@pytest.mark.parametrize("device", DEVICES)
def test_a_steps_record_is_read_once_the_next_steps_micro_batches_are_queued(device):
    """No host read drains the GPU at every inner step: the record of step t is read (a pinned copy
    and an event) after step t + 1's micro-batches are queued behind it; the last step's at once.
    On the CPU the order is what can be pinned: loss_fn calls before each record."""
    n, steps = 2, 5
    cfg = config(method="diloco", n_grad_accumulation=n, nb_steps_tot=n * steps, sync_every=2)
    with maybe_installed(device) as fake:
        engine = DiLoCoEngine(make_model("mlp"), cfg)
        reads, seen = _counted_reads(engine, n, steps)
    # micro-batches computed at each read
    assert reads == [(t + 1) * n for t in range(1, steps)] + [steps * n]
    # what a checkpoint's data position rewinds
    assert seen == [(t, n) for t in range(1, steps)] + [(steps, 0)]
    if fake is not None:  # the host sleeps on a blocking event (no spin), recorded behind the step's copy
        assert engine.stats_ready.blocking and engine.stats_ready.completed


def _counted_reads(engine, n, steps):
    calls = []

    def counting_loss(model, batch):
        calls.append(1)
        return loss_fn(model, batch)

    reads, read = [], engine._read_stats
    engine._read_stats = lambda k: (reads.append(len(calls)), read(k))[1]
    seen = [(record.step, engine.computed_ahead) for record in engine.run(stream("mlp", 0, 1), counting_loss)]
    engine.close()
    return reads, seen
