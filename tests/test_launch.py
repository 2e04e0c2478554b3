import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import LAUNCH_VARS, REPO, clean_env, write_script

from acco.launch import DEFAULT_PORT, dist_env, expand_nodelist, free_port, init_distributed, launch_local


@pytest.fixture
def no_launcher(monkeypatch):
    for k in list(os.environ):
        if k in LAUNCH_VARS or k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    return monkeypatch


# --------------------------------------------------------------------------- node lists


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu-a[1,3],gpu-b2", ["gpu-a1", "gpu-a3", "gpu-b2"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]-n[1,3]", ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]),
        ("a,b[1-2],c[5]", ["a", "b1", "b2", "c5"]),
        ("jean-zay-iam[01-02],jean-zay-a[1]", ["jean-zay-iam01", "jean-zay-iam02", "jean-zay-a1"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-04", "node01]", "node[a-b]", "node[4-1]", "n[[1]]"])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(ValueError, match="bad SLURM node list"):
        expand_nodelist(bad)


# --------------------------------------------------------------------------- dist_env


def test_dist_env_none(no_launcher):
    assert dist_env() is None


def test_dist_env_torchrun(no_launcher):
    for k, v in dict(
        RANK="3",
        WORLD_SIZE="8",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="10.0.0.5",
        MASTER_PORT="1234",
        SLURM_PROCID="0",
        SLURM_NTASKS="2",
    ).items():
        no_launcher.setenv(k, v)
    assert dist_env() == {
        "source": "torchrun",
        "rank": 3,
        "world_size": 8,
        "local_rank": 1,
        "local_world_size": 2,
        "master_addr": "10.0.0.5",
        "master_port": 1234,
    }


def test_dist_env_slurm(no_launcher):
    for k, v in dict(
        SLURM_STEP_ID="0",
        SLURM_PROCID="5",
        SLURM_NTASKS="8",
        SLURM_LOCALID="1",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu[07-08,10]",
        SLURM_TASKS_PER_NODE="4(x2)",
    ).items():
        no_launcher.setenv(k, v)
    assert dist_env() == {
        "source": "slurm",
        "rank": 5,
        "world_size": 8,
        "local_rank": 1,
        "local_world_size": 4,
        "master_addr": "gpu07",
        "master_port": DEFAULT_PORT + 4242 % 3000,
    }
    # the step's own node list and task count win over the job's; explicit MASTER_* win over all
    no_launcher.setenv("SLURM_STEP_NODELIST", "gpu[08,10]")
    no_launcher.setenv("SLURM_STEP_NUM_TASKS", "4")
    env = dist_env()
    assert (env["master_addr"], env["world_size"]) == ("gpu08", 4)
    no_launcher.setenv("MASTER_ADDR", "10.1.1.1")
    no_launcher.setenv("MASTER_PORT", "31000")
    env = dist_env()
    assert (env["master_addr"], env["master_port"]) == ("10.1.1.1", 31000)


def test_slurm_batch_script_is_not_a_rank(no_launcher):
    """The batch script (no srun step) has SLURM_PROCID=0 and SLURM_NTASKS=N too: a plain
    `python main.py` there must launch its own workers, not wait for N-1 peers that never come."""
    for k, v in dict(SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu[07-08]",
                     SLURM_TASKS_PER_NODE="4(x2)").items():
        no_launcher.setenv(k, v)
    assert dist_env() is None
    no_launcher.setenv("SLURM_STEP_ID", "batch")
    assert dist_env() is None
    no_launcher.setenv("SLURM_STEP_ID", "3")
    assert dist_env()["world_size"] == 8


# --------------------------------------------------------------------------- init_distributed


def test_init_distributed_single_process(no_launcher):
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    try:
        rank, world, local_rank, device = init_distributed(timeout_s=30)
        assert (rank, world, local_rank) == (0, 1, 0)
        assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        t = torch.tensor([2.0], device=device)
        dist.all_reduce(t)
        assert t.item() == 2.0
        assert init_distributed() == (rank, world, local_rank, device)  # reused
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


ALLREDUCE = """
    import sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from acco.launch import init_distributed

    rank, world, local_rank, device = init_distributed(timeout_s=60)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    Path(sys.argv[1], f"rank{rank}.txt").write_text(f"{world} {local_rank} {t.item()}")
    dist.destroy_process_group()
"""


def test_launch_local_allreduce(tmp_path):
    script = write_script(tmp_path, "allreduce.py", ALLREDUCE)
    code = launch_local(2, [sys.executable, script, str(tmp_path)], env_extra={"PYTHONPATH": REPO})
    assert code == 0
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == f"2 {rank} 3.0"


def test_init_distributed_under_slurm(tmp_path):
    script = write_script(tmp_path, "allreduce.py", ALLREDUCE)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(tmp_path)],
            env=clean_env(
                dict(
                    SLURM_STEP_ID="0",
                    SLURM_PROCID=str(r),
                    SLURM_NTASKS="2",
                    SLURM_LOCALID=str(r),
                    SLURM_JOB_ID="77",
                    SLURM_JOB_NODELIST="localhost",
                    MASTER_PORT=str(port),
                )
            ),
        )
        for r in range(2)
    ]
    try:
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == f"2 {rank} 3.0"


STALL_IN_SETUP = """
    import json, os, signal, sys, time
    from pathlib import Path
    from acco.engine.progress import LostWorkerError
    from acco.launch import every_rank_at, init_distributed

    out = Path(sys.argv[1])
    if os.environ["SLURM_PROCID"] == "1":
        time.sleep(3)  # starts after the collective timeout: the rendezvous must wait for it
    rank, world, _, _ = init_distributed(timeout_s=2)
    (out / f"pid{rank}").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(3)  # slow one-off work (longer than the timeout), but alive: the others wait for it
    every_rank_at("setup")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stalls (srun would not stop the others either)
    start = time.monotonic()
    try:
        every_rank_at("tokenizing")
    except LostWorkerError as e:
        lost = {"message": str(e), "lost": e.lost, "s": time.monotonic() - start}
        (out / "lost.json").write_text(json.dumps(lost))
    os.kill(int((out / "pid1").read_text()), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_worker_stalled_in_one_off_work_is_named_within_the_timeout(tmp_path):
    """Under srun: a late rank is waited for, a slow but live one too; a stalled one is named
    within the collective timeout (2 s here), not after the hour that one-off work may take."""
    script = write_script(tmp_path, "stall.py", STALL_IN_SETUP)
    port = free_port()
    slurm = dict(
        SLURM_STEP_ID="0",
        SLURM_NTASKS="2",
        SLURM_JOB_ID="78",
        SLURM_JOB_NODELIST="localhost",
        MASTER_PORT=str(port),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(tmp_path)],
            env=clean_env({**slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}),
        )
        for r in range(2)
    ]
    try:
        assert procs[0].wait(timeout=90) == 0
        assert procs[1].wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in procs:
            p.kill()
            p.wait()
    lost = json.loads((tmp_path / "lost.json").read_text())
    assert lost["lost"] == [1] and lost["s"] < 8, lost
    assert lost["message"].startswith(
        "rank 1 stopped responding (died or stalled) while the workers waited for"
    )


def test_self_command():
    from acco.launch import self_command

    cmd = self_command()
    assert cmd[0] == sys.executable and len(cmd) >= 2


# --------------------------------------------------------------------------- naming the lost rank


def _explain_after_marks(rank, world, marks, report_dir):
    import torch.distributed as dist

    from acco.engine import progress

    for i in range(marks[rank]):
        progress.mark(f"update {i + 1}")
    dist.barrier()  # every rank has marked

    @progress.names_lost_ranks
    def collective():
        raise RuntimeError("Timed out waiting 30000ms for recv operation to complete")

    @progress.names_lost_ranks
    def computation():  # not a communication failure: never blamed on another rank
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    os.environ["ACCO_FAILURE_DIR"] = report_dir
    try:
        computation()
    except progress.LostWorkerError:
        return "a local error was blamed on another rank", None, False
    except RuntimeError:
        pass
    try:
        collective()
    except progress.LostWorkerError as e:
        found = str(e), e.lost, (Path(report_dir) / f"rank{rank}.json").exists()
    except RuntimeError as e:
        found = str(e), None, (Path(report_dir) / f"rank{rank}.json").exists()
    dist.barrier()  # every rank has looked; then the launcher stops the run on a Ctrl-C
    if rank == 0:
        progress.note_stopping(report_dir)
    dist.barrier()
    try:
        collective()
    except progress.LostWorkerError:
        return (*found, "blamed while the launcher stops the run")
    except RuntimeError:
        return (*found, None)


def test_a_failed_collective_names_the_ranks_behind_this_one(tmp_path):
    from distributed import run_distributed

    results = run_distributed(_explain_after_marks, 4, [3, 1, 2, 1], str(tmp_path))
    message, lost, reported, _ = results[0]
    assert lost == [1, 3] and reported  # not rank 2: merely behind rank 0, ahead of the lost ones
    assert message == ("ranks 1 and 3 stopped responding (died or stalled): their last progress was "
                       "update 1; rank 0 reached update 3")
    assert results[2][1] == [1, 3]
    message, lost, reported, _ = results[1]  # rank 1 is among the lost: its error is left as it was
    assert lost is None and not reported and message.startswith("Timed out")
    # once the launcher stops the run on a signal, a failed collective blames no one
    assert [r[3] for r in results] == [None] * 4


# A store whose operations take a second: one is on its way when the script exits.
SLOW_STORE_AT_EXIT = """
    import sys, threading, time
    from pathlib import Path
    import torch.distributed as dist

    out, which = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    started = threading.Event()

    class SlowStore:
        def add(self, key, amount):
            started.set()
            time.sleep(1)  # a slow store, not a synchronisation
            (out / "done").write_text(key)
            return 1

        def set(self, key, value):
            self.add(key, 0)

    dist.distributed_c10d._get_default_store = SlowStore
    dist.get_world_size = lambda *args, **kwargs: 2  # as a rank of two would
    if which == "beat":
        from acco.launch.process_group import start_heartbeat
        start_heartbeat(600.0)
    else:
        from acco.engine import progress
        progress.mark("update 1")
    started.wait(timeout=60)
    sys.exit(3)
"""


@pytest.mark.parametrize("which", ["beat", "progress"])
def test_an_exit_waits_for_the_store_write_on_its_way(tmp_path, which):
    """The heartbeat and the progress publisher are daemon threads: one still inside the store's
    C++ client when the interpreter finalises aborts the process (SIGABRT, exit code 134, seen
    under load), so at exit each lets its write finish and starts no other."""
    script = write_script(tmp_path, "slow_store.py", SLOW_STORE_AT_EXIT)
    cmd = [sys.executable, script, str(tmp_path), which]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert (tmp_path / "done").read_text() == ("acco/alive/0" if which == "beat" else "acco/progress/0")



GPU_NODES = glob.glob("/dev/nvidia[0-9]*") + [p for p in ("/dev/kfd", "/dev/dxg") if os.path.exists(p)]


@pytest.mark.skipif(bool(GPU_NODES), reason="a GPU device")
def test_auto_nproc_on_a_machine_without_gpus_imports_no_torch():
    """launch.nproc=auto: one worker per GPU, else 2; where no GPU device exists the launcher knows
    it without importing torch (seconds on a small machine, before it can report a bad input)."""
    code = ("import sys; from acco.launch.local import local_nproc as n; "
            "print(n('auto'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(),
                         timeout=60)  # fmt: skip
    assert out.stdout.split() == ["2", "False"], out
