"""acco's split of an update between its two rounds, and the parameters a round sends ahead of the
committed ones: acco's estimate theta~_{t+1} and wp's prediction 2 theta_{t+1} - theta_t.

The split (docs/algorithm.md, "The split"): a worker computes e micro-batches while an estimate
round runs and 2k - e while an update round runs, so that every update holds 2k; `EstimateSplit`
holds e and all of its arithmetic. The engine (decoupled.py) decides it, the round (comm.py)
reads it.

acco's estimate, `acco_estimate: lean` (the default; `paper` is the paper's form): the estimate
error e_t = theta~_t - theta_t feeds back into the next estimate through the half-batch gradient
taken at theta~_t. On a quadratic with
AdamW's preconditioned curvature a, e_{t+1} = -(1 - beta1) a / 2 * e_t: the loop diverges from
a = 2 / (1 - beta1) = 20, while Adam itself is stable up to a = 38. High learning rates, where
training runs at Adam's edge of stability, are exactly where the paper's estimate drifts. Adding
half of the last error to the next estimate, theta~_{t+1} = Opt_trial(theta_t, g~_t) + e_t / 2,
moves that limit to a = 30 at the cost of one fp32 shard (4 P / W bytes). In the learning-rate
sweep (BENCHMARKS.md) it halves acco's gap to ddp at ddp's best learning rate on the synthetic
corpus and equals the paper's form on TinyStories.
"""

from __future__ import annotations

import torch

from acco.engine import quantize
from acco.engine.comm import RoundKind
from acco.engine.config import EngineConfig
from acco.engine.optim import ShardedAdamW

# auto split: weight of the newest update's round durations in their running average
SPLIT_SMOOTHING = 0.25


class EstimateSplit:
    """acco's split of an update's 2k micro-batches per worker between its two rounds, owned by the
    compute side (DecoupledEngine); the comm round only reads it.

    ``e``: micro-batches per worker computed while an estimate round runs (the update round's
    2k - e before it made that round's payload); every other method keeps the even split, unused.
    With ``estimate_micro_batches: auto`` it starts from the rounds' bytes and follows their
    measured durations (docs/algorithm.md, "The split"): ``note_round`` updates this worker's
    ``proposal``, an update round carries every worker's and ``agree`` keeps the largest, and
    ``adopt`` takes it when the next update round is launched, the one place where the payload in
    hand and the micro-batches still to compute add up to 2k whatever the new split is."""

    def __init__(self, cfg: EngineConfig, shard_numel: int, element_size: int):
        self.k2, e = 2 * cfg.n_grad_accumulation, cfg.estimate_micro_batches
        self.acco = cfg.method == "acco"
        self.auto = self.acco and e == "auto"
        self.share = 0.5  # the estimate round's share of an update's comm time, averaged
        if self.auto and cfg.estimate_comm == "int8":  # until measured: the share of the bytes
            ratio = quantize.row_bytes(shard_numel) / (shard_numel * element_size)
            self.share = ratio / (1 + ratio)
        self._estimate_s = None  # the last estimate round's duration, until its update round's
        self.proposal = self._proposal()
        self.e = self.next_e = self.proposal if self.auto else (e or self.k2 // 2)

    def during(self, kind: RoundKind) -> int:
        """Micro-batches per worker computed while a round of `kind` runs: acco's e (estimate round)
        and 2k - e (update round, and the warm start's first payload); every other method's k."""
        if kind is RoundKind.ESTIMATE:
            return self.e
        return self.k2 - self.e if self.acco else self.k2 // 2

    def estimated_update(self, total: int) -> int:
        """The micro-batches (over all workers) of the update that an estimate round estimates, from
        its payload's `total`: that update adds the e per worker computed during the estimate round
        to the payload's 2k - e, exactly so with a fixed batch."""
        return total * self.k2 // (self.k2 - self.e)

    def _proposal(self) -> int:
        return min(max(int(self.k2 * self.share + 0.5), 1), self.k2 - 1)

    def note_round(self, kind: RoundKind, busy_s: float) -> None:
        """Between rounds: a finished round's duration (auto only)."""
        if not self.auto:
            return
        if kind is RoundKind.ESTIMATE:
            self._estimate_s = busy_s
        elif self._estimate_s is not None and self._estimate_s + busy_s > 0:
            share = self._estimate_s / (self._estimate_s + busy_s)
            self.share += SPLIT_SMOOTHING * (share - self.share)
            self.proposal = self._proposal()

    def agree(self, largest: int | None) -> None:
        """An update round's `RoundResult.agreed_split`: the split every worker adopts next."""
        if largest is not None:
            self.next_e = largest

    def adopt(self) -> None:
        """Before an update round's launch: the split the last update round agreed."""
        self.e = self.next_e

    def state_dict(self) -> dict:
        return {"e": self.e, "next": self.next_e, "share": self.share}

    def load_state_dict(self, state: dict) -> None:
        self.e, self.next_e = int(state["e"]), int(state["next"])
        self.share = float(state["share"])
        self.proposal = self._proposal()


class Lookahead:
    """A round's step on this worker's fp32 master shard and the shard it sends: theta_{t+1} (ddp,
    dpu), wp's prediction 2 theta_{t+1} - theta_t, or acco's estimate theta~_{t+1} (the paper's, or
    lean's with half the last error added). The engine builds it, the round (comm.py) calls it."""

    def __init__(self, cfg: EngineConfig, master: torch.Tensor):
        # lean estimate: the last estimate's fp32 shard, which becomes its error after the commit
        self.lean = cfg.method == "acco" and cfg.acco_estimate == "lean"
        self.estimate_error = torch.zeros_like(master) if self.lean else None
        self.estimate_pending = False  # estimate_error holds theta~ (not yet its error)
        # wp: the fp32 master shard before the round's commit, for the prediction 2 theta_{t+1} -
        # theta_t taken in fp32 (in bf16 most updates at a small LR are below one bf16 step)
        self.previous_master = torch.empty_like(master) if cfg.method == "wp" else None

    def commit(
        self, optimizer: ShardedAdamW, grad_shard: torch.Tensor, lr: float, divisor: float, predict: bool,
        sent: torch.Tensor,
    ) -> None:
        """theta_{t+1} = Opt(theta_t, g / divisor) into the master shard; wp's `predict`: the shard
        sent is 2 theta_{t+1} - theta_t, in fp32 (2x is exact: one rounding), grad_shard as scratch."""
        master = optimizer.master
        if predict:
            self.previous_master.copy_(master)
        optimizer.commit(grad_shard, lr, divisor)
        if predict:
            sent.copy_(torch.mul(master, 2.0, out=grad_shard).sub_(self.previous_master))
        else:
            sent.copy_(master)
        if self.lean and self.estimate_pending:  # e_{t+1} = theta~_{t+1} - theta_{t+1}
            self.estimate_error.sub_(master)
            self.estimate_pending = False

    def trial(
        self, optimizer: ShardedAdamW, grad_shard: torch.Tensor, lr: float, divisor: float, int8: bool,
        sent: torch.Tensor,
    ) -> torch.Tensor | None:
        """acco's theta~_{t+1}, nothing committed; returns its fp32 shard where the int8 gather needs it."""
        if self.lean:  # theta~_{t+1} = Opt_trial(theta_t, g~_t) + e_t / 2, kept in fp32
            error = self.estimate_error

            def add_half_the_error(c: slice, trial: torch.Tensor) -> None:  # chunk by chunk: in cache
                torch.add(trial, error[c], alpha=0.5, out=error[c])
                if not int8:
                    sent[c].copy_(error[c])

            optimizer.trial(grad_shard, lr, divisor, each=add_half_the_error)
            self.estimate_pending = True
            return error
        if int8:  # the paper's estimate, kept in fp32 for its delta
            optimizer.trial(grad_shard, lr, divisor, out=grad_shard)
            return grad_shard
        # theta~_{t+1} = Opt_trial(theta_t, g~_t), the paper's estimate
        optimizer.trial(grad_shard, lr, divisor, out=sent)
        return None
