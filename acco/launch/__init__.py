"""Process launching for torch.distributed: torchrun, SLURM (srun), or local workers.

- ``env.py``: who is who (``dist_env()``: torchrun's variables, else SLURM's; SLURM node lists).
- ``process_group.py``: ``init_distributed()`` and the store waits for slow one-off work
  (``after_rank0``, ``every_rank_at``), with a heartbeat that tells a dead peer from a slow one.
- ``local.py``: ``launch_local()``, the launcher of a plain ``python main.py``.

Typical use at the top of an entry point::

    if dist_env() is None and nproc > 1:
        sys.exit(launch_local(nproc, self_command()))
    rank, world_size, local_rank, device = init_distributed()

The workers find RANK in their environment, so they do not launch again. Failures are detected
and reported by ``acco.engine.progress``, which both the workers and the launcher use.
"""

from acco.launch.env import DEFAULT_PORT, dist_env, expand_nodelist, free_port, self_command
from acco.launch.local import launch_local, wait_for_go
from acco.launch.process_group import after_rank0, every_rank_at, init_distributed, wait_on_store

__all__ = [
    "DEFAULT_PORT",
    "after_rank0",
    "dist_env",
    "every_rank_at",
    "expand_nodelist",
    "free_port",
    "init_distributed",
    "launch_local",
    "self_command",
    "wait_for_go",
    "wait_on_store",
]
