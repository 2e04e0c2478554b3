"""Whole jobs stopped and started again (the slow tier: each runs training jobs of a minute or so):
torchrun's elastic agent restarts a group whose worker died, and with
`train.resume_from_checkpoint=auto` every start, the first and the restarts, is the same command;
also on 2 nodes of 2 workers (the two-level rounds), the local launcher's emulated ones and two
torchrun agents'."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import REPO, clean_env, free_port

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


# 2 nodes x 2 workers, 16 micro-batches an update (acco: 2 rounds of 2 on each of 4 workers): 8
# updates, after FIXED's (the later override wins)
NODES = ["train=acco", "train.nb_steps_tot=128"]
TWO_LEVELS = "layout: 2 nodes x 2 workers: two-level rounds"


def _local_nodes(tmp_path: Path, name: str) -> list[str]:
    return [sys.executable, f"{REPO}/main.py", "launch.nproc=4", "launch.workers_per_node=2",
            *_job(tmp_path, name), *NODES]  # fmt: skip


@pytest.fixture(scope="module")
def straight_nodes(tmp_path_factory):
    """The uninterrupted run of the local launcher's 4 workers on 2 emulated nodes of 2."""
    tmp_path = tmp_path_factory.mktemp("nodes")
    proc = subprocess.run(_local_nodes(tmp_path, "straight"), capture_output=True, text=True, timeout=400,
                          env=clean_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(TWO_LEVELS) == 1, proc.stdout[-3000:]
    return tmp_path / "straight"


def _stop_after_checkpoint_2(agents: list[subprocess.Popen], said) -> str:
    """SIGTERM to every process in `agents` once rank 0 (the first's stdout) has written checkpoint-2;
    what rank 0 said until it exited."""
    seen = []
    for line in agents[0].stdout:
        seen.append(line)
        if line.startswith("checkpoint-2:"):
            for agent in agents:
                os.kill(agent.pid, signal.SIGTERM)  # forwarded to its workers
            break
    out = "".join(seen) + agents[0].communicate(timeout=300)[0]
    for agent in agents[1:]:
        agent.wait(timeout=300)
    assert "acco: stopped on SIGTERM after update" in out and "resume_from_checkpoint=auto" in out, said()
    return out


@pytest.mark.slow
def test_sigterm_to_two_emulated_nodes_checkpoints_and_the_same_command_finishes_exactly(
    straight_nodes, tmp_path
):
    cmd = _local_nodes(tmp_path, "stopped")
    with open(tmp_path / "stopped-stderr.txt", "w") as stderr:
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=clean_env())
    out = _stop_after_checkpoint_2([job], lambda: _said(tmp_path, "stopped"))
    assert job.returncode == EXIT_SAVED_ON_SIGNAL and out.count(TWO_LEVELS) == 1, out[-3000:]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=clean_env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming exactly from" in again.stdout and TWO_LEVELS in again.stdout, again.stdout[-3000:]
    assert _losses(tmp_path / "stopped") == _losses(straight_nodes)


def _torchrun_nodes(tmp_path: Path, name: str, port: int) -> list[subprocess.Popen]:
    """Two torchrun agents on this machine, nodes 0 and 1 of 2 workers each (LOCAL_WORLD_SIZE=2),
    static rendezvous on 127.0.0.1: the job of `_local_nodes`. Node 1's output goes to files."""
    env = clean_env({"OMP_NUM_THREADS": "1"})
    agents = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               f"{REPO}/main.py", *_job(tmp_path, name), *NODES]  # fmt: skip
        with open(tmp_path / f"{name}-node{node}-stderr.txt", "w") as err:
            if node == 0:  # rank 0's lines, read as they come
                agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env))
                continue
            with open(tmp_path / f"{name}-node1-stdout.txt", "w") as out:
                agents.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env))
    return agents


def _said(tmp_path: Path, name: str) -> str:
    """What a run wrote to its files (stderr; torchrun's node 1 also its stdout), for a failure."""
    return "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob(f"{name}-*.txt")))


@pytest.mark.slow
def test_torchrun_on_two_nodes_runs_the_two_level_rounds_stops_on_sigterm_and_resumes_exactly(
    straight_nodes, tmp_path
):
    """torchrun --nnodes 2 --nproc-per-node 2, both agents on this machine: the layout comes from
    torchrun's LOCAL_WORLD_SIZE, and the run equals the local launcher's on its emulated nodes."""
    agents = _torchrun_nodes(tmp_path, "stopped", free_port())
    out = _stop_after_checkpoint_2(agents, lambda: _said(tmp_path, "stopped"))
    assert out.count(TWO_LEVELS) == 1, out[-3000:]
    agents = _torchrun_nodes(tmp_path, "stopped", free_port())
    out = agents[0].communicate(timeout=400)[0]
    assert [agent.wait(timeout=300) for agent in agents] == [0, 0], _said(tmp_path, "stopped")
    assert "resuming exactly from" in out and TWO_LEVELS in out, out[-3000:]
    assert _losses(tmp_path / "stopped") == _losses(straight_nodes)
