"""The reference (:mod:`acco_bench.reference`) run on a language model, as a training run would:
``acco-bench lr-sweep`` runs it beside the engine. :func:`build_case` builds the model, data and
settings of a ``python main.py <overrides>`` run in-process; :func:`simulate` trains a copy with
ddp, dpu or acco on W virtual workers; :func:`evaluate` scores parameters on the eval blocks. Also
the quick way to try an estimate variant on one process before putting it in the engine:

    case = build_case(["train.learning_rate=3e-3", "model.hidden_size=128"])
    out = simulate(case, "acco", world_size=2, grad_accum=4)
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch.nn.utils import vector_to_parameters

from acco_bench.reference import Reference

__all__ = ["Case", "build_case", "evaluate", "simulate", "target_tokens", "token_loss"]


@dataclasses.dataclass
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
    return Case(
        model=model,
        train_blocks=pack_documents(train_docs, tokenizer, args.max_length, None, text),
        eval_blocks=pack_documents(eval_docs, tokenizer, args.max_length, None, text) if eval_docs else None,
        train={k: getattr(args, k) for k in vars(args)},
        seed=args.seed,
    )


def token_loss(model, batch) -> torch.Tensor:
    """The batch's next-token cross-entropy, summed over its target tokens (see :func:`target_tokens`)."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def target_tokens(batch) -> float:
    """The tokens a batch predicts (labels other than -100 after the first position)."""
    return float((batch["labels"][:, 1:] != -100).sum())


def simulate(
    case: Case,
    method: str,
    world_size: int = 2,
    grad_accum: int = 4,
    eval_every: int = 0,
    max_eval_batches: int | None = None,
    max_updates: int | None = None,
    final_eval: bool = True,
) -> dict:
    """Train a copy of `case.model` with `method` ("ddp", "dpu" or "acco") and a fixed batch:
    `grad_accum` micro-batches per worker per update (acco: half per round), until the budget or
    `max_updates`, clipping and estimating as `case.train` (the composed config) says. Returns
    per-update losses and gradient norms, and the eval loss at the end (and every `eval_every` updates)."""
    from acco.data import MicroBatchStream

    if method not in ("ddp", "dpu", "acco"):
        raise ValueError(f"the reference knows ddp, dpu and acco, not {method!r}")
    t, estimate = case.train, case.train["acco_estimate"]
    if estimate not in ("paper", "lean"):
        raise ValueError(f"the reference knows acco's paper and lean estimates, not {estimate!r}")
    streams = [
        MicroBatchStream(case.train_blocks, t["batch_size"], r, world_size, case.seed)
        for r in range(world_size)
    ]
    counts = [grad_accum // 2 if method == "acco" else grad_accum] * world_size
    ref = Reference(copy.deepcopy(case.model).float().train(), t, world_size, counts,
                    read=lambda r, j: next(streams[r]), loss_fn=token_loss, weight=target_tokens)
    scoring = dataclasses.replace(case, model=copy.deepcopy(ref.model))  # evaluations leave ref.model alone
    max_eval = max_eval_batches if max_eval_batches is not None else t.get("max_eval_batches")
    evals = []

    def on_commit(theta):
        if eval_every and len(ref.sample_counts) % eval_every == 0:
            evals.append((ref.samples, evaluate(scoring, theta, world_size, max_eval)))

    ref.on_commit = on_commit
    per_update = sum(counts) * (2 if method == "acco" else 1)
    updates = math.ceil(t["nb_steps_tot"] / per_update)
    updates = updates if max_updates is None else min(updates, max_updates)
    if method == "ddp":
        theta = ref.ddp(updates)
    elif method == "dpu":
        theta = ref.delayed(updates, predict=False)
    else:
        theta = ref.acco(updates, lean=estimate == "lean")
    return {"method": method, "loss": ref.losses, "grad_norm": ref.grad_norms, "lr": ref.lrs,
            "samples": ref.sample_counts, "eval": evals, "params": theta,
            "final_eval_loss": evaluate(scoring, theta, world_size, max_eval) if final_eval else None}


@torch.no_grad()
def evaluate(case: Case, theta: torch.Tensor, world_size: int, max_eval_batches: int | None) -> float | None:
    """Mean next-token loss on the eval blocks, the samples the trainer's W ranks would read, with
    `case.model`'s parameters set to `theta`."""
    from acco.data import eval_batches

    if case.eval_blocks is None:
        return None
    model = case.model
    vector_to_parameters(theta.clone(), [p for p in model.parameters() if p.requires_grad])
    model.eval()
    b = case.train.get("eval_batch_size") or case.train["batch_size"]
    loss_sum = tokens = 0.0
    for r in range(world_size):
        for i, batch in enumerate(eval_batches(case.eval_blocks, b, r, world_size)):
            if max_eval_batches is not None and i >= max_eval_batches:
                break
            loss_sum += float(token_loss(model, batch))
            tokens += target_tokens(batch)
    model.train()
    return loss_sum / tokens
