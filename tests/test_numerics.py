"""Numerics of the engine in bf16: wp's prediction on the fp32 master, and what a worker holds."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from acco.engine import EngineConfig, build_engine
from acco.engine.config import ConfigWarning


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
    return EngineConfig(
        method=method,
        n_grad_accumulation=1,
        nb_steps_tot=updates,
        use_mixed_precision=bf16,
        learning_rate=1e-4,
        warmup=0,
        scheduler_name="constant",
        weight_decay=0.0,
        accumulate_while_waiting=False,
    )


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
    # model-dtype params, grads, comm buffer; fp32 master, moments, gradient shard, wp's previous
    # master (the trial workspace is acco's only); no fp32 gradient accumulator (grad_accum_dtype
    # bf16, the default: test_grad_accum_dtype_... has fp32); no received or sent shard: both
    # collectives run in place on the round's vectors
    assert bf16.state_bytes() == {
        "params": 2 * p, "grads": 2 * p, "comm_buffer": 2 * p,
        "master": 4 * p, "exp_avg": 4 * p, "exp_avg_sq": 4 * p,
        "grad_shard": 4 * p, "wp_previous_master": 4 * p}  # fmt: skip
    bf16.close()
    fp32 = build_engine(mlp(), cfg("ddp", bf16=False))
    got = fp32.state_bytes()  # ddp: no comm buffer; the reduce-scatter lands in the fp32 gradient shard
    assert sorted(got) == ["exp_avg", "exp_avg_sq", "grad_shard", "grads", "master", "params"]
    assert sum(got.values()) == 4 * p * 6
    fp32.close()
    acco = build_engine(mlp(), cfg("acco", bf16=False))
    assert acco.state_bytes()["trial_workspace"] == 4 * 3 * -(-p // 3)  # the trial: 3 chunks
    acco.close()


def _payload_and_micro_grads(accum: str, k: int = 8):
    """The first update's payload of ddp in bf16 (k micro-batches), and each micro-batch's own
    bf16 gradient, in the flat order."""
    model = mlp()
    config = EngineConfig(
        method="ddp",
        n_grad_accumulation=k,
        nb_steps_tot=k,
        use_mixed_precision=True,
        accumulate_while_waiting=False,
        grad_accum_dtype=accum,
        max_grad_norm=None,
    )
    engine = build_engine(model, config)
    payloads, run = [], engine.comm.run
    engine.comm.run = lambda payload, *a, **kw: (payloads.append(payload.clone()), run(payload, *a, **kw))[1]
    reference = mlp().to(torch.bfloat16)
    micro_grads = []
    for batch in itertools.islice(batches(torch.bfloat16), k):
        reference.zero_grad()
        mse(reference, batch).backward()
        ordered = [p for p in reference.parameters() if p.dim() >= 2] + [
            p for p in reference.parameters() if p.dim() < 2
        ]
        micro_grads.append(torch.cat([p.grad.flatten() for p in ordered]))
    list(engine.run(batches(torch.bfloat16), mse))
    state = engine.state_bytes()
    engine.close()
    return payloads[0][: micro_grads[0].numel()], micro_grads, state


def test_grad_accum_dtype_sums_micro_batches_in_fp32_or_in_bf16():
    """fp32: the payload is the fp32 sum of the micro-batches' bf16 gradients, rounded once; bf16:
    each micro-batch's gradient is added in bf16, as autograd accumulates into a bf16 .grad."""
    payload, micro, state = _payload_and_micro_grads("fp32")
    in_fp32 = torch.zeros_like(micro[0], dtype=torch.float32)
    for g in micro:
        in_fp32 += g  # in the engine's order
    assert torch.equal(payload, in_fp32.to(torch.bfloat16))
    assert state["grad_accumulator_fp32"] == 4 * payload.numel()
    payload, micro, state = _payload_and_micro_grads("bf16")
    in_bf16 = micro[0].clone()
    for g in micro[1:]:
        in_bf16 += g
    assert torch.equal(payload, in_bf16)
    assert "grad_accumulator_fp32" not in state
    assert not torch.equal(in_bf16, in_fp32.to(torch.bfloat16))  # the two differ here


@pytest.mark.parametrize(
    "kernels, bf16, said", [(False, True, True), (True, True, False), (False, False, False)],
    ids=["avx2-bf16", "avx512-bf16", "avx2-fp32"],
)
def test_bf16_on_a_cpu_without_its_matrix_kernels_is_said(monkeypatch, kernels, bf16, said):
    """Mixed precision on an AVX2 CPU trains right but 25-300x slower: one line says so and how to
    train in fp32; not said where the CPU has the kernels, nor in fp32."""
    import acco.engine
    import acco.engine.config

    monkeypatch.setattr(acco.engine.config, "_ADVISED", set())
    monkeypatch.setattr(acco.engine, "cpu_has_bf16_matmul", lambda: kernels)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_engine(mlp(), cfg("ddp", bf16)).close()
    lines = [str(w.message) for w in caught if w.category is ConfigWarning]
    assert lines == (["use_mixed_precision=true trains in bf16, which this CPU has no matrix kernels for (no "
                      "AVX512 or AMX): its matrix products run 25-300x slower than fp32; "
                      "use_mixed_precision=false trains in fp32"] if said else [])


def test_the_cpu_s_bf16_kernels_are_torch_s_answer(monkeypatch):
    """The check is oneDNN's (torch's own choice of kernel), and a torch without it says nothing."""
    from acco.engine import cpu_has_bf16_matmul

    assert cpu_has_bf16_matmul() is torch.ops.mkldnn._is_mkldnn_bf16_supported()
    monkeypatch.setattr(torch.ops, "mkldnn", None)
    assert cpu_has_bf16_matmul() is True
