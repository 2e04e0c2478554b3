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
    for method in ("acco", "wp", "torch-ddp", "torch-hsdp"):
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
    for method in ("acco", "wp", "torch-ddp", "torch-hsdp"):
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


# Tiny causal LMs built locally from transformers' own configs (no download), by class: those the
# fused loss is taken for (acco.loss.FUSED_LOSS_MODELS), then two that transform their logits.
_SIZES = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64, head_dim=8)  # fmt: skip
TINY_LMS = {
    "GPT2LMHeadModel": ("GPT2Config", dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                           bos_token_id=0, eos_token_id=0)),
    "GPTNeoForCausalLM": ("GPTNeoConfig", dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
                                               attention_types=[[["global", "local"], 1]], window_size=16,
                                               max_position_embeddings=64)),
    "LlamaForCausalLM": ("LlamaConfig", _SIZES),
    "MistralForCausalLM": ("MistralConfig", _SIZES),
    "Qwen2ForCausalLM": ("Qwen2Config", _SIZES),
    "Qwen3ForCausalLM": ("Qwen3Config", _SIZES),
    # logits * logit_scale (Cohere's default is 0.0625: any value but 1 changes the loss)
    "CohereForCausalLM": ("CohereConfig", _SIZES | dict(logit_scale=0.5)),
    # logits capped by a tanh at final_logit_softcapping (Gemma 2's default 30; 1 for a tiny model's logits)
    "Gemma2ForCausalLM": ("Gemma2Config", _SIZES | dict(final_logit_softcapping=1.0)),
}  # fmt: skip


def tiny_lm(name: str):
    import transformers

    config_class, sizes = TINY_LMS[name]
    torch.manual_seed(0)
    # weights drawn 10x wider than transformers' 0.02: logits far from uniform, whose loss any
    # change of them moves (a scale or a cap changed a loss of 4.6 by 1e-4 at 0.02)
    config = getattr(transformers, config_class)(**sizes, initializer_range=0.2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == name
    return model.eval()  # no dropout (GPT-2's is 0.1): the two losses see the same network


def _own_and_acco_s(model):
    """(the model's own mean loss, acco's mean loss), and the gradients of each, on one masked batch."""
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 97, (3, 24), generator=gen)
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    batch = {"input_ids": torch.randint(0, 97, (3, 24), generator=gen), "labels": labels}
    results = []
    for compute in (lambda: model(**batch).loss, lambda: torch.div(*causal_lm_loss(model, batch))):
        model.zero_grad()
        loss = compute()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    return results


def test_the_fused_loss_is_taken_for_the_tested_architectures_only():
    """A class joins FUSED_LOSS_MODELS with its tiny model here, tested below; a subclass of one
    (its forward may be another) is not taken."""
    assert acco.loss.FUSED_LOSS_MODELS == set(TINY_LMS) - {"CohereForCausalLM", "Gemma2ForCausalLM"}
    llama = tiny_lm("LlamaForCausalLM")

    class MyLlama(type(llama)):
        pass

    assert acco.loss._output_head(llama) is not None and acco.loss._output_head(MyLlama(llama.config)) is None


@pytest.mark.parametrize("name", list(TINY_LMS))
def test_acco_s_loss_is_the_model_s_own(name):
    """Each architecture's own loss (transformers' forward with labels: its logits, shifted, mean
    over the unmasked tokens) and its gradients, from acco's loss: fused for the architectures it
    is proven on, through the logits for the others. Cohere scales its logits (logit_scale) and
    Gemma 2 caps them: the fused loss over lm_head(hidden) alone was another loss, without an error."""
    model = tiny_lm(name)
    (own, own_grads), (acco_s, acco_grads) = _own_and_acco_s(model)
    torch.testing.assert_close(acco_s, own, rtol=1e-5, atol=1e-6)
    for got, want in zip(acco_grads, own_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert (acco.loss._output_head(model) is not None) == (name in acco.loss.FUSED_LOSS_MODELS)


def test_a_model_the_fused_loss_does_not_know_trains_on_its_own_logits_said_once(tmp_path, capsys):
    """The line is said once, by the trainer (rank 0), not by every micro-batch's loss."""
    from trainer_helpers import tiny_args, tiny_data, tiny_model

    from acco.trainer import DecoupledTrainer

    args = tiny_args("ddp", tmp_path / "cohere", nb_steps_tot=4, n_grad_accumulation=1, save=False)
    cohere = tiny_lm("CohereForCausalLM")
    summary = DecoupledTrainer(model=cohere, train_dataset=tiny_data(), args=args).train()
    assert summary["samples"] == 4
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loss:")]
    proven = "GPT2LMHeadModel, GPTNeoForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    assert said == [f"loss: through CohereForCausalLM's own logits (the fused loss is proven on {proven}, "
                    "Qwen3ForCausalLM only: docs/training.md)"], said  # fmt: skip
    args = tiny_args("ddp", tmp_path / "gpt-neo", nb_steps_tot=4, n_grad_accumulation=1, save=False)
    DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args)  # says it here, if anything
    assert "loss:" not in capsys.readouterr().out  # the fused loss: nothing to say
