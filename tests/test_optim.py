"""ShardedAdamW (commit and trial steps, the gradient's divisor, weight decay's ranges) and the LR
schedule, against torch's AdamW and the formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from acco.engine import EngineConfig, optim
from acco.engine.optim import ShardedAdamW, learning_rate


def _adamw_cfg():
    return EngineConfig(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95)


def test_trial_step_equals_commit_and_leaves_state_bit_identical():
    torch.manual_seed(0)
    master = torch.randn(1000)
    opt = ShardedAdamW(master, _adamw_cfg())
    for _ in range(3):
        opt.commit(torch.randn(1000), lr=1e-2)
    snapshot = {k: v.clone() for k, v in opt.state_tensors().items()}
    grad = torch.randn(1000)
    out = torch.empty(1000)
    opt.trial(grad.clone(), lr=7e-3, out=out)
    for name, value in opt.state_tensors().items():
        assert torch.equal(value, snapshot[name]), f"trial step changed {name}"
    assert opt.step_count == 3 == int(opt.state_tensors()["step"])
    opt.trial(grad.clone(), lr=0.0, out=out)  # lr 0 (end of a linear schedule) moves nothing
    assert torch.equal(out, master)
    opt.trial(grad.clone(), lr=7e-3, out=out)
    opt.commit(grad.clone(), lr=7e-3)
    assert torch.equal(out, master)  # commit's own kernel: bit for bit
    assert not torch.allclose(snapshot["master"], master)
    assert opt.step_count == 4 == int(opt.state_tensors()["step"])


@pytest.mark.parametrize("out_is_grad", [False, True])
def test_a_trial_step_in_chunks_is_a_commit_bit_for_bit(monkeypatch, out_is_grad):
    """The trial runs AdamW's kernel on copies one workspace chunk at a time: chunks that end inside
    a range, at the decayed range's end, and a last short one; into the gradient itself too (the
    lean and int8 estimates), and into a bf16 output rounded once."""
    monkeypatch.setattr(optim, "TRIAL_CHUNK", 7)
    torch.manual_seed(0)
    master = torch.randn(50)
    opt = ShardedAdamW(master, _adamw_cfg(), decayed=31)
    assert opt._chunk == 7 and opt.trial_workspace.numel() == 21  # three chunks: at most 4 bytes an element
    for _ in range(2):
        opt.commit(torch.randn(50), lr=1e-2)
    grad = torch.randn(50)
    out = grad.clone() if out_is_grad else torch.empty(50, dtype=torch.bfloat16)
    opt.trial(out if out_is_grad else grad.clone(), lr=3e-3, out=out)
    opt.commit(grad, lr=3e-3)
    assert torch.equal(out, master if out_is_grad else master.to(torch.bfloat16))
    small = ShardedAdamW(torch.randn(10), _adamw_cfg())
    assert small.trial_workspace.numel() == 3 * 4  # a shard smaller than three chunks: ceil(10 / 3) each


def test_the_gradient_s_divisor_is_applied_inside_the_kernel_alike_by_trial_and_commit():
    """The round divides the summed gradient by its weight (and clips) through the kernel's
    grad_scale: a commit of g with divisor d is AdamW on g / d, and a trial with d is that commit
    bit for bit (chunks of 7: inside and across the ranges)."""
    torch.manual_seed(0)
    # AdamW is blind to the gradient's scale but for eps: an eps of the divided gradient's size
    # makes a missing or doubled division move the parameters
    g, d, eps = torch.randn(50) * 8.0, 6.5, 1.0
    cfg = EngineConfig(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=eps)
    ref = nn.Parameter(torch.randn(50))
    master = ref.detach().clone()
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=eps, weight_decay=0.1)
    opt = ShardedAdamW(master, cfg)
    for _ in range(2):
        ref.grad = g / d
        ref_opt.step()
        opt.commit(g.clone(), lr=1e-2, divisor=d)
    torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)
    left = g.clone()
    opt.commit(left, lr=1e-2, divisor=1.0)  # divisor 1: the gradient is read as it is, not written
    assert torch.equal(left, g)
    chunked = ShardedAdamW(torch.randn(50), cfg, decayed=31, chunk=7)
    assert chunked.trial_workspace.numel() == 21
    out = torch.empty(50)
    chunked.trial(g.clone(), lr=3e-3, divisor=d, out=out)
    undivided = out.clone()
    chunked.trial(g.clone(), lr=3e-3, divisor=1.0, out=undivided)
    assert not torch.allclose(out, undivided)
    divided = g.clone()
    chunked.commit(divided, lr=3e-3, divisor=d)
    assert torch.equal(out, chunked.master)
    torch.testing.assert_close(divided, g / d)  # left divided, as torch's AMP unscaling leaves it


def test_commit_matches_torch_adamw():
    torch.manual_seed(0)
    p = torch.randn(50)
    ref = nn.Parameter(p.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = ShardedAdamW(p, _adamw_cfg())
    for _ in range(4):
        g = torch.randn(50)
        ref.grad = g.clone()
        ref_opt.step()
        opt.commit(g, lr=1e-2)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)  # fused kernel vs the reference loop


def test_weight_decay_only_on_the_first_range_as_torch_adamw_with_two_groups():
    """The shard's first 30 elements (matrices) decay, the last 20 (biases, norms) do not: the same
    as torch's AdamW with two parameter groups, for commits and for a trial step."""
    torch.manual_seed(0)
    p = torch.randn(50)
    decayed, plain = nn.Parameter(p[:30].clone()), nn.Parameter(p[30:].clone())
    ref_opt = torch.optim.AdamW(
        [{"params": [decayed], "weight_decay": 0.1}, {"params": [plain], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    opt = ShardedAdamW(p, _adamw_cfg(), decayed=30)
    for _ in range(4):
        g = torch.randn(50)
        decayed.grad, plain.grad = g[:30].clone(), g[30:].clone()
        ref_opt.step()
        out = torch.empty(50)
        opt.trial(g.clone(), lr=1e-2, out=out)
        opt.commit(g, lr=1e-2)
        assert torch.equal(out, p)
    torch.testing.assert_close(p, torch.cat([decayed.detach(), plain.detach()]), rtol=1e-6, atol=1e-7)
    everywhere = torch.randn(50, generator=torch.Generator().manual_seed(1))
    split = everywhere.clone()
    for opt in (ShardedAdamW(everywhere, _adamw_cfg()), ShardedAdamW(split, _adamw_cfg(), decayed=30)):
        opt.commit(torch.zeros(50), lr=1.0)  # a zero gradient: only the decay moves anything
    assert torch.equal(split[30:], torch.randn(50, generator=torch.Generator().manual_seed(1))[30:])
    torch.testing.assert_close(split[:30], everywhere[:30])


@pytest.mark.parametrize(
    "name,samples,batch,expected",
    [
        ("constant", 50, 10, 1.0),
        ("cosine", 0, 10, 0.5),  # warm-up counts this update's batch: 10 / 20
        ("cosine", 20, 10, 1.0),  # decay starts after warm-up
        ("cosine", 60, 10, 0.5),  # half-way through the decay
        ("cosine", 100, 10, 0.0),
        ("linear", 60, 10, 0.5),
    ],
)
def test_learning_rate_follows_samples(name, samples, batch, expected):
    cfg = EngineConfig(
        learning_rate=1.0, scheduler_name=name, warmup=20 if name != "constant" else 0, nb_steps_tot=100
    )
    assert learning_rate(cfg, samples, batch) == pytest.approx(expected, abs=1e-12)
