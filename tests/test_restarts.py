"""Whole jobs stopped and started again (the slow tier: each runs training jobs of a minute or so):
torchrun's elastic agent restarts a group whose worker died, and with
`train.resume_from_checkpoint=auto` every start, the first and the restarts, is the same command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import REPO, clean_env

from acco.config import EXIT_SAVED_ON_SIGNAL

FIXED = ["model=tiny", "data.n_docs=600", "train.nb_steps_tot=64", "train.n_grad_accumulation=2",
         "train.accumulate_while_waiting=false", "train.save_step=2", "train.resume_from_checkpoint=auto",
         "train.eval_step=4"]  # fmt: skip


def _job(tmp_path: Path, name: str) -> list[str]:
    return FIXED + [f"train.output_dir={tmp_path / name}", f"train.cache_dir={tmp_path / 'cache'}"]


def _torchrun(script: str, args: list[str], *agent: str) -> subprocess.CompletedProcess:
    # c10d rendezvous (--standalone) with a fresh store per attempt: on torch 2.13's shared agent store
    # (always shared with the default static rendezvous) a restarted group can read the previous
    # attempt's gloo addresses and fail to connect (docs/checkpoints.md, "Restarts").
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *agent,
           script, *args]  # fmt: skip
    env = clean_env({"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)


def _losses(out: Path) -> tuple[dict, list]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return (
        {x["step"]: x["loss"] for x in lines if x["type"] == "train"},
        [x["eval_loss"] for x in lines if x["type"] == "eval"],
    )


@pytest.mark.slow
def test_torchrun_restarts_the_group_after_a_worker_dies_and_auto_resumes_exactly(tmp_path):
    straight = _torchrun(f"{REPO}/main.py", _job(tmp_path, "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    # rank 1 dies (os._exit, no clean-up) after update 5, in the workers' first start only
    faults = f"{REPO}/tests/faults.py"
    restarted = _torchrun(
        faults, ["rank=1,step=5,mode=exit,attempt=0", *_job(tmp_path, "restarted")], "--max-restarts", "1"
    )
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "resuming exactly from" in restarted.stdout and "checkpoint-4" in restarted.stdout
    # a fixed batch: the restarted run's every update and evaluation are the uninterrupted run's
    assert _losses(tmp_path / "restarted") == _losses(tmp_path / "straight")


@pytest.mark.slow
def test_sigterm_to_a_plain_python_main_checkpoints_and_the_same_command_finishes_exactly(tmp_path):
    straight = subprocess.run(
        [sys.executable, f"{REPO}/main.py", "launch.nproc=2", *_job(tmp_path, "straight")],
        capture_output=True,
        text=True,
        timeout=400,
        env=clean_env(),
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    cmd = [sys.executable, f"{REPO}/main.py", "launch.nproc=2", *_job(tmp_path, "stopped")]
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=clean_env())
        seen = []
        for line in job.stdout:  # rank 0's lines: signal the launcher once checkpoint-2 is written
            seen.append(line)
            if line.startswith("checkpoint-2:"):
                os.kill(job.pid, signal.SIGTERM)  # it forwards the signal to its workers
                break
        out = "".join(seen) + job.communicate(timeout=300)[0]
        stderr.seek(0)
        assert job.returncode == EXIT_SAVED_ON_SIGNAL, (out[-2000:], stderr.read()[-3000:])
    assert "acco: stopped on SIGTERM after update" in out and "resume_from_checkpoint=auto" in out
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=clean_env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming exactly from" in again.stdout
    assert _losses(tmp_path / "stopped") == _losses(tmp_path / "straight")
