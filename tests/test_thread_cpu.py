"""Each worker thread's CPU time by role: the comm thread is named at the OS level, and
acco-bench's LoadMeter adds up every worker's threads as training, comm, transport and other."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from acco.engine.background import COMM_THREAD_NAME, BackgroundComm
from acco_bench.workers import LoadMeter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


def test_the_comm_thread_has_its_name_at_the_os_level():
    comm = BackgroundComm(torch.device("cpu"))
    try:
        name = comm.submit(lambda: Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text())
        assert name.result(timeout=60).value.strip() == COMM_THREAD_NAME
    finally:
        comm.close()


# A worker stand-in: a named comm thread and the main thread each spin for a known CPU time, then
# both stay alive (a thread's /proc entry goes with it) until the test has sampled them.
_SPINNER = """
import threading, time
from acco.engine.background import COMM_THREAD_NAME, name_os_thread

def spin(seconds):
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass

done, hold = threading.Event(), threading.Event()
def comm():
    name_os_thread(COMM_THREAD_NAME)
    spin(0.4)
    done.set()
    hold.wait()
threading.Thread(target=comm, daemon=True).start()
spin(0.2)
done.wait()
print("ready", flush=True)
input()
"""


def test_load_meter_adds_up_the_workers_cpu_by_thread_role():
    proc = subprocess.Popen([sys.executable, "-c", _SPINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        meter = LoadMeter()
        meter.sample([proc])
        cpu = meter.result()["worker_cpu_s"]
    finally:
        proc.kill()
        proc.wait()
    assert cpu["comm"] == pytest.approx(0.4, abs=0.05)
    assert 0.2 <= cpu["training"] < 0.4 + 2.0  # the spin and the interpreter's start (imports)
    assert cpu["network"] == 0.0  # no emulated network process was given
