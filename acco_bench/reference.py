"""A plain, single-process reference of the methods' recurrences, independent of the engine.

One model, torch's own AdamW (weight decay on the matrices and embeddings) and clip_grad_norm_,
the learning-rate schedule written out (:func:`learning_rate`), W virtual workers that read their
micro-batches in the order the engine's fixed-batch mode reads them, flat parameter vectors, and
gradients summed micro-batch by micro-batch at the parameters each recurrence names:
:meth:`Reference.ddp` (ddp, torch-ddp: AdamW on the global batch), :meth:`Reference.acco` (the
estimate and update rounds, paper or lean estimate; a trial step is a real AdamW step on copies
of the model and optimizer), :meth:`Reference.delayed` (dpu; wp at the predicted parameters) and
:meth:`Reference.diloco` (diloco, streaming-diloco: W local AdamWs, a global Nesterov SGD).

The tests (``tests/engine_helpers.py``) hold the engine to it on toy models; ``acco-bench
lr-sweep`` runs it beside the engine on a language model (:mod:`acco_bench.reference_lm`): a gap
that shows in both is the algorithm's, a gap in one only is the implementation's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping

import torch
from torch.nn.utils import clip_grad_norm_, parameters_to_vector, vector_to_parameters

from acco.engine.config import EngineSettings

__all__ = ["Reference", "decay_groups", "fragment_indices", "learning_rate", "stability_limit"]


def _get(settings, name: str):  # an EngineConfig's attribute, or a mapping's key (default: the library's)
    default = getattr(EngineSettings, name)
    return settings.get(name, default) if isinstance(settings, Mapping) else getattr(settings, name)


def learning_rate(settings, samples_before: int, batch: int) -> float:
    """The schedule, written out: linear warm-up over ``warmup`` micro-batches counting this
    update's ``batch``, then cosine (or linear, or constant) decay from the samples before it to
    ``nb_steps_tot``. ``settings``: an EngineConfig or a mapping with ``learning_rate``,
    ``warmup``, ``nb_steps_tot`` and ``scheduler_name``."""
    lr, warmup = _get(settings, "learning_rate"), _get(settings, "warmup")
    total = _get(settings, "nb_steps_tot")
    if warmup > 0 and samples_before < warmup:
        return lr * min(1.0, (samples_before + batch) / warmup)
    name = _get(settings, "scheduler_name")
    if name == "constant":
        return lr
    progress = min(1.0, max(0.0, (samples_before - warmup) / max(1, total - warmup)))
    if name == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_groups(params, weight_decay: float) -> list[dict]:
    """Hugging Face's and nanoGPT's convention: decay the matrices and embeddings, not the
    biases and norm weights."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def _adamw(params, settings) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        decay_groups(params, _get(settings, "weight_decay")),
        lr=_get(settings, "learning_rate"),
        eps=_get(settings, "adam_eps"),
        betas=(_get(settings, "adam_beta1"), _get(settings, "adam_beta2")),
        foreach=False,
    )


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def fragment_indices(params, num_fragments: int) -> list[list[int]]:
    """Parameter indices (registration order) of each fragment: where each parameter's middle falls
    when the parameters are laid end to end and cut into equal parts."""
    sizes = [p.numel() for p in params]
    total, before, out = sum(sizes), 0, [[] for _ in range(num_fragments)]
    for k, n in enumerate(sizes):
        out[min(int((before + n / 2) / total * num_fragments), num_fragments - 1)].append(k)
        before += n
    return out


class Reference:
    """Plain single-process AdamW with the methods' operations on flat parameter vectors.

    ``model`` holds theta_0 and is trained in place; ``settings``: an EngineConfig or a mapping
    (schedule, AdamW, ``max_grad_norm``, diloco's keys); ``counts``: micro-batches per worker and
    round; ``read(rank, j)``: worker ``rank``'s j-th micro-batch (j = 0, 1, ... in order);
    ``loss_fn(model, batch)``: the loss whose gradients are summed; ``weight(batch)``: its share of
    the mean, as the engine's ``(loss, weight)`` (default 1; a summed token loss: its tokens).
    Per update: ``losses`` (mean training loss), ``grad_norms`` (before clipping), ``lrs``,
    ``sample_counts``; ``on_commit(theta)`` is called after each update when set.
    """

    def __init__(self, model: torch.nn.Module, settings, world: int, counts: list[int],
                 read: Callable[[int, int], object], loss_fn: Callable, weight: Callable | None = None):
        self.model, self.settings, self.world, self.counts = model, settings, world, list(counts)
        self.read, self.loss_fn = read, loss_fn
        self.weight = weight or (lambda batch: 1)
        self.params = _trainable(model)
        self.opt = _adamw(self.params, settings)
        self.samples = 0
        self.consumed = [0] * world  # micro-batches read so far by each worker
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []
        self.sample_counts: list[int] = []
        self.on_commit: Callable[[torch.Tensor], None] | None = None

    def theta(self) -> torch.Tensor:
        return parameters_to_vector(self.params).detach().clone()

    def _reads(self, rank: int, n: int) -> list:
        batches = [self.read(rank, self.consumed[rank] + j) for j in range(n)]
        self.consumed[rank] += n
        return batches

    def next_chunk(self, counts=None) -> list:
        """The micro-batches every worker reads in its next round, worker 0's first."""
        return [batch for r, n in enumerate(counts or self.counts) for batch in self._reads(r, n)]

    def weight_of(self, chunk: list):
        return sum(self.weight(batch) for batch in chunk)

    def grad_sum(self, theta: torch.Tensor, chunk: list) -> tuple[torch.Tensor, float]:
        """Sum over the chunk's micro-batches of their gradients at theta (and of their losses)."""
        probe = copy.deepcopy(self.model)
        params = _trainable(probe)
        vector_to_parameters(theta.clone(), params)  # (it makes the parameters views of the vector)
        total, loss_sum = None, 0.0
        for batch in chunk:
            probe.zero_grad()
            loss = self.loss_fn(probe, batch)
            loss.backward()
            g = parameters_to_vector([torch.zeros_like(p) if p.grad is None else p.grad for p in params])
            total = g if total is None else total + g
            loss_sum += loss.item()
        return total, loss_sum

    def _step(self, model, opt, theta, mean_grad, lr) -> tuple[torch.Tensor, float]:
        """(AdamW's new parameters, the gradient's norm before torch's clip_grad_norm_)."""
        params = _trainable(model)
        vector_to_parameters(theta.clone(), params)
        offset = 0
        for p in params:
            p.grad = mean_grad[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        norm = float(clip_grad_norm_(params, _get(self.settings, "max_grad_norm") or math.inf))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        return parameters_to_vector(params).detach().clone(), norm

    def commit(self, theta, grad_sum, batch: int, weight=None) -> torch.Tensor:
        """Opt: the update of ``batch`` micro-batches whose gradients sum to ``grad_sum`` (their
        mean: over ``weight``, by default ``batch``)."""
        lr = learning_rate(self.settings, self.samples, batch)
        theta, norm = self._step(
            self.model, self.opt, theta, grad_sum / (batch if weight is None else weight), lr
        )
        self.samples += batch
        self.grad_norms.append(norm)
        self.lrs.append(lr)
        self.sample_counts.append(self.samples)
        if self.on_commit is not None:
            self.on_commit(theta)
        return theta

    def trial(self, theta, grad_sum, batch: int, update_batch: int, weight=None) -> torch.Tensor:
        """Opt_trial: the step of the update it estimates (that update's LR, for ``update_batch``
        micro-batches), on copies: the optimizer itself is left as it was."""
        model, opt = copy.deepcopy((self.model, self.opt))
        lr = learning_rate(self.settings, self.samples, update_batch)
        return self._step(model, opt, theta, grad_sum / (batch if weight is None else weight), lr)[0]

    def ddp(self, updates: int, counts=None) -> torch.Tensor:
        """theta_{t+1} = Opt(theta_t, mean of the global batch's gradients at theta_t)."""
        theta = self.theta()
        for _ in range(updates):
            chunk = self.next_chunk(counts)
            g, loss = self.grad_sum(theta, chunk)
            w = self.weight_of(chunk)
            self.losses.append(loss / w)
            theta = self.commit(theta, g, len(chunk), w)
        return theta

    def acco(self, updates: int, sequential_updates: int = 0, lean: bool = False) -> torch.Tensor:
        """acco: ``sequential_updates`` (n_warmup_steps) first updates run as ddp on both rounds'
        micro-batches; ``lean``: every estimate adds half of the last estimate's error
        theta~_t - theta_t (acco_estimate=lean)."""
        self.ddp(sequential_updates, [2 * n for n in self.counts])
        theta = self.theta()
        chunk = self.next_chunk()
        g_est, loss_est = self.grad_sum(theta, chunk)  # warm start: g~_0 at theta_0
        n_est, w_est = len(chunk), self.weight_of(chunk)
        error = torch.zeros_like(theta)
        for _ in range(updates):
            # estimate round: theta~_{t+1} = Opt_trial(theta_t, g~_t); meanwhile g_t at theta_t
            theta_est = self.trial(theta, g_est, n_est, update_batch=n_est + sum(self.counts), weight=w_est)
            if lean:
                theta_est = theta_est + 0.5 * error
            chunk = self.next_chunk()
            g, loss = self.grad_sum(theta, chunk)
            # update round: theta_{t+1} = Opt(theta_t, (g~_t + g_t) / N); meanwhile g~_{t+1} at theta~_{t+1}
            batch, w = n_est + len(chunk), w_est + self.weight_of(chunk)
            self.losses.append((loss_est + loss) / w)
            theta = self.commit(theta, g_est + g, batch, w)
            error = theta_est - theta
            chunk = self.next_chunk()
            g_est, loss_est = self.grad_sum(theta_est, chunk)
            n_est, w_est = len(chunk), self.weight_of(chunk)
        return theta

    def delayed(self, updates: int, predict: bool, counts_per_round=None) -> torch.Tensor:
        """dpu: theta_{k+1} = Opt(theta_k, g(theta_{k-1})); wp (``predict``): the gradient is taken
        at the prediction 2 theta_{k-1} - theta_{k-2} instead (theta_{-1} = theta_0).
        ``counts_per_round``: each round's counts (updates + 1 of them), where they vary."""
        counts_per_round = counts_per_round or [None] * (updates + 1)
        thetas = [self.theta()]
        chunk = self.next_chunk(counts_per_round[0])
        g, loss = self.grad_sum(thetas[0], chunk)
        n, w = len(chunk), self.weight_of(chunk)
        computed_at = thetas[0]
        for k in range(updates):
            self.losses.append(loss / w)
            thetas.append(self.commit(thetas[-1], g, n, w))
            # during round k+1 the model held the parameters swapped in after round k
            chunk = self.next_chunk(counts_per_round[k + 1])
            g, loss = self.grad_sum(computed_at, chunk)
            n, w = len(chunk), self.weight_of(chunk)
            computed_at = 2 * thetas[-1] - thetas[-2] if predict else thetas[-1]
        return thetas[-1]

    def diloco(self) -> torch.Tensor:
        """diloco and streaming-diloco until ``nb_steps_tot``: torchft's local_sgd.py recurrence
        written out with whole parameters, fragment by fragment. W copies of the model, each with
        torch's AdamW (ddp's parameter groups), and the global model (this one) with
        torch.optim.SGD(nesterov=True). Worker 0's loss per inner step goes to ``losses``;
        returns the final global parameters."""
        s, world = self.settings, self.world
        H, nf, tau = _get(s, "sync_every"), _get(s, "num_fragments"), _get(s, "fragment_sync_delay")
        alpha = _get(s, "fragment_update_alpha")
        glob = self.model
        outer = torch.optim.SGD(
            self.params, lr=_get(s, "outer_lr"), momentum=_get(s, "outer_momentum"), nesterov=True
        )
        workers = [copy.deepcopy(glob) for _ in range(world)]
        inner = [_adamw(_trainable(w), s) for w in workers]
        fragments = fragment_indices(self.params, nf)
        offsets = [math.floor(H / nf * (i + 1)) for i in range(nf)]
        pending, merged, step = {}, [0] * nf, 0

        def params(model, i):
            ps = _trainable(model)
            return [ps[k] for k in fragments[i]]

        def due(i, delay):
            return step >= offsets[i] + delay and (step - offsets[i] - delay) % H == 0

        def pseudo_gradient(i):  # global minus local, averaged over the workers
            return [
                sum(g.detach() - p.detach() for p in ps) / world
                for g, *ps in zip(params(glob, i), *(params(w, i) for w in workers))
            ]

        def outer_step(i, pseudo, keep):
            for p in self.params:
                p.grad = None
            for p, g in zip(params(glob, i), pseudo):
                p.grad = g.clone()
            outer.step()
            with torch.no_grad():
                for w in workers:
                    for p, g in zip(params(w, i), params(glob, i)):
                        p.copy_(keep * p + (1 - keep) * g)
            merged[i] = step

        while self.samples < _get(s, "nb_steps_tot"):
            lr = learning_rate(s, self.samples, sum(self.counts))
            for r, (w, opt) in enumerate(zip(workers, inner)):
                opt.zero_grad()
                batches = self._reads(r, self.counts[r])
                total, weight = 0.0, self.weight_of(batches)
                for batch in batches:
                    loss = self.loss_fn(w, batch)
                    (loss / weight).backward()
                    total += loss.item()
                if r == 0:
                    self.losses.append(total / weight)
                clip_grad_norm_(_trainable(w), _get(s, "max_grad_norm") or math.inf)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
            step, self.samples = step + 1, self.samples + sum(self.counts)
            for i in range(nf):
                if due(i, 0):
                    pending[i] = pseudo_gradient(i)
            for i in range(nf):
                if due(i, tau) and i in pending:
                    outer_step(i, pending.pop(i), alpha)
        for i in list(pending):  # the end: what is in flight, then every fragment with progress
            outer_step(i, pending.pop(i), 0.0)
        for i in range(nf):
            if merged[i] < step:
                outer_step(i, pseudo_gradient(i), 0.0)
        return self.theta()


def stability_limit(beta1: float = 0.9, lean: float | None = 0.0, a_max: float = 100.0) -> float:
    """The smallest preconditioned curvature a = lr * h / sqrt(v) at which the linearised
    recurrence on a quadratic diverges: AdamW as heavy-ball (`lean=None`), or acco with the
    estimate theta~_{t+1} = Opt_trial(theta_t, g~_t) + lean * (theta~_t - theta_t), its update
    taking the mean of the gradients at theta_t and at theta~_t. Noise-free, moments frozen."""
    import numpy as np

    def radius(a: float) -> float:
        def step(state):
            theta, m, err = state
            g, g_est = a * theta, a * (theta + err)
            g_update = g if lean is None else 0.5 * (g + g_est)
            m_new = beta1 * m + (1 - beta1) * g_update
            theta_new = theta - m_new
            if lean is None:
                return np.array([theta_new, m_new, 0.0])
            estimate = theta - (beta1 * m + (1 - beta1) * g_est) + lean * err
            return np.array([theta_new, m_new, estimate - theta_new])

        matrix = np.stack([step(v) for v in np.eye(3)], axis=1)
        return float(max(abs(np.linalg.eigvals(matrix))))

    lo, a = 0.0, 0.5
    while a < a_max and radius(a) <= 1 + 1e-12:
        lo, a = a, a + 0.5
    hi = a
    for _ in range(40):  # bisect the first crossing
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if radius(mid) <= 1 + 1e-12 else (lo, mid)
    return hi
