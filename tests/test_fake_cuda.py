"""The fake GPU (tests/fake_cuda.py) catches each CUDA rule broken on purpose, the comm thread
hands back one shape of result on every device, and a run saved and resumed through the GPU's code
paths (prefetch, comm stream, device RNG) continues exactly."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import config, loss_fn, make_model, stream
from fake_cuda import DEVICES, FakeStream, StreamRuleError, installed, maybe_installed
from trainer_helpers import tiny_args, tiny_data, tiny_model, train_losses

from acco import checkpoint
from acco.engine import build_engine
from acco.engine.background import BackgroundComm, Timed
from acco.engine.device import device_ops


def test_a_read_on_another_stream_needs_an_event_in_between():
    with installed() as fake:
        side = fake.new_stream()
        x = torch.zeros(4)
        x.add_(1)  # written on the default stream
        with fake.use_stream(side), pytest.raises(StreamRuleError, match="no event or host wait"):
            x.sum()
        ready = fake.event()
        ready.record()
        with fake.use_stream(side):
            side.wait_event(ready)
            assert float(x.sum()) == 4.0  # ordered by the event: allowed


def test_a_write_over_memory_another_stream_reads_needs_an_event_in_between():
    with installed() as fake:
        side = fake.new_stream()
        x = torch.ones(4)
        ready = fake.event()
        ready.record()
        with fake.use_stream(side):
            side.wait_event(ready)
            x.sum()  # the side stream reads x ...
        with pytest.raises(StreamRuleError, match="writes memory that stream side1 reads"):
            x.zero_()  # ... and the default stream overwrites it, not knowing whether the read is done
        done = fake.event()
        done.record(side)
        done.synchronize()  # the host waited for the read: what it queues next comes after
        x.zero_()


def test_a_tensor_made_on_a_side_stream_is_used_elsewhere_only_after_record_stream():
    with installed() as fake:
        copy = fake.new_stream()
        with fake.use_stream(copy):
            moved = fake.to_device(torch.arange(6.0))
            done = fake.event()
            done.record(copy)
        compute = fake.current_stream()
        compute.wait_event(done)
        with pytest.raises(StreamRuleError, match="made on stream side1 without record_stream"):
            moved.sum()
        fake.record_stream(moved, compute)
        assert float(moved.sum()) == 15.0


def test_waits_only_on_recorded_events_and_timing_only_on_one_stream_once_done():
    with installed() as fake:
        side = fake.new_stream()
        with pytest.raises(StreamRuleError, match="never recorded"):
            side.wait_event(fake.event())
        with pytest.raises(StreamRuleError, match="never recorded"):
            fake.event().synchronize()
        start, end = fake.event(enable_timing=True), fake.event(enable_timing=True)
        start.record(side)
        end.record(fake.current_stream())
        end.synchronize()
        with pytest.raises(StreamRuleError, match="between events on streams side1 and default"):
            start.elapsed_time(end)
        end.record(side)
        with pytest.raises(StreamRuleError, match="before the host waited"):
            start.elapsed_time(end)
        end.synchronize()
        assert start.elapsed_time(end) >= 0
        untimed = fake.event()
        untimed.record(side)
        untimed.synchronize()
        with pytest.raises(StreamRuleError, match="without enable_timing"):
            start.elapsed_time(untimed)


@pytest.mark.parametrize("device", DEVICES)
def test_the_comm_thread_hands_back_the_value_and_its_busy_seconds_on_every_device(device):
    """diloco's all-reduce returns a bare flag and acco's round a RoundResult: both come back as
    Timed on the CPU and on the GPU's path alike (the bug that crashed diloco on CUDA)."""
    with maybe_installed(device):
        background = BackgroundComm(torch.device("cpu"))
        x = torch.ones(3)
        timed = background.submit(lambda: bool(x.sum() > 0)).result()
        background.close()
    assert isinstance(timed, Timed) and timed.value is True and timed.busy_s >= 0


def test_an_engine_that_forgets_the_comm_streams_wait_fails_on_the_fake(monkeypatch):
    """The rule broken in the engine: the comm stream reads the payload without waiting for the
    compute stream to finish it (here: its wait dropped)."""
    cfg = config(method="acco", n_grad_accumulation=1, nb_steps_tot=8)
    with installed() as fake:
        engine = build_engine(make_model("mlp"), cfg)
        assert isinstance(engine.background.stream, FakeStream)
        monkeypatch.setattr(FakeStream, "wait_event", lambda self, event: None)
        with pytest.raises(StreamRuleError, match="with no event or host wait"):
            list(engine.run(stream("mlp", 0, 1), loss_fn))
        engine.close()
    monkeypatch.undo()
    with installed() as fake:  # as it is: every round waits, and each is timed on its own stream
        engine = build_engine(make_model("mlp"), cfg)
        records = list(engine.run(stream("mlp", 0, 1), loss_fn))
        engine.close()
    assert len(records) == 4 and fake.counts["waits"] >= 8 and fake.counts["timings"] >= 8


@pytest.mark.parametrize("method", ["acco", "streaming-diloco"])
def test_save_and_resume_through_the_gpu_paths_is_exact(tmp_path, method):
    """One worker through DecoupledTrainer on the fake GPU: micro-batches prefetched on a copy stream
    (one read ahead, which the checkpoint's data position gives back), rounds on the comm stream,
    the device RNG saved; resumed from checkpoint-2 with other initial weights, the losses after it
    are those of the straight run, bit for bit."""
    from acco.trainer import DecoupledTrainer

    with installed() as fake:
        ref, resumed = tmp_path / "reference", tmp_path / "resumed"
        torch.manual_seed(0)
        trainer = DecoupledTrainer(
            model=tiny_model(), train_dataset=tiny_data(), args=tiny_args(method, ref, nb_steps_tot=16)
        )
        summary = trainer.train()
        assert "peak_gpu_mem_mb" in summary and "peak_rss_mb" not in summary  # the device's memory, named so
        assert trainer._stream.prefetch and fake.counts["handovers"] > 0  # the copy stream's path ran
        saved = checkpoint.load_worker(ref / "checkpoint-2", 0, 1)
        assert "cuda_rng" in saved
        torch.manual_seed(1)
        torch.rand(8, generator=fake.rng)  # the device RNG moves on: the resume must bring it back
        DecoupledTrainer(
            model=tiny_model(), train_dataset=tiny_data(), args=tiny_args(method, resumed, nb_steps_tot=16)
        ).train(resume_from_checkpoint=str(ref / "checkpoint-2"))
        assert device_ops(torch.device("cpu")) is fake and torch.equal(fake.rng_state(), saved["cuda_rng"])
    straight, again = train_losses(ref), train_losses(resumed)
    assert len(straight) > 3 and again == {step: loss for step, loss in straight.items() if step > 2}
