"""How a process that a test starts waits for a signal that its own Python handler must see.

Not with signal.pause() or a blocking read: a signal that lands after the interpreter last looked for
pending handlers, but before that call blocks, runs only the C-level handler, and the call then waits
for another signal, which never comes. test_netns's signal test hung so about once in 500 runs beside
a second suite (the child still in its read, no handler run). CPython also writes a byte to its wakeup
fd for every signal, so a select on that fd returns at once for a signal that came before the select
began, and the Python handler runs as the select call returns (the remedy CPython itself took in
multiprocessing's forkserver: python/cpython#2139).

Importing this module arms the wakeup fd (main thread only): import it before the process tells the
test it is ready. ``write_script`` (distributed.py) puts this file beside a script that imports it.
"""

import os
import select
import signal

_wake, _woken = os.pipe()
os.set_blocking(_woken, False)
signal.set_wakeup_fd(_woken)


def wait_for_signal() -> None:
    """Return once a signal has come since the last call (or the import); its handler has run by then."""
    select.select([_wake], [], [])
    os.read(_wake, 512)
