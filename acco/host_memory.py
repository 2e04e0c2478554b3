"""Host memory a worker keeps after freeing it: glibc's mmap threshold.

glibc serves an allocation above its mmap threshold with its own mapping, returned to the system
on free, and smaller ones from its heap, which keeps freed blocks for reuse. The threshold starts
at 128 KiB and moves up to the size of each mapped block freed (up to 32 MiB): after the first
large tensor of a step is freed, activations of a few MiB land on the heap, where the blocks freed
between them stay in the process. GPT-Neo 125M, one 4 x 1024 micro-batch, fp32, with gradient
checkpointing: 5.36 GB peak RSS, 3.95 GB with the threshold fixed at 1 MiB (BENCHMARKS.md,
"Memory: activations of GPT-Neo 125M, measured and computed"). A threshold set once stays where
it is set, which is what `keep_heap_small` does for a training process on glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20  # a tensor of 1 MiB and more: mapped, given back on free


def keep_heap_small(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process; False where the C library
    is not glibc (macOS, musl) or refuses the value, and nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
