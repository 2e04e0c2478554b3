"""train.estimate_micro_batches (issue 20, item 4): acco's fixed 2k micro-batches per worker per update
split unevenly, e while the estimate round runs and 2k - e while the update round runs (and for the
warm start), held to a plain single-process recurrence on 2 gloo workers; the default is the even split."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from engine_helpers import Reference, assert_close, config, loss_fn, make_model, stream

from acco.config import InputError, TrainArgs, compose
from acco.engine import ConfigError, EngineConfig, build_engine
from acco.engine.comm import RoundKind

K, WORLD, UPDATES = 2, 2, 4


def test_config():
    assert EngineConfig().estimate_micro_batches is None and TrainArgs().estimate_micro_batches is None
    for e in (1, 2, 3):
        EngineConfig(method="acco", n_grad_accumulation=K, estimate_micro_batches=e)
    EngineConfig(method="acco", n_grad_accumulation=K, estimate_micro_batches=1, accumulate_while_waiting=True)
    for bad in (0, 4, -1, 1.5, True, "auto"):
        with pytest.raises(ConfigError, match=r"estimate_micro_batches must be an integer in \[1, 2 n_grad_accumulation "
                                              r"- 1 = 3\] or null"):
            EngineConfig(method="acco", n_grad_accumulation=K, estimate_micro_batches=bad)
    with pytest.raises(ConfigError, match="acco's estimate round only; method dpu has none"):
        EngineConfig(method="dpu", estimate_micro_batches=1)
    # the trainer's key: one line, named as the user wrote it
    with pytest.raises(InputError) as info:
        compose(["train=acco", "train.n_grad_accumulation=2", "train.estimate_micro_batches=4"])
    message = str(info.value)
    assert "\n" not in message and message.startswith("train.estimate_micro_batches must be an integer in [1, "), message
    assert compose(["train=acco", "train.n_grad_accumulation=2", "train.estimate_micro_batches=1"]).train \
        .estimate_micro_batches == 1


def _train(rank, world, kind, cfgs):
    """Every round's result on this worker (kind, micro-batches per worker in its payload, lr), and
    the final parameters, per config."""
    out = []
    for cfg in cfgs:
        model = make_model(kind)
        engine = build_engine(model, cfg)
        rounds, run = [], engine.comm.run

        def counted(*args, run=run, rounds=rounds):
            result = run(*args)
            rounds.append((result.kind, result.micro_batches, result.lr))
            return result

        engine.comm.run = counted
        records = list(engine.run(stream(kind, rank, world), loss_fn))
        engine.close()
        out.append((torch.nn.utils.parameters_to_vector(model.parameters()).detach(), records, rounds))
    return out


def reference_split(kind: str, cfg: EngineConfig, e: int, lean: bool) -> tuple[torch.Tensor, list[float]]:
    """acco's recurrence (docs/algorithm.md) with the split written out: g~_t, the estimate round's
    payload, is the 2k - e micro-batches per worker computed at theta~_t while the last update round
    ran (the warm start's at theta_0); g_t, the e computed at theta_t while the estimate round runs.
    The estimate takes the LR of the update it estimates (2k W micro-batches)."""
    ref = Reference(kind, cfg, WORLD, [2 * K - e] * WORLD)
    theta = ref.theta()
    chunk = ref.next_chunk()
    g_est, n_est = ref.grad_sum(theta, chunk)[0], len(chunk)
    error = torch.zeros_like(theta)
    for _ in range(UPDATES):
        theta_est = ref.trial(theta, g_est, n_est, update_batch=n_est + e * WORLD)
        if lean:
            theta_est = theta_est + 0.5 * error
        chunk = ref.next_chunk([e] * WORLD)
        g = ref.grad_sum(theta, chunk)[0]
        theta = ref.commit(theta, g_est + g, n_est + len(chunk))
        error = theta_est - theta
        chunk = ref.next_chunk()
        g_est, n_est = ref.grad_sum(theta_est, chunk)[0], len(chunk)
    return theta, ref.lrs


def test_split_counts_and_updates_equal_the_reference():
    kind = "mlp"
    # warmup longer than an update, so that the estimate's LR depends on the update's batch it counts
    base = dict(method="acco", n_grad_accumulation=K, nb_steps_tot=2 * K * WORLD * UPDATES, warmup=40)
    cfgs = [config(**base), config(**base, estimate_micro_batches=1),
            config(**base, estimate_micro_batches=3, acco_estimate="paper"),
            config(**base, estimate_micro_batches=1, estimate_comm="int8")]
    results = run_distributed(_train, WORLD, kind, cfgs)
    for i, (cfg, (params, records, rounds)) in enumerate(zip(cfgs, results[0])):
        e = cfg.estimate_micro_batches or K
        # the estimate round's payload holds 2k - e per worker, the update's 2k: e were computed in between
        assert [(kind_, mb) for kind_, mb, _ in rounds] == \
            [(RoundKind.ESTIMATE, [2 * K - e] * WORLD), (RoundKind.UPDATE, [2 * K] * WORLD)] * UPDATES, (i, rounds)
        assert [r.micro_batches for r in records] == [[2 * K] * WORLD] * UPDATES
        # each estimate round took the LR of the update that follows it (the warm-up is still on)
        lrs = [lr for _, _, lr in rounds]
        assert lrs[0::2] == lrs[1::2] and lrs[-1] < cfg.learning_rate, lrs
        if cfg.estimate_comm == "int8":  # counts only: tests/test_estimate_int8.py holds its values
            continue
        expected, ref_lrs = reference_split(kind, cfg, e, lean=cfg.acco_estimate == "lean")
        assert_close(params, expected, f"estimate_micro_batches={cfg.estimate_micro_batches}")
        torch.testing.assert_close(lrs[1::2], ref_lrs)
        if cfg.estimate_micro_batches is None:  # the default is today's even split
            even = Reference(kind, cfg, WORLD, [K] * WORLD).acco(UPDATES, lean=True)
            assert_close(params, even, "default split")
        else:  # and the split shows: the even split is not what the engine computed
            assert (params - results[0][0][0]).abs().max() > 1e-4
    for i in range(len(cfgs)):  # every worker holds the same parameters
        torch.testing.assert_close(results[1][i][0], results[0][i][0], rtol=0, atol=0)


def _resume(rank, world, kind, cfg, stop):
    """The final parameters of an uninterrupted run, and of one checkpointed in memory after `stop`
    updates and resumed by a fresh engine on the same data stream."""
    out = []
    for interrupt in (False, True):
        model, data = make_model(kind), stream(kind, rank, world)
        engine = build_engine(model, cfg)
        for record in engine.run(data, loss_fn):
            if interrupt and record.step == stop:
                break
        if interrupt:
            state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in engine.state_dict().items()}
            engine.finish()
            engine.close()
            model = make_model(kind)
            engine = build_engine(model, cfg)
            assert engine.load_state_dict(state)
            list(engine.run(data, loss_fn))
        engine.close()
        out.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
    return out


def test_split_resumes_exactly():
    # with a fixed batch the checkpoint keeps the accumulator: the next g~, 2k - e micro-batches per worker
    cfg = config(method="acco", n_grad_accumulation=K, nb_steps_tot=2 * K * WORLD * UPDATES, estimate_micro_batches=1)
    whole, resumed = run_distributed(_resume, WORLD, "mlp", cfg, 2)[0]
    torch.testing.assert_close(resumed, whole, rtol=0, atol=0)
