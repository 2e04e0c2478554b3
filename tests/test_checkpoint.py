"""Never lose a run: exact resume, resharded resume, dead and stalled workers, NaN, bad checkpoints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from trainer_helpers import tiny_args, tiny_data, tiny_model, train_losses

from acco import checkpoint, checkpoint_writer
from acco.engine import CheckpointError, ConfigError
from acco.resume import checkpoint_folders, load_meta
from acco.run_folder import list_checkpoints

# n_grad_accumulation pinned: acco takes 2 rounds x 2 micro-batches x 2 workers = 8 per update, 12 updates.
RUN = ("data.n_docs=600", "train.nb_steps_tot=96", "train.n_grad_accumulation=2",
       "train.accumulate_while_waiting=false", "train.learning_rate=2e-3")  # fmt: skip


FAULTS = str(Path(__file__).with_name("faults.py"))  # the CLI with a fault injected into one worker


def cli(out: Path, *overrides: str, fault: str | None = None, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    entry = [FAULTS, fault] if fault else ["-m", "acco.cli"]
    cmd = [
        sys.executable, *entry, f"launch.nproc={nproc}", f"train.output_dir={out}",
        f"train.cache_dir={out.parent / 'cache'}", *RUN, *overrides,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def no_worker_left(out: Path) -> bool:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return str(out) not in ps


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run whose rank 1 dies right after update 6 (checkpoints every 4 updates); the seconds from
    its death (the time it wrote, not the start: torch's imports take long on a loaded machine)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    proc = cli(out, "train.save_step=4", fault="rank=1,step=6,mode=exit")
    ended = time.monotonic()
    died = re.search(r"acco: test fault: rank 1 exits after update 6 at ([0-9.]+)", proc.stderr)
    return out, proc, ended - float(died[1]) if died else float("inf")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run as `interrupted`, uninterrupted: it completes its budget."""
    out = tmp_path_factory.mktemp("ckpt") / "uninterrupted"
    proc = cli(out, "train.save_step=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.slow  # a whole CLI job on 2-4 workers (the slow tier: make test-slow)
def test_a_dead_worker_stops_the_run_and_leaves_the_checkpoint_intact(interrupted):
    out, proc, elapsed = interrupted
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "exited with code 17" in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 60 and no_worker_left(out)
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-4"]
    folder = out / "checkpoint-4"
    meta = load_meta(folder)
    assert meta["step"] == 4 and meta["world_size"] == 2 and meta["method"] == "acco"
    for rank in (0, 1):
        state = checkpoint.load_worker(folder, rank, 2)["engine"]
        assert state["step"] == 4 and torch.isfinite(state["master"]).all()
        assert state["accumulator"] is not None  # acco's pending g~ travels with the checkpoint
    assert (folder / "model" / "model.safetensors").exists()
    assert not list(out.glob("checkpoint-*.tmp"))


@pytest.mark.slow  # a whole CLI job on 2-4 workers (the slow tier: make test-slow)
def test_resume_on_the_same_world_size_is_exact(interrupted, reference):
    out, _, _ = interrupted
    proc = cli(out, "train.save_step=4", "train.resume_from_checkpoint=latest")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming exactly" in proc.stdout
    expected, got = train_losses(reference), train_losses(out)
    assert sorted(got) == sorted(expected) == list(range(1, 13))
    assert got == expected  # fp32, fixed counts: bit-identical, also after the resume point
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["final_eval_loss"] == json.loads((reference / "summary.json").read_text())["final_eval_loss"]
    )


def _cut_short(path: Path) -> None:  # what a page cache that never reached the disk leaves
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow  # a whole CLI job on 2-4 workers (the slow tier: make test-slow)
@pytest.mark.parametrize("lost", ["rank1-of-2.pt", "meta.json"])
def test_auto_resumes_past_a_checkpoint_a_host_crash_cut_short_and_ends_bit_equal(reference, tmp_path, lost):
    """A run's checkpoints 4 and 8 (and its log) as a host that lost power leaves them: checkpoint-8
    renamed into place, one of its files cut to half. `auto` skips it, says so in one line, resumes
    from checkpoint-4, writes checkpoint-8 again, and ends bit-equal to the uninterrupted run
    (fixed batch): every loss, the evaluation, the final model and every final master shard."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("checkpoint-4", "checkpoint-8", "metrics.jsonl"):
        os.system(f"cp -r {reference / name} {run}/")
    _cut_short(run / "checkpoint-8" / lost)
    proc = cli(run, "train.save_step=4", "train.resume_from_checkpoint=auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    skipped = [line for line in proc.stderr.splitlines() if "does not verify" in line]
    why = "rank1-of-2.pt holds " if lost.endswith(".pt") else "unreadable meta.json"
    assert len(skipped) == 1, proc.stderr[-2000:]
    assert skipped[0].startswith(f"acco: warning: checkpoint-8 does not verify ({why}"), skipped
    assert skipped[0].endswith("resuming from checkpoint-4, the newest checkpoint before it that does")
    assert f"resuming exactly from {run / 'checkpoint-4'} (update 4" in proc.stdout
    assert train_losses(run) == train_losses(reference) and sorted(train_losses(run)) == list(range(1, 13))
    summaries = [json.loads((r / "summary.json").read_text()) for r in (run, reference)]
    assert summaries[0]["final_eval_loss"] == summaries[1]["final_eval_loss"]
    model = Path("model") / "model.safetensors"
    assert (run / model).read_bytes() == (reference / model).read_bytes()
    for rank in (0, 1):
        states = (checkpoint.load_worker(r / "checkpoint-12", rank, 2) for r in (run, reference))
        got, expected = (dict(checkpoint_writer.floating_tensors(state)) for state in states)
        assert got.keys() == expected.keys() and "engine.master" in got
        assert all(torch.equal(got[k], expected[k]) for k in got)
    assert load_meta(run / "checkpoint-8")["step"] == 8 and not list(run.glob("checkpoint-*.tmp"))


@pytest.mark.slow  # a whole CLI job on 2-4 workers (the slow tier: make test-slow)
def test_resume_on_another_world_size_continues_from_the_same_samples(interrupted, tmp_path):
    out, _, _ = interrupted
    moved = tmp_path / "one-worker"
    moved.mkdir()
    os.system(f"cp -r {out / 'checkpoint-4'} {moved}/")
    # Other data would be read from the converted position: refused, and the run folder left as it was
    proc = cli(moved, "train.resume_from_checkpoint=latest", "data.n_docs=700", nproc=1)
    assert proc.returncode != 0 and "saved num_samples" in proc.stderr, proc.stderr[-2000:]
    assert {p.name for p in moved.iterdir()} <= {"checkpoint-4", "tokenizer"}  # no config.yaml, no log
    proc = cli(moved, "train.resume_from_checkpoint=latest", nproc=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resharded to 1" in proc.stdout
    lines = [json.loads(x) for x in (moved / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert lines[0]["step"] == 5 and lines[0]["samples"] == 32 + 4  # one worker: 2 rounds of 2 micro-batches
    assert lines[-1]["samples"] >= 96
    # The resharded state is the saved one: the first update's loss is that of the same parameters.
    assert abs(lines[0]["loss"] - train_losses(out)[5]) < 0.15


STALL_TIMEOUT_S = 5  # launch.timeout_s of the stall test: the detection takes this plus a few seconds


@pytest.mark.slow  # a whole CLI job on 2-4 workers (the slow tier: make test-slow)
def test_the_stalled_rank_is_named_within_60_s_at_the_default_timeout(tmp_path):
    """4 workers, rank 2 stalls. Its ring neighbours time out as well as the others: the progress
    record must still name rank 2, and nobody else, as the lost one, and the run ends with no
    worker left. Run at launch.timeout_s=5: the detection takes the timeout plus what follows it
    (settling, reports, stopping the workers), and at the default timeout that sum stays within 60 s."""
    from acco.config import compose

    default_timeout_s = compose([]).launch.timeout_s
    out = tmp_path / "stall4"
    cmd = [
        sys.executable, FAULTS, "rank=2,step=3,mode=hang", "launch.nproc=4", f"train.output_dir={out}",
        f"train.cache_dir={out.parent / 'cache'}", *RUN, "train.save_step=2",
        f"launch.timeout_s={STALL_TIMEOUT_S}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines, stalled_at = [], []

    def read_stderr():  # a thread: the pipe closes only when no process holds it, orphans included
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if "rank 2 hangs after update 3" in line:
                stalled_at.append(time.monotonic())

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=240)
    finally:
        proc.kill()
    ended = time.monotonic()
    reader.join(timeout=10)
    err = "\n".join(lines)
    assert code != 0 and stalled_at, err[-3000:]
    detected_s = ended - stalled_at[0]
    print(f"stalled rank detected and the run ended {detected_s:.1f} s after the stall "
          f"(timeout {STALL_TIMEOUT_S} s)")
    assert detected_s >= STALL_TIMEOUT_S - 1, err[-3000:]
    assert default_timeout_s - STALL_TIMEOUT_S + detected_s < 60, err[-3000:]
    assert "rank 2 stopped responding (died or stalled)" in err, err[-3000:]
    launcher = [line for line in lines if line.startswith("acco.launch:")]
    assert len(launcher) == 1, err[-3000:]
    assert launcher[0].startswith("acco.launch: rank 2 stopped responding"), err[-3000:]
    named = re.findall(r"(ranks? [\d, and]+?) stopped responding", err)
    assert named and set(named) == {"rank 2"}, err[-3000:]
    assert no_worker_left(out) and not reader.is_alive()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    assert not list(out.glob("checkpoint-*.tmp"))
    for rank in range(4):
        state = checkpoint.load_worker(out / "checkpoint-2", rank, 4)["engine"]
        assert state["step"] == 2 and torch.isfinite(state["master"]).all()


@pytest.mark.slow  # a whole CLI job on 2-4 workers (the slow tier: make test-slow)
def test_nan_loss_stops_the_run_and_no_checkpoint_holds_it(tmp_path):
    out = tmp_path / "nan"
    proc = cli(out, "train.save_step=1", fault="rank=0,step=12,mode=nan")  # from the 13th micro-batch on
    assert proc.returncode != 0
    # Micro-batch 13 is in acco's accumulator (the next payload) when update 3 is checkpointed:
    # the check covers the whole engine state, not only the parameters.
    assert "holds NaN or inf at update 3 (rank 0: accumulator" in proc.stderr, proc.stderr[-2000:]
    assert "no checkpoint written" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("acco: error:")]
    assert errors and "Traceback" not in proc.stderr
    saved = list_checkpoints(out)
    assert [p.name for p in saved] == ["checkpoint-1", "checkpoint-2"]
    for folder in saved:
        for rank in (0, 1):
            worker = checkpoint.load_worker(folder, rank, 2)
            tensors = dict(checkpoint_writer.floating_tensors(worker))
            assert "engine.accumulator" in tensors and "engine.exp_avg_sq" in tensors
            for name, tensor in tensors.items():
                assert torch.isfinite(tensor).all(), f"{folder.name} rank {rank}: {name}"
    assert not list(out.glob("checkpoint-*.tmp"))
    # A resume takes checkpoint-2, and the validation pass finds it whole (the CLI resume itself,
    # metrics.jsonl cut back to the checkpoint: test_resume_on_the_same_world_size_is_exact).
    assert [p.name for p in checkpoint_folders(out)] == ["checkpoint-2", "checkpoint-1"]
    from acco.config import compose
    from acco.validate import validate_job

    base = [f"train.output_dir={out}", f"train.cache_dir={out.parent / 'cache'}", *RUN, "train.save_step=1"]
    validate_job(compose([*base, "launch.nproc=2", "train.resume_from_checkpoint=latest"]), world_size=2)


@pytest.mark.slow  # a whole CLI job on 2-4 workers (the slow tier: make test-slow)
def test_resuming_a_finished_run_does_nothing_and_writes_nothing(reference, capsys, monkeypatch):
    """The CLI's own path (acco.cli.run), in-process with one worker: the validation pass finds the
    budget done, and the job says so and returns 0 before any worker starts."""
    from acco.cli import run
    from acco.config import compose

    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):  # run() sets them
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    before = {p: p.stat().st_mtime_ns for p in reference.rglob("*")}
    overrides = [f"train.output_dir={reference}", f"train.cache_dir={reference.parent / 'cache'}", *RUN]
    job = compose(["launch.nproc=1", *overrides, "train.save_step=4", "train.resume_from_checkpoint=latest"])
    assert run(job) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "checkpoint-12 already completed the budget of 96 micro-batches (update 12, 96 micro-batches); "
        "nothing to do (raise train.nb_steps_tot to train further)"
    )
    assert {p: p.stat().st_mtime_ns for p in reference.rglob("*")} == before


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("acco: error: "), proc.stderr[-2000:]
    return lines[0]


def validation_error(out: Path, *overrides: str) -> str:
    """The one-line InputError that the CLI's validation pass raises for this run, in-process."""
    from acco.config import InputError, compose
    from acco.validate import validate_job

    base = ["launch.nproc=2", f"train.output_dir={out}", f"train.cache_dir={out.parent / 'cache'}", *RUN]
    with pytest.raises(InputError) as info:
        validate_job(compose([*base, *overrides]), world_size=2)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.slow  # a whole CLI job on 2-4 workers (the slow tier: make test-slow)
def test_bad_resumes_fail_validation_and_overwrite_nothing(reference, tmp_path):
    """Every bad resume is one clear line from the validation pass, before anything is written:
    through the CLI once (one line on stderr, no traceback, no folder written), then in-process
    (the same pass as the CLI's, without its start-up) for every case."""
    run = tmp_path / "run"
    run.mkdir()
    os.system(f"cp -r {reference / 'checkpoint-4'} {reference / 'config.yaml'} {run}/")
    config = (run / "config.yaml").read_bytes()

    def nothing_written():
        assert (run / "config.yaml").read_bytes() == config and not (run / "tokenizer").exists()
        assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4", "config.yaml"]

    # The CLI: one line, and neither the new run's folder nor the checkpoint's is written.
    line = one_error_line(
        cli(tmp_path / "other", f"train.resume_from_checkpoint={run / 'checkpoint-4'}", "train=ddp")
    )
    assert "checkpoint-4 was written by method 'acco', this run is 'ddp'" in line
    assert not (tmp_path / "other").exists()
    nothing_written()
    line = validation_error(run, "train.resume_from_checkpoint=latest", "train=ddp")
    assert "checkpoint-4 was written by method 'acco', this run is 'ddp'" in line
    line = validation_error(tmp_path / "empty", "train.resume_from_checkpoint=latest")
    assert "no complete checkpoint in" in line and not (tmp_path / "empty").exists()
    line = validation_error(run, "train.resume_from_checkpoint=latest", "model.hidden_size=32")
    assert "checkpoint-4 holds a model of" in line and "model 'tiny' has" in line
    line = validation_error(run, "train.resume_from_checkpoint=latest", "model.num_heads=2")
    assert "checkpoint-4 holds another architecture than model 'tiny': num_heads 4 (this run: 2)" in line
    line = validation_error(run, "train.resume_from_checkpoint=latest", "train.seed=5")
    assert "train.seed=5 (the checkpoint has 0)" in line and "other samples" in line
    line = validation_error(run, "train.resume_from_checkpoint=latest", "train.batch_size=4")
    assert "train.batch_size=4 (the checkpoint has 8)" in line
    # Damaged in the middle, size unchanged: the values would be finite garbage; the CRC sees it.
    rank1 = run / "checkpoint-4" / "rank1-of-2.pt"
    whole = rank1.read_bytes()
    data = bytearray(whole)
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    rank1.write_bytes(bytes(data))
    line = validation_error(run, "train.resume_from_checkpoint=latest")
    assert "rank1-of-2.pt: corrupted checkpoint file" in line and "CRC" in line
    rank1.write_bytes(whole[:1000])  # truncated: not the size written (and no zip directory)
    line = validation_error(run, "train.resume_from_checkpoint=latest")
    assert f"rank1-of-2.pt holds 1,000 bytes, {len(whole):,} were written" in line
    rank1.unlink()
    assert "missing rank1-of-2.pt" in validation_error(run, "train.resume_from_checkpoint=latest")
    line = validation_error(run, f"train.resume_from_checkpoint={tmp_path / 'nowhere'}")
    assert line == f"train.resume_from_checkpoint={tmp_path / 'nowhere'}: no such checkpoint folder"
    nothing_written()


def test_resharding_resumes_from_the_committed_samples():
    """Two old workers, 4 samples per micro-batch: each read 10 micro-batches, of which 2 and 3 sat
    uncommitted in acco's accumulator; resharding drops those, so their samples are read again."""

    def old(pending: int) -> dict:
        data = {"epoch": 0, "position": 10, "seed": 0, "num_samples": 400, "global_batch_size": 8}
        stats = torch.tensor([0.0, 0.0, pending, 0.0], dtype=torch.float64)
        return {"data": data, "engine": {"accumulator": torch.zeros(3), "accumulator_stats": stats}}

    # (10 - 2 + 10 - 3) x 4 = 60 committed samples: 15 micro-batches of one new worker of 4
    assert checkpoint.data_position([old(2), old(3)], 4, 1, 100) == {"epoch": 0, "position": 15}
    assert checkpoint.data_position([old(2), old(3)], 4, 1, 10) == {"epoch": 1, "position": 5}
    ddp = old(0) | {"engine": {"accumulator": None, "accumulator_stats": torch.zeros(4, dtype=torch.float64)}}
    assert checkpoint.data_position([ddp, ddp], 2, 2, 100) == {"epoch": 0, "position": 20}


def test_rewind_moves_a_data_position_back_across_epochs():
    from acco.data.on_device import rewind

    data = {"epoch": 2, "position": 1, "seed": 0, "num_samples": 50, "global_batch_size": 8}  # 6 per epoch
    assert rewind(data, 4) == data | {"epoch": 1, "position": 3}
    assert rewind(data, 0) == data


def test_save_prunes_old_checkpoints_and_removes_a_crashed_save(tmp_path):
    crashed = tmp_path / "checkpoint-7.tmp"  # a save that died half-way, in an earlier attempt
    crashed.mkdir(parents=True)
    (crashed / "rank0-of-1.pt").write_bytes(b"half")
    for step in (1, 2, 3, 4):
        meta = {"step": step, "samples": 4 * step, "method": "ddp", "world_size": 1, "numel": 2}
        checkpoint.save(
            tmp_path, step, {"x": torch.ones(2)}, meta, 0, 1, lambda folder: folder.mkdir(), keep=2
        )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert load_meta(tmp_path / "checkpoint-4")["samples"] == 16
    from acco.trainer import TrainArgs

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="save_total_limit must be null"):
            TrainArgs(save_total_limit=bad)
    assert TrainArgs(save_total_limit=1).save_total_limit == 1


# ---- the trainer's own resume (every method's exact resume: test_checkpoint_contents.py) -------


def test_trainer_api_resumes_latest_with_true_and_leaves_a_finished_run_alone(tmp_path, capsys):
    """Single process: train(resume_from_checkpoint=True) means "latest", as in transformers."""
    from acco.trainer import DecoupledTrainer, TrainArgs

    assert TrainArgs(resume_from_checkpoint=True).resume_from_checkpoint == "latest"
    out = tmp_path / "run"
    DecoupledTrainer(
        model=tiny_model(), train_dataset=tiny_data(), args=tiny_args("ddp", out, nb_steps_tot=8)
    ).train()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    capsys.readouterr()
    args = tiny_args("ddp", out, nb_steps_tot=16)
    summary = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train(
        resume_from_checkpoint=True
    )
    printed = capsys.readouterr()
    assert "resuming exactly from" in printed.out and "checkpoint-4" in printed.out
    assert (
        "acco: warning: resuming with train.nb_steps_tot=16, the checkpoint was written with 8" in printed.err
    )
    assert summary["samples"] == 16 and sorted(train_losses(out)) == list(range(1, 9))

    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    # Another seed would read other samples: refused before anything is written.
    reseeded = DecoupledTrainer(
        model=tiny_model(), train_dataset=tiny_data(), args=args | {"nb_steps_tot": 32, "seed": 5}
    )
    with pytest.raises(CheckpointError, match=r"train.seed=5 \(the checkpoint has 0\)"):
        reseeded.train(resume_from_checkpoint=True)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    summary = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train(
        resume_from_checkpoint=True
    )
    assert summary["nothing_to_do"] and summary["samples"] == 16
    assert "checkpoint-8 already completed the budget of 16 micro-batches" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_trainer_api_checks_what_the_command_line_checks(tmp_path):
    """Without the command line's validation pass, DecoupledTrainer runs its checks itself, before
    anything is written: a damaged checkpoint named (CRC), one with newer checkpoints beside it (a
    restart would resume those), a finished run without overwrite_output_dir, and a checkpoint
    that the engine refuses (diloco's sync period) leave the run folder as it was."""
    from acco.config import InputError
    from acco.trainer import DecoupledTrainer

    def train(out, method="ddp", resume=None, **more):
        args = tiny_args(method, out, **more)
        return DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train(resume)

    def files(out):
        return {p: p.stat().st_mtime_ns for p in out.rglob("*")}

    out = tmp_path / "run"
    train(out, nb_steps_tot=8)  # checkpoint-2 and checkpoint-4
    before, rank0 = files(out), out / "checkpoint-4" / "rank0-of-1.pt"
    whole, middle = rank0.read_bytes(), rank0.stat().st_size // 2
    rank0.write_bytes(whole[:middle] + bytes([whole[middle] ^ 0xFF]) + whole[middle + 1 :])  # size unchanged
    with pytest.raises(CheckpointError, match="rank0-of-1.pt: corrupted checkpoint file .entry .* CRC"):
        train(out, resume=str(out / "checkpoint-4"), nb_steps_tot=16)  # `latest` falls back (below)
    rank0.write_bytes(whole)
    with pytest.raises(CheckpointError, match=r"newer than checkpoint-2 \(checkpoint-4\)"):
        train(out, resume=str(out / "checkpoint-2"), nb_steps_tot=16)
    with pytest.raises(InputError, match="already holds a run"):
        train(out, nb_steps_tot=8, save=False)
    assert files(out) == {**before, rank0: rank0.stat().st_mtime_ns}

    diloco = tmp_path / "diloco"
    train(diloco, "diloco", nb_steps_tot=12)  # tiny_args: sync_every 3
    before = files(diloco)
    with pytest.raises(CheckpointError, match="synchronised 1 fragment.s. every 3 steps; this run: 1 every"):
        train(diloco, "diloco", resume="latest", nb_steps_tot=24, sync_every=2)
    assert files(diloco) == before
