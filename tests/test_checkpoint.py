"""Never lose a run: exact resume, resharded resume, dead and stalled workers, NaN, bad checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from acco import checkpoint
from acco.engine import CheckpointError, EngineConfig, build_engine

RUN = ("data.n_docs=600", "train.nb_steps_tot=96", "train.accumulate_while_waiting=false", "train.learning_rate=2e-3")


def cli(out: Path, *overrides: str, fault: str | None = None, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("ACCO_TEST_FAULT", None)
    if fault:
        env["ACCO_TEST_FAULT"] = fault
    cmd = [
        sys.executable, "-m", "acco.cli", f"launch.nproc={nproc}", f"train.output_dir={out}",
        f"train.cache_dir={out.parent / 'cache'}", *RUN, *overrides,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def train_losses(out: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if x["type"] == "train"]
    assert len(steps) == len(set(steps)), f"duplicated steps in metrics.jsonl: {steps}"
    return {x["step"]: x["loss"] for x in lines if x["type"] == "train"}


def no_worker_left(out: Path) -> bool:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return str(out) not in ps


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run whose rank 1 dies right after update 6 (checkpoints every 4 updates)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    start = time.monotonic()
    proc = cli(out, "train.save_step=4", fault="rank=1,step=6,mode=exit")
    return out, proc, time.monotonic() - start


def test_a_dead_worker_stops_the_run_and_leaves_the_checkpoint_intact(interrupted):
    out, proc, elapsed = interrupted
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "exited with code 17" in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 60 and no_worker_left(out)
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["checkpoint-4"]
    folder = out / "checkpoint-4"
    meta = checkpoint.load_meta(folder)
    assert meta["step"] == 4 and meta["world_size"] == 2 and meta["method"] == "acco"
    for rank in (0, 1):
        state = checkpoint.load_worker(folder, rank, 2)["engine"]
        assert state["step"] == 4 and torch.isfinite(state["master"]).all()
        assert state["accumulator"] is not None  # acco's pending g~ travels with the checkpoint
    assert (folder / "model" / "model.safetensors").exists()
    assert not list(out.glob("checkpoint-*.tmp"))


def test_resume_on_the_same_world_size_is_exact(interrupted, tmp_path):
    out, _, _ = interrupted
    reference = tmp_path / "uninterrupted"
    assert cli(reference, "train.save_step=4").returncode == 0
    proc = cli(out, "train.save_step=4", "train.resume_from_checkpoint=latest")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming exactly" in proc.stdout
    expected, got = train_losses(reference), train_losses(out)
    assert sorted(got) == sorted(expected) == list(range(1, 13))
    assert got == expected  # fp32, fixed counts: bit-identical, also after the resume point
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval_loss"] == json.loads((reference / "summary.json").read_text())["final_eval_loss"]


def test_resume_on_another_world_size_continues_from_the_same_samples(interrupted, tmp_path):
    out, _, _ = interrupted
    moved = tmp_path / "one-worker"
    moved.mkdir()
    os.system(f"cp -r {out / 'checkpoint-4'} {moved}/")
    proc = cli(moved, "train.resume_from_checkpoint=latest", nproc=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resharded to 1" in proc.stdout
    lines = [json.loads(x) for x in (moved / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert lines[0]["step"] == 5 and lines[0]["samples"] == 32 + 4  # one worker: 2 rounds of 2 micro-batches
    assert lines[-1]["samples"] >= 96
    # The resharded state is the saved one: the first update's loss is that of the same parameters.
    assert abs(lines[0]["loss"] - train_losses(out)[5]) < 0.15


def test_resharding_reassembles_master_and_moments():
    torch.manual_seed(0)
    model = nn.Linear(7, 3)  # 24 parameters: padded to 27 for 3 old workers, to 24 for 1 new one
    engine = build_engine(model, EngineConfig(method="acco", nb_steps_tot=4))
    numel = engine.flat.layout.numel
    full = {name: torch.randn(numel) for name in ("master", "exp_avg", "exp_avg_sq")}
    params = torch.randn(numel)
    old = []
    for r in range(3):
        shard = {}
        for name, vector in full.items():
            padded = torch.zeros(27)
            padded[:numel] = vector
            shard[name] = padded[r * 9 : (r + 1) * 9].clone()
        old.append({"method": "acco", "numel": numel, "world_size": 3, "rank": r, "samples": 40, "step": 5,
                    "wall_time": 1.0, "params": params, "committed": None, "accumulator": torch.ones(numel),
                    "accumulator_stats": torch.ones(4), **shard})  # fmt: skip
    assert engine.load_state_dict(old[0], lambda: old) is False
    opt = engine.comm.optimizer
    for name, vector in full.items():
        assert torch.equal(getattr(opt, name)[:numel], vector), name
    assert torch.equal(engine.flat.params[:numel], params) and engine.samples == 40 and opt.step_count == 5
    assert engine.flat.grads.abs().sum() == 0  # a per-worker accumulator does not survive resharding
    with pytest.raises(CheckpointError, match="method 'acco', this run is 'dpu'"):
        build_engine(nn.Linear(7, 3), EngineConfig(method="dpu")).load_state_dict(old[0], lambda: old)
    with pytest.raises(CheckpointError, match="parameters, the model has"):
        build_engine(nn.Linear(8, 3), EngineConfig(method="acco")).load_state_dict(old[0], lambda: old)


def test_a_stalled_worker_ends_the_run_within_the_timeout(tmp_path):
    out = tmp_path / "stall"
    start = time.monotonic()
    proc = cli(out, "launch.timeout_s=10", fault="rank=1,step=3,mode=hang")
    assert proc.returncode != 0 and time.monotonic() - start < 60
    assert "receiving from rank 1" in proc.stderr and "died or stalled" in proc.stderr, proc.stderr[-2000:]
    assert no_worker_left(out)


def test_nan_loss_stops_the_run_and_no_checkpoint_holds_it(tmp_path):
    out = tmp_path / "nan"
    proc = cli(out, "train.save_step=1", fault="rank=0,step=12,mode=nan")  # from the 13th micro-batch on
    assert proc.returncode != 0
    assert "training loss is nan at update" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("acco: error:")]
    assert errors and "Traceback" not in proc.stderr
    saved = checkpoint.list_checkpoints(out)
    assert saved, "the updates before the NaN were checkpointed"
    for folder in saved:
        for rank in (0, 1):
            state = checkpoint.load_worker(folder, rank, 2)["engine"]
            assert torch.isfinite(state["master"]).all() and torch.isfinite(state["params"]).all()


def test_corrupted_or_mismatched_checkpoints_get_one_clear_line(interrupted, tmp_path):
    out, _, _ = interrupted
    broken = tmp_path / "broken"
    broken.mkdir()
    os.system(f"cp -r {out / 'checkpoint-4'} {broken}/")
    rank1 = broken / "checkpoint-4" / "rank1-of-2.pt"
    rank1.write_bytes(rank1.read_bytes()[:1000])
    proc = cli(broken, "train.resume_from_checkpoint=latest")
    assert proc.returncode != 0 and "corrupted checkpoint file" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli(tmp_path / "other", f"train.resume_from_checkpoint={out / 'checkpoint-4'}", "train=ddp")
    assert proc.returncode != 0 and "written by method 'acco', this run is 'ddp'" in proc.stderr
