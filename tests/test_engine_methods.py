"""Every method, run on real gloo processes, equals a plain single-process reference of the spec.

The references below are written the plain way: one model, torch.optim.AdamW, gradients summed
micro-batch by micro-batch at the parameters the spec says, trial steps computed on a deep copy.
The engine runs with fixed micro-batch counts (accumulate_while_waiting off) so that which
micro-batch lands in which round is known; `test_time_varying_counts` covers the other mode.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.nn.utils import clip_grad_norm_, parameters_to_vector, vector_to_parameters

from acco.engine import EngineConfig, build_engine

MICRO_BATCH = 4


class TinyBlock(nn.Module):
    """A transformer encoder block and a head: attention, layer norms, MLP.

    No biases in the block: the key bias's gradient is zero in exact arithmetic, and Adam turns
    its rounding noise into full-size steps that no two summation orders agree on.
    """

    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(
            8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True, bias=False
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.block(x))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return TinyBlock()


def micro_batch(kind: str, index: int):
    gen = torch.Generator().manual_seed(10_000 + index)
    shape = (MICRO_BATCH, 8) if kind == "mlp" else (MICRO_BATCH, 5, 8)
    x = torch.randn(shape, generator=gen)
    y = torch.sin(x[..., :4] * 1.5) + 0.1 * torch.randn(x[..., :4].shape, generator=gen)
    return x, y


def loss_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def stream(kind: str, rank: int, world: int):
    """Worker `rank` reads global micro-batches rank, rank + W, rank + 2W, ..."""
    for j in itertools.count():
        yield micro_batch(kind, j * world + rank)


def reference_lr(cfg: EngineConfig, samples_before: int, batch: int) -> float:
    """The schedule, written out: linear warm-up over `warmup` micro-batches counting this
    update's batch, then cosine decay from the samples before it to `nb_steps_tot`."""
    if samples_before < cfg.warmup:
        return cfg.learning_rate * min(1.0, (samples_before + batch) / cfg.warmup)
    progress = min(1.0, (samples_before - cfg.warmup) / (cfg.nb_steps_tot - cfg.warmup))
    return cfg.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))


def config(**kw) -> EngineConfig:
    base = dict(
        learning_rate=2e-2,
        # An eps near the gradients' size makes AdamW sensitive to their scale: a wrong
        # normalisation (N) then changes the parameters instead of cancelling out.
        adam_eps=1e-2,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        scheduler_name="cosine",
        warmup=4,
        accumulate_while_waiting=False,
        max_grad_norm=None,
    )
    base.update(kw)
    return EngineConfig(**base)


def run_engine(rank, world, kind, cfgs, delay_s=0.0, measure=None):
    """Runs on every rank: train a fresh model with each config, return final params and records
    (and `measure(engine, model)`, taken before the engine closes, when given)."""
    out = []
    for cfg in cfgs:
        if isinstance(cfg, list):  # per-rank configs
            cfg = cfg[rank]
        model = make_model(kind)
        engine = build_engine(model, cfg)
        if delay_s:
            import time

            engine.comm.delay_hook = lambda: time.sleep(delay_s)
        records = list(engine.run(stream(kind, rank, world), loss_fn))
        extra = () if measure is None else (measure(engine, model),)
        engine.close()
        out.append((parameters_to_vector(model.parameters()).detach().float(), records, *extra))
    return out


def decay_groups(model, weight_decay: float) -> list[dict]:
    """Hugging Face's and nanoGPT's convention: decay the matrices and embeddings, not the
    biases and norm weights."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


class Reference:
    """Plain single-process AdamW with the spec's operations on flat parameter vectors."""

    def __init__(self, kind: str, cfg: EngineConfig, world: int, counts: list[int]):
        self.kind, self.cfg, self.world, self.counts = kind, cfg, world, counts
        self.model = make_model(kind)
        self.opt = torch.optim.AdamW(
            decay_groups(self.model, cfg.weight_decay),
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
        )
        self.samples = 0
        self.consumed = [0] * world  # micro-batches read so far by each worker
        self.losses = []
        self.grad_norms = []  # of committed updates, before clipping

    def theta(self) -> torch.Tensor:
        return parameters_to_vector(self.model.parameters()).detach().clone()

    def next_chunk(self, counts=None) -> list[int]:
        """The global micro-batch indices every worker reads in its next round."""
        chunk = []
        for r, n in enumerate(counts or self.counts):
            chunk += [(self.consumed[r] + j) * self.world + r for j in range(n)]
            self.consumed[r] += n
        return chunk

    def grad_sum(self, theta: torch.Tensor, chunk: list[int]) -> tuple[torch.Tensor, float]:
        """Sum over the chunk's micro-batches of their gradients at theta (and of their losses)."""
        probe = copy.deepcopy(self.model)
        vector_to_parameters(theta.clone(), probe.parameters())  # (it makes params views of the vector)
        total, loss_sum = None, 0.0
        for i in chunk:
            probe.zero_grad()
            loss = loss_fn(probe, micro_batch(self.kind, i))
            loss.backward()
            g = parameters_to_vector([p.grad for p in probe.parameters()])
            total = g if total is None else total + g
            loss_sum += loss.item()
        return total, loss_sum

    def _step(self, model, opt, theta, mean_grad, lr):
        """(AdamW's new parameters, the gradient's norm before torch's clip_grad_norm_)."""
        vector_to_parameters(theta.clone(), model.parameters())
        offset = 0
        for p in model.parameters():
            p.grad = mean_grad[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        norm = float(clip_grad_norm_(model.parameters(), self.cfg.max_grad_norm or math.inf))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        return parameters_to_vector(model.parameters()).detach().clone(), norm

    def commit(self, theta, grad_sum, batch):
        lr = reference_lr(self.cfg, self.samples, batch)
        theta, norm = self._step(self.model, self.opt, theta, grad_sum / batch, lr)
        self.grad_norms.append(norm)
        self.samples += batch
        return theta

    def trial(self, theta, grad_sum, batch, update_batch):
        """Opt_trial: the step of the update it estimates (that update's LR, for update_batch
        micro-batches), on copies: the optimizer itself is left as it was."""
        model, opt = copy.deepcopy((self.model, self.opt))
        lr = reference_lr(self.cfg, self.samples, update_batch)
        return self._step(model, opt, theta, grad_sum / batch, lr)[0]

    def ddp(self, updates: int, counts=None):
        theta = self.theta()
        for _ in range(updates):
            chunk = self.next_chunk(counts)
            g, loss = self.grad_sum(theta, chunk)
            self.losses.append(loss / len(chunk))
            theta = self.commit(theta, g, len(chunk))
        return theta


def reference_acco(ref: Reference, updates: int, sequential_updates: int = 0, lean: bool = False) -> torch.Tensor:
    """`sequential_updates` (n_warmup_steps) first updates run as ddp on both rounds' micro-batches.
    `lean`: every estimate adds half of the last estimate's error theta~_t - theta_t."""
    ref.ddp(sequential_updates, [2 * n for n in ref.counts])
    theta = ref.theta()
    chunk = ref.next_chunk()
    g_est, loss_est = ref.grad_sum(theta, chunk)  # warm start: g~_0 at theta_0
    n_est = len(chunk)
    error = torch.zeros_like(theta)
    for _ in range(updates):
        # estimate round: theta~_{t+1} = Opt_trial(theta_t, g~_t); meanwhile g_t at theta_t
        theta_est = ref.trial(theta, g_est, n_est, update_batch=n_est + sum(ref.counts))
        if lean:
            theta_est = theta_est + 0.5 * error
        chunk = ref.next_chunk()
        g, loss = ref.grad_sum(theta, chunk)
        # update round: theta_{t+1} = Opt(theta_t, (g~_t + g_t) / N); meanwhile g~_{t+1} at theta~_{t+1}
        batch = n_est + len(chunk)
        ref.losses.append((loss_est + loss) / batch)
        theta = ref.commit(theta, g_est + g, batch)
        error = theta_est - theta
        chunk = ref.next_chunk()
        g_est, loss_est = ref.grad_sum(theta_est, chunk)
        n_est = len(chunk)
    return theta


def reference_delayed(ref: Reference, updates: int, predict: bool, counts_per_round=None) -> torch.Tensor:
    """dpu: theta_{k+1} = Opt(theta_k, g(theta_{k-1})); wp: the gradient is taken at the prediction
    2 theta_{k-1} - theta_{k-2} instead (theta_{-1} = theta_0)."""
    counts_per_round = counts_per_round or [None] * (updates + 1)
    thetas = [ref.theta()]
    chunk = ref.next_chunk(counts_per_round[0])
    g, loss = ref.grad_sum(thetas[0], chunk)
    n = len(chunk)
    computed_at = thetas[0]
    for k in range(updates):
        ref.losses.append(loss / n)
        thetas.append(ref.commit(thetas[-1], g, n))
        # during round k+1 the model held the parameters swapped in after round k
        chunk = ref.next_chunk(counts_per_round[k + 1])
        g, loss = ref.grad_sum(computed_at, chunk)
        n = len(chunk)
        if predict:
            computed_at = 2 * thetas[-1] - thetas[-2]
        else:
            computed_at = thetas[-1]
    return thetas[-1]


def assert_close(a, b, what):
    torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")


# max_grad_norm between the gradient norms these runs see (mlp 0.39-0.55, block 0.63-0.92
# unclipped), so that some updates are clipped and others not, acco's estimates included.
@pytest.mark.parametrize("kind,world,clip", [("mlp", 2, 0.45), ("block", 3, 0.7)])
def test_methods_equal_their_references(kind, world, clip):
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
    results = run_distributed(run_engine, world, kind, cfgs)
    (ddp, ddp_rec), (tddp, tddp_rec), (acco, acco_rec), (lean, _), (dpu, dpu_rec), (wp, wp_rec) = results[0]
    for rank_result in results[1:]:  # every worker ends with the same parameters
        for (theta, _), (theta0, _) in zip(rank_result, results[0]):
            assert torch.equal(theta, theta0)

    ref = Reference(kind, cfgs[0], world, [n] * world)
    expected = ref.ddp(updates)
    assert [r.step for r in ddp_rec] == list(range(1, updates + 1))
    assert [r.samples for r in ddp_rec] == [n * world * (t + 1) for t in range(updates)]
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
    assert_close(torch.tensor([r.grad_norm for r in acco_rec]), torch.tensor(ref.grad_norms), "acco gradient norms")
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
            [config(method="acco", n_grad_accumulation=n, nb_steps_tot=2 * budget, acco_estimate="paper") for n in (3, 1)],
            [config(method="acco", n_grad_accumulation=n, nb_steps_tot=2 * budget, n_warmup_steps=2,
                    acco_estimate="paper") for n in (3, 1)],
            [config(method="acco", n_grad_accumulation=n, nb_steps_tot=2 * budget, n_warmup_steps=2,
                    acco_estimate="lean") for n in (3, 1)]]  # fmt: skip
    (ddp, ddp_rec), (tddp, tddp_rec), (dpu, _), (acco, acco_rec), (acco_w, acco_w_rec), (lean, _) = run_distributed(
        run_engine, 2, "mlp", cfgs
    )[0]
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
    """With a slow comm round, workers keep accumulating; the update is the mean over all of them."""
    cfg = config(method="dpu", n_grad_accumulation=1, nb_steps_tot=150, accumulate_while_waiting=True)
    theta, records = run_distributed(run_engine, 2, "mlp", [cfg], 0.02)[0][0]
    counts = [r.micro_batches for r in records]
    assert counts[0] == [1, 1]  # the warm start computes exactly n_grad_accumulation
    assert any(sum(c) > 2 for c in counts[1:]), f"no worker accumulated while waiting: {counts}"
    assert records[-1].samples == sum(map(sum, counts)) >= 150
    # dpu: the micro-batches of update k are those computed during round k-1 (k = 0: warm start).
    expected = reference_delayed(Reference("mlp", cfg, 2, [1, 1]), len(records), False, counts + [[1, 1]])
    assert_close(theta, expected, "dpu with time-varying counts")
