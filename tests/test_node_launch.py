"""The node layout at launch: launch.workers_per_node groups the local launcher's workers into
emulated nodes (each worker's ACCO_WORKERS_PER_NODE, its LOCAL_RANK still its index on the
machine), and a layout that does not divide the workers is refused in one line before any worker
starts: the local launcher's, and torchrun's or srun's where the rounds run on it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from distributed import REPO, clean_env, write_script
from validation_helpers import NO_WORKER_LAUNCHER

from acco.config import InputError, compose
from acco.job import job_of
from acco.launch import launch_local
from acco.validate import check_node_layout

REPORT = """
    import json, os, sys
    from acco.engine.layout import workers_per_node_from_env
    keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCO_WORKERS_PER_NODE")
    seen = {k: os.environ.get(k) for k in keys}
    seen["per_node"] = workers_per_node_from_env(int(os.environ["WORLD_SIZE"]))
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(seen, f)
"""


@pytest.mark.parametrize("per_node, expected", [(2, 2), (None, 4)])
def test_each_local_worker_is_told_its_node_and_keeps_its_machine_index(
    tmp_path, monkeypatch, per_node, expected
):
    script = write_script(tmp_path, "report.py", REPORT)
    # one inherited from the launcher's own environment is not the layout: launch.workers_per_node is
    monkeypatch.setenv("ACCO_WORKERS_PER_NODE", "1")
    code = launch_local(4, [sys.executable, script, str(tmp_path)], env_extra={"PYTHONPATH": REPO},
                        workers_per_node=per_node)  # fmt: skip
    assert code == 0
    for rank in range(4):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "4",
                        "ACCO_WORKERS_PER_NODE": str(expected), "per_node": expected}  # fmt: skip




def test_a_layout_that_does_not_divide_the_local_workers_is_refused_before_any_starts(tmp_path):
    script = write_script(tmp_path, "launcher.py", NO_WORKER_LAUNCHER)
    cmd = [sys.executable, script, "launch.nproc=4", "launch.workers_per_node=3",
           f"train.output_dir={tmp_path / 'out'}", f"train.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and lines == [
        "acco: error: launch.workers_per_node=3 does not divide the 4 workers into whole nodes: "
        "use a divisor of 4"
    ], proc.stderr[-2000:]
    assert "torch imported: False" in proc.stdout  # said before the launcher imports torch
    assert not (tmp_path / "out").exists()


def test_launch_workers_per_node_is_a_positive_integer_or_null():
    assert compose(["launch.workers_per_node=2"]).launch.workers_per_node == 2
    assert compose([]).launch.workers_per_node is None
    for bad, said in (("0", "got 0"), ("two", "must be an integer")):
        with pytest.raises(InputError, match=f"launch.workers_per_node.*{said}"):
            compose([f"launch.workers_per_node={bad}"])


def _torchrun(monkeypatch, **env) -> None:
    for key in ("ACCO_WORKERS_PER_NODE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_a_launchers_layout_is_checked_where_the_rounds_run_on_it(monkeypatch, tmp_path):
    """Under torchrun (or srun) the environment says the layout: nodes of unequal sizes cannot run
    the two-level rounds (and diloco's replica per node, torch-hsdp's mesh), said on rank 0's
    validation before training; flat rounds and torch-ddp never read it."""
    out = f"train.output_dir={tmp_path / 'out'}"
    _torchrun(monkeypatch, LOCAL_WORLD_SIZE="3")
    with pytest.raises(InputError) as refused:
        check_node_layout(job_of(compose([out]), 4))
    assert str(refused.value) == ("LOCAL_WORLD_SIZE=3 does not divide the 4 workers into whole nodes: use a "
                                  "divisor of 4, or set train.rounds=flat (one ring)")  # fmt: skip
    for fine in (["train.rounds=flat"], ["train=torch-ddp"]):
        check_node_layout(job_of(compose([out, *fine]), 4))
    for read in (["train=diloco"], ["train=torch-hsdp"]):
        with pytest.raises(InputError, match="LOCAL_WORLD_SIZE=3 does not divide"):
            check_node_layout(job_of(compose([out, *read]), 4))
    _torchrun(monkeypatch, SLURM_NTASKS_PER_NODE="3(x1),1")  # srun's, its first node's
    with pytest.raises(InputError, match="SLURM_NTASKS_PER_NODE=3 does not divide"):
        check_node_layout(job_of(compose([out]), 4))
    _torchrun(monkeypatch, LOCAL_WORLD_SIZE="2")
    check_node_layout(job_of(compose([out]), 4))  # 2 x 2
    check_node_layout(job_of(compose([out, "launch.workers_per_node=3"]), 4))  # the local launcher's key
