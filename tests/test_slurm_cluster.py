"""The examples' sbatch scripts on a real one-machine SLURM cluster (tools/slurm_cluster.sh: Debian's
slurm-wlm 22.05, its munged, slurmctld and slurmd), run small by their arguments (the tiny models,
2 CPU tasks): a job preempted with `scancel --signal=USR1` checkpoints, exits 75 and requeues
itself, even where rank 0 leaves after srun has seen another task's 75, and ends as the
uninterrupted run, bit for bit; the Alpaca fine-tuning runs to the end; a job whose worker is
killed with SIGKILL ends, naming it. The slow tier (the README's lines aside); where the machine
cannot host the cluster (not root, no apt-get) every test on it is skipped with that one reason."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import REPO, clean_env

# over the scripts' #SBATCH lines: one node, 2 tasks of one CPU
SMALL = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
# The runs, as the README gives them: the tiny model on the synthetic corpus with a fixed batch (the
# run is then deterministic: 120 updates); a tiny Llama on a few Alpaca records, 8 updates.
TINY = ["model=tiny", "data=synthetic", "data.path=null", "train.accumulate_while_waiting=false"]
ALPACA_RUN = ["model=llama-tiny", "model.pretrained=null", "data.path=alpaca.json", "train.nb_steps_tot=32",
              "train.warmup=4"]  # fmt: skip
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}

# The workers' interpreter for these jobs (the example's PYTHON): each writes its pid to
# $TASKS/rank-N.pid. Rank 0, once it has checkpointed on the notice (exit 75), leaves only after
# srun has reported task 1's exit 75, and 2 s later: a slow teardown, the order in which
# `srun --kill-on-bad-exit` kills it (SIGTERM) and returns 143 instead of 75. SLURM
# signals every process of a task: the notice is the worker's, this shell only passes it on.
WRAPPER = """#!/bin/bash
echo $$ > "$TASKS/rank-$SLURM_PROCID.pid"
[ "$SLURM_PROCID" = 0 ] || exec "$REAL_PYTHON" "$@"
trap true USR1
"$REAL_PYTHON" "$@"
code=$?
if [ $code = 75 ]; then
  until grep -q "task 1: Exited with exit code 75" "$JOB_OUT"; do sleep 0.1; done
  sleep 2
fi
exit $code
"""


class Cluster:
    """The cluster of tools/slurm_cluster.sh in `folder`: its commands, and the jobs a test submitted."""

    def __init__(self, folder: Path):
        self.folder, self.cache, self.jobs = folder, folder / "cache", []
        self.env = {"SLURM_CONF": str(folder / "slurm.conf"), "PYTHON": str(folder / "python.sh"),
                    "REAL_PYTHON": sys.executable}  # fmt: skip

    def run(self, *cmd: str, **more) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, cwd=REPO, env=clean_env(self.env | more), capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, (cmd, done.stderr)
        return done

    def sbatch(self, tmp_path: Path, script: str, *overrides: str) -> int:
        """examples/`script` with these overrides, run small; its output in tmp_path/job.out."""
        (tmp_path / "tasks").mkdir()
        out = tmp_path / "job.out"
        args = [*SMALL, f"--output={out}", f"examples/{script}", *overrides,
                f"train.output_dir={tmp_path / 'run'}", f"train.cache_dir={self.cache}"]  # fmt: skip
        submitted = self.run("sbatch", "--parsable", *args, TASKS=str(tmp_path / "tasks"), JOB_OUT=str(out))
        self.jobs.append(int(submitted.stdout.strip().split(";")[0]))
        return self.jobs[-1]

    def job(self, job_id: int) -> dict:
        shown = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    def poll(self, what, until, job_id: int, timeout_s: float = 600):
        """`what()` once `until` holds for it; fails, with the job's state, where the job ends first
        or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not until(value := what()):
            job = self.job(job_id)
            assert job["JobState"] not in FINAL_STATES, f"job {job_id} ended first: {job}"
            assert time.monotonic() < deadline, f"not within {timeout_s} s: {job}"
            time.sleep(0.2)
        return value

    def ended(self, job_id: int, timeout_s: float = 600) -> dict:
        deadline = time.monotonic() + timeout_s
        while (job := self.job(job_id))["JobState"] not in FINAL_STATES:
            assert time.monotonic() < deadline, f"job {job_id} not done within {timeout_s} s: {job}"
            time.sleep(0.2)
        return job


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Started once for the module (installed first where it is missing), stopped after it."""
    folder = tmp_path_factory.mktemp("slurm")
    script = str(Path(REPO) / "tools" / "slurm_cluster.sh")
    began = time.monotonic()
    started = subprocess.run(["bash", script, "start", str(folder)], capture_output=True, text=True,
                             timeout=900)  # the install included  # fmt: skip
    try:
        if started.returncode == 3:  # this machine cannot host it: the script's one line
            pytest.skip(started.stderr.strip().splitlines()[-1])
        assert started.returncode == 0, started.stderr[-3000:]
        print(f"SLURM cluster up in {time.monotonic() - began:.0f} s: {started.stderr.strip()}")
        (folder / "python.sh").write_text(WRAPPER)
        (folder / "python.sh").chmod(0o755)
        yield Cluster(folder)
    finally:
        subprocess.run(["bash", script, "stop", str(folder)], timeout=120)


@pytest.fixture
def slurm(cluster):
    """The cluster, with the jobs a test leaves running cancelled after it (a failed test's)."""
    yield cluster
    if cluster.jobs:
        subprocess.run(["scancel", *map(str, cluster.jobs)], env=clean_env(cluster.env), timeout=60)
        cluster.jobs.clear()


def _updates(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return metrics.read_text().count('"type": "train"') if metrics.exists() else 0


def _losses(run: Path) -> tuple[dict, list]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return (
        {x["step"]: x["loss"] for x in lines if x["type"] == "train"},
        [x["eval_loss"] for x in lines if x["type"] == "eval"],
    )


def test_slurm_cluster_runs_are_the_readme_s():
    """The README's SLURM lines are the ones these tests run (less their output and cache folders)."""
    readme = " ".join((Path(REPO) / "README.md").read_text().replace("\\\n", " ").split())
    for script, args in [("slurm_preemptible.sbatch", TINY), ("slurm_alpaca.sbatch", ALPACA_RUN)]:
        assert " ".join(["sbatch", *SMALL, f"examples/{script}", *args]) in readme, script


@pytest.mark.slow
def test_slurm_cluster_preempted_job_requeues_itself_and_ends_as_the_uninterrupted_run(slurm, tmp_path):
    straight_dir, stopped_dir = tmp_path / "straight", tmp_path / "stopped"
    straight_dir.mkdir(), stopped_dir.mkdir()
    straight = slurm.ended(slurm.sbatch(straight_dir, "slurm_preemptible.sbatch", *TINY))
    assert (straight["JobState"], straight["Restarts"]) == ("COMPLETED", "0"), straight

    job_id = slurm.sbatch(stopped_dir, "slurm_preemptible.sbatch", *TINY)
    slurm.poll(lambda: _updates(stopped_dir / "run"), lambda n: n >= 4, job_id)  # mid-run
    slurm.run("scancel", "--signal=USR1", str(job_id))  # as --signal=USR1@90 does before the time limit
    job = slurm.ended(job_id)
    out = (stopped_dir / "job.out").read_text()
    assert (job["JobState"], job["Restarts"], job["ExitCode"]) == ("COMPLETED", "1", "0:0"), out[-3000:]
    stopped = re.search(r"acco: stopped on SIGUSR1 after update (\d+) .*\(exit 75\)", out)
    assert stopped and f"resuming exactly from {stopped_dir / 'run'}/checkpoint-{stopped[1]} " in out, out
    # the order the wrapper forced: srun saw task 1 leave with 75 before rank 0 left
    first, last = "task 1: Exited with exit code 75", "task 0: Exited with exit code 75"
    assert first in out and last in out and out.index(first) < out.index(last), out
    assert _losses(stopped_dir / "run") == _losses(straight_dir / "run")  # every update's, every evaluation's


ALPACA = [
    {"instruction": "Give the opposite of the word.", "input": "hot", "output": "cold"},
    {"instruction": "Name a color.", "input": "", "output": "Blue is a color."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."},
    {"instruction": "Say hello.", "input": "", "output": "Hello there!"},
]


@pytest.mark.slow
def test_slurm_cluster_alpaca_fine_tuning_runs_to_the_end(slurm, tmp_path):
    data = tmp_path / "alpaca.json"  # the form of Stanford Alpaca's alpaca_data.json: one array
    data.write_text(json.dumps(ALPACA * 30))
    run = [f"data.path={data}" if arg == "data.path=alpaca.json" else arg for arg in ALPACA_RUN]
    job_id = slurm.sbatch(tmp_path, "slurm_alpaca.sbatch", *run)
    job = slurm.ended(job_id)
    out = (tmp_path / "job.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), (job, out[-3000:])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["method"], summary["world_size"]) == ("acco", 2) and summary["samples"] >= 32, summary
    assert math.isfinite(summary["final_eval_loss"]) and "model: llama-tiny" in out, out


@pytest.mark.slow
def test_slurm_cluster_job_whose_worker_is_killed_ends_naming_it(slurm, tmp_path):
    job_id = slurm.sbatch(tmp_path, "slurm_preemptible.sbatch", *TINY, "train.nb_steps_tot=4000")
    slurm.poll(lambda: _updates(tmp_path / "run"), lambda n: n >= 4, job_id)
    os.kill(int((tmp_path / "tasks" / "rank-1.pid").read_text()), signal.SIGKILL)  # the worker (exec'd)
    killed = time.monotonic()
    job = slurm.ended(job_id, timeout_s=300)
    took_s = time.monotonic() - killed
    out = (tmp_path / "job.out").read_text()
    # not requeued: the job failed, well within launch.timeout_s (30 s) of the kill plus a loaded
    # machine's margin, with the lost rank named by srun (task 1) and by rank 0's error line
    assert (job["JobState"], job["Restarts"]) == ("FAILED", "0"), (job, out[-3000:])
    assert took_s < 120, (took_s, out[-3000:])
    assert "task 1: Killed" in out and re.search(r"acco: error: \[rank 0\] .*\brank 1\b", out), out[-3000:]
