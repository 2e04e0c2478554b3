"""`acco-bench faults` (acco_bench/faults.py): a fixed-batch job under torchrun's elastic agent, its
workers signalled from outside (SIGKILL in the warm start and at a random moment, SIGTERM during a
save, a host crash that cuts the newest checkpoint short), compared with an uninterrupted run. The
drill itself is in the slow tier; its parts, and the restart it exposed (a job killed in its first
save could not start again), are quick."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from trainer_helpers import tiny_args, tiny_data, tiny_model, train_losses, write_checkpoint

from acco.config import InputError
from acco_bench.fault_job import crash_host, last_step, newest_checkpoint, whole_checkpoints
from acco_bench.fault_plan import DrillSettings, plan_faults
from acco_bench.fault_results import bits_equal


def test_the_plan_is_seeded_starts_with_a_warm_start_kill_and_has_every_kind():
    s = DrillSettings(workers=3, faults=10, seed=4)
    plan = plan_faults(s)
    assert plan == plan_faults(s) and plan != plan_faults(DrillSettings(workers=3, faults=10, seed=5))
    assert len(plan) == 10 and plan[0]["kind"] == "kill-warm-start"
    assert {f["kind"] for f in plan} == {"kill-warm-start", "kill", "term-save", "host-crash"}
    assert all(0 <= f["rank"] < 3 if f["kind"] != "host-crash" else f["rank"] == "all" for f in plan)
    timed = [f for f in plan if f["kind"] in ("kill", "host-crash")]
    assert all(1 <= f["after_updates"] <= 2 * s.save_step for f in timed)
    assert {f["kind"] for f in plan_faults(DrillSettings(faults=3))} == {
        "kill-warm-start",
        "kill",
        "term-save",
    }
    # every attempt moves the resume point by at most 2 save intervals and 2 updates: the job outlasts the
    # faults
    assert s.budget_updates >= 10 * (2 * s.save_step + 2)


def test_bit_equality_and_the_progress_lines_the_drill_reads(tmp_path):
    assert bits_equal(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    assert not bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, other bits
    assert not bits_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    log = tmp_path / "rank0.jsonl"
    log.write_text(json.dumps({"step": 4}) + "\n" + json.dumps({"step": 5}) + "\n" + '{"step": 6, "comp')
    assert last_step(log, 0) == 5  # a line being written is not an update yet
    assert last_step(log, time.time_ns() + 10**9) is None  # written before the attempt started: not its own
    assert last_step(tmp_path / "missing.jsonl", 0) is None


def test_a_host_crash_stops_every_worker_and_cuts_the_newest_checkpoints_last_file(tmp_path):
    """The drill's host crash: the workers (two sleeping processes here) stopped, then killed; the
    newest checkpoint's meta.json (written last) cut to half; the newest checkpoint a new group
    would resume from is then the one before."""
    import subprocess
    import sys

    for step in (2, 4):
        write_checkpoint(tmp_path, step)
    assert newest_checkpoint(tmp_path) == 4
    size = (tmp_path / "checkpoint-4" / "meta.json").stat().st_size
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    try:
        said = crash_host(tmp_path, [p.pid for p in workers])
        assert [p.wait(timeout=30) for p in workers] == [-signal.SIGKILL] * 2
    finally:
        for p in workers:
            p.kill()
    assert said == f"checkpoint-4/meta.json cut to {size // 2} of {size} bytes"
    assert newest_checkpoint(tmp_path) == 2
    assert [p.name for p in whole_checkpoints(tmp_path)] == ["checkpoint-2"]


def test_auto_starts_afresh_over_the_debris_of_a_first_save_that_crashed(tmp_path):
    """A worker killed in the job's first save leaves checkpoint-N.tmp and no complete checkpoint:
    resume auto starts afresh (it refused, "holds checkpoints of another run", so every torchrun
    restart failed the same way)."""
    from acco.trainer import DecoupledTrainer

    out = tmp_path / "run"
    (out / "checkpoint-2.tmp").mkdir(parents=True)
    (out / "checkpoint-2.tmp" / "rank0-of-2.pt").write_bytes(b"half")
    args = tiny_args("acco", out, nb_steps_tot=8, resume_from_checkpoint="auto")
    summary = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train()
    assert summary["samples"] == 8 and sorted(train_losses(out)) == [1, 2]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    # another run's complete checkpoint is still protected
    with pytest.raises(InputError, match="already holds a run .summary.json, metrics.jsonl, checkpoint-2."):
        DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=tiny_args("acco", out)).train()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the drill finds the workers through /proc")
def test_the_fault_drill_survives_every_fault_and_ends_bit_equal(tmp_path):
    from acco_bench.cli import main

    # 2 workers, 4 faults (a kill in the warm start, a kill at a random moment, a SIGTERM in a save,
    # a host crash)
    assert (
        main(["faults", "--workers", "2", "--faults", "4", "--save-step", "2", "--out", str(tmp_path)]) == 0
    )
    bench = json.loads((tmp_path / "bench.json").read_text())
    summary, faults = bench["summary"], bench["faulted"]["faults"]
    assert {f["kind"] for f in faults} == {"kill-warm-start", "kill", "term-save", "host-crash"}
    assert summary["faults_survived"] == 4 and summary["unplanned_failures"] == 0 and summary["restarts"] == 4
    # at most one save interval; two for the host crash, whose newest checkpoint is lost with it
    assert all(f["lost_updates"] <= (4 if f["kind"] == "host-crash" else 2) for f in faults)
    crash = next(f for f in faults if f["kind"] == "host-crash")
    assert crash["next_resumed_from"] < crash["reached"] and "meta.json cut to" in crash["during"]
    # checkpointed on the signal
    assert next(f for f in faults if f["kind"] == "term-save")["lost_updates"] == 0
    assert summary["final_params_bit_equal"] and summary["losses_equal"]
    assert bench["comparison"]["checkpoint_tensors_differing"] == []
    assert (
        "Final parameters bit-equal to the uninterrupted run's: **yes**"
        in (tmp_path / "bench.md").read_text()
    )


def test_the_drills_job_inherits_no_launcher_variables(monkeypatch):
    """A drill started from inside a worker (its rank, or the local launcher's start gate) must not
    hand those to torchrun's workers: one would wait at a gate no launcher opens."""
    from acco.launch.local import GO_FD_ENV
    from acco_bench.fault_plan import job_env

    monkeypatch.setenv(GO_FD_ENV, "7")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("SLURM_PROCID", "1")
    env = job_env(DrillSettings())
    assert not {GO_FD_ENV, "RANK", "SLURM_PROCID"} & env.keys() and "PATH" in env
