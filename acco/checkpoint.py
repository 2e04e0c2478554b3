"""Checkpoints of a sharded run: written atomically, resumed exactly, or resharded.

    output_dir/checkpoint-N/
        meta.json            step, samples, method, world size, parameter count, every file's size
                             (rank 0; last)
        rank{r}-of-{W}.pt    worker r's shard of the fp32 master and AdamW moments (and of acco's
                             estimate error, wp's prediction), step, data position, RNG state, and
                             its gradient accumulator only with a fixed batch
        model/               the committed model in save_pretrained form, for users

Each distinct tensor is written once: no rank file holds the parameter vector (a resume gathers the
committed parameters from the master shards, as an update round does). An accumulator is per-worker
state that an exact resume needs only with a fixed batch (EngineConfig.fixed_batch: train=acco's
default, or accumulate_while_waiting=false); where micro-batch counts follow timing a resume restarts
the overlapped regime from its warm start and the data position goes back by the micro-batches the
accumulator held. GPT-Neo 125M on 4 workers, fp32: 20 bytes per parameter (2.49 GB), 36 with a fixed
batch (BENCHMARKS.md, "Scale").

`save_run` and `resume_run` are the trainer's two calls; whether and from which checkpoint a run
resumes, and what verifies a checkpoint, is acco/resume.py's. Resharding maps the old files
(torch.load(mmap=True)) and each new worker copies only the slices of the old shards that overlap
its new one (engine/shard_map.py, between any layouts: flat, nodes, sharded inside the node): a
4 -> 2 resume of GPT-Neo 125M peaks at the memory of a fresh 2-worker run.

Every worker writes its own file into checkpoint-N.tmp/ and fsyncs it; once all have, rank 0
writes the model and meta.json, fsyncs them and the folders, renames the folder into place and
fsyncs the output folder: a checkpoint-N is on the disk whole, whatever crashes after (a host
included). A crash mid-save leaves only a .tmp folder behind (removed by the next save) and the
previous checkpoint valid; rotation removes a checkpoint only once a newer one verifies. The
workers wait for each other on the rendezvous store with a long timeout, not with a barrier:
writing a large model's shards may take longer than the short collective timeout that detects
dead workers. A blocking save stalls every worker for what rank 0 needs (125M / 4 workers: about
4 s on an idle VM); by default the files are written (and fsynced) in the background from host
copies (acco/checkpoint_writer.py) and training pauses for the copies.

Plain torch.save files rather than torch.distributed.checkpoint (DCP): the state is a handful of
flat 1-D shards, and resharding them is a slice of a memory-mapped file, which reads only the
overlapping chunks as DCP's planner would, without wrapping every shard in a DTensor. Measured on
one worker's 125M / 4 state (4 x 31.3M fp32, 501 MB): torch.save 0.45 s, dcp.save 1.43 s, the same
bytes; reading a quarter of the master: 0.02 s mapped, 0.12 s with dcp.load. Like DCP's
async_save, the writes overlap training (checkpoint_writer.py), without DCP's process group.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from acco.checkpoint_writer import non_finite
from acco.data.on_device import rewind
from acco.engine import CheckpointError
from acco.engine.comm import MICRO_BATCHES
from acco.engine.device import device_ops
from acco.launch.process_group import decided_by_rank0, wait_on_store
from acco.messages import size_text
from acco.resume import rank_file, verify
from acco.run_folder import checkpoint_folders, step_of

# How long the workers wait for each other's (and rank 0's) writes: writes are slow, not stuck.
SAVE_TIMEOUT_S = 3600.0


_save_calls = [0]


def _all_written(key: str, rank: int, world_size: int, failed: str = "") -> str:
    """Rank 0 returns once every rank has called this with `key` (each sets its own store key; the
    wait's timeout is long, unlike a barrier's), with what failed ("rank 1: OSError: ..."; "": nothing),
    the others at once with "": a failed write is said, not a shard that never comes waited for."""
    if world_size == 1:
        return failed and f"rank 0: {failed}"
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.set(f"{key}/{rank}", f"failed {failed}" if failed else "written")
        return ""
    others = [f"{key}/{r}" for r in range(1, world_size)]
    wait_on_store(others, "every worker's checkpoint shard", SAVE_TIMEOUT_S)
    said = {0: f"failed {failed}" if failed else "written"}
    said.update({r: store.get(f"{key}/{r}").decode() for r in range(1, world_size)})
    return "; ".join(f"rank {r}: {v.removeprefix('failed ')}" for r, v in said.items() if v != "written")


def _finish_on_rank0(finish, key: str, rank: int, world_size: int, failed: str) -> None:
    """Rank 0 runs `finish()` unless a shard failed; then every rank raises what failed, if anything."""
    if rank == 0:
        if not failed:
            try:
                finish()
            except Exception as e:
                failed = f"rank 0: {type(e).__name__}: {e}"
        if world_size > 1:
            dist.distributed_c10d._get_default_store().set(key, f"failed {failed}" if failed else "done")
    else:
        wait_on_store([key], "rank 0's checkpoint", SAVE_TIMEOUT_S)
        said = dist.distributed_c10d._get_default_store().get(key).decode()
        failed = said.removeprefix("failed ") if said != "done" else ""
    if failed:
        raise CheckpointWriteError(f"a checkpoint could not be written: {failed}")


class CheckpointWriteError(OSError):
    """A part of a checkpoint could not be written (a full disk): every worker raises it alike."""


def fsync(path: Path) -> None:
    """`path`'s data (a file) or its entries (a folder) on the disk, not only in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a folder: its entries are then theirs to keep
        if not (path.is_dir() and e.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def write_durably(state, path: Path) -> float:
    """torch.save `state` into `path` and fsync it; returns the fsync's seconds. Through a Python
    file: torch's own writer reports a full disk as "unexpected pos" (a RuntimeError), while a
    file object's OSError is kept as the context of that error, and raised here in its place."""
    try:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            start = time.perf_counter()
            os.fsync(f.fileno())
            return time.perf_counter() - start
    except RuntimeError as e:
        if isinstance(e.__context__, OSError):
            raise e.__context__ from None
        raise


def fsync_tree(folder: Path, skip: tuple[Path, ...] = ()) -> None:
    """Every file under `folder` (but `skip`, already synced), then every folder, deepest first."""
    paths = sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    files, folders = [p for p in paths if p.is_file() and p not in skip], [p for p in paths if p.is_dir()]
    for path in [*files, *folders, folder]:
        fsync(path)


def rename_into_place(tmp: Path, final: Path) -> None:
    """`tmp` renamed to `final`, on the disk once this returns. A `final` already there (a
    checkpoint that did not verify, which the resume passed over) is first renamed aside and
    removed after: no crash leaves a folder named `final` partly written or partly deleted (a crash
    between the two renames leaves no `final`, and a resume takes the checkpoint before)."""
    aside = final.with_name(f"{final.name}.replaced.tmp")
    if final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def rotate(out: Path, keep: int) -> None:
    """Keep the `keep` newest checkpoints that verify (their files' sizes: the CRCs would read the
    files again, from the page cache the fsyncs just wrote out); remove the older ones. One that
    does not verify never counts as kept, and goes only once a newer one verifies."""
    found = checkpoint_folders(out)
    whole = []
    for folder in found:
        try:
            verify(folder, crc=False)
            whole.append(folder)
        except CheckpointError:
            pass
    if not whole:
        return
    for folder in found:
        if folder not in whole[:keep] and step_of(folder) < step_of(whole[0]):
            shutil.rmtree(folder, ignore_errors=True)


def save(
    output_dir,
    step: int,
    worker_state: dict,
    meta: dict,
    rank: int,
    world_size: int,
    save_model,
    keep: int | None,
):
    """Write checkpoint-`step` atomically and durably: every file is fsynced before the folder is
    renamed into place, the output folder after. `save_model(folder)` writes the model (rank 0)."""
    out = Path(output_dir)
    tmp, final = out / f"checkpoint-{step}.tmp", out / f"checkpoint-{step}"
    _save_calls[0] += 1  # every rank saves the same checkpoints in the same order: unique keys
    key = f"acco/checkpoint/{_save_calls[0]}/{final.resolve()}"

    def prepare() -> str:  # rank 0: a fresh .tmp folder (those of saves that crashed go), or why not
        try:
            for stale in out.glob("checkpoint-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:  # a folder that cannot be written: every rank says so below
            return f"rank 0: {type(e).__name__}: {e}"
        return ""

    start = time.perf_counter()
    cannot = decided_by_rank0(prepare, key=f"{key}/prepare", slow_timeout_s=SAVE_TIMEOUT_S)
    if cannot:
        raise CheckpointWriteError(f"a checkpoint could not be written: {cannot}")
    shard_sync_s = 0.0
    try:  # on the disk before this rank says it is written
        shard_sync_s, failed = write_durably(worker_state, rank_file(tmp, rank, world_size)), ""
    except Exception as e:  # said to rank 0, and raised on every rank below
        failed = f"{type(e).__name__}: {e}"
    shard_s = time.perf_counter() - start
    failed = _all_written(f"{key}/written", rank, world_size, failed)
    shards_s = time.perf_counter() - start

    def finish():  # rank 0 alone, once every shard is on disk; the others wait on the store
        save_model(tmp / "model")
        model_s = time.perf_counter() - start - shards_s
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta.update(checkpoint_bytes=sum(files.values()), files=files)  # what a resume verifies
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        synced = time.perf_counter()
        fsync_tree(tmp, skip=tuple(rank_file(tmp, r, world_size) for r in range(world_size)))
        rename_into_place(tmp, final)
        sync_s = time.perf_counter() - synced
        if keep:  # None: keep all (TrainArgs checks that it is None or >= 1)
            rotate(out, keep)
        size = meta["checkpoint_bytes"]
        print(  # where the time goes: rank 0's own shard, the slowest rank's, the model, the fsyncs
            f"{final.name}: {size_text(size)} ({size / meta['numel']:.1f} bytes per parameter) in "
            f"{time.perf_counter() - start:.1f} s: own shard {shard_s:.1f} s (fsync {shard_sync_s:.1f} s), "
            f"every shard {shards_s:.1f} s, model {model_s:.1f} s, fsync and rename {sync_s:.1f} s",
            flush=True,
        )

    try:
        _finish_on_rank0(finish, f"{key}/finish", rank, world_size, failed)
    except CheckpointWriteError:
        if rank == 0:  # every rank is done with it: the space it took is free again
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_worker(folder: Path, rank: int, world_size: int, mmap: bool = False) -> dict:
    """Worker `rank`'s file; with `mmap`, its tensors are mapped, not read: only what is then
    touched is read from disk (resharding reads slices of the old shards)."""
    path = rank_file(folder, rank, world_size)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError as e:
        raise CheckpointError(f"{folder}: missing {path.name}") from e
    except Exception as e:  # truncated or corrupted file: torch raises several types
        raise CheckpointError(f"{path}: corrupted checkpoint file ({type(e).__name__}: {e})") from e


def data_position(old_states: list[dict], batch_size: int, world_size: int, batches_per_epoch: int) -> dict:
    """Where a stream of `world_size` workers resumes so as to skip the samples the old run committed.

    Each old worker's stream also counts the micro-batches in its gradient accumulator (acco's
    next payload, computed during the last round): resharding drops the accumulator, so those
    samples were never committed and must be read again.
    """
    read = 0
    for s in old_states:
        d, engine = s["data"], s["engine"]
        old_bpe = d["num_samples"] // d["global_batch_size"]
        pending = 0
        if engine.get("accumulator") is not None:
            pending = int(engine["accumulator_stats"][MICRO_BATCHES])
        read += (d["epoch"] * old_bpe + d["position"] - pending) * (d["global_batch_size"] // len(old_states))
    position = read // (batch_size * world_size)
    return {"epoch": position // batches_per_epoch, "position": position % batches_per_epoch}


# --------------------------------------------------------------------------- a run's save and resume


def save_run(
    engine, position, record, args: dict, rank: int, world_size: int, writer, snapshot_model
) -> None:
    """Checkpoint a run after `record`'s update: every worker's engine state, data position and
    RNG, and (rank 0) the model and meta.json. Refused, on every rank, when any worker's state holds
    NaN or inf: the last good checkpoint stays the newest. The state is copied now and written by
    `writer` (acco/checkpoint_writer.py: in the background, or at once); `snapshot_model(writer)`,
    called on every rank (a model sharded inside the node is gathered by all), copies the committed
    model to rank 0 and returns there the call that writes it (None elsewhere)."""
    writer.wait()  # one save in flight at most: its host buffers are free again
    state = engine.state_dict()
    # Every floating tensor (master, moments, parameters, acco's accumulator and its stats,
    # torch-ddp's optimizer state ...) of every worker, one all-reduced flag.
    bad = non_finite(state, writer.ops.device, world_size)
    if bad:
        raise FloatingPointError(
            f"the training state holds NaN or inf at update {record.step} (rank {rank}: "
            f"{', '.join(bad[:6])}); no checkpoint written"
        )
    data = position.state_dict()
    # Micro-batches read but in no saved state: torch-ddp's next update, already fetched, and an
    # accumulator not kept (a batch that follows timing): the resumed run reads them again.
    back = state.get("fetched_ahead", 0) + state.get("dropped_micro_batches", 0)
    if back:
        data = rewind(data, back)
    worker = {"engine": writer.snapshot(state, "engine"), "data": data, "rng": torch.get_rng_state()}
    device_rng = writer.ops.rng_state()
    if device_rng is not None:
        worker["cuda_rng"] = device_rng
    meta = {
        "step": record.step,
        "samples": record.committed_micro_batches,
        "method": args["method_name"],
        "world_size": world_size,
        # the shard order of the rank files (flat.py's state_header): 0 flat, else the two-level
        # rounds' workers per node; a resume on another layout reshards
        "workers_per_node": shard_order(engine),
        "shard_inside_node": bool(state.get("shard_inside_node", False)),
        "numel": state["numel"],
        "wall_time": record.wall_time,
        "train": args,
    }
    write_model = snapshot_model(writer)
    writer.submit(
        lambda: save(
            args["output_dir"],
            record.step,
            worker,
            meta,
            rank,
            world_size,
            write_model,
            args["save_total_limit"],
        )
    )


def shard_order(engine) -> int:
    """The shard order of `engine`'s state as its checkpoints record it (meta.json's
    workers_per_node): the two-level rounds' workers per node, 0 for the flat ring and for the
    engines whose state is not in shards of the rounds (torch-ddp); torch-hsdp's, its mesh's (it
    resumes on that layout only, and says so)."""
    rounds = getattr(engine, "rounds", None)
    return rounds.workers_per_node if rounds is not None else getattr(engine, "workers_per_node", 0)


def resume_run(
    engine, position, folder: Path, meta: dict, rank: int, world_size: int, device, batch_size: int
) -> bool:
    """Load a checkpoint into `engine` and the data `position`: exactly on the same world size and
    shard order (True), from this worker's own file; else resharded from the same samples (False),
    each old file memory-mapped so that only the slices this worker needs are read."""
    old_world = int(meta["world_size"])
    sharded = bool(getattr(getattr(engine, "cfg", None), "shard_inside_node", False))
    if (old_world != world_size or int(meta.get("workers_per_node", 0)) != shard_order(engine)
            or bool(meta.get("shard_inside_node", False)) != sharded):
        def old(r: int) -> dict:
            return load_worker(folder, r, old_world, mmap=True)

        engine.load_state_dict(old(0)["engine"], lambda r: old(r)["engine"])
        # The data positions and pending micro-batch counts: a few numbers of each old file.
        positions = []
        for r in range(old_world):
            state = old(r)
            positions.append(
                {
                    "data": state["data"],
                    "engine": {k: state["engine"].get(k) for k in ("accumulator", "accumulator_stats")},
                }
            )
            del state
        position.check_same_data(positions[0]["data"])
        position.load_state_dict(data_position(positions, batch_size, world_size, position.batches_per_epoch))
        return False
    mine = load_worker(folder, rank, old_world)
    engine.load_state_dict(mine["engine"])
    position.load_state_dict(mine["data"])
    torch.set_rng_state(mine["rng"])
    if "cuda_rng" in mine:
        device_ops(device).set_rng_state(mine["cuda_rng"])
    return True
