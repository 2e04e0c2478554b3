"""Every method, run on real gloo processes, equals a plain single-process reference of the spec.

The reference (acco_bench/reference.py, on engine_helpers.py's toy models) is written the plain
way: one model, torch.optim.AdamW, gradients summed micro-batch by micro-batch at the parameters
the spec says, trial steps computed on a deep copy.
The engine runs with fixed micro-batch counts (accumulate_while_waiting off) so that which
micro-batch lands in which round is known; `test_time_varying_counts` covers the other mode.
"""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_distributed
from engine_helpers import Reference, assert_close, config, reference_acco, reference_delayed, run_engine

from acco.config import InputError, compose
from acco.engine import ConfigError, EngineConfig


# max_grad_norm between the gradient norms these runs see (mlp 0.39-0.55, block 0.63-0.92
# unclipped), so that some updates are clipped and others not, acco's estimates included.
# fake-cuda: the engines' GPU paths (comm stream, events, timing) on the CPU, CUDA's rules checked
@pytest.mark.parametrize("kind,world,clip,device", [("mlp", 2, 0.45, "host"), ("block", 3, 0.7, "host"),
                                                    ("mlp", 2, 0.45, "fake-cuda")])
def test_methods_equal_their_references(kind, world, clip, device):
    n, updates = 2, 6
    budget_ddp = n * world * updates
    cfgs = [
        config(method="ddp", n_grad_accumulation=n, nb_steps_tot=budget_ddp, max_grad_norm=clip),
        config(method="torch-ddp", n_grad_accumulation=n, nb_steps_tot=budget_ddp, max_grad_norm=clip),
        config(method="acco", n_grad_accumulation=n // 2, nb_steps_tot=budget_ddp, max_grad_norm=clip,
               acco_estimate="paper"),
        config(method="acco", n_grad_accumulation=n // 2, nb_steps_tot=budget_ddp, max_grad_norm=clip,
               acco_estimate="lean"),
        config(method="dpu", n_grad_accumulation=n, nb_steps_tot=budget_ddp, max_grad_norm=clip),
        config(method="wp", n_grad_accumulation=n, nb_steps_tot=budget_ddp, max_grad_norm=clip),
    ]
    results = run_distributed(run_engine, world, kind, cfgs, 0.0, None, device)
    (ddp, ddp_rec), (tddp, tddp_rec), (acco, acco_rec), (lean, _), (dpu, dpu_rec), (wp, wp_rec) = results[0]
    for rank_result in results[1:]:  # every worker ends with the same parameters
        for (theta, _), (theta0, _) in zip(rank_result, results[0]):
            assert torch.equal(theta, theta0)

    ref = Reference(kind, cfgs[0], world, [n] * world)
    expected = ref.ddp(updates)
    assert [r.step for r in ddp_rec] == list(range(1, updates + 1))
    assert [r.committed_micro_batches for r in ddp_rec] == [n * world * (t + 1) for t in range(updates)]
    assert_close(ddp, expected, "ddp vs AdamW on the global batches")
    assert_close(torch.tensor([r.loss for r in ddp_rec]), torch.tensor(ref.losses), "ddp losses")
    assert_close(tddp, expected, "torch-ddp vs AdamW on the global batches")
    assert_close(torch.tensor([r.loss for r in tddp_rec]), torch.tensor(ref.losses), "torch-ddp losses")
    norms = torch.tensor(ref.grad_norms)
    assert norms.min() < clip < norms.max(), f"clipping should act on some updates only: {norms}"
    assert_close(torch.tensor([r.grad_norm for r in ddp_rec]), norms, "ddp gradient norms")
    assert_close(torch.tensor([r.grad_norm for r in tddp_rec]), norms, "torch-ddp gradient norms")

    ref = Reference(kind, cfgs[2], world, [n // 2] * world)
    expected = reference_acco(ref, updates)
    assert len(acco_rec) == updates
    assert [r.micro_batches for r in acco_rec] == [[n] * world] * updates
    assert_close(acco, expected, "acco vs the estimate/update reference")
    assert_close(torch.tensor([r.loss for r in acco_rec]), torch.tensor(ref.losses), "acco losses")
    assert_close(
        torch.tensor([r.grad_norm for r in acco_rec]), torch.tensor(ref.grad_norms), "acco gradient norms"
    )
    ref = Reference(kind, cfgs[3], world, [n // 2] * world)
    assert_close(lean, reference_acco(ref, updates, lean=True), "acco_estimate=lean vs its reference")
    assert (lean - acco).abs().max() > 10 * 2e-5  # the correction shows, well beyond the tolerance

    for name, got, records, predict in (("dpu", dpu, dpu_rec, False), ("wp", wp, wp_rec, True)):
        ref = Reference(kind, cfgs[0], world, [n] * world)
        expected = reference_delayed(ref, updates, predict)
        assert len(records) == updates
        assert_close(got, expected, f"{name} vs its recurrence")
        assert_close(torch.tensor([r.loss for r in records]), torch.tensor(ref.losses), f"{name} losses")
    # The methods differ from each other: the comparisons above are not vacuous.
    assert not torch.allclose(acco, dpu, atol=1e-4) and not torch.allclose(dpu, wp, atol=1e-4)


def test_unequal_counts_give_the_count_weighted_mean():
    """Worker 0 accumulates 3 micro-batches per round, worker 1 only 1: every gradient counts once,
    for every method (acco: 3 and 1 per round; also with 2 sequential warm-up updates)."""
    updates = 5
    budget = 4 * updates

    def per_rank(method, **kw):
        return [config(method=method, n_grad_accumulation=n, nb_steps_tot=budget, **kw) for n in (3, 1)]

    cfgs = [per_rank("ddp"), per_rank("torch-ddp"), per_rank("dpu"),
            [config(method="acco", n_grad_accumulation=n, nb_steps_tot=2 * budget, acco_estimate="paper")
             for n in (3, 1)],
            [config(method="acco", n_grad_accumulation=n, nb_steps_tot=2 * budget, n_warmup_steps=2,
                    acco_estimate="paper") for n in (3, 1)],
            [config(method="acco", n_grad_accumulation=n, nb_steps_tot=2 * budget, n_warmup_steps=2,
                    acco_estimate="lean") for n in (3, 1)]]  # fmt: skip
    (ddp, ddp_rec), (tddp, tddp_rec), (dpu, _), (acco, acco_rec), (acco_w, acco_w_rec), (lean, _) = (
        run_distributed(run_engine, 2, "mlp", cfgs)[0]
    )
    assert [r.micro_batches for r in ddp_rec] == [[3, 1]] * updates
    assert [r.micro_batches for r in tddp_rec] == [[3, 1]] * updates
    ref = Reference("mlp", cfgs[0][0], 2, [3, 1])
    expected = ref.ddp(updates)
    assert_close(ddp, expected, "ddp with counts 3 and 1")
    assert_close(tddp, expected, "torch-ddp with counts 3 and 1")
    assert_close(torch.tensor([r.loss for r in tddp_rec]), torch.tensor(ref.losses), "torch-ddp losses")
    expected = reference_delayed(Reference("mlp", cfgs[2][0], 2, [3, 1]), updates, predict=False)
    assert_close(dpu, expected, "dpu with counts 3 and 1")
    assert [r.micro_batches for r in acco_rec] == [[6, 2]] * updates
    ref = Reference("mlp", cfgs[3][0], 2, [3, 1])
    assert_close(acco, reference_acco(ref, updates), "acco with counts 3 and 1")
    assert_close(torch.tensor([r.loss for r in acco_rec]), torch.tensor(ref.losses), "acco losses")
    # n_warmup_steps: two ddp updates of both rounds' micro-batches, then acco from its warm start.
    assert [r.micro_batches for r in acco_w_rec] == [[6, 2]] * updates
    ref = Reference("mlp", cfgs[4][0], 2, [3, 1])
    assert_close(acco_w, reference_acco(ref, updates - 2, sequential_updates=2), "acco after 2 ddp updates")
    assert not torch.allclose(acco_w, acco, atol=1e-4)
    # acco_estimate=lean after sequential updates, which must leave its error at zero (a commit
    # without a pending estimate that took its error would be off by theta)
    ref = Reference("mlp", cfgs[5][0], 2, [3, 1])
    assert_close(lean, reference_acco(ref, updates - 2, sequential_updates=2, lean=True), "lean acco")
    # Averaging per worker first (the mistake this guards against) would give something else.
    wrong = Reference("mlp", cfgs[0][0], 2, [3, 1])
    theta = wrong.theta()
    chunk = wrong.next_chunk()
    g0, _ = wrong.grad_sum(theta, chunk[:3])
    g1, _ = wrong.grad_sum(theta, chunk[3:])
    per_worker_mean = wrong.commit(theta, (g0 / 3 + g1) / 2 * 4, 4)
    first = Reference("mlp", cfgs[0][0], 2, [3, 1]).ddp(1)
    assert not torch.allclose(per_worker_mean, first, atol=1e-5)


def test_time_varying_counts_with_accumulate_while_waiting():
    """With a slow comm round, workers keep accumulating (uncapped: the paper's); the update is the
    mean over all of them."""
    cfg = config(method="dpu", n_grad_accumulation=1, nb_steps_tot=150, accumulate_while_waiting=True,
                 accumulate_cap=None)  # fmt: skip
    theta, records = run_distributed(run_engine, 2, "mlp", [cfg], 0.02)[0][0]
    counts = [r.micro_batches for r in records]
    assert counts[0] == [1, 1]  # the warm start computes exactly n_grad_accumulation
    assert any(sum(c) > 2 for c in counts[1:]), f"no worker accumulated while waiting: {counts}"
    assert records[-1].committed_micro_batches == sum(map(sum, counts)) >= 150
    # dpu: the micro-batches of update k are those computed during round k-1 (k = 0: warm start).
    expected = reference_delayed(Reference("mlp", cfg, 2, [1, 1]), len(records), False, counts + [[1, 1]])
    assert_close(theta, expected, "dpu with time-varying counts")


def test_accumulate_cap_bounds_what_a_round_gathers_while_waiting():
    """A round as slow as many micro-batches still gathers at most cap x its minimum per worker,
    rounded down (dpu: 1.5 x 3 -> 4), and the update is still the mean over what was gathered."""
    dpu = config(method="dpu", n_grad_accumulation=3, nb_steps_tot=120, accumulate_while_waiting=True,
                 accumulate_cap=1.5)  # fmt: skip
    acco = config(method="acco", n_grad_accumulation=2, nb_steps_tot=96, accumulate_while_waiting=True,
                  accumulate_cap=2)  # fmt: skip
    (theta, records), (_, acco_records) = run_distributed(run_engine, 2, "mlp", [dpu, acco], 0.05)[0]
    counts = [r.micro_batches for r in records]
    assert counts[0] == [3, 3] and all(max(c) <= 4 for c in counts), counts
    assert any(max(c) == 4 for c in counts[1:]), f"the slow round did not fill the cap: {counts}"
    expected = reference_delayed(Reference("mlp", dpu, 2, [3, 3]), len(records), False, counts + [[3, 3]])
    assert_close(theta, expected, "dpu with capped counts")
    # acco: two rounds of at least 2 micro-batches each per update, so at most 2 x 4 per worker
    acco_counts = [r.micro_batches for r in acco_records]
    assert all(max(c) <= 8 for c in acco_counts) and any(max(c) == 8 for c in acco_counts[1:]), acco_counts


@pytest.mark.parametrize("settings, fixed", [
    (dict(method="acco", n_grad_accumulation=1), True),  # train=acco: 1.5 x 1 rounds down to 1
    (dict(method="acco", n_grad_accumulation=1, accumulate_cap=2), False),
    (dict(method="acco", n_grad_accumulation=1, accumulate_cap=None), False),
    (dict(method="acco", n_grad_accumulation=2), False),  # 1.5 x 2 = 3
    (dict(method="acco", n_grad_accumulation=2, accumulate_cap=1.4), True),
    (dict(method="acco", n_grad_accumulation=2, accumulate_cap=1.4, estimate_micro_batches=1), False),  # 4.2
    (dict(method="acco", n_grad_accumulation=2, accumulate_cap=1.4, estimate_micro_batches="auto"), False),
    (dict(method="acco", n_grad_accumulation=4, accumulate_while_waiting=False), True),
    (dict(method="dpu", n_grad_accumulation=2), False),  # train=dpu and train=wp: 2 grows to 3
    (dict(method="wp", n_grad_accumulation=1), True),
    (dict(method="ddp", n_grad_accumulation=2), True),  # never computes while a round runs
    (dict(method="torch-ddp", n_grad_accumulation=2), True),
    (dict(method="torch-hsdp", n_grad_accumulation=2), True),
    (dict(method="diloco", n_grad_accumulation=2), True),
])  # fmt: skip
def test_a_fixed_batch_is_one_no_round_can_grow(settings, fixed):
    """fixed_batch decides whether a checkpoint keeps the accumulator and a resume says "exactly":
    true where no round's minimum (acco: e and 2k - e, any e under auto) grows under the cap."""
    cfg = EngineConfig(**settings)
    assert cfg.fixed_batch is fixed
    assert cfg.most_micro_batches(3) == (3 if not cfg.accumulate_while_waiting else
                                         math.inf if cfg.accumulate_cap is None else
                                         max(3, int(3 * cfg.accumulate_cap)))  # fmt: skip


def test_accumulate_cap_is_checked_where_it_is_set():
    assert EngineConfig(method="acco", accumulate_cap=1.5).accumulate_cap == 1.5
    for bad in (0, -1, 0.5, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ConfigError, match="accumulate_cap must be a number >= 1 or null"):
            EngineConfig(method="acco", accumulate_cap=bad)
    with pytest.raises(InputError) as info:  # the CLI's key: one line, named as the user wrote it
        compose(["train=acco", "train.accumulate_cap=0"])
    line = str(info.value)
    assert "\n" not in line and line.startswith("train.accumulate_cap must be"), line
    assert compose(["train=acco", "train.accumulate_cap=2"]).train.accumulate_cap == 2
    # 1.5 by default (BENCHMARKS.md, "Comm share 0.6, the paper's setting, and the accumulate cap"),
    # null for the paper's uncapped setting
    assert EngineConfig().accumulate_cap == 1.5 and compose(["train=dpu"]).train.accumulate_cap == 1.5
    assert compose(["train=acco", "train.accumulate_cap=null"]).train.accumulate_cap is None
