"""A plain, single-process reference of the methods' recurrences (ddp, dpu, acco), independent
of the engine: torch's own AdamW on the model's parameters, torch's ``clip_grad_norm_``, the
learning-rate schedule written out, and W virtual workers that read their micro-batches in the
order the engine's fixed-batch mode reads them. A trial step (acco's estimate) is a real AdamW
step whose parameters and optimizer state are restored afterwards, as the authors' code does.

The learning-rate sweep runs it beside the engine on a small case: a gap that shows in both is
the algorithm's, a gap in one only is the implementation's. It is also the quick way to try an
estimate variant on one process before putting it in the engine.

    case = build_case(["train.learning_rate=3e-3", "model.hidden_size=128"])
    out = simulate(case, "acco", world_size=2, grad_accum=4)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch.nn.utils import clip_grad_norm_, parameters_to_vector


@dataclass
class Case:
    """What a training run is made of: the model at its initial weights, the data, the settings."""

    model: torch.nn.Module
    train_blocks: object
    eval_blocks: object
    train: dict  # the run's train settings (learning_rate, warmup, nb_steps_tot, batch_size, ...)
    seed: int


def build_case(overrides: list[str]) -> Case:
    """The model, data and settings a `python main.py <overrides>` run would train with, in-process."""
    from acco.config import compose
    from acco.data import pack_documents
    from acco.data.prepare import load_corpus_rank0_first, prepare_tokenizer, split_corpus
    from acco.models import build_model
    from acco.trainer import TrainArgs

    cfg = compose(list(overrides))
    args = TrainArgs.from_any(cfg.train)
    train_docs, eval_docs = split_corpus(load_corpus_rank0_first(cfg.data), args)
    tokenizer = prepare_tokenizer(cfg, train_docs)
    torch.manual_seed(args.seed)  # as the training CLI: the initial weights are a function of the seed
    model = build_model(cfg.model, vocab_size=len(tokenizer), max_length=args.max_length,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    text = cfg.data.text_column
    return Case(model=model, train_blocks=pack_documents(train_docs, tokenizer, args.max_length, None, text),
                eval_blocks=pack_documents(eval_docs, tokenizer, args.max_length, None, text) if eval_docs else None,
                train={k: getattr(args, k) for k in vars(args)}, seed=args.seed)


@torch.no_grad()
def _load(vector: torch.Tensor, tensors) -> None:
    """Copy a flat vector into tensors (torch's vector_to_parameters would make them views of it)."""
    offset = 0
    for t in tensors:
        t.copy_(vector[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def schedule(t: dict, samples_before: int, batch: int) -> float:
    """Cosine (or linear, constant) by micro-batches seen, linear warm-up counting this update's batch."""
    lr, warmup, total = t["learning_rate"], t["warmup"], t["nb_steps_tot"]
    if warmup > 0 and samples_before < warmup:
        return lr * min(1.0, (samples_before + batch) / warmup)
    if t["scheduler_name"] == "constant":
        return lr
    progress = min(1.0, max(0.0, (samples_before - warmup) / max(1, total - warmup)))
    if t["scheduler_name"] == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


class _Workers:
    """W virtual workers: each reads its own MicroBatchStream; gradients summed over all of them."""

    def __init__(self, case: Case, world_size: int):
        from acco.data import MicroBatchStream

        self.model = case.model
        self.params = [p for p in case.model.parameters() if p.requires_grad]
        b = case.train["batch_size"]
        self.streams = [MicroBatchStream(case.train_blocks, b, r, world_size, case.seed) for r in range(world_size)]

    def grad_sum(self, theta: torch.Tensor, n: int) -> tuple[torch.Tensor, float, float, int]:
        """(sum of token-loss gradients, summed token loss, target tokens, micro-batches) of the
        next `n` micro-batches of every worker, at parameters `theta`."""
        _load(theta, self.params)
        for p in self.params:
            p.grad = torch.zeros_like(p)
        loss_sum = tokens = 0.0
        for stream in self.streams:
            for _ in range(n):
                batch = next(stream)
                logits = self.model(input_ids=batch["input_ids"], use_cache=False).logits
                labels = batch["labels"][:, 1:]
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
                loss.backward()
                loss_sum += float(loss.detach())
                tokens += float((labels != -100).sum())
        return parameters_to_vector([p.grad for p in self.params]), loss_sum, tokens, n * len(self.streams)


class _Optimizer:
    """torch AdamW on the model's parameters; `step(..., commit=False)` restores everything after."""

    def __init__(self, params, t: dict, max_grad_norm: float | None):
        self.params = params
        # weight decay on the matrices and embeddings only, as Hugging Face's Trainer decides it
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t["weight_decay"]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        self.opt = torch.optim.AdamW(groups, lr=t["learning_rate"], betas=(t["adam_beta1"], t["adam_beta2"]),
                                     eps=t["adam_eps"], foreach=False)
        self.max_grad_norm = max_grad_norm

    def step(self, theta: torch.Tensor, grad: torch.Tensor, lr: float, commit: bool) -> tuple[torch.Tensor, float]:
        """(the parameters AdamW makes of theta with this mean gradient, the gradient's norm before clipping)."""
        _load(theta, self.params)
        _load(grad, [p.grad for p in self.params])
        norm = float(clip_grad_norm_(self.params, self.max_grad_norm or math.inf))
        saved = None if commit else copy.deepcopy(self.opt.state_dict())
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        new = parameters_to_vector(self.params).detach().clone()
        if saved is not None:
            self.opt.load_state_dict(saved)
        return new, norm


def simulate(case: Case, method: str, world_size: int = 2, grad_accum: int = 4,
             max_grad_norm: float | None = None, estimate: str = "paper", eval_every: int = 0,
             max_eval_batches: int | None = None, max_updates: int | None = None, final_eval: bool = True) -> dict:
    """Train a copy of `case.model` with `method` ("ddp", "dpu" or "acco") and a fixed batch:
    `grad_accum` micro-batches per worker per update (acco: half of it per round, two rounds per
    update), until the budget or `max_updates`. Returns per-update training losses, gradient
    norms and the eval loss at the end (and every `eval_every` updates)."""
    if method not in ("ddp", "dpu", "acco"):
        raise ValueError(f"the reference knows ddp, dpu and acco, not {method!r}")
    if estimate not in ("paper", "lean"):
        raise ValueError(f"the reference knows acco's paper and lean estimates, not {estimate!r}")
    case = copy.copy(case)
    case.model = copy.deepcopy(case.model).float().train()
    t = case.train
    workers = _Workers(case, world_size)
    opt = _Optimizer(workers.params, t, max_grad_norm)
    theta = parameters_to_vector(workers.params).detach().clone()
    samples, out = 0, {"method": method, "loss": [], "grad_norm": [], "lr": [], "samples": [], "eval": []}
    max_eval = max_eval_batches if max_eval_batches is not None else t.get("max_eval_batches")

    def running() -> bool:
        return samples < t["nb_steps_tot"] and (max_updates is None or len(out["loss"]) < max_updates)

    def commit(grad, loss, tokens, batch, at):
        nonlocal samples
        lr = schedule(t, samples, batch)
        new, norm = opt.step(at, grad / tokens, lr, commit=True)
        samples += batch
        out["loss"].append(loss / tokens)
        out["grad_norm"].append(norm)
        out["lr"].append(lr)
        out["samples"].append(samples)
        if eval_every and len(out["loss"]) % eval_every == 0:
            out["eval"].append((samples, evaluate(case, new, world_size, max_eval)))
        return new

    if method == "ddp":
        while running():
            theta = commit(*workers.grad_sum(theta, grad_accum), at=theta)
    elif method == "dpu":
        pending = workers.grad_sum(theta, grad_accum)  # computed at theta_0, with nothing to overlap
        while running():
            nxt = workers.grad_sum(theta, grad_accum)  # at theta_t, while the round on `pending` runs
            theta = commit(*pending, at=theta)
            pending = nxt
    else:  # acco
        k = grad_accum // 2
        g_est = workers.grad_sum(theta, k)  # g~_0 at theta_0
        error = torch.zeros_like(theta)  # theta~_t - theta_t, the last estimate's error
        while running():
            # estimate round: theta~_{t+1} = Opt_trial(theta_t, g~_t); meanwhile g_t at theta_t
            lr_trial = schedule(t, samples, 2 * g_est[3])
            theta_est, _ = opt.step(theta, g_est[0] / g_est[2], lr_trial, commit=False)
            if estimate == "lean":
                theta_est += 0.5 * error  # acco_estimate=lean: half of the last estimate's error
            g_now = workers.grad_sum(theta, k)
            total = tuple(a + b for a, b in zip(g_est, g_now))
            # update round: theta_{t+1} = Opt(theta_t, (g~_t + g_t) / N); meanwhile g~_{t+1} at theta~_{t+1}
            g_est = workers.grad_sum(theta_est, k)
            theta = commit(*total, at=theta)
            error = theta_est - theta
    out["final_eval_loss"] = evaluate(case, theta, world_size, max_eval) if final_eval else None
    out["params"] = theta
    return out


@torch.no_grad()
def evaluate(case: Case, theta: torch.Tensor, world_size: int, max_eval_batches: int | None) -> float | None:
    """Mean next-token loss on the eval blocks, the samples the trainer's W ranks would read."""
    from acco.data import eval_batches

    if case.eval_blocks is None:
        return None
    model = case.model
    params = [p for p in model.parameters() if p.requires_grad]
    _load(theta, params)
    model.eval()
    b = case.train.get("eval_batch_size") or case.train["batch_size"]
    loss_sum = tokens = 0.0
    for r in range(world_size):
        for i, batch in enumerate(eval_batches(case.eval_blocks, b, r, world_size)):
            if max_eval_batches is not None and i >= max_eval_batches:
                break
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits
            labels = batch["labels"][:, 1:]
            loss_sum += float(torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"))
            tokens += float((labels != -100).sum())
    model.train()
    return loss_sum / tokens


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
