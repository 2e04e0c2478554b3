"""The causal LM loss (acco/loss.py): the textbook formula's value and gradients, without its copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from trainer_helpers import loss_test_config

import acco.loss
from acco.loss import IGNORE_INDEX, causal_lm_loss
from acco.models import build_model


def textbook(model, batch):
    """The formula as written (and as acco computed it before): slice the logits, upcast, sum."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (labels != IGNORE_INDEX).sum()


@pytest.mark.parametrize("arch", ["gpt_neo", "llama"])
@pytest.mark.parametrize("chunked", [False, True])
def test_the_loss_is_the_textbook_formula(monkeypatch, arch, chunked):
    torch.manual_seed(0)
    config = loss_test_config(arch)
    model = build_model(config, vocab_size=97, max_length=64)
    labels = torch.randint(0, 97, (3, 40))
    labels[0, :7] = IGNORE_INDEX  # a masked prompt
    labels[2, 30:] = IGNORE_INDEX  # padding
    batch = {"input_ids": torch.randint(0, 97, (3, 40)), "labels": labels}
    assert acco.loss._output_head(model) is not None  # the fused loss over hidden states
    if chunked:  # chunks that do not divide the 120 positions; else one chunk
        monkeypatch.setattr(acco.loss, "CHUNK_POSITIONS", 16)
    loss, n = causal_lm_loss(model, batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected, expected_n = textbook(model, batch)
    expected.backward()
    assert n == expected_n == (labels[:, 1:] != IGNORE_INDEX).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-4)
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _train_with_and_without_checkpointing(rank: int, world_size: int, root: str) -> dict:
    from pathlib import Path

    from trainer_helpers import tiny_args, tiny_data, tiny_model, train_losses

    from acco.trainer import DecoupledTrainer

    losses = {}
    for method in ("acco", "wp", "torch-ddp"):
        for gc in (False, True):
            out = Path(root) / f"{method}-{gc}"
            torch.manual_seed(0)
            args = tiny_args(method, out, nb_steps_tot=24, gradient_checkpointing=gc)
            trainer = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args)
            assert trainer.model.is_gradient_checkpointing == gc
            trainer.train()
            losses[(method, gc)] = train_losses(out)
        resumed = Path(root) / f"{method}-resumed"
        torch.manual_seed(1)
        args = tiny_args(method, resumed, nb_steps_tot=24, gradient_checkpointing=True)
        DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train(
            resume_from_checkpoint=str(Path(root) / f"{method}-True" / "checkpoint-2")
        )
        losses[(method, "resumed")] = train_losses(resumed)
    return losses


def test_gradient_checkpointing_trains_the_same_and_resumes(tmp_path):
    """Two workers, fixed batch, fp32: with train.gradient_checkpointing every update's loss is the
    one without it (the activations are recomputed, not changed), and a resume is exact."""
    from distributed import run_distributed

    losses = run_distributed(_train_with_and_without_checkpointing, 2, str(tmp_path))[0]
    for method in ("acco", "wp", "torch-ddp"):
        plain, checkpointed, resumed = (
            losses[(method, False)],
            losses[(method, True)],
            losses[(method, "resumed")],
        )
        assert len(plain) >= 3 and checkpointed == plain, method
        assert resumed == {step: loss for step, loss in plain.items() if step > 2}, method


def test_checkpoint_activations_uses_transformers_current_name_and_refuses_other_models():
    """train.gradient_checkpointing turns on transformers' non-reentrant checkpointing through the
    current name (no deprecation warning), and a model without it gets one clear error."""
    import warnings

    from acco.models import checkpoint_activations

    model = build_model(loss_test_config("gpt_neo"), vocab_size=97, max_length=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        checkpoint_activations(model)
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    with pytest.raises(ValueError, match="needs a transformers model"):
        checkpoint_activations(torch.nn.Linear(2, 2))
