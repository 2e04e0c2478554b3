"""Shared by the engine tests: toy models and micro-batches, an engine config, a runner for
`distributed.run_distributed`, and the plain reference of the recurrences
(`acco_bench.reference.Reference`) on those models and micro-batches."""

from __future__ import annotations

import itertools

import fake_cuda
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from acco.engine import EngineConfig, build_engine
from acco_bench import reference

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


class Stack(nn.Module):
    """The mlp's data, through repeated blocks (a ModuleList: FSDP2 units under sharding inside the
    node) between layers whose rows (5) do not divide by 2 workers: shards of unequal rows."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 5)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Tanh(), nn.Linear(5, 5)) for _ in range(2))
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(torch.tanh(x))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    if kind == "stack":
        return Stack()
    return TinyBlock()


def micro_batch(kind: str, index: int):
    gen = torch.Generator().manual_seed(10_000 + index)
    shape = (MICRO_BATCH, 5, 8) if kind == "block" else (MICRO_BATCH, 8)
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


def run_engine(rank, world, kind, cfgs, delay_s=0.0, measure=None, device="host"):
    """Runs on every rank: train a fresh model with each config, return final params and records
    (and `measure(engine, model)`, taken before the engine closes, when given); `device`
    "fake-cuda" runs the engines' GPU paths on the CPU (tests/fake_cuda.py)."""
    with fake_cuda.maybe_installed(device):
        return _run_engine(rank, world, kind, cfgs, delay_s, measure)


def _run_engine(rank, world, kind, cfgs, delay_s, measure):
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


def assert_close(a, b, what):
    torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")


class Reference(reference.Reference):
    """The plain reference on a fresh `make_model(kind)`: worker r reads the global micro-batches
    r, r + W, r + 2W, ... (as `stream`), with `loss_fn`."""

    def __init__(self, kind: str, cfg: EngineConfig, world: int, counts: list[int]):
        super().__init__(
            make_model(kind),
            cfg,
            world,
            counts,
            read=lambda r, j: micro_batch(kind, j * world + r),
            loss_fn=loss_fn,
        )


def reference_acco(
    ref: Reference, updates: int, sequential_updates: int = 0, lean: bool = False
) -> torch.Tensor:
    return ref.acco(updates, sequential_updates, lean)


def reference_delayed(ref: Reference, updates: int, predict: bool, counts_per_round=None) -> torch.Tensor:
    return ref.delayed(updates, predict, counts_per_round)


def reference_diloco(
    kind: str, cfg: EngineConfig, world: int, workers_per_replica: int = 1
) -> tuple[torch.Tensor, list[float]]:
    """Final global parameters and replica 0's loss per inner step. A replica of S =
    `workers_per_replica` workers (diloco on nodes of S) takes each inner step on its workers'
    micro-batches together: the reference's replica q reads, per inner step, worker q S's n
    micro-batches, then worker q S + 1's, ..., as those workers' streams hold them; the mean of
    their gradients is its step's. S = 1: worker q is replica q, read as `stream`."""
    S, n = workers_per_replica, cfg.n_grad_accumulation
    replicas = world // S

    def read(q: int, j: int):
        step, k = divmod(j, S * n)  # the replica's j-th micro-batch: worker q S + s's (step n + i)-th
        s, i = divmod(k, n)
        return micro_batch(kind, (step * n + i) * world + q * S + s)

    ref = reference.Reference(make_model(kind), cfg, replicas, [S * n] * replicas, read=read, loss_fn=loss_fn)
    return ref.diloco(), ref.losses


def five_methods(n: int, **common) -> list[EngineConfig]:
    """ddp, acco (paper and lean), dpu and wp at one batch: n micro-batches per worker per update
    (acco n / 2 per round), each with `common`; what `check_five_methods` checks."""
    return [
        config(method="ddp", n_grad_accumulation=n, **common),
        config(method="acco", n_grad_accumulation=n // 2, acco_estimate="paper", **common),
        config(method="acco", n_grad_accumulation=n // 2, acco_estimate="lean", **common),
        config(method="dpu", n_grad_accumulation=n, **common),
        config(method="wp", n_grad_accumulation=n, **common),
    ]


def check_five_methods(kind: str, cfgs, world: int, n: int, updates: int, results: list, where: str) -> None:
    """`results` (per rank: each of `five_methods`' runs, (parameters, records, ...)): the same on
    every rank, and each method's equal to its plain reference; `where` names the layout."""
    for rank_result in results[1:]:
        for (theta, *_), (theta0, *_) in zip(rank_result, results[0]):
            assert torch.equal(theta, theta0)
    (ddp, ddp_rec, *_), (acco, *_), (lean, *_), (dpu, *_), (wp, *_) = results[0]
    ref = Reference(kind, cfgs[0], world, [n] * world)
    assert_close(ddp, ref.ddp(updates), f"ddp {where} vs AdamW on the global batches")
    assert_close(torch.tensor([r.loss for r in ddp_rec]), torch.tensor(ref.losses), "ddp losses")
    assert_close(torch.tensor([r.grad_norm for r in ddp_rec]), torch.tensor(ref.grad_norms), "ddp norms")
    ref = Reference(kind, cfgs[1], world, [n // 2] * world)
    assert_close(acco, reference_acco(ref, updates), f"acco {where} vs the estimate/update reference")
    ref = Reference(kind, cfgs[2], world, [n // 2] * world)
    assert_close(lean, reference_acco(ref, updates, lean=True), f"acco lean {where} vs its reference")
    for name, got, predict in (("dpu", dpu, False), ("wp", wp, True)):
        ref = Reference(kind, cfgs[0], world, [n] * world)
        assert_close(got, reference_delayed(ref, updates, predict), f"{name} {where} vs its recurrence")
