"""Run a function on W real processes joined by a gloo process group (CPU), collect what rank 0 returns."""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # W processes share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args):
    """fn(rank, world_size, *args) runs on every rank; returns the list of per-rank results."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size, start_method="spawn"
        )
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
