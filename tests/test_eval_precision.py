"""DecoupledTrainer.evaluate() before train() runs in training's precision: bf16 autocast on the
trainer's device when train.use_mixed_precision is on (no engine has cast the parameters yet, so
they are still in their load dtype, fp32 here), plain fp32 when it is off.

flash_attention_2 refuses fp32 inputs; it is not installed on a CPU, so the Llama here runs an
attention function with its rule: transformers' flash path casts an fp32 query to the autocast
dtype when autocast is on, and otherwise to the dtype of the layer's weights, which flash-attn
then refuses if it is fp32."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.flash_attention import get_target_dtype
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from acco.data.loader import eval_batches
from acco.loss import causal_lm_loss
from acco.models import build_model
from acco.trainer import DecoupledTrainer

LLAMA = dict(
    arch="llama",
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    max_position_embeddings=16,
)


def half_only_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA with flash-attn's dtype rule: the dtype transformers' flash path would hand it must be half."""
    dtype = get_target_dtype(query, module) or query.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"FlashAttention only support fp16 and bf16 data type (got {dtype})")
    return sdpa_attention_forward(
        module, query.to(dtype), key.to(dtype), value.to(dtype), attention_mask, **kwargs
    )


@pytest.fixture
def half_only(monkeypatch):
    monkeypatch.setitem(AttentionInterface._global_mapping, "acco_test_half_only", half_only_attention)
    return "acco_test_half_only"


def _trainer(tmp_path, model, mixed: bool) -> DecoupledTrainer:
    g = torch.Generator().manual_seed(0)
    train, held_out = torch.randint(0, 96, (8, 16), generator=g), torch.randint(0, 96, (6, 16), generator=g)
    args = dict(
        method_name="acco",
        batch_size=2,
        eval_batch_size=4,
        nb_steps_tot=4,
        max_length=16,
        use_mixed_precision=mixed,
        save=False,
        output_dir=str(tmp_path / "run"),
    )
    return DecoupledTrainer(
        model=model, train_dataset={"input_ids": train}, eval_dataset={"input_ids": held_out}, args=args
    )


def _by_hand(trainer: DecoupledTrainer, autocast: bool) -> float:
    """The eval loss computed here, with or without bf16 autocast on the CPU."""
    loss_sum = tokens = 0.0
    trainer.model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for batch in eval_batches(trainer.eval_data, 4, 0, 1, None):
            s, n = causal_lm_loss(trainer.model, batch)
            loss_sum, tokens = loss_sum + s.item(), tokens + n.item()
    return loss_sum / tokens


def _activation_dtypes(model) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    return seen


def test_evaluate_before_train_runs_under_bf16_autocast_in_mixed_precision(tmp_path, half_only):
    torch.manual_seed(0)
    model = build_model({**LLAMA, "attn_implementation": half_only}, vocab_size=96, max_length=16)
    trainer = _trainer(tmp_path, model, mixed=True)
    assert trainer.engine is None and next(model.parameters()).dtype == torch.float32
    seen = _activation_dtypes(model)
    loss = trainer.evaluate()["eval_loss"]  # fp32 weights without autocast: the attention raises
    assert seen and set(seen) == {torch.bfloat16}
    assert next(model.parameters()).dtype == torch.float32  # evaluation casts nothing
    assert loss == pytest.approx(_by_hand(trainer, autocast=True), rel=1e-6)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):  # the attention's rule holds
        _by_hand(trainer, autocast=False)


def test_evaluate_before_train_stays_fp32_without_mixed_precision(tmp_path):
    torch.manual_seed(0)
    model = build_model({**LLAMA, "attn_implementation": "sdpa"}, vocab_size=96, max_length=16)
    trainer = _trainer(tmp_path, model, mixed=False)
    seen = _activation_dtypes(model)
    loss = trainer.evaluate()["eval_loss"]
    assert seen and set(seen) == {torch.float32}
    fp32, bf16 = _by_hand(trainer, autocast=False), _by_hand(trainer, autocast=True)
    assert loss == pytest.approx(fp32, rel=1e-6) and loss != pytest.approx(bf16, rel=1e-6)
