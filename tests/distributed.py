"""Run a function on W real processes joined by a gloo process group (CPU), collect what rank 0 returns."""

from __future__ import annotations

import gc
import os
import random
import select
import shutil
import socket
import tempfile
import textwrap
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now that no connection will take as its local port: below the kernel's ephemeral
    range, from which every connection (gloo's pairs, the stores' clients) draws its own. A port the
    kernel handed out as free (bind to 0) was once taken by such a connection before the test's store
    could listen on it (EADDRINUSE, two suites side by side)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    pick = random.SystemRandom()  # not the seeded module state: two suites would draw alike
    for _ in range(200):
        port = pick.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address, as the store's server binds
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range (from {low})")


# The workers fork from one server process that has imported torch and acco's trainer once per
# session (multiprocessing's forkserver): a fresh interpreter per run would import them again, each
# time, in every worker (about 10 s per run on 2 busy cores). Each worker is still a new process
# with the modules as imported, not as an earlier test left them; it takes the caller's environment.
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "acco.engine", "acco.checkpoint", "acco.data",
           "acco.models", "acco.trainer", "transformers.models.gpt_neo.modeling_gpt_neo"]  # fmt: skip
mp.set_forkserver_preload(PRELOAD)


def _entry(rank: int, world_size: int, port: int, fn, args, out_dir: str, env: dict,
           timeout_s: float) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # W processes share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        del result
        # Free what fn built (DDP's reducer holds the group, in reference cycles) while the
        # interpreter is whole: a gloo group released at interpreter exit can abort the process.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def start_workers(fn, nprocs: int, args: tuple = ()) -> None:
    """mp.spawn(fn, args, nprocs): fn(rank, *args) on `nprocs` processes forked from that server."""
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def run_distributed(fn, world_size: int, *args, timeout_s: float = 120.0):
    """fn(rank, world_size, *args) runs on every rank; returns the list of per-rank results.
    `timeout_s`: the process group's collective timeout."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry, args=(world_size, free_port(), fn, args, out_dir, dict(os.environ), timeout_s),
            nprocs=world_size,
            start_method="forkserver",
        )
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)
        ]


def _cli_entry(rank: int, world_size: int, port: int, overrides: list[str], stdout: str, env: dict) -> None:
    import contextlib

    from acco.cli import run
    from acco.config import compose

    os.environ.clear()
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)  # W processes share 2 cores
    with open(f"{stdout}.rank{rank}", "w") as out, contextlib.redirect_stdout(out):
        code = run(compose(overrides))
    if code:
        raise SystemExit(code)


def run_cli(overrides: list[str], world_size: int, stdout: Path) -> str:
    """The command line's job (`python main.py OVERRIDES`) on `world_size` workers, each started as
    torchrun starts one (its rank in the environment) but forked from the preloaded server (no
    interpreter nor torch import of its own); returns what rank 0 printed (also in `stdout`)."""
    mp.start_processes(
        _cli_entry, args=(world_size, free_port(), list(overrides), str(stdout), dict(os.environ)),
        nprocs=world_size, start_method="forkserver",
    )  # fmt: skip
    return Path(f"{stdout}.rank0").read_text()


# Subprocess helpers of the launcher tests (test_launch.py, test_launch_local.py).

REPO = str(Path(__file__).resolve().parents[1])
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


def clean_env(extra=None):
    """os.environ without launcher variables, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def wait_dead(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` has exited (a zombie counts as exited); waits on a pidfd, no polling."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def write_script(tmp_path, name, body):
    """`body` dedented into tmp_path/name; with signal_wait.py beside it when it imports that (the
    script's folder is on its path)."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    if "from signal_wait import" in body:
        shutil.copy(Path(__file__).with_name("signal_wait.py"), tmp_path)
    return str(path)
