"""What the CUDA review decided, checked on the CPU: NCCL's timeout and error handling, the prefetch
of the next micro-batch, and a pretrained model loaded in its own dtype."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import DEVICES, maybe_installed

from acco.data.on_device import OnDevice, Rewound
from acco.launch.process_group import NCCL_MIN_TIMEOUT_S, backend_settings


def test_nccl_gets_a_set_up_timeout_and_async_error_handling_gloo_keeps_its_own():
    assert backend_settings("gloo", 30) == (30.0, {})
    for nccl in ("nccl", "cpu:gloo,cuda:nccl"):
        timeout, env = backend_settings(nccl, 30)
        assert timeout == NCCL_MIN_TIMEOUT_S >= 300
        # 2: abort the communicator and raise in Python (torch's default, 3, kills the process)
        assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert backend_settings("nccl", 3600)[0] == 3600.0  # a longer timeout asked for is kept


def counted(n: int, log: list):
    for i in range(n):
        log.append(i)
        ids = torch.full((2, 3), i)
        yield {"input_ids": ids, "labels": ids, "attention_mask": PADDED.clone()}


PADDED = torch.tensor([[1, 1, 1], [1, 1, 0]])  # a padded row: the mask travels (all ones, it is dropped)


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_reads_one_ahead_and_hands_out_every_micro_batch_in_order(device):
    """fake-cuda: the copies run on a copy stream, the compute stream waits for each and takes it
    over (record_stream) before it reads it; the fake fails any use that skips either."""
    with maybe_installed(device) as fake:
        read: list[int] = []
        stream = OnDevice(counted(4, read), torch.device("cpu"), prefetch=True)
        assert stream.ahead == 0 and read == []  # nothing is read before the first request
        got = []
        for batch in stream:
            got.append(int(batch["input_ids"][0, 0]))
            assert batch["labels"] is batch["input_ids"]  # sent once
            assert torch.equal(batch["attention_mask"], PADDED)
            # the next one was read while this one is handed out (none after the last)
            assert read == list(range(min(len(got) + 1, 4)))
            assert stream.ahead == (1 if len(got) < 4 else 0)
        # by default: where streams are
        assert OnDevice(counted(1, []), torch.device("cpu")).prefetch == (fake is not None)
    assert got == [0, 1, 2, 3] and stream.ahead == 0
    if fake is not None:  # two distinct tensors per micro-batch, each handed over to the compute stream
        assert fake.counts["handovers"] == 8 and fake.counts["waits"] == 4
    # on the CPU by default nothing is read ahead
    read = []
    plain = OnDevice(counted(3, read), torch.device("cpu"))
    assert int(next(plain)["input_ids"][0, 0]) == 0 and read == [0] and plain.ahead == 0


def test_a_checkpoint_position_goes_back_by_the_prefetched_micro_batch():
    class Position:
        def state_dict(self):
            return {"epoch": 2, "position": 0, "num_samples": 40, "global_batch_size": 4}

    # 10 micro-batches per epoch: one back from the start of epoch 2 is the last of epoch 1
    assert Rewound(Position(), 1).state_dict() == {
        "epoch": 1,
        "position": 9,
        "num_samples": 40,
        "global_batch_size": 4,
    }


def test_a_pretrained_model_loads_in_its_own_dtype_and_the_master_keeps_every_bit(tmp_path):
    from acco.engine import EngineConfig, build_engine
    from acco.models import build_model

    cfg = dict(
        arch="gpt_neo", hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16, window_size=16
    )
    torch.manual_seed(0)
    fp32 = build_model(cfg, vocab_size=96, max_length=16)
    fp32.save_pretrained(tmp_path / "fp32")
    fp32.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    fp32 = build_model({**cfg, "pretrained": str(tmp_path / "fp32")}, 96)
    bf16 = build_model({**cfg, "pretrained": str(tmp_path / "bf16")}, 96)
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    forced = build_model({**cfg, "pretrained": str(tmp_path / "bf16")}, 96, dtype=torch.float32)
    assert {p.dtype for p in forced.parameters()} == {torch.float32}
    # An fp32 checkpoint under mixed precision: the engine casts, the master has the file's bits.
    weights = torch.cat([p.detach().flatten() for p in fp32.parameters() if p.dim() >= 2]).clone()
    assert not torch.equal(weights, weights.to(torch.bfloat16).float())  # bf16 would lose bits here
    engine = build_engine(fp32, EngineConfig(method="ddp", nb_steps_tot=1, use_mixed_precision=True))
    assert torch.equal(engine.comm.optimizer.master[: weights.numel()], weights)
    assert {p.dtype for p in fp32.parameters()} == {torch.bfloat16}
    engine.close()


@pytest.mark.slow
def test_bench_gpu_nproc_2_runs_its_processes_and_skips_without_the_gpus(tmp_path):
    import argparse
    import json

    from acco_bench import gpu

    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    if not torch.cuda.is_available():
        args = parser.parse_args(["--nproc", "2", "--out", str(tmp_path / "cuda")])
        assert gpu.main(args) == gpu.SKIP_EXIT
        assert json.loads((tmp_path / "cuda" / "gpu.json").read_text())["skipped"] is True
    # the same 2 processes on gloo (the code path; NCCL needs the GPUs)
    args = parser.parse_args(["--device", "cpu", "--nproc", "2", "--model", "tiny", "--batch-size", "2",
                              "--max-length", "16", "--steps", "3", "--warmup", "1",
                              "--variants", "engine-acco,plain-bf16",
                              "--out", str(tmp_path / "cpu")])  # fmt: skip
    assert gpu.main(args) == 0
    result = json.loads((tmp_path / "cpu" / "gpu.json").read_text())
    assert result["nproc"] == 2 and list(result["variants"]) == ["engine-acco"]  # plain loops are 1-process
    assert result["variants"]["engine-acco"]["updates_timed"] >= 2


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_slow_worker_stretches_its_compute_not_its_waits(monkeypatch, prefetch):
    """`train.slowdown` (acco-bench --slow-worker) sleeps (slowdown - 1) x what this worker computed
    since it took the last micro-batch: a wait in between (ddp's round, acco at its cap) and what the
    trainer does apart (evaluations, checkpoints) are not stretched. It was once the wall time, which
    stretched ddp's comm by the slowdown and aimed --comm-share wrong (0.31 measured for 0.40 asked);
    then the evaluations' CPU time (0.34 for 0.40: ddp's compute 1.75 s in the probes, which do not
    evaluate, 2.29 s in the race)."""
    import threading
    import time

    from acco.data import on_device

    slept: list[float] = []
    monkeypatch.setattr(on_device.time, "sleep", slept.append)
    stream = OnDevice(counted(3, []), torch.device("cpu"), slowdown=3.0, prefetch=prefetch)
    next(stream)
    assert slept == []  # nothing computed before the first micro-batch

    def compute(seconds: float) -> None:  # this thread's CPU for that long
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            torch.ones(64, 64) @ torch.ones(64, 64)

    compute(0.05)  # the micro-batch's compute
    threading.Event().wait(0.3)  # then a wait on a round: no CPU
    with stream.not_compute():
        compute(0.3)  # then an evaluation: timed apart from training, so not stretched either
    next(stream)
    assert len(slept) == 1 and 2 * 0.05 <= slept[0] < 2 * 0.15, slept  # (3 - 1) x the compute alone


def test_the_slowdown_is_refused_off_the_cpu():
    from acco.engine.config import ConfigError

    with pytest.raises(ConfigError, match="train.slowdown emulates a slower worker on the CPU only"):
        OnDevice(iter([]), torch.device("cuda"), slowdown=2.0)


def test_the_comm_thread_computes_on_one_host_thread_and_leaves_the_rest_to_training():
    """On the CPU a comm round runs beside the training thread: two OpenMP teams on the same cores
    spun against each other (acco at 0.82-0.85 of ddp's tokens/s on 2 cores, BENCHMARKS.md). The comm
    thread takes one intra-op thread; the training thread keeps its own setting."""
    from acco.engine.background import BackgroundComm

    training_threads = torch.get_num_threads()
    comm = BackgroundComm(torch.device("cpu"))
    try:
        assert comm.submit(torch.get_num_threads).result().value == 1
    finally:
        comm.close()
    assert torch.get_num_threads() == training_threads
