"""Numerics of the engine in bf16: wp's prediction on the fp32 master, and what a worker holds."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from acco.engine import EngineConfig, build_engine


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def batches(dtype):
    gen = torch.Generator().manual_seed(1)
    for _ in itertools.count():
        x = torch.randn(8, 16, generator=gen)
        yield x.to(dtype), torch.sin(x[:, :4]).to(dtype)


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y.float())


def cfg(method: str, bf16: bool, updates: int = 8) -> EngineConfig:
    # lr 1e-4: most updates are below one bf16 step of these weights (the case)
    return EngineConfig(method=method, n_grad_accumulation=1, nb_steps_tot=updates, use_mixed_precision=bf16,
                        learning_rate=1e-4, warmup=0, scheduler_name="constant", weight_decay=0.0,
                        accumulate_while_waiting=False)  # fmt: skip


def test_wp_prediction_is_taken_on_the_fp32_master_in_bf16():
    model = mlp()
    engine = build_engine(model, cfg("wp", bf16=True))
    master = engine.comm.optimizer.master
    numel = engine.flat.layout.numel
    masters, predictions, committed = [master.clone()], [], []
    for _ in engine.run(batches(torch.bfloat16), mse):
        masters.append(master.clone())
        predictions.append(engine.flat.params[:numel].clone())
        with engine.committed_params():  # the committed parameters, gathered from the master
            committed.append(engine.flat.params[:numel].clone())
        assert torch.equal(engine.flat.params[:numel], predictions[-1])  # the prediction is back
    engine.close()
    assert len(predictions) == 8
    moved_by_fp32_only = 0
    for t, prediction in enumerate(predictions):
        old, new = masters[t], masters[t + 1]
        assert torch.equal(prediction, (2 * new - old).to(torch.bfloat16)), f"update {t + 1}"
        assert torch.equal(committed[t], new.to(torch.bfloat16))
        # The old way, 2 bf16(theta_{t+1}) - bf16(theta_t), extrapolated in bf16:
        in_bf16 = torch.lerp(old.to(torch.bfloat16), new.to(torch.bfloat16), 2.0)
        moved_by_fp32_only += int((prediction != in_bf16).sum())
    # At this LR the bf16 extrapolation misses most of the motion: thousands of elements differ.
    assert moved_by_fp32_only > 0.1 * numel * len(predictions), moved_by_fp32_only
    # After the run the model holds the committed parameters, cast from the fp32 master.
    assert torch.equal(engine.flat.params[:numel], master.to(torch.bfloat16))
    assert torch.equal(model[2].bias.detach(), master[-4:].to(torch.bfloat16))


def test_state_bytes_counts_each_buffer_once():
    p = sum(q.numel() for q in mlp().parameters())  # world size 1: no padding, the shard is everything
    bf16 = build_engine(mlp(), cfg("wp", bf16=True))
    # model-dtype params, grads, payload, summed gradient and sent shard; fp32 master, moments,
    # gradient shard, wp's previous master (the trial workspace is acco's only)
    assert bf16.state_bytes() == {
        "params": 2 * p, "grads": 2 * p, "payload": 2 * p, "master": 4 * p, "exp_avg": 4 * p, "exp_avg_sq": 4 * p,
        "grad_shard": 4 * p, "summed_grad_shard": 2 * p, "new_param_shard": 2 * p,
        "wp_previous_master": 4 * p}  # fmt: skip
    bf16.close()
    fp32 = build_engine(mlp(), cfg("ddp", bf16=False))
    got = fp32.state_bytes()  # ddp: no payload; the reduce-scatter lands in the fp32 gradient shard itself
    assert "payload" not in got and "summed_grad_shard" not in got and "wp_previous_master" not in got
    assert sorted(got) == ["exp_avg", "exp_avg_sq", "grad_shard", "grads", "master", "new_param_shard", "params"]
    assert sum(got.values()) == 4 * p * 7
    fp32.close()
    acco = build_engine(mlp(), cfg("acco", bf16=False))
    assert acco.state_bytes()["trial_workspace"] == 4 * p  # the estimate round's trial step
    acco.close()
