"""The model's fast paths that change nothing it computes (acco/models.py, acco/attention.py):
gelu_new runs as the fused gelu_pytorch_tanh, equal within rounding, and saved models load as
before; a training step on a batch without mask or position ids makes no host sync (on a GPU a
read of a device tensor, `.item()` or `bool()`, waits for every kernel queued before it), and an
all-ones mask is dropped on the host before the copy, so that such a batch is one of those."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.activations import GELUTanh, NewGELUActivation

from acco.data.on_device import OnDevice
from acco.loss import causal_lm_loss
from acco.models import build_model

TINY = dict(
    hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64, window_size=8, intermediate_size=64
)


def _kinds(model) -> set[type]:
    return {type(m) for m in model.modules()}


def test_gelu_new_runs_fused_and_equal_within_rounding():
    x = torch.linspace(-6, 6, 4001, dtype=torch.float64)
    exact = NewGELUActivation()(x)
    torch.testing.assert_close(GELUTanh()(x.float()).double(), exact, rtol=1e-6, atol=1e-6)  # fp32
    x16 = x.bfloat16()
    exact = NewGELUActivation()(x16.double())
    ours, theirs = GELUTanh()(x16).double(), NewGELUActivation()(x16).double()
    # one rounding to bf16 (half an ulp: 2^-8 relative at most) where gelu_new's eight bf16 ops round eight
    # times
    assert ((ours - exact).abs() <= 2**-8 * exact.abs() + 1e-6).all()
    assert (ours - exact).abs().max() <= (theirs - exact).abs().max()
    torch.manual_seed(0)
    model = build_model(TINY | {"arch": "gpt_neo"}, vocab_size=97)
    assert model.config.activation_function == "gelu_new"  # the config, hence a saved model, unchanged
    assert GELUTanh in _kinds(model) and NewGELUActivation not in _kinds(model)
    reference = build_model(TINY | {"arch": "gpt_neo"}, vocab_size=97)
    reference.load_state_dict(model.state_dict())
    for block in reference.transformer.h:
        block.mlp.act = NewGELUActivation()
    ids = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(
        model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("arch", ["gpt_neo", "llama"])
def test_saved_models_load_with_the_fused_gelu(tmp_path, arch):
    """A folder saved with gelu_new (acco's GPT-Neo, or a Llama whose config names it) loads with
    the fused activation, the same state dict, and the same logits within rounding."""
    torch.manual_seed(0)
    if arch == "gpt_neo":
        saved = build_model(TINY | {"arch": arch}, vocab_size=97)
    else:
        config = transformers.LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_act="gelu_new",
        )
        saved = transformers.LlamaForCausalLM(config)
        assert NewGELUActivation in _kinds(saved)
    saved.save_pretrained(tmp_path)
    loaded = build_model(TINY | {"arch": arch, "pretrained": str(tmp_path)}, vocab_size=97)
    assert GELUTanh in _kinds(loaded) and NewGELUActivation not in _kinds(loaded)
    assert loaded.state_dict().keys() == saved.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.state_dict().items())
    ids = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(
        loaded(input_ids=ids).logits, saved(input_ids=ids).logits, rtol=1e-5, atol=1e-5
    )
    loaded.save_pretrained(tmp_path / "again")  # and saves the same config again
    again = transformers.AutoConfig.from_pretrained(tmp_path / "again")
    assert getattr(again, "activation_function", getattr(again, "hidden_act", None)) == "gelu_new"


class HostSyncs(TorchDispatchMode):
    """Records every op that copies a device value to the host (what `.item()`, `bool()`, `.all()`
    in an `if`, `.tolist()` reach): on CPU tensors it costs nothing, on a GPU it is a sync."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_local_scalar_dense", "item", "is_nonzero", "equal"):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["gpt_neo", "llama"])
def test_a_training_step_makes_no_host_sync(arch):
    torch.manual_seed(0)
    model = build_model(TINY | {"arch": arch}, vocab_size=97)
    ids = torch.randint(0, 97, (2, 16))  # 16 tokens > window 8: GPT-Neo's local layers masked
    with HostSyncs() as seen:
        loss, n = causal_lm_loss(model, {"input_ids": ids, "labels": ids})
        (loss / n).backward()
    assert seen.syncs == []
    with torch.no_grad(), HostSyncs() as seen:  # evaluation
        causal_lm_loss(model.eval(), {"input_ids": ids, "labels": ids})
    assert seen.syncs == []
    # The detector sees the check where it still runs: position ids given, which may pack sequences
    with HostSyncs() as seen:
        model(input_ids=ids, position_ids=torch.arange(16).expand(2, -1))
    assert seen.syncs


@pytest.mark.parametrize("arch", ["gpt_neo", "llama"])
def test_an_all_ones_mask_is_dropped_on_the_host(arch):
    torch.manual_seed(0)
    model = build_model(TINY | {"arch": arch}, vocab_size=97)
    ids = torch.randint(0, 97, (2, 16))
    full = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    with HostSyncs() as seen:  # given to the model, transformers reads the mask to find no padding
        masked_loss, _ = causal_lm_loss(model, full)
    assert seen.syncs
    moved = next(OnDevice(iter([full]), torch.device("cpu")))  # the trainer's way to the device
    assert "attention_mask" not in moved
    prefetched = OnDevice(iter([full]), torch.device("cpu"), prefetch=True)  # a GPU's way, on the CPU
    assert "attention_mask" not in next(prefetched)
    with HostSyncs() as seen:
        loss, n = causal_lm_loss(model, moved)
        (loss / n).backward()
    assert seen.syncs == []
    torch.testing.assert_close(loss, masked_loss)
    padded = full | {"attention_mask": torch.ones_like(ids).index_fill_(1, torch.tensor([15]), 0)}
    kept = next(OnDevice(iter([padded]), torch.device("cpu")))  # any padding keeps the mask
    assert torch.equal(kept["attention_mask"], padded["attention_mask"])


@pytest.mark.parametrize("arch, length, want", [
    ("gpt_neo", 24, [(True, True), (True, True), (False, False)]),  # global; local blocked (3 windows)
    ("gpt_neo", 20, [(True, True), (False, False)]),  # global; local under its full window mask
    ("llama", 24, [(True, True), (True, True)]),
])  # fmt: skip
def test_own_positions_keep_sdpa_s_causal_path_where_transformers_would_trace_a_mask(
    monkeypatch, arch, length, want
):
    """In a forward with the model's own positions (no mask, no position ids, no cache) the causal
    mask is skipped as in eager even where transformers, tracing, would build a dense one: a body
    compiled whole (train.compile_scope=model) on the GPU's torch 2.11 and transformers 5.17 took
    every layer off SDPA's is_causal (flash) and GPT-Neo's local layers off their blocks. Any other
    forward (a padding mask, position ids) gets transformers' mask, traced or not."""
    import torch.nn.functional as F

    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        seen.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = build_model(TINY | {"arch": arch}, vocab_size=97)
    ids = torch.randint(0, 97, (2, length))
    with torch.no_grad():
        eager = model.base_model(input_ids=ids).last_hidden_state
        assert seen == want
        # transformers' mask builder as it answers while dynamo traces: 5.17 (is_tracing) and later
        # releases on torch before 2.14 (dynamo makes is_exporting True)
        from transformers import masking_utils

        monkeypatch.setattr(masking_utils, "is_tracing", lambda *a, **k: True, raising=False)
        monkeypatch.setattr(masking_utils, "is_torchdynamo_exporting", lambda: True, raising=False)
        seen.clear()
        traced = model.base_model(input_ids=ids).last_hidden_state
        assert seen == want
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)
        seen.clear()  # positions given: transformers' own decision, here a mask in every layer
        model.base_model(input_ids=ids, position_ids=torch.arange(length).expand(2, -1))
        assert seen and all(not no_mask for no_mask, _ in seen)


@pytest.mark.parametrize("arch", ["gpt_neo", "llama"])
def test_the_own_positions_hooks_make_no_module_state_while_they_run(arch):
    """The hooks around the body keep their stack on the module from when they are set, and a
    forward leaves the module's attributes as it found them: state made inside a hook (a
    dict.setdefault there) broke torch 2.11's graph of a body compiled whole, at the hook."""
    model = build_model(TINY | {"arch": arch}, vocab_size=97)
    base = model.base_model
    before = dict(base.__dict__)
    with torch.no_grad():
        base(input_ids=torch.randint(0, 97, (2, 16)))
    assert base.__dict__.keys() == before.keys() and base._acco_own_positions == []
