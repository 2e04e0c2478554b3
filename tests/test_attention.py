"""GPT-Neo through SDPA (acco/attention.py) equals transformers' eager attention, global and local
layers, with and without padding, in value and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from acco.attention import GPTNeoSDPAttention, use_sdpa
from acco.models import build_model


@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_equals_eager_for_gpt_neo(padded):
    torch.manual_seed(0)
    config = dict(arch="gpt_neo", hidden_size=64, num_layers=4, num_heads=4, max_position_embeddings=64, window_size=8)
    eager = build_model(config | {"attn_implementation": "eager"}, vocab_size=100, max_length=64)
    assert eager.config.attention_layers == ["global", "local", "global", "local"]
    sdpa = copy.deepcopy(eager)
    assert use_sdpa(sdpa) == 4
    assert sum(isinstance(m, GPTNeoSDPAttention) for m in sdpa.modules()) == 4
    assert sdpa.state_dict().keys() == eager.state_dict().keys()
    built = build_model(config, vocab_size=100, max_length=64)  # the default swaps it in
    assert sum(isinstance(m, GPTNeoSDPAttention) for m in built.modules()) == 4
    x = torch.randint(0, 100, (3, 64), generator=torch.Generator().manual_seed(1))
    mask = None
    labels = x
    if padded:  # the last 14 positions are padding: local rows there see no real key at all
        mask = torch.ones_like(x).index_fill_(1, torch.arange(50, 64), 0)
        labels = x.masked_fill(mask == 0, -100)
    outs = []
    for model in (eager, sdpa):
        out = model(input_ids=x, attention_mask=mask, labels=labels)
        out.loss.backward()
        outs.append((out.logits[:, :50].detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    for g_sdpa, g_eager in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(g_sdpa, g_eager, rtol=1e-4, atol=1e-6)
