"""What the tests of ``acco-bench gpu`` share: its arguments at the tiny model's shapes on the CPU,
and one intra-op thread while it runs."""

from __future__ import annotations

import contextlib

import torch

# acco-bench gpu on the CPU at the tiny model's shapes: 2 timed updates after 1 of warm-up
TINY_ON_CPU = "gpu --device cpu --model tiny --batch-size 2 --max-length 16 --steps 2 --warmup 1".split()


@contextlib.contextmanager
def one_thread():
    """Intra-op threads that wait on each other on shared cores make tiny ops 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
