"""signal_wait.wait_for_signal, the wait of the processes that signal tests start: it returns for a
signal that the interpreter took only at the C level while the main thread waited, where
signal.pause() or a blocking read waits on (the lost wakeup that hung test_netns's signal test)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from distributed import write_script

# The signal goes to a second thread: its C-level handler runs there and the main thread's blocking
# call is not interrupted, as with a signal landing just before that call blocks, but every time.
CHILD = """
    import signal, sys, threading
    from signal_wait import wait_for_signal

    caught = []
    signal.signal(signal.SIGUSR1, lambda *_: caught.append(1))
    print("up", flush=True)
    threading.Thread(target=lambda: signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)).start()
    WAIT
    print(caught)
"""


def test_a_signal_taken_outside_the_wait_still_ends_it(tmp_path):
    script = write_script(tmp_path, "child.py", CHILD.replace("WAIT", "wait_for_signal()"))
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout == "up\n[1]\n", proc.stderr  # returned, the handler run


def test_signal_pause_misses_it(tmp_path):
    """The control: the same signal leaves signal.pause() waiting (2 s after the child is up)."""
    script = write_script(tmp_path, "child.py", CHILD.replace("WAIT", "signal.pause()"))
    proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
    finally:
        proc.kill()
        proc.communicate()
