"""The local launcher (acco/launch/local.py): the first failure stops every worker and names the
rank at fault, signals are forwarded, nothing outlives it, and workers wait for its check."""

import os
import signal
import subprocess
import sys
import time

import pytest
from distributed import REPO, clean_env, wait_dead, write_script

from acco.launch import launch_local

FAILING = """
    import subprocess, sys, threading
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from acco.launch import init_distributed

    out = Path(sys.argv[1])
    rank, world, _, _ = init_distributed(timeout_s=600)
    (out / f"pid{rank}").write_text(str(__import__("os").getpid()))
    if rank == 0:  # a descendant that must not outlive the run either
        child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
        (out / "grandchild").write_text(str(child.pid))
    dist.barrier()
    if rank == 1:
        sys.exit(3)
    try:
        dist.all_reduce(torch.ones(1))  # rank 1 never comes: would wait 600 s
    except Exception:
        pass
    threading.Event().wait()  # whatever gloo does, stay until killed
"""


def test_launch_local_first_failure_stops_all(tmp_path, capfd):
    script = write_script(tmp_path, "failing.py", FAILING)
    start = time.monotonic()
    code = launch_local(2, [sys.executable, script, str(tmp_path)], env_extra={"PYTHONPATH": REPO}, grace_s=2)
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert code == 3
    assert "acco.launch: rank 1" in err and "exited with code 3" in err
    assert elapsed < 30
    pids = [int((tmp_path / name).read_text()) for name in ("pid0", "pid1", "grandchild")]
    for pid in pids:
        assert wait_dead(pid, timeout=5), f"process {pid} outlived the launcher"


LOST_PEER = """
    import os, signal, sys, time
    from acco.engine.progress import report_lost_ranks

    rank, scenario = int(os.environ["RANK"]), sys.argv[1]
    if scenario == "stall" and rank != 2:  # rank 2 stalls; the others time out, rank 1 first
        time.sleep(0.2 * rank)
        report_lost_ranks(rank, [2], f"rank 2 stopped responding (died or stalled): seen by rank {rank}")
        sys.exit(1)
    ready = os.path.join(sys.argv[2], "rank1-started") if scenario == "crash" else ""
    if scenario == "crash" and rank == 0:  # rank 0 loses its peer and happens to exit first...
        while not os.path.exists(ready):
            time.sleep(0.01)
        report_lost_ranks(0, [1], "rank 1 stopped responding (died or stalled)")
        sys.exit(1)
    if scenario == "crash" and rank == 1:  # ...but rank 1 was killed, a moment later
        open(ready, "w").close()
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
"""


def test_launcher_relays_the_lost_rank_that_the_survivors_found(tmp_path, capfd):
    script = write_script(tmp_path, "lost_peer.py", LOST_PEER)
    start = time.monotonic()
    code = launch_local(4, [sys.executable, script, "stall"], env_extra={"PYTHONPATH": REPO}, grace_s=2)
    err = capfd.readouterr().err
    assert code == 1 and time.monotonic() - start < 10
    blamed = [line for line in err.splitlines() if line.startswith("acco.launch:")]
    assert len(blamed) == 1 and blamed[0].startswith("acco.launch: rank 2 stopped responding"), err


def test_launcher_prefers_a_crashed_worker_to_one_that_lost_its_peer(tmp_path, capfd):
    script = write_script(tmp_path, "lost_peer.py", LOST_PEER)
    code = launch_local(2, [sys.executable, script, "crash", str(tmp_path)], env_extra={"PYTHONPATH": REPO}, grace_s=2)
    err = capfd.readouterr().err
    assert code == 128 + signal.SIGKILL
    assert "acco.launch: rank 1 (pid" in err and "killed by signal SIGKILL" in err, err


BLOCKER = """
    import os, signal, sys
    print(f"ready {os.environ['RANK']} {os.getpid()}", flush=True)
    signal.pause()
"""

LAUNCHER = """
    import sys
    from acco.launch import launch_local
    sys.exit(launch_local(2, [sys.executable, sys.argv[1]], grace_s=2))
"""


def start_launcher(tmp_path):
    blocker = write_script(tmp_path, "blocker.py", BLOCKER)
    launcher = write_script(tmp_path, "launcher.py", LAUNCHER)
    proc = subprocess.Popen(
        [sys.executable, launcher, blocker], env=clean_env(), stdout=subprocess.PIPE, text=True
    )
    pids = []
    for _ in range(2):  # both workers up (blocking read of their "ready" lines)
        line = proc.stdout.readline()
        assert line.startswith("ready"), line
        pids.append(int(line.split()[2]))
    return proc, pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launcher_forwards_signals(tmp_path, sig):
    proc, pids = start_launcher(tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 128 + sig
    for pid in pids:
        assert wait_dead(pid, timeout=5)


def test_workers_die_with_killed_launcher(tmp_path):
    proc, pids = start_launcher(tmp_path)
    proc.kill()  # no cleanup possible: the parent-death signal must do it
    proc.wait()
    for pid in pids:
        assert wait_dead(pid, timeout=5)


def test_launch_local_rejects_bad_nproc():
    with pytest.raises(ValueError):
        launch_local(0, [sys.executable, "-c", "pass"])


GATED = """
    import os, sys
    from acco.launch import wait_for_go
    with open(sys.argv[1], "w") as fifo:  # tell the test this worker runs (a blocking write)
        fifo.write(f"{os.environ['RANK']} {os.getpid()}\\n")
    wait_for_go()
    open(os.path.join(os.path.dirname(sys.argv[1]), f"went-{os.environ['RANK']}"), "w").close()
"""


def gated_launch(tmp_path, check_passes: bool):
    script = write_script(tmp_path, "gated.py", GATED)
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    pids = []

    def check():  # runs once the workers exist: both report in before it returns
        for _ in range(2):
            with open(fifo) as f:
                pids.append(int(f.readline().split()[1]))
        assert not list(tmp_path.glob("went-*"))  # no worker went past the gate yet
        if not check_passes:
            raise ValueError("bad input")

    os.environ.update(PYTHONPATH=clean_env()["PYTHONPATH"])
    return launch_local(2, [sys.executable, script, str(fifo)], check=check), pids


def test_workers_start_while_the_launcher_checks_and_go_once_it_passes(tmp_path):
    code, pids = gated_launch(tmp_path, check_passes=True)
    assert code == 0 and len(pids) == 2
    assert sorted(p.name for p in tmp_path.glob("went-*")) == ["went-0", "went-1"]


def test_a_failed_check_stops_the_workers_before_they_go(tmp_path):
    with pytest.raises(ValueError, match="bad input"):
        gated_launch(tmp_path, check_passes=False)
    assert not list(tmp_path.glob("went-*"))
