"""The causal LM loss, without copies of the full-vocabulary logits.

``causal_lm_loss(model, batch)`` returns (sum of next-token losses, number of target tokens); the
engine divides by the tokens summed over micro-batches and workers, so a padded or masked batch
counts each token once. It is the value of the textbook formula

    cross_entropy(logits[:, :-1].float(), labels[:, 1:], ignore_index=-100, reduction="sum")

computed without its copies: the labels are shifted instead of the logits being sliced (a slice of
a (batch, length, vocabulary) tensor is a copy once flattened). When the logits would be large
(GPT-Neo 125M at 4 x 1024 tokens: 0.8 GB per copy, and the loss keeps two more for its backward),
the loss is computed from the model's last hidden states, chunk by chunk: each chunk's logits are
made, upcast to fp32 and reduced to a sum, and recomputed in the backward pass
(torch.utils.checkpoint), so the full logits never exist.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from acco.data.instruct import IGNORE_INDEX

# Above this many logits (batch x length x vocabulary) the loss is chunked over hidden states.
CHUNK_ABOVE_LOGITS = 64 * 1024 * 1024
CHUNK_POSITIONS = 1024  # positions per chunk: 1024 x 50257 fp32 logits are 0.2 GB


def causal_lm_loss(model, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels = batch["labels"]
    # Position i predicts token i + 1; the last position predicts nothing.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).flatten()
    n_targets = (targets != IGNORE_INDEX).sum()
    head = _output_head(model)
    if head is None or labels.numel() * head.weight.shape[0] <= CHUNK_ABOVE_LOGITS:
        logits = model(**inputs, use_cache=False).logits.flatten(0, 1)  # a view: no copy
        return _loss_sum(logits, targets), n_targets
    hidden = model.base_model(**inputs, use_cache=False).last_hidden_state.flatten(0, 1)
    loss = sum(
        checkpoint(_head_loss_sum, head, h, t, use_reentrant=False)
        for h, t in zip(hidden.split(CHUNK_POSITIONS), targets.split(CHUNK_POSITIONS))
    )
    return loss, n_targets


def _output_head(model):
    """The LM head of a transformers causal LM whose logits are exactly head(last hidden state),
    else None (the loss then goes through the model's own logits)."""
    get_head, base = getattr(model, "get_output_embeddings", None), getattr(model, "base_model", None)
    head = get_head() if callable(get_head) else None
    config = getattr(model, "config", None)
    if (not isinstance(head, torch.nn.Linear) or base is None or base is model
            or getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_scaling", None)):  # fmt: skip
        return None
    return head


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _head_loss_sum(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _loss_sum(head(hidden), targets)
