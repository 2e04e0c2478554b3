"""Checkpoints of a sharded run: written atomically, resumed exactly, or resharded.

    output_dir/checkpoint-N/
        meta.json            step, samples, method, world size, parameter count (rank 0; written last)
        rank{r}-of-{W}.pt    worker r's engine state (fp32 master shard, AdamW moments, step, what
                             its model and gradient accumulator hold), data position and RNG state
        model/               the committed model in save_pretrained form, for users

Every worker writes its own file into checkpoint-N.tmp/; once all have (a barrier), rank 0
renames the folder. A crash mid-save leaves only a .tmp folder behind and the previous
checkpoint valid. Plain torch.save files, one per worker, rather than torch.distributed.checkpoint:
the state is a handful of flat 1-D tensors whose resharding is a concatenation and a slice
(done in DecoupledEngine.load_state_dict), and a resume must also bring back each worker's
partial gradient accumulator, which is per-worker state that DCP's resharding has no meaning for.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from acco.engine import CheckpointError
from acco.launch import after_rank0

_NAME = re.compile(r"^checkpoint-(\d+)$")


def rank_file(folder: Path, rank: int, world_size: int) -> Path:
    return folder / f"rank{rank}-of-{world_size}.pt"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (with meta.json), oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _NAME.match(p.name)) and (p / "meta.json").exists()]
    return [p for _, p in sorted(found)]


def resolve(spec: str, output_dir: str | Path) -> Path:
    """`latest` (the newest complete checkpoint in output_dir) or a checkpoint folder."""
    if spec == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(f"resume_from_checkpoint=latest: no complete checkpoint in {output_dir}")
        return found[-1]
    folder = Path(spec)
    if not (folder / "meta.json").is_file():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no meta.json)")
    return folder


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def save(output_dir, step: int, worker_state: dict, meta: dict, rank: int, world_size: int, save_model, keep: int | None):
    """Write checkpoint-`step` atomically. `save_model(folder)` writes the model (rank 0)."""
    out = Path(output_dir)
    tmp, final = out / f"checkpoint-{step}.tmp", out / f"checkpoint-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(world_size)
    torch.save(worker_state, rank_file(tmp, rank, world_size))
    _barrier(world_size)  # every worker's shard is on disk

    def finish():  # rank 0 alone, while the others wait without the collective timeout
        save_model(tmp / "model")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep is not None and keep > 0:
            for old in list_checkpoints(out)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)

    after_rank0(finish, key=f"checkpoint/{final.resolve()}")
    return final


def load_meta(folder: Path) -> dict:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: unreadable meta.json ({e})") from e


def load_worker(folder: Path, rank: int, world_size: int) -> dict:
    path = rank_file(folder, rank, world_size)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{folder}: missing {path.name}") from e
    except Exception as e:  # truncated or corrupted file: torch raises several types
        raise CheckpointError(f"{path}: corrupted checkpoint file ({type(e).__name__}: {e})") from e


def all_finite(tensors, device, world_size: int) -> bool:
    """Whether every worker's tensors are finite (one small all-reduce)."""
    bad = torch.zeros(1, device=device)
    for t in tensors:
        if t is not None and t.is_floating_point() and not torch.isfinite(t).all():
            bad += 1
    if world_size > 1:
        dist.all_reduce(bad)
    return bad.item() == 0


def data_position(old_states: list[dict], batch_size: int, world_size: int, batches_per_epoch: int) -> dict:
    """Where a stream of `world_size` workers resumes so as to skip the samples the old run read."""
    read = 0
    for s in old_states:
        d = s["data"]
        old_bpe = d["num_samples"] // d["global_batch_size"]
        read += (d["epoch"] * old_bpe + d["position"]) * (d["global_batch_size"] // len(old_states))
    position = read // (batch_size * world_size)
    return {"epoch": position // batches_per_epoch, "position": position % batches_per_epoch}
