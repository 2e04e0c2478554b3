"""Checkpoints that survive a host crash: every file fsynced before the rename (in the background
writer), the rename atomic also over a checkpoint of the same name, `auto` and `latest` falling back
past a checkpoint that does not verify (saying so), rotation that keeps what verifies, and bad input
at save time (a full disk, a folder that cannot be written): one line, nothing overwritten, the
previous checkpoint whole. The whole-job versions (the CLI, bit-equal to an uninterrupted run):
tests/test_checkpoint.py's slow tier."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from disk_helpers import read_only, small_disk
from trainer_helpers import tiny_args, tiny_data, tiny_model, train_losses, write_checkpoint
from validation_helpers import validation_error

from acco import checkpoint
from acco.checkpoint import CheckpointWriteError
from acco.config import InputError, TrainArgs
from acco.engine import CheckpointError
from acco.resume import ResumePoint, decide_resume, verify
from acco.run_folder import list_checkpoints


def args(out: Path, spec, **more) -> TrainArgs:
    return TrainArgs(method_name="ddp", output_dir=str(out), resume_from_checkpoint=spec, **more)


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_byte(path: Path) -> None:
    """A byte of checkpoint-4's master shard (write_checkpoint's values): the size unchanged, the
    values finite, so that only the CRC can tell."""
    data = bytearray(path.read_bytes())
    at = data.find((torch.arange(6.0) + 4).numpy().tobytes())
    assert at > 0
    data[at + 1] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGES = {  # what a lost page cache (or a bad disk) can leave of a renamed checkpoint
    "shard cut short": (lambda f: cut_in_half(f / "rank0-of-1.pt"), "rank0-of-1.pt holds "),
    "meta.json cut in half": (lambda f: cut_in_half(f / "meta.json"), "unreadable meta.json"),
    "meta.json lost": (lambda f: (f / "meta.json").unlink(), "no meta.json"),
    "model file cut short": (lambda f: cut_in_half(f / "model" / "config.json"), "model/config.json holds "),
    "shard damaged, same size": (lambda f: flip_a_byte(f / "rank0-of-1.pt"), "fails its CRC check"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_auto_and_latest_fall_back_past_a_checkpoint_that_does_not_verify(tmp_path, damage):
    for step in (2, 4):
        write_checkpoint(tmp_path, step)
    spoil, reason = DAMAGES[damage]
    spoil(tmp_path / "checkpoint-4")
    for spec in ("auto", "latest", True):
        point = decide_resume(args(tmp_path, spec), 1)
        assert point.folder == tmp_path / "checkpoint-2" and point.meta["step"] == 2
        (line,) = point.skipped
        assert line.startswith("checkpoint-4 does not verify (") and reason in line, line
        assert line.endswith("resuming from checkpoint-2, the newest checkpoint before it that does")
    with pytest.raises(CheckpointError) as named:  # an explicit path: one line, no fallback
        decide_resume(args(tmp_path, str(tmp_path / "checkpoint-4")), 1)
    assert reason in str(named.value) and "\n" not in str(named.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]  # nothing removed


def test_no_checkpoint_that_verifies_is_an_error_and_auto_starts_afresh_only_over_none(tmp_path):
    assert decide_resume(args(tmp_path, "auto"), 1) == ResumePoint()
    with pytest.raises(CheckpointError, match="^no complete checkpoint in "):
        decide_resume(args(tmp_path, "latest"), 1)
    for step in (2, 4):
        write_checkpoint(tmp_path, step)
        cut_in_half(tmp_path / f"checkpoint-{step}" / "rank0-of-1.pt")
    for spec in ("auto", "latest"):  # never a fresh start that would write over a run's checkpoints
        none = r"^none of the 2 checkpoint\(s\) in .* verifies \(the newest, checkpoint-4: rank0-of-1.pt "
        with pytest.raises(CheckpointError, match=none + "holds .*move them out"):
            decide_resume(args(tmp_path, spec), 1)


def test_a_whole_checkpoint_of_another_model_or_method_is_an_error_not_a_fallback(tmp_path):
    """Its older neighbours are of the same run: falling back would resume another run silently."""
    write_checkpoint(tmp_path, 2)
    write_checkpoint(tmp_path, 4, method="acco")
    with pytest.raises(CheckpointError, match="checkpoint-4 was written by method 'acco', this run is 'ddp'"):
        decide_resume(args(tmp_path, "auto"), 1)
    shutil.rmtree(tmp_path / "checkpoint-4")
    with pytest.raises(CheckpointError, match="checkpoint-2 holds a model of 6 parameters, model 'x' has 7$"):
        decide_resume(args(tmp_path, "latest"), 1, numel=lambda folder: 7, model_label="model 'x'")
    assert decide_resume(args(tmp_path, "latest"), 1, numel=lambda folder: 6).folder.name == "checkpoint-2"


def test_the_validation_pass_decides_once_and_latest_with_nothing_answers_before_any_load(
    tmp_path, capsys, monkeypatch
):
    """check_folders (run by the local launcher before any worker starts, by a worker before it
    loads a tokenizer, a model or data) answers `latest` with nothing to resume and a damaged
    explicit checkpoint; the full pass says what it skipped and leaves its decision in job.resume."""
    from acco import models
    from acco.config import compose
    from acco.job import job_of
    from acco.validate import check_folders, validate_job

    out = tmp_path / "out"
    overrides = [f"train.output_dir={out}", f"train.cache_dir={tmp_path / 'cache'}", "launch.nproc=1",
                 "train=ddp"]  # fmt: skip
    job = job_of(compose([*overrides, "train.resume_from_checkpoint=latest"]))
    latest = "train.resume_from_checkpoint=latest"
    with pytest.raises(InputError, match=f"^{latest}: no complete checkpoint in {out}$"):
        check_folders(job)
    for step in (2, 4):
        write_checkpoint(out, step, **{k: v for k, v in vars(job.args).items() if k != "output_dir"})
    cut_in_half(out / "checkpoint-4" / "meta.json")
    named = f"train.resume_from_checkpoint={out / 'checkpoint-4'}"
    with pytest.raises(InputError, match=f"^{named}: unreadable meta.json"):
        check_folders(job_of(compose([*overrides, named])))
    monkeypatch.setattr(models, "trainable_parameters", lambda *a, **k: 6)  # the stand-in checkpoint's size
    capsys.readouterr()
    job = validate_job(compose([*overrides, "train.resume_from_checkpoint=auto"]))
    assert job.resume.folder == out / "checkpoint-2" and job.resume.meta["step"] == 2
    said = capsys.readouterr().err
    assert said.startswith("acco: warning: checkpoint-4 does not verify (unreadable meta.json"), said


def test_rotation_removes_nothing_until_a_newer_checkpoint_verifies(tmp_path):
    write_checkpoint(tmp_path, 2)
    write_checkpoint(tmp_path, 4)
    cut_in_half(tmp_path / "checkpoint-4" / "rank0-of-1.pt")
    checkpoint.rotate(tmp_path, keep=1)  # the newest verifies not: it does not count, 2 stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    write_checkpoint(tmp_path, 6, keep=2)  # verifies: kept with 2; 4, older than a whole one, goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-6"]
    write_checkpoint(tmp_path, 8, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-8"]


def test_a_checkpoint_of_the_same_name_is_replaced_in_one_rename(tmp_path, monkeypatch):
    """A run that fell back past checkpoint-4 writes checkpoint-4 again: the damaged one is renamed
    aside, never deleted in place (a crash midway left a partial checkpoint-4 that `auto` took)."""
    write_checkpoint(tmp_path, 2)
    write_checkpoint(tmp_path, 4)
    cut_in_half(tmp_path / "checkpoint-4" / "rank0-of-1.pt")
    real, renames = os.replace, []

    def crash_at_the_second(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        if len(renames) == 2:
            raise OSError(errno.EIO, "the host lost power here")
        real(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", crash_at_the_second)
    crashed = "^a checkpoint could not be written: rank 0: OSError: .* power"
    with pytest.raises(CheckpointWriteError, match=crashed):
        write_checkpoint(tmp_path, 4)
    assert renames == [("checkpoint-4", "checkpoint-4.replaced.tmp"), ("checkpoint-4.tmp", "checkpoint-4")]
    assert not (tmp_path / "checkpoint-4").exists()  # no folder of that name half written or half deleted
    assert decide_resume(args(tmp_path, "auto"), 1).folder.name == "checkpoint-2"
    monkeypatch.setattr(checkpoint.os, "replace", real)
    write_checkpoint(tmp_path, 4, keep=2)  # the next save: the debris goes, the new one takes the name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert verify(tmp_path / "checkpoint-4")["step"] == 4


def test_every_file_is_fsynced_in_the_background_before_the_rename_and_the_folder_after(
    tmp_path, monkeypatch
):
    """Spied: os.fsync (which file, which thread) and the renames, in a one-worker run that saves
    in the background (train.async_save, the default)."""
    from acco.trainer import DecoupledTrainer

    events, fsync, replace = [], os.fsync, os.replace

    def spied_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), threading.current_thread().name))
        fsync(fd)

    def spied_replace(src, dst):
        events.append(("rename", str(src), str(dst)))
        replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", spied_fsync)
    monkeypatch.setattr(checkpoint.os, "replace", spied_replace)
    out = tmp_path / "run"
    DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(),
                     args=tiny_args("acco", out, nb_steps_tot=16, save_step=2)).train()  # fmt: skip
    for folder in list_checkpoints(out):
        tmp, renamed = f"{folder}.tmp", events.index(("rename", f"{folder}.tmp", str(folder)))
        synced = {path for kind, path, _ in events[:renamed] if kind == "fsync"}
        written = {str(p).replace(str(folder), tmp) for p in [folder, *folder.rglob("*")]}
        assert written <= synced, sorted(written - synced)  # every file and folder, before the rename
        assert ("fsync", str(out)) in [e[:2] for e in events[renamed:]]  # the rename itself, after it
    threads = {thread for kind, path, thread in events if kind == "fsync" and "checkpoint-" in path}
    assert threads == {"acco-checkpoint-writer"}  # not the training thread


@pytest.mark.parametrize("where", ["shard", "model"])
def test_a_full_disk_at_save_time_is_one_line_and_the_previous_checkpoint_stays_whole(
    tmp_path, monkeypatch, where
):
    """A tmpfs of 512 KiB where mounts are allowed (else ENOSPC faked at the write): a worker's
    shard, or the model rank 0 writes after the shards (safetensors, as save_pretrained), does
    not fit."""
    from safetensors.torch import save_file

    out = tmp_path / "disk"
    with small_disk(out, 512) as mounted:
        write_checkpoint(out, 2)
        big = {"master": torch.zeros(256 * 1024)}  # 1 MiB

        def model(folder: Path) -> None:
            folder.mkdir()
            if where == "model":
                if not mounted:
                    raise OSError(errno.ENOSPC, "No space left on device")
                save_file(big, folder / "model.safetensors")

        if where == "shard" and not mounted:
            def full(*a, **k):
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(checkpoint, "write_durably", full)
        state = {"engine": big if where == "shard" else {}, "data": {}}
        meta = {"step": 4, "samples": 16, "method": "ddp", "world_size": 1, "numel": 6}
        with pytest.raises(CheckpointWriteError) as said:
            checkpoint.save(out, 4, state, meta, 0, 1, model, keep=1)
        line = str(said.value)
        assert line.startswith("a checkpoint could not be written: rank 0: ") and "\n" not in line
        assert "No space left on device" in line, line
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]  # no .tmp left taking the space
        assert verify(out / "checkpoint-2")["step"] == 2  # whole, CRCs read
        assert decide_resume(args(out, "auto"), 1).folder == out / "checkpoint-2"


def test_an_output_folder_that_cannot_be_written(tmp_path):
    """At validation, one line before anything starts; at save time (the folder made read-only
    mid-run), one line from the save and the previous checkpoint whole."""
    out = tmp_path / "out"
    write_checkpoint(out, 2)
    with read_only(out):
        line = validation_error(tmp_path, "train.resume_from_checkpoint=auto")
        assert line.startswith(f"train.output_dir '{out}' is not writable"), line
        meta = {"step": 4, "samples": 16, "method": "ddp", "world_size": 1, "numel": 6}
        with pytest.raises(CheckpointWriteError, match="^a checkpoint could not be written: rank 0: "
                                                       "(PermissionError|OSError): .*checkpoint-4.tmp"):
            checkpoint.save(out, 4, {"engine": {}}, meta, 0, 1, lambda folder: folder.mkdir(), keep=1)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]
    assert verify(out / "checkpoint-2")["step"] == 2


def test_a_fixed_batch_run_resumed_past_a_truncated_checkpoint_ends_bit_equal(tmp_path, capsys):
    """One worker, acco with a fixed batch: checkpoints 2 and 4 of a run, 4's shard cut short as a
    lost page cache leaves it; `auto` resumes from 2 (saying so) and the run ends with every loss
    and every parameter equal to the uninterrupted run's."""
    from acco.trainer import DecoupledTrainer

    def run(out, **more):
        torch.manual_seed(0)
        args = tiny_args("acco", out, nb_steps_tot=24, save_step=2, **more)
        trainer = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args)
        trainer.train()
        return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])

    straight = run(tmp_path / "straight")
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for name in ("checkpoint-2", "checkpoint-4"):  # and the log, which the resume cuts back to its update
        shutil.copytree(tmp_path / "straight" / name, crashed / name)
    shutil.copy(tmp_path / "straight" / "metrics.jsonl", crashed)
    cut_in_half(crashed / "checkpoint-4" / "rank0-of-1.pt")
    capsys.readouterr()
    resumed = run(crashed, resume_from_checkpoint="auto")
    said = capsys.readouterr()
    assert "acco: warning: checkpoint-4 does not verify (rank0-of-1.pt holds " in said.err
    assert f"resuming exactly from {crashed / 'checkpoint-2'} (update 2" in said.out
    assert train_losses(crashed) == train_losses(tmp_path / "straight")
    assert torch.equal(resumed, straight)
    assert verify(crashed / "checkpoint-4")["step"] == 4  # written again, whole
