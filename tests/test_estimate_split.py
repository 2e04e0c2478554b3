"""train.estimate_micro_batches: acco's fixed 2k micro-batches per worker per update
split unevenly, e while the estimate round runs and 2k - e while the update round runs (and for the
warm start), held to a plain single-process recurrence on 2 gloo workers; the default is the even split.
``auto`` picks e from the rounds' durations (given here, not timed), agreed by every worker and changed
only where the committed batch stays 2k."""

from __future__ import annotations

import warnings

import pytest
import torch
from distributed import run_distributed
from engine_helpers import Reference, assert_close, config, loss_fn, make_model, stream
from omegaconf import OmegaConf

import acco.engine.config
from acco.config import InputError, TrainArgs, compose
from acco.engine import ConfigError, ConfigWarning, EngineConfig, build_engine
from acco.engine.comm import RoundKind

K, WORLD, UPDATES = 2, 2, 4


def test_config(monkeypatch):
    assert EngineConfig().estimate_micro_batches is None and TrainArgs().estimate_micro_batches is None
    for e in (1, 2, 3):
        EngineConfig(method="acco", n_grad_accumulation=K, estimate_micro_batches=e)
    EngineConfig(
        method="acco", n_grad_accumulation=K, estimate_micro_batches=1, accumulate_while_waiting=True
    )
    EngineConfig(method="acco", n_grad_accumulation=K, estimate_micro_batches="auto")
    for bad in (0, 4, -1, 1.5, True, "Auto", "even"):
        with pytest.raises(
            ConfigError,
            match=r"estimate_micro_batches must be auto, null \(the even split\) or an integer in \[1, "
            r"2 n_grad_accumulation - 1 = 3\], got",
        ):
            EngineConfig(method="acco", n_grad_accumulation=K, estimate_micro_batches=bad)
    with pytest.raises(ConfigError, match="acco's estimate round only; method dpu has none"):
        EngineConfig(method="dpu", estimate_micro_batches=1)
    # the trainer's key: one line, named as the user wrote it
    with pytest.raises(InputError) as info:
        compose(["train=acco", "train.n_grad_accumulation=2", "train.estimate_micro_batches=4"])
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        "train.estimate_micro_batches must be auto, null (the even split) or an integer in [1, "
    ), message
    assert compose(["train=acco", "train.n_grad_accumulation=2", "train.estimate_micro_batches=1"]).train \
        .estimate_micro_batches == 1
    # auto at one micro-batch per round (train=acco's default) has nothing to split: said in one line,
    # where the values are used (composing validates quietly, and does not count it as said)
    monkeypatch.setattr(acco.engine.config, "_ADVISED", set())
    cfg = compose(["train=acco", "train.estimate_micro_batches=auto"])
    assert cfg.train.estimate_micro_batches == "auto"
    with pytest.warns(ConfigWarning, match=r"^train.estimate_micro_batches=auto has no split to choose at "
                      r"train.n_grad_accumulation=1: "):
        OmegaConf.to_object(cfg.train)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        compose(["train=acco", "train.n_grad_accumulation=2", "train.estimate_micro_batches=auto"])


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


def reference_split(kind: str, cfg: EngineConfig, e, lean: bool, k: int = K,
                    updates: int = UPDATES) -> tuple[torch.Tensor, list[float]]:
    """acco's recurrence (docs/algorithm.md) with the split written out: g~_t, the estimate round's
    payload, is the 2k - e micro-batches per worker computed at theta~_t while the last update round
    ran (the warm start's at theta_0); g_t, the e computed at theta_t while the estimate round runs.
    The estimate takes the LR of the update it estimates (2k W micro-batches). ``e``: one split, or
    one per update round and one for the warm start (a changing split: update t's estimate round
    computes the e that its payload left over)."""
    splits = [e] * (updates + 1) if isinstance(e, int) else e
    ref = Reference(kind, cfg, WORLD, [2 * k - splits[0]] * WORLD)
    theta = ref.theta()
    chunk = ref.next_chunk()
    g_est, n_est = ref.grad_sum(theta, chunk)[0], len(chunk)
    error = torch.zeros_like(theta)
    for t in range(updates):
        e = splits[t]
        theta_est = ref.trial(theta, g_est, n_est, update_batch=n_est + e * WORLD)
        if lean:
            theta_est = theta_est + 0.5 * error
        chunk = ref.next_chunk([e] * WORLD)
        g = ref.grad_sum(theta, chunk)[0]
        theta = ref.commit(theta, g_est + g, n_est + len(chunk))
        error = theta_est - theta
        chunk = ref.next_chunk([2 * k - splits[t + 1]] * WORLD)
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
        assert [(kind_, mb) for kind_, mb, _ in rounds] == [
            (RoundKind.ESTIMATE, [2 * K - e] * WORLD),
            (RoundKind.UPDATE, [2 * K] * WORLD),
        ] * UPDATES, (i, rounds)
        assert [r.micro_batches for r in records] == [[2 * K] * WORLD] * UPDATES
        assert [r.estimate_micro_batches for r in records] == [e] * UPDATES  # logged with each update
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
            state = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in engine.state_dict().items()
            }
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
    cfg = config(
        method="acco", n_grad_accumulation=K, nb_steps_tot=2 * K * WORLD * UPDATES, estimate_micro_batches=1
    )
    whole, resumed = run_distributed(_resume, WORLD, "mlp", cfg, 2)[0]
    torch.testing.assert_close(resumed, whole, rtol=0, atol=0)


# ---- estimate_micro_batches=auto ---------------------------------------------------------------

AUTO_K, AUTO_UPDATES = 4, 7
# Round durations (s) the engine is told, per rank: (estimate, update). Rank 1's estimate round is
# relatively shorter, so it proposes fewer micro-batches than rank 0, whose proposal wins.
DURATIONS = {0: (0.1, 0.5), 1: (0.02, 0.58)}


def expected_auto_splits(updates: int, k: int = AUTO_K, prior: float = 0.5) -> list[int]:
    """The rule written out (docs/algorithm.md, "The split"): each worker's share of comm time taken by
    the estimate round, a running average from `prior` with weight SPLIT_SMOOTHING; its proposal
    round(2k share) in [1, 2k - 1]; an update round carries every worker's current proposal, the
    largest is adopted when the next update round is launched. Returns the e of the warm start and
    of each update round."""
    from acco.engine.estimate import SPLIT_SMOOTHING

    shares, adopted = dict.fromkeys(DURATIONS, prior), []
    proposal = {r: min(max(int(2 * k * prior + 0.5), 1), 2 * k - 1) for r in DURATIONS}
    e = carried = proposal[0]
    adopted.append(e)
    for _ in range(updates):
        e = carried  # adopted at this update round's launch
        adopted.append(e)
        carried = max(proposal.values())  # what this update round carries
        for r, (est, upd) in DURATIONS.items():  # noted once the round is back
            shares[r] += SPLIT_SMOOTHING * (est / (est + upd) - shares[r])
            proposal[r] = min(max(int(2 * k * shares[r] + 0.5), 1), 2 * k - 1)
    return adopted


def _train_auto(rank, world, kind, cfg, stop=None):
    """Train with the round durations of DURATIONS[rank]; returns (params, records, rounds). With
    `stop`: checkpoint in memory after that many updates and resume with a fresh engine."""

    def build():
        model = make_model(kind)
        engine = build_engine(model, cfg)
        run, note = engine.comm.run, engine.split.note_round

        def recorded(payload, stats, new_params, round_kind, *args):
            result = run(payload, stats, new_params, round_kind, *args)
            rounds.append((result.kind, result.micro_batches, result.lr))
            return result

        engine.comm.run = recorded
        # the compute side notes each round's duration as given, not as timed
        engine.split.note_round = lambda kind, busy_s: note(kind, DURATIONS[rank][kind is RoundKind.UPDATE])
        return model, engine

    rounds, data = [], stream(kind, rank, world)
    model, engine = build()
    records = []
    for record in engine.run(data, loss_fn):
        records.append(record)
        if record.step == stop:
            break
    if stop is not None:
        state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in engine.state_dict().items()}
        engine.finish()
        engine.close()
        model, engine = build()
        assert engine.load_state_dict(state)
        records += list(engine.run(data, loss_fn))
    engine.close()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), records, rounds


def test_auto_split_follows_the_rounds_durations_and_keeps_the_batch():
    kind = "mlp"
    cfg = config(method="acco", n_grad_accumulation=AUTO_K, nb_steps_tot=2 * AUTO_K * WORLD * AUTO_UPDATES,
                 warmup=40, estimate_micro_batches="auto")
    results = run_distributed(_train_auto, WORLD, kind, cfg)
    splits = expected_auto_splits(AUTO_UPDATES)
    assert len(set(splits)) >= 3, splits  # the split moved (4, then 3, then 2 here)
    params, records, rounds = results[0]
    # the committed batch is 2k per worker in every update, whatever the split
    assert [r.micro_batches for r in records] == [[2 * AUTO_K] * WORLD] * AUTO_UPDATES
    assert [r.estimate_micro_batches for r in records] == splits[1:]  # each update logs its split
    # each estimate round's payload was computed while the last update round ran: 2k - that round's e
    assert [mb for kind_, mb, _ in rounds[0::2]] == [[2 * AUTO_K - e] * WORLD for e in splits[:-1]], rounds
    assert all(kind_ is RoundKind.ESTIMATE for kind_, _, _ in rounds[0::2])
    expected, ref_lrs = reference_split(kind, cfg, splits, lean=True, k=AUTO_K, updates=AUTO_UPDATES)
    assert_close(params, expected, "estimate_micro_batches=auto")
    lrs = [lr for _, _, lr in rounds]
    assert lrs[0::2] == lrs[1::2] and lrs[1::2] == pytest.approx(ref_lrs, rel=1e-6)
    # every worker adopted the same split (rank 1 proposed less): the same parameters
    torch.testing.assert_close(results[1][0], params, rtol=0, atol=0)
    assert results[1][2] == rounds


def test_auto_split_resumes_exactly():
    cfg = config(method="acco", n_grad_accumulation=AUTO_K, nb_steps_tot=2 * AUTO_K * WORLD * AUTO_UPDATES,
                 estimate_micro_batches="auto")
    whole = run_distributed(_train_auto, WORLD, "mlp", cfg)[0]
    resumed = run_distributed(_train_auto, WORLD, "mlp", cfg, 3)[0]
    torch.testing.assert_close(resumed[0], whole[0], rtol=0, atol=0)
    assert [r.micro_batches for r in resumed[1]] == [r.micro_batches for r in whole[1]]


def test_auto_split_starts_from_the_bytes_of_an_int8_estimate_round():
    """With an int8 estimate round, before any round is measured, e is 2k times the estimate round's
    share of the bytes: about 1 / (1 + 4) of them in fp32."""
    model = make_model("mlp")
    engine = build_engine(
        model,
        config(
            method="acco", n_grad_accumulation=AUTO_K, estimate_micro_batches="auto", estimate_comm="int8"
        ),
    )
    assert engine.split.e == round(2 * AUTO_K * 0.2) == 2
    engine.close()
    engine = build_engine(make_model("mlp"), config(method="acco", n_grad_accumulation=AUTO_K,
                                                    estimate_micro_batches="auto"))
    assert engine.split.e == AUTO_K  # a full estimate round: the even split until measured
    engine.close()
