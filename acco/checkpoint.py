"""Checkpoints of a sharded run: written atomically, resumed exactly, or resharded.

    output_dir/checkpoint-N/
        meta.json            step, samples, method, world size, parameter count, bytes (rank 0; last)
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

Resume and checkpoint metadata live here too: `check_resumable` (run once per job, by the
validation pass: it reads every file once for its CRC), `save_run` and `resume_run` (the
trainer's two calls). Resharding maps the old files (torch.load(mmap=True)) and each new worker
copies only the slices of the old shards that overlap its new one (engine/decoupled.py, `_reshard`): a
4 -> 2 resume of GPT-Neo 125M peaks at the memory of a fresh 2-worker run.

Every worker writes its own file into checkpoint-N.tmp/; once all have, rank 0 writes the model
and renames the folder. A crash mid-save leaves only a .tmp folder behind (removed by the next
save) and the previous checkpoint valid. The workers wait for each other on the rendezvous store
with a long timeout, not with a barrier: writing a large model's shards may take longer than the
short collective timeout that detects dead workers. A blocking save stalls every worker for what
rank 0 needs (125M / 4 workers: about 4 s on an idle VM); by default the files are written in the
background from host copies (acco/checkpoint_writer.py) and training pauses for the copies.

Plain torch.save files rather than torch.distributed.checkpoint (DCP): the state is a handful of
flat 1-D shards, and resharding them is a slice of a memory-mapped file, which reads only the
overlapping chunks as DCP's planner would, without wrapping every shard in a DTensor. Measured on
one worker's 125M / 4 state (4 x 31.3M fp32, 501 MB): torch.save 0.45 s, dcp.save 1.43 s, the same
bytes; reading a quarter of the master: 0.02 s mapped, 0.12 s with dcp.load. Like DCP's
async_save, the writes overlap training (checkpoint_writer.py), without DCP's process group.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from acco.checkpoint_writer import non_finite
from acco.config import AlreadyCompleted
from acco.data.on_device import rewind
from acco.engine import CheckpointError
from acco.engine.comm import MICRO_BATCHES
from acco.engine.device import device_ops
from acco.launch.process_group import after_rank0, wait_on_store
from acco.messages import size_text
from acco.run_folder import CHECKPOINT_NAME, list_checkpoints

# How long the workers wait for each other's (and rank 0's) writes: writes are slow, not stuck.
SAVE_TIMEOUT_S = 3600.0
META_KEYS = ("step", "samples", "method", "world_size", "numel")
# Train settings a resume may change, but rarely should: each difference gets a warning.
RESUME_KEYS = ("n_grad_accumulation", "estimate_micro_batches", "learning_rate", "nb_steps_tot",
               "weight_decay", "scheduler_name", "warmup", "accumulate_while_waiting", "max_grad_norm")
# Settings that decide which samples the data position points at: a resume must keep them
# (batch_size may change only with the world size, where the position is converted by samples).
DATA_KEYS = ("seed", "max_length", "batch_size")


def rank_file(folder: Path, rank: int, world_size: int) -> Path:
    return folder / f"rank{rank}-of-{world_size}.pt"


def resolve(spec: str | bool, output_dir: str | Path) -> Path | None:
    """`latest` (the newest complete checkpoint in output_dir) or a checkpoint folder; True means
    `latest`, as in transformers.Trainer.train(resume_from_checkpoint=True). `auto`: the newest
    complete checkpoint if there is one, else None (a fresh start)."""
    if spec == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    if spec is True or spec == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(f"no complete checkpoint in {output_dir}")
        return found[-1]
    folder = Path(os.path.expanduser(str(spec)))
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if not (folder / "meta.json").is_file():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no meta.json)")
    return folder


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
    """Write checkpoint-`step` atomically. `save_model(folder)` writes the model (rank 0)."""
    out = Path(output_dir)
    tmp, final = out / f"checkpoint-{step}.tmp", out / f"checkpoint-{step}"
    _save_calls[0] += 1  # every rank saves the same checkpoints in the same order: unique keys
    key = f"acco/checkpoint/{_save_calls[0]}/{final.resolve()}"

    def prepare():  # rank 0: a fresh .tmp folder; those of saves that crashed go too
        for stale in out.glob("checkpoint-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)

    start = time.perf_counter()
    after_rank0(prepare, key=f"{key}/prepare", slow_timeout_s=SAVE_TIMEOUT_S)
    try:
        torch.save(worker_state, rank_file(tmp, rank, world_size))
        failed = ""
    except Exception as e:  # said to rank 0, and raised on every rank below
        failed = f"{type(e).__name__}: {e}"
    shard_s = time.perf_counter() - start
    failed = _all_written(f"{key}/written", rank, world_size, failed)
    shards_s = time.perf_counter() - start

    def finish():  # rank 0 alone, once every shard is on disk; the others wait on the store
        save_model(tmp / "model")
        model_s = time.perf_counter() - start - shards_s
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        meta["checkpoint_bytes"] = size
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep:  # None: keep all (TrainArgs checks that it is None or >= 1)
            for old in list_checkpoints(out)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        print(  # where the time goes: rank 0's own shard, waiting for the slowest rank's, the model
            f"{final.name}: {size_text(size)} ({size / meta['numel']:.1f} bytes per parameter) in "
            f"{time.perf_counter() - start:.1f} s: own shard {shard_s:.1f} s, every shard {shards_s:.1f} s, "
            f"model {model_s:.1f} s",
            flush=True,
        )

    _finish_on_rank0(finish, f"{key}/finish", rank, world_size, failed)
    return final


def load_meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: unreadable meta.json ({e})") from e
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise CheckpointError(f"{folder}: meta.json lacks {', '.join(missing)}")
    return meta


def saved_vocab_size(folder: Path) -> int | None:
    """The vocabulary the checkpoint's model was built for (its model/config.json), None when it
    cannot be read: a run whose BPE is not trained yet counts its model's size with it."""
    try:
        vocab = json.loads((folder / "model" / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) else None


def already_completed(folder: Path, meta: dict, nb_steps_tot: int) -> str | None:
    """The line to print when the checkpoint has already consumed the budget (a resumed run
    would train one update more and overwrite the finished run's outputs), else None."""
    if int(meta["samples"]) < nb_steps_tot:
        return None
    return (
        f"{folder.name} already completed the budget of {nb_steps_tot} micro-batches (update {meta['step']}, "
        f"{meta['samples']} micro-batches); nothing to do (raise train.nb_steps_tot to train further)"
    )


def config_changes(saved: dict, current: dict) -> list[str]:
    """One line per key train setting that differs from the one the checkpoint was written with."""
    return [
        f"resuming with train.{k}={current.get(k)!r}, the checkpoint was written with {saved[k]!r}"
        for k in RESUME_KEYS
        if k in saved and saved[k] != current.get(k)
    ]


def data_changes(saved: dict, current: dict, same_world_size: bool) -> list[str]:
    """The data settings that differ from the checkpoint's, such that a resume would read other
    samples than the interrupted run (repeating some, skipping others)."""
    keys = DATA_KEYS if same_world_size else tuple(k for k in DATA_KEYS if k != "batch_size")
    return [
        f"train.{k}={current.get(k)!r} (the checkpoint has {saved[k]!r})"
        for k in keys
        if k in saved and saved[k] != current.get(k)
    ]


def check_files(folder: Path, meta: dict) -> None:
    """Every worker's file is there and whole: a truncated file has no zip directory (it sits at
    the end), and a damaged one fails the CRC-32 that torch.save records for every entry
    (damaged but finite values would otherwise resume silently)."""
    world_size = int(meta["world_size"])
    for r in range(world_size):
        path = rank_file(folder, r, world_size)
        if not path.is_file():
            raise CheckpointError(f"{folder}: missing {path.name} (written by {world_size} workers)")
        try:
            with zipfile.ZipFile(path) as archive:
                damaged = archive.testzip()
        except (OSError, zipfile.BadZipFile) as e:
            raise CheckpointError(f"{path}: corrupted checkpoint file ({type(e).__name__}: {e})") from e
        if damaged is not None:
            raise CheckpointError(f"{path}: corrupted checkpoint file (entry {damaged} fails its CRC check)")


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


def check_resumable(
    args, world_size: int, numel=None, model_label: str = "this run's model"
) -> tuple[Path, dict] | None:
    """``args.resume_from_checkpoint`` names a complete checkpoint that this run can continue:
    meta.json and every worker's file whole (the CRC check reads every file: run it once per job),
    the same method and data settings, a model of ``numel(folder)`` parameters (None: not checked).
    Returns (folder, meta), or None when not resuming; raises CheckpointError, or
    ``AlreadyCompleted`` when the checkpoint has consumed the budget already."""
    spec = args.resume_from_checkpoint
    if not spec:
        return None
    folder = resolve(spec, os.path.expanduser(str(args.output_dir)))
    if folder is None:  # auto, and nothing to resume yet
        return None
    meta = load_meta(folder)
    check_files(folder, meta)
    newer = [p.name for p in list_checkpoints(os.path.expanduser(str(args.output_dir)))
             if int(CHECKPOINT_NAME.match(p.name).group(1)) > int(meta["step"])]  # fmt: skip
    if newer:
        raise CheckpointError(
            f"train.output_dir holds checkpoints newer than {folder.name} ({', '.join(newer)}), of the run "
            "that went on from it: this run's would be mixed with them (the newest is what a restart "
            f"resumes); resume from {newer[-1]}, or move them out of train.output_dir"
        )
    if meta["method"] != args.method_name:
        raise CheckpointError(
            f"{folder} was written by method {meta['method']!r}, this run is {args.method_name!r}"
        )
    if (
        args.method_name in ("torch-ddp", "diloco", "streaming-diloco")
        and int(meta["world_size"]) != world_size
    ):
        raise CheckpointError(
            f"{folder} was written by {meta['world_size']} workers, this run has {world_size}; "
            f"{args.method_name} resumes only on the world size it was saved with"
        )
    numel = numel(folder) if numel is not None else None
    if numel is not None and numel != int(meta["numel"]):
        raise CheckpointError(
            f"{folder} holds a model of {int(meta['numel']):,} parameters, {model_label} has {numel:,}"
        )
    changed = data_changes(meta.get("train") or {}, vars(args), int(meta["world_size"]) == world_size)
    if changed:
        raise CheckpointError(
            f"{', '.join(changed)}: the run would resume on other samples than those it stopped at; "
            "keep the checkpoint's values (a changed batch_size resumes only on another world size)"
        )
    done = already_completed(folder, meta, args.nb_steps_tot)
    if done:
        raise AlreadyCompleted(done)
    return folder, meta


def save_run(
    engine, position, record, args: dict, rank: int, world_size: int, writer, snapshot_model
) -> None:
    """Checkpoint a run after `record`'s update: every worker's engine state, data position and
    RNG, and (rank 0) the model and meta.json. Refused, on every rank, when any worker's state holds
    NaN or inf: the last good checkpoint stays the newest. The state is copied now and written by
    `writer` (acco/checkpoint_writer.py: in the background, or at once); `snapshot_model(writer)`
    (rank 0) copies the committed model and returns the call that writes it."""
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
        "samples": record.samples,
        "method": args["method_name"],
        "world_size": world_size,
        "numel": state["numel"],
        "wall_time": record.wall_time,
        "train": args,
    }
    write_model = snapshot_model(writer) if rank == 0 else None
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


def resume_run(
    engine, position, folder: Path, meta: dict, rank: int, world_size: int, device, batch_size: int
) -> bool:
    """Load a checkpoint into `engine` and the data `position`: exactly on the same world size
    (True), from this worker's own file; else resharded from the same samples (False), each old
    file memory-mapped so that only the slices this worker needs are read."""
    old_world = int(meta["world_size"])
    if old_world != world_size:
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
