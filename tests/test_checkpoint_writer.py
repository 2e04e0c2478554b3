"""Checkpoints written in the background (train.async_save): the files hold the state of the update
they name even when training has changed it before they are written, one save is in flight at most,
a failed write is raised in the training thread, and a run's checkpoints are the same with the
writer in the background as with blocking saves."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from trainer_helpers import tiny_args, tiny_data, tiny_model

from acco import checkpoint, checkpoint_writer
from acco.checkpoint_writer import CheckpointWriter
from acco.resume import load_meta
from acco.run_folder import list_checkpoints


class _Engine:
    """The part of an engine a save reads: a live state that training keeps changing."""

    def __init__(self, log: list[str]):
        self.master = torch.arange(6, dtype=torch.float32)
        self.moments = [torch.zeros(6), torch.ones(6)]
        self.log = log

    def state_dict(self) -> dict:
        self.log.append("state")
        return {"numel": 6, "master": self.master, "moments": self.moments, "step": 1}


class _Position:
    def state_dict(self) -> dict:
        return {"epoch": 0, "position": 3, "num_samples": 12, "global_batch_size": 1}


def _save(engine, out, step, writer, model):
    args = {"method_name": "ddp", "output_dir": str(out), "save_total_limit": None}
    record = SimpleNamespace(step=step, committed_micro_batches=step, wall_time=0.0)

    def snapshot_model(w):
        copy = w.host_copy(model, "model.w")
        return lambda folder: (folder.mkdir(), torch.save(copy, folder / "w.pt"))

    checkpoint.save_run(engine, _Position(), record, args, 0, 1, writer, snapshot_model)


@pytest.mark.parametrize("background", [True, False])
def test_files_hold_the_saved_update_though_training_changed_it_since(tmp_path, monkeypatch, background):
    """The write is held until training has changed every saved tensor in place: the files must
    still hold the values of the update the checkpoint names (host copies taken at the save)."""
    release, original = threading.Event(), checkpoint.save

    def held(*a, **k):
        assert release.wait(30), "the test never released the write"
        return original(*a, **k)

    monkeypatch.setattr(checkpoint, "save", held)
    engine, model = _Engine([]), torch.full((3,), 7.0)
    expected = {"master": engine.master.clone(), "moments": [m.clone() for m in engine.moments]}
    writer = CheckpointWriter(torch.device("cpu"), background)
    if not background:  # a blocking save writes before it returns: nothing may hold it
        release.set()
    _save(engine, tmp_path, 1, writer, model)
    engine.master.add_(100.0)  # the next updates, before the write
    for m in engine.moments:
        m.mul_(-3.0)
    model.zero_()
    release.set()
    assert writer.wait() == tmp_path / "checkpoint-1"
    saved = checkpoint.load_worker(tmp_path / "checkpoint-1", 0, 1)["engine"]
    assert torch.equal(saved["master"], expected["master"])
    assert all(torch.equal(a, b) for a, b in zip(saved["moments"], expected["moments"], strict=True))
    assert torch.equal(torch.load(tmp_path / "checkpoint-1" / "model" / "w.pt"), torch.full((3,), 7.0))
    assert load_meta(tmp_path / "checkpoint-1")["step"] == 1


def test_the_next_save_waits_for_the_one_in_flight_and_reuses_its_buffers(tmp_path, monkeypatch):
    """Order, not timing: the first write lets itself finish only once the second save has
    started reading the engine's state, or after 2 s. Waiting for it, the second save reads the
    state only after the first write is done."""
    log, original = [], checkpoint.save
    engine = _Engine(log)

    def logged(out, step, *a, **k):
        if step == 1:
            deadline = threading.Event()
            # With the wait missing, the second save's state read lands here, before this write ends.
            deadline.wait(2.0) if log.count("state") < 2 else None
        result = original(out, step, *a, **k)
        log.append(f"written {step}")
        return result

    monkeypatch.setattr(checkpoint, "save", logged)
    writer = CheckpointWriter(torch.device("cpu"), background=True)
    model = torch.zeros(3)
    _save(engine, tmp_path, 1, writer, model)
    buffers = {name: b.data_ptr() for name, b in writer._buffers.items()}
    engine.master.add_(1.0)
    _save(engine, tmp_path, 2, writer, model)
    writer.wait()
    assert log == ["state", "written 1", "state", "written 2"]
    assert {name: b.data_ptr() for name, b in writer._buffers.items()} == buffers  # no new host memory
    assert torch.equal(
        checkpoint.load_worker(tmp_path / "checkpoint-2", 0, 1)["engine"]["master"], engine.master
    )
    assert not torch.equal(
        checkpoint.load_worker(tmp_path / "checkpoint-1", 0, 1)["engine"]["master"], engine.master
    )


def test_a_failed_background_write_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save", full_disk)
    writer = CheckpointWriter(torch.device("cpu"), background=True)
    _save(_Engine([]), tmp_path, 1, writer, torch.zeros(3))
    with pytest.raises(OSError, match="No space left on device"):
        writer.wait()
    assert writer.wait() is None  # raised once; the writer takes the next save


def test_a_run_writes_the_same_checkpoints_in_the_background_as_blocking(tmp_path):
    """One worker, acco with a fixed batch (the accumulator is saved too): every checkpoint's
    tensors, data position and RNG equal between async_save on and off; the summary counts the pause."""
    from acco.trainer import DecoupledTrainer

    runs = {}
    for background in (True, False):
        out = tmp_path / f"async-{background}"
        args = tiny_args(
            "acco", out, nb_steps_tot=16, save_step=1, async_save=background, accumulate_while_waiting=False
        )
        torch.manual_seed(0)
        summary = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train()
        assert summary["checkpoint_pause_s"] > 0
        runs[background] = {p.name: checkpoint.load_worker(p, 0, 1) for p in list_checkpoints(out)}
    assert list(runs[True]) == list(runs[False]) and len(runs[True]) >= 4
    for name, state in runs[True].items():
        blocking = runs[False][name]
        assert state["data"] == blocking["data"] and torch.equal(state["rng"], blocking["rng"])
        flat = dict(checkpoint_writer.floating_tensors(state["engine"]))
        assert flat.keys() == dict(checkpoint_writer.floating_tensors(blocking["engine"])).keys()
        for key, tensor in checkpoint_writer.floating_tensors(blocking["engine"]):
            assert torch.equal(flat[key], tensor), f"{name}: {key}"


def test_after_a_failure_close_gives_up_on_a_stuck_write_without_raising(tmp_path, monkeypatch, capsys):
    """A write waiting on a dead peer must not hold the failing worker: close() returns after its
    timeout with a line, raises nothing over the error in flight, and frees the host buffers."""
    stuck = threading.Event()
    monkeypatch.setattr(checkpoint, "save", lambda *a, **k: stuck.wait(60))
    writer = CheckpointWriter(torch.device("cpu"), background=True)
    _save(_Engine([]), tmp_path, 1, writer, torch.zeros(3))
    assert writer._buffers
    writer.close(timeout_s=0.2)
    assert "the checkpoint being written was abandoned after 0 s" in capsys.readouterr().err
    assert not writer._buffers
    stuck.set()


def _one_worker_cannot_write(rank, world, root, background, part="shard"):
    """Rank 1's shard fails as on a full disk, or (`part` "folder") rank 0 cannot create the
    checkpoint's .tmp folder; every worker's train() and the time it took."""
    import errno
    import time
    from pathlib import Path

    from acco.trainer import DecoupledTrainer

    save, mkdir = torch.save, Path.mkdir

    def full_disk(obj, file, *a, **k):
        if rank == 1 and str(getattr(file, "name", file)).endswith(f"rank1-of-{world}.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(file.name))
        return save(obj, file, *a, **k)

    def no_permission(path, *a, **k):
        if path.name.endswith(".tmp"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return mkdir(path, *a, **k)

    # this spawned worker's alone
    if part == "shard":
        checkpoint.torch.save = full_disk
    else:
        Path.mkdir = no_permission
    args = tiny_args("acco", root, nb_steps_tot=48, save_step=2, async_save=background, timeout_s=60)
    trainer = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args)
    start = time.monotonic()
    try:
        trainer.train()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return None, None, time.monotonic() - start


@pytest.mark.parametrize("background,part", [(True, "shard"), (False, "shard"), (True, "folder")],
                         ids=["async", "blocking", "folder"])  # fmt: skip
def test_a_shard_that_cannot_be_written_is_said_by_every_worker(tmp_path, background, part):
    """Rank 0 waited for a shard that never came (a full disk on rank 1) until the collective
    timeout, and the run ended blaming rank 0 as stalled; now every worker raises the write's own
    error at once, and the checkpoint before stays the newest. The same where rank 0 cannot create
    the checkpoint's folder (the others waited for it up to an hour)."""
    from distributed import run_distributed

    found = run_distributed(_one_worker_cannot_write, 2, str(tmp_path), background, part)
    said = "a checkpoint could not be written: " + (
        "rank 1: OSError: [Errno 28] No space left on device" if part == "shard"
        else "rank 0: PermissionError: [Errno 13] Permission denied"
    )  # fmt: skip
    for kind, message, seconds in found:
        assert kind == "CheckpointWriteError" and message.startswith(said), found
        assert seconds < 30, found  # not the 60 s collective timeout
    assert [p.name for p in list_checkpoints(tmp_path)] == []  # the first save failed
