"""The local launcher (acco/launch/local.py): the first failure stops every worker and names the
rank at fault, signals are forwarded, nothing outlives it, and workers wait for its check."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from distributed import REPO, clean_env, wait_dead, write_script

from acco.config import EXIT_SAVED_ON_SIGNAL
from acco.launch import launch_local

FAILING = """
    import subprocess, sys, threading, time
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
        (out / "exit1").write_text(repr(time.monotonic()))  # the clock every process shares (Linux)
        sys.exit(3)
    try:
        dist.all_reduce(torch.ones(1))  # rank 1 never comes: would wait 600 s
    except Exception:
        pass
    threading.Event().wait()  # whatever gloo does, stay until killed
"""


def test_launch_local_first_failure_stops_all(tmp_path, capfd):
    script = write_script(tmp_path, "failing.py", FAILING)
    code = launch_local(2, [sys.executable, script, str(tmp_path)], env_extra={"PYTHONPATH": REPO}, grace_s=2)
    # timed from rank 1's exit, not from the start: two workers importing torch take from seconds
    # to tens of seconds, as busy as the machine is; stopping the rest takes the launcher at most
    # grace_s, not rank 0's 600 s collective timeout
    elapsed = time.monotonic() - float((tmp_path / "exit1").read_text())
    err = capfd.readouterr().err
    assert code == 3, err
    assert "acco.launch: rank 1" in err and "exited with code 3" in err
    assert elapsed < 20, elapsed
    pids = [int((tmp_path / name).read_text()) for name in ("pid0", "pid1", "grandchild")]
    for pid in pids:
        assert wait_dead(pid, timeout=5), f"process {pid} outlived the launcher"


# No sleeps order the workers. "stall": ranks 0, 1 and 3 report at once that rank 2 stopped (in
# whatever order they exit, each names rank 2), while rank 2 sleeps far longer than the launcher
# may take. "crash": rank 1 dies right after rank 0 has exited with its lost-peer report: rank 0
# hands its pid over a FIFO (the open blocks until rank 1 reads it), and rank 1 SIGKILLs itself
# as soon as that pid has exited, well within the launcher's wait for a worker that failed on its
# own (_ROOT_CAUSE_WAIT_S), however busy the machine. "abort": the same handover, rank 0 aborts
# (SIGABRT, as gloo does when its peer goes) and rank 1 then exits with code 3.
LOST_PEER = """
    import os, resource, select, signal, sys, time
    from acco.engine.progress import report_lost_ranks

    rank, scenario = int(os.environ["RANK"]), sys.argv[1]
    if scenario == "stall" and rank != 2:  # rank 2 stalls; the others time out
        report_lost_ranks(rank, [2], f"rank 2 stopped responding (died or stalled): seen by rank {rank}")
        sys.exit(1)
    handover = os.path.join(sys.argv[2], "rank0-pid") if scenario != "stall" else ""
    if rank == 0:  # rank 0 loses its peer and exits first (a report, or gloo's abort)...
        with open(handover, "w") as fifo:
            fifo.write(str(os.getpid()))
        if scenario == "abort":
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
            os.abort()
        report_lost_ranks(0, [1], "rank 1 stopped responding (died or stalled)")
        sys.exit(1)
    if rank == 1:  # ...but rank 1 was killed, or exited with an error, a moment later
        with open(handover) as fifo:
            pid = int(fifo.read())
        try:
            exited = os.pidfd_open(pid)
            select.select([exited], [], [])  # readable once rank 0 has exited
        except ProcessLookupError:
            pass  # already exited and reaped
        if scenario == "abort":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(STALL_S)
"""
STALL_S = 60  # a launcher that waited for the stalled rank would take this long


def test_launcher_relays_the_lost_rank_that_the_survivors_found(tmp_path, capfd):
    script = write_script(tmp_path, "lost_peer.py", LOST_PEER.replace("STALL_S", str(STALL_S)))
    start = time.monotonic()
    code = launch_local(4, [sys.executable, script, "stall"], env_extra={"PYTHONPATH": REPO}, grace_s=2)
    err = capfd.readouterr().err
    assert code == 1 and time.monotonic() - start < STALL_S / 2  # the stalled rank was not waited for
    blamed = [line for line in err.splitlines() if line.startswith("acco.launch:")]
    assert len(blamed) == 1 and blamed[0].startswith("acco.launch: rank 2 stopped responding"), err


@pytest.mark.parametrize(
    "scenario, code, blame",
    [("crash", 128 + signal.SIGKILL, "was killed by signal SIGKILL"), ("abort", 3, "exited with code 3")],
)
def test_launcher_prefers_a_crashed_worker_to_one_that_lost_its_peer(tmp_path, capfd, scenario, code, blame):
    """Rank 0 ends first, having lost its peer ("crash": its report; "abort": SIGABRT, as gloo does
    when a peer closes the connection), and rank 1's own failure reaches the launcher after it."""
    script = write_script(tmp_path, "lost_peer.py", LOST_PEER.replace("STALL_S", str(STALL_S)))
    os.mkfifo(tmp_path / "rank0-pid")
    got = launch_local(
        2, [sys.executable, script, scenario, str(tmp_path)], env_extra={"PYTHONPATH": REPO}, grace_s=2
    )
    err = capfd.readouterr().err
    assert got == code, err
    assert "acco.launch: rank 1 (pid" in err and blame in err, err


# Each worker says it is up in one write(2) of its whole line: a pipe never splits or interleaves a
# write of up to PIPE_BUF bytes. (print() writes the text and its newline separately where stdout
# is unbuffered, PYTHONUNBUFFERED=1: two workers' lines then ran together, "12024ready".)
BLOCKER = """
    import os
    from signal_wait import wait_for_signal
    os.write(1, f"ready {os.environ['RANK']} {os.getpid()}\\n".encode())
    while True:  # SIGTERM's default action, or SIGINT's KeyboardInterrupt, ends it
        wait_for_signal()
"""

LAUNCHER = """
    import signal, sys
    from acco.launch import launch_local
    saves = [signal.Signals[name] for name in sys.argv[2:]]
    sys.exit(launch_local(2, [sys.executable, sys.argv[1]], grace_s=2, save_signals=saves))
"""


def start_launcher(tmp_path, save_signals=(), worker=BLOCKER):
    blocker = write_script(tmp_path, "blocker.py", worker)
    launcher = write_script(tmp_path, "launcher.py", LAUNCHER)
    # The launcher's report folder in tmp_path: a launcher killed with SIGKILL cannot remove it
    (tmp_path / "tmp").mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, launcher, blocker, *save_signals], env=clean_env({"TMPDIR": str(tmp_path / "tmp")}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pids = {}
    while len(pids) < 2:  # both workers up (blocking read of their "ready" lines, in either order)
        line = proc.stdout.readline()
        ready = re.fullmatch(r"ready (\d+) (\d+)\n", line)
        assert ready and int(ready[1]) not in pids, f"not one worker's ready line: {line!r}"
        pids[int(ready[1])] = int(ready[2])
    return proc, [pids[rank] for rank in range(2)]


@pytest.mark.parametrize("save_signals", [(), ("SIGTERM", "SIGUSR1")], ids=["plain", "saving"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launcher_forwards_signals(tmp_path, sig, save_signals):
    """The workers (here before any training, with no handler of their own) die of the signal the
    launcher forwarded: its exit code, and no worker blamed for it, whichever comes first to the
    launcher, the signal or their exits."""
    proc, pids = start_launcher(tmp_path, save_signals)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 128 + sig
    for pid in pids:
        assert wait_dead(pid, timeout=5)
    err = proc.stderr.read()
    assert "acco.launch:" not in err, err
    assert list((tmp_path / "tmp").iterdir()) == []  # its report folder removed


# acco's worker (cli.main) under a Ctrl-C: rank 0 stops on its KeyboardInterrupt, while rank 1 is
# inside a collective (no Python signal handler runs there: SIGINT ignored stands for it) that
# fails once rank 0 has exited (its pid handed over a FIFO, its exit awaited on a pidfd).
PEER_STOPPED_ON_CTRL_C = """
    import os, select, signal, sys
    import acco.cli as cli
    from acco.engine.progress import LostWorkerError
    from signal_wait import wait_for_signal

    rank, handover = int(os.environ["RANK"]), "HANDOVER"

    def run(cfg):
        if rank == 0:
            with open(handover, "w") as fifo:
                fifo.write(str(os.getpid()))
            os.write(1, f"ready 0 {os.getpid()}\\n".encode())
            wait_for_signal()  # SIGINT: the KeyboardInterrupt comes out of it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with open(handover) as fifo:
            exited = os.pidfd_open(int(fifo.read()))
        os.write(1, f"ready 1 {os.getpid()}\\n".encode())
        select.select([exited], [], [])
        raise LostWorkerError("rank 0 stopped responding (died or stalled)", lost=[0])

    cli.run = run
    sys.argv = sys.argv[:1]
    cli.main()
"""


def test_a_worker_whose_peer_stopped_on_a_ctrl_c_says_nothing(tmp_path):
    os.mkfifo(tmp_path / "handover")
    worker = PEER_STOPPED_ON_CTRL_C.replace("HANDOVER", str(tmp_path / "handover"))
    proc, pids = start_launcher(tmp_path, worker=worker)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 128 + signal.SIGINT
    for pid in pids:
        assert wait_dead(pid, timeout=5)
    err = proc.stderr.read()
    assert "acco" not in err and "Traceback" not in err, err


# Workers that catch the save signal: "finish" exits 0 on it (the notice came after the last update:
# the run completes), "stuck" goes on (a save that takes long), to be killed by a second signal.
CATCHER = """
    import os, signal, sys
    from signal_wait import wait_for_signal
    caught = []
    signal.signal(signal.SIGTERM, lambda *_: caught.append(os.write(1, b"caught\\n")))
    os.write(1, f"ready {os.environ['RANK']} {os.getpid()}\\n".encode())
    while not caught or "SCENARIO" == "stuck":
        wait_for_signal()
"""


def test_a_save_signal_that_finds_the_run_finishing_is_no_failure(tmp_path):
    proc, pids = start_launcher(tmp_path, ("SIGTERM",), worker=CATCHER.replace("SCENARIO", "finish"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0  # every worker exited 0: the run is complete
    assert "acco.launch:" not in proc.stderr.read()


# A launcher whose check (the job's validation) waits on a FIFO that the test opens once the
# launcher has had a save signal: the notice comes while the job is being checked.
CHECKING = """
    import signal, sys
    from acco.launch import launch_local

    def check():
        print("checking", flush=True)
        with open(sys.argv[2]) as fifo:
            return fifo.read().encode()

    sys.exit(launch_local(2, [sys.executable, sys.argv[1]], grace_s=2, check=check,
                          save_signals=[signal.SIGTERM]))
"""


def test_a_save_signal_during_the_check_is_forwarded_not_the_end_of_the_launcher(tmp_path):
    worker = write_script(tmp_path, "catcher.py", CATCHER.replace("SCENARIO", "finish"))
    launcher = write_script(tmp_path, "checking.py", CHECKING)
    os.mkfifo(tmp_path / "checked")
    proc = subprocess.Popen([sys.executable, launcher, worker, str(tmp_path / "checked")], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        up = sorted(proc.stdout.readline().split(" ")[0] for _ in range(3))  # in whatever order
        assert up == ["checking\n", "ready", "ready"], up
        proc.send_signal(signal.SIGTERM)  # it was the launcher's end (-15) while the job was checked
        assert [proc.stdout.readline() for _ in range(2)] == ["caught\n"] * 2  # both workers have it
        assert proc.poll() is None, proc.stderr.read()  # the launcher still checks the job
        with open(tmp_path / "checked", "w") as fifo:
            fifo.write("")  # the check passes
        assert proc.wait(timeout=30) == 0, proc.stderr.read()  # the workers finished (exit 0)
    finally:
        proc.kill()


def test_a_second_signal_kills_and_blames_no_worker(tmp_path):
    proc, pids = start_launcher(tmp_path, ("SIGTERM",), worker=CATCHER.replace("SCENARIO", "stuck"))
    proc.send_signal(signal.SIGTERM)
    assert [proc.stdout.readline() for _ in pids] == ["caught\n"] * 2  # forwarded: both workers saving
    proc.send_signal(signal.SIGTERM)  # the user's second Ctrl-C, or the scheduler's kill
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in pids:
        assert wait_dead(pid, timeout=5)
    err = proc.stderr.read()
    assert "acco.launch:" not in err, err


# SIGTERM reaches the launcher as its first worker starts (sent from the worker's side of the fork,
# before it runs the command): the earliest a signal can come once a worker exists. It must be
# forwarded like any other, not end the launcher alone (128 + 15, not -15), whatever the timing.
EARLY_SIGNAL = """
    import os, signal, sys
    from acco.launch import local

    parent_death = local._parent_death_signal_setter()

    def sigterm_the_launcher():  # in the worker, between fork and exec
        if parent_death is not None:
            parent_death()
        os.kill(os.getppid(), signal.SIGTERM)

    local._parent_death_signal_setter = lambda: sigterm_the_launcher
    sys.exit(local.launch_local(2, [sys.executable, sys.argv[1]], grace_s=2))
"""


def test_a_signal_that_comes_as_the_first_worker_starts_is_forwarded(tmp_path):
    blocker = write_script(tmp_path, "blocker.py", BLOCKER)
    launcher = write_script(tmp_path, "early.py", EARLY_SIGNAL)
    proc = subprocess.run(
        [sys.executable, launcher, blocker], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert blocker not in ps  # no worker outlived the launcher


def test_workers_die_with_killed_launcher(tmp_path):
    proc, pids = start_launcher(tmp_path)
    proc.kill()  # no cleanup possible: the parent-death signal must do it
    proc.wait()
    for pid in pids:
        assert wait_dead(pid, timeout=5)


def test_a_killed_launcher_s_report_folder_goes_at_the_next_start_and_a_running_one_s_stays(tmp_path):
    killed, pids = start_launcher(tmp_path)
    killed.kill()
    killed.wait()
    for pid in pids:
        assert wait_dead(pid, timeout=5)
    (stale,) = (tmp_path / "tmp").iterdir()  # its finally never ran
    running, _ = start_launcher(tmp_path)  # its start removed the stale folder
    (own,) = (tmp_path / "tmp").iterdir()
    assert own != stale
    one = "import sys; from acco.launch import launch_local as run; sys.exit(run(1, [sys.executable, '-V']))"
    done = subprocess.run([sys.executable, "-c", one], env=clean_env({"TMPDIR": str(tmp_path / "tmp")}),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((tmp_path / "tmp").iterdir()) == [own]  # a running launcher's folder is kept
    running.send_signal(signal.SIGTERM)
    assert running.wait(timeout=30) == 128 + signal.SIGTERM
    assert list((tmp_path / "tmp").iterdir()) == []


def test_launch_local_rejects_bad_nproc():
    with pytest.raises(ValueError):
        launch_local(0, [sys.executable, "-c", "pass"])


# Each worker reports in on a FIFO of its own (opening it blocks until the test reads). On one
# FIFO shared by both, the test's buffered readline could take both lines in one read and drop the
# second with the file it closed; its next open then met a writer that had already written: "".
GATED = """
    import os, signal, sys
    from acco.launch import wait_for_go
    signal.signal(signal.SIGTERM, lambda *_: None)  # as catch_early: a notice at start-up is noted
    rank = os.environ["RANK"]
    with open(os.path.join(sys.argv[1], f"started-{rank}"), "w") as fifo:  # tell the test this worker runs
        fifo.write(f"{rank} {os.getpid()}\\n")
    if len(sys.argv) > 2:  # still importing (torch takes seconds) when the check fails
        import time
        time.sleep(float(sys.argv[2]))
    wait_for_go()
    open(os.path.join(sys.argv[1], f"went-{rank}"), "w").close()
"""


def gated_launch(tmp_path, check_passes: bool, grace_s: float = 5.0, busy_s: float | None = None):
    script = write_script(tmp_path, "gated.py", GATED)
    for rank in range(2):
        os.mkfifo(tmp_path / f"started-{rank}")
    pids = []

    def check():  # runs once the workers exist: both report in before it returns
        for rank in range(2):  # read to the end: the worker closed its FIFO after its one line
            line = (tmp_path / f"started-{rank}").read_text()
            assert re.fullmatch(rf"{rank} \d+\n", line), line
            pids.append(int(line.split()[1]))
        assert not list(tmp_path.glob("went-*"))  # no worker went past the gate yet
        if not check_passes:
            raise ValueError("bad input")

    code = launch_local(
        2, [sys.executable, script, str(tmp_path), *([] if busy_s is None else [str(busy_s)])],
        env_extra={"PYTHONPATH": REPO}, check=check, grace_s=grace_s,
    )
    return code, pids


def test_workers_start_while_the_launcher_checks_and_go_once_it_passes(tmp_path):
    code, pids = gated_launch(tmp_path, check_passes=True)
    assert code == 0 and len(pids) == 2
    assert sorted(p.name for p in tmp_path.glob("went-*")) == ["went-0", "went-1"]


def test_a_failed_check_stops_the_workers_before_they_go(tmp_path):
    """At once: they have only started (and note a SIGTERM, as preemption.catch_early makes them),
    so the error is said without the grace a running job gets (5 s before each refusal, before)."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad input"):
        gated_launch(tmp_path, check_passes=False, grace_s=120, busy_s=120)
    assert time.monotonic() - start < 60  # neither the workers' 120 s nor the 120 s grace
    assert not list(tmp_path.glob("went-*"))


# A worker that checkpoints on the save signal: it says so, "saves" for a second (longer than the
# launcher's grace_s=0 and its 0.2 s poll), and exits with EXIT_SAVED_ON_SIGNAL.
SAVER = """
    import os, signal, sys, time
    from signal_wait import wait_for_signal
    caught = []
    signal.signal(signal.SIGUSR1, lambda *_: caught.append(1))
    os.write(1, f"ready {os.environ['RANK']} {os.getpid()}\\n".encode())
    while not caught:
        wait_for_signal()
    os.write(1, f"saving {os.environ['RANK']}\\n".encode())
    time.sleep(1.0)  # the save
    os.write(1, f"saved {os.environ['RANK']}\\n".encode())
    sys.exit(75)
"""

SAVING_LAUNCHER = """
    import signal, sys
    from acco.launch import launch_local
    sys.exit(launch_local(2, [sys.executable, sys.argv[1]], grace_s=0, save_signals=[signal.SIGUSR1]))
"""


def test_on_a_save_signal_the_launcher_waits_for_its_workers_to_checkpoint(tmp_path):
    """grace_s=0: a launcher that killed its workers after forwarding would leave no 'saved' line."""
    saver = write_script(tmp_path, "saver.py", SAVER)
    launcher = write_script(tmp_path, "saving.py", SAVING_LAUNCHER)
    proc = subprocess.Popen([sys.executable, launcher, saver], env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines = [proc.stdout.readline() for _ in range(2)]
    assert all(line.startswith("ready") for line in lines), lines
    proc.send_signal(signal.SIGUSR1)
    assert sorted(proc.stdout.readline() for _ in range(2)) == ["saving 0\n", "saving 1\n"]
    out, err = proc.communicate(timeout=30)
    assert sorted(out.splitlines()) == ["saved 0", "saved 1"]
    assert proc.returncode == EXIT_SAVED_ON_SIGNAL and "acco.launch" not in err, err


def test_workers_that_checkpointed_on_their_own_signal_are_no_failure(tmp_path):
    script = write_script(tmp_path, "saved.py", "import sys\nsys.exit(75)\n")
    launcher = write_script(tmp_path, "launcher.py", LAUNCHER)
    proc = subprocess.run(
        [sys.executable, launcher, script], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == EXIT_SAVED_ON_SIGNAL and "acco.launch" not in proc.stderr, proc.stderr
