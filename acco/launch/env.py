"""Who is who: the ranks a launcher put in the environment (torchrun, else SLURM's srun).

- ``dist_env()`` reads them, or returns None for a plain ``python main.py``;
- ``expand_nodelist()`` expands a SLURM host list (the master is the first host of the step);
- ``free_port()`` and ``self_command()`` serve the local launcher (acco/launch/local.py).
"""

from __future__ import annotations

import os
import re
import socket
import sys
from itertools import product

DEFAULT_PORT = 29500
_SLURM_PORT_SPREAD = 3000  # 29500..32499: below Linux's ephemeral range (32768+)


# --------------------------------------------------------------------------- SLURM node lists


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"bad SLURM node list {text!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"bad SLURM node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"bad SLURM node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range_set(body: str, text: str) -> list[str]:
    out = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise ValueError(f"bad SLURM node list {text!r}: {item!r} is not a number or a range")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"bad SLURM node list {text!r}: range {item!r} goes down")
        width = len(lo)  # node[01-10] keeps the zero padding of its lower bound
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list, as ``scontrol show hostnames`` does.

    ``node[01-04,07]`` -> node01 node02 node03 node04 node07;
    ``gpu-a[1,3],gpu-b2`` -> gpu-a1 gpu-a3 gpu-b2; ``r[1-2]-n[1-2]`` -> r1-n1 r1-n2 r2-n1 r2-n2.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [
            _expand_range_set(p[1:-1], nodelist) if p.startswith("[") else [p] for p in pieces if p != ""
        ]
        hosts.extend("".join(combo) for combo in product(*choices))
    return hosts


# --------------------------------------------------------------------------- environment


def _slurm_port(job_id: str | None) -> int:
    digits = re.sub(r"\D", "", job_id or "")
    return DEFAULT_PORT + (int(digits) % _SLURM_PORT_SPREAD if digits else 0)


def dist_env() -> dict | None:
    """Ranks from the environment, or None when no launcher set them.

    Returns ``{"source", "rank", "world_size", "local_rank", "local_world_size", "master_addr",
    "master_port"}``. torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) win
    over SLURM's, so ``torchrun`` inside an allocation works. Under ``srun`` the ranks come from
    SLURM_PROCID / SLURM_NTASKS (the step's SLURM_STEP_NUM_TASKS when set) / SLURM_LOCALID, the
    master is the first host of the step's node list (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST)
    and the port 29500 + SLURM_JOB_ID % 3000, unless MASTER_ADDR / MASTER_PORT are set.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        return {
            "source": "torchrun",
            "rank": rank,
            "world_size": world,
            "local_rank": int(env.get("LOCAL_RANK", rank)),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", world)),
            "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": int(env.get("MASTER_PORT", DEFAULT_PORT)),
        }
    world_s = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    # Only a task of an srun step is one of the job's ranks. The batch script itself (and an
    # salloc shell) also has SLURM_PROCID=0 and SLURM_NTASKS=N, but no step: there a plain
    # `python main.py` starts its own local workers instead of waiting for N-1 peers.
    in_step = "SLURM_STEP_NUM_TASKS" in env or env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).isdigit()
    if "SLURM_PROCID" in env and world_s and in_step:
        rank, world = int(env["SLURM_PROCID"]), int(world_s)
        nodelist = (
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        )
        master = env.get("MASTER_ADDR")
        if not master:
            hosts = expand_nodelist(nodelist) if nodelist else []
            master = hosts[0] if hosts else "127.0.0.1"
        tasks_per_node = re.match(
            r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
        )
        return {
            "source": "slurm",
            "rank": rank,
            "world_size": world,
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            "local_world_size": int(tasks_per_node.group(0)) if tasks_per_node else 1,
            "master_addr": master,
            "master_port": int(env.get("MASTER_PORT") or _slurm_port(env.get("SLURM_JOB_ID"))),
        }
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def self_command() -> list[str]:
    """The command line that started this process (``python -m pkg``, scripts and console entry
    points alike), to start more copies of it."""
    return [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
