"""glibc's mmap threshold fixed by `keep_heap_small`: a tensor of a few MiB allocated after a larger
one was freed gets its own mapping (given back on free) instead of heap memory (acco/host_memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")

# Frees a 24 MiB tensor (glibc's moving threshold then rises to 24 MiB), allocates a 4 MiB one and
# prints how many KiB of mapped (not heap) memory that added, from glibc's own count (mallinfo2).
SCRIPT = """
import ctypes, sys, torch
from acco.host_memory import keep_heap_small
if sys.argv[1] == "keep":
    assert keep_heap_small()
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
big = torch.ones(6 << 20)
del big
before = libc.mallinfo2().hblkhd
medium = torch.ones(1 << 20)
print((libc.mallinfo2().hblkhd - before) >> 10)
"""


def mapped_kib(mode: str) -> int:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    if "mallinfo2" in proc.stderr:
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1])


def test_a_few_mib_tensor_is_mapped_after_a_larger_one_was_freed():
    assert mapped_kib("default") == 0  # glibc's moving threshold: the 4 MiB come from the heap
    assert mapped_kib("keep") >= 4096
