"""Whether and from where a run resumes: decided by `decide_resume`, which the job's validation
pass (acco/validate.py's check_resume) and DecoupledTrainer.train both call, and no one else.

    train.resume_from_checkpoint=auto    the newest checkpoint that verifies; a fresh start where
                                         train.output_dir holds no checkpoint at all
    latest (or True)                     the same, but no checkpoint is an error
    PATH                                 that checkpoint: it must verify

A checkpoint verifies when its meta.json parses, every file it lists has the size it was written
with, and every worker's file passes the CRC-32 checks that torch.save records for its entries.
A host that lost power can leave a renamed checkpoint with files its page cache never wrote (acco
fsyncs them before the rename; a disk or file system that drops writes still can): `auto` and
`latest` skip it, say so in one line, and take the one before. A checkpoint that verifies but is
not this run's (another method, model or data settings) is an error, not skipped: the older
checkpoints beside it are of the same run.

The CRC check reads every worker's file: it runs once per job, before any worker trains, in the
validation pass (the local launcher, or rank 0), or on rank 0 in DecoupledTrainer.train when no
pass ran; every worker then takes its answer, a `ResumePoint`. The launcher also asks without the
CRC (`crc=False`: meta.json and sizes) before it starts its workers, so that `latest` with
nothing to resume is said at once; rotation (acco/checkpoint.py) checks sizes only, too.

Reads files and imports no torch.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from acco.engine import CheckpointError
from acco.run_folder import checkpoint_folders, step_of

META_KEYS = ("step", "samples", "method", "world_size", "numel")
# Train settings a resume may change, but rarely should: each difference gets a warning.
RESUME_KEYS = ("n_grad_accumulation", "estimate_micro_batches", "learning_rate", "nb_steps_tot",
               "weight_decay", "scheduler_name", "warmup", "accumulate_while_waiting", "max_grad_norm")
# Settings that decide which samples the data position points at: a resume must keep them
# (batch_size may change only with the world size, where the position is converted by samples).
DATA_KEYS = ("seed", "max_length", "batch_size")
# Methods whose checkpoint holds per-worker state that is not resharded.
SAME_WORLD_ONLY = ("torch-ddp", "torch-hsdp", "diloco", "streaming-diloco")


def rank_file(folder: Path, rank: int, world_size: int) -> Path:
    return folder / f"rank{rank}-of-{world_size}.pt"


def load_meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: unreadable meta.json ({e})") from e
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise CheckpointError(f"{folder}: meta.json lacks {', '.join(missing)}")
    counts = [meta[k] for k in META_KEYS if k != "method"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in counts):
        raise CheckpointError(f"{folder}: meta.json's {', '.join(k for k in META_KEYS if k != 'method')} "
                              "are not all integers")
    return meta


def _check_crc(folder: Path, name: str) -> None:
    """A truncated zip file has no directory (it sits at the end); a damaged one fails the CRC-32
    of an entry (damaged but finite values would otherwise resume silently)."""
    try:
        with zipfile.ZipFile(folder / name) as archive:
            damaged = archive.testzip()
    except (OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{folder}: {name}: corrupted checkpoint file ({type(e).__name__}: {e})") from e
    if damaged is not None:
        raise CheckpointError(
            f"{folder}: {name}: corrupted checkpoint file (entry {damaged} fails its CRC check)"
        )


def verify(folder: Path, crc: bool = True) -> dict:
    """`folder`'s meta.json, once the checkpoint verifies: meta.json parses, every worker's file and
    every file meta.json lists is there with the size it was written with (checkpoints of acco
    before it listed them: presence only), and with `crc` every worker's file passes its CRC
    checks. Else a CheckpointError `"{folder}: why"`."""
    if not (folder / "meta.json").is_file():
        raise CheckpointError(f"{folder}: no meta.json (not a complete checkpoint)")
    meta = load_meta(folder)
    world_size = meta["world_size"]
    sizes = meta.get("files") if isinstance(meta.get("files"), dict) else {}
    ranks = [rank_file(folder, r, world_size).name for r in range(world_size)]
    for name in [*ranks, *(n for n in sizes if n not in ranks)]:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: missing {name} (written by {world_size} workers)")
        if name in sizes and path.stat().st_size != sizes[name]:
            raise CheckpointError(f"{folder}: {name} holds {path.stat().st_size:,} bytes, "
                                  f"{sizes[name]:,} were written (cut short, or changed since)")  # fmt: skip
    if crc:
        for name in ranks:
            _check_crc(folder, name)
    return meta


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


# --------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class ResumePoint:
    """What `decide_resume` decided: the checkpoint to resume (folder None: a fresh start), its
    meta.json, a line for each newer checkpoint passed over, and the line to say instead of
    training when the checkpoint has completed the budget. Pickled or sent as JSON to the workers."""

    folder: Path | None = None
    meta: dict | None = None
    skipped: tuple[str, ...] = ()
    completed: str | None = None

    def to_json(self) -> str:
        return json.dumps({"folder": str(self.folder) if self.folder else None, "meta": self.meta,
                           "skipped": list(self.skipped), "completed": self.completed})  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> ResumePoint:
        d = json.loads(text)
        return cls(Path(d["folder"]) if d["folder"] else None, d["meta"], tuple(d["skipped"]), d["completed"])


def _newest_that_verifies(out: Path, spec: str, crc: bool) -> tuple[Path | None, dict | None, tuple]:
    """`auto` / `latest`: the newest checkpoint in `out` that verifies, and a line per newer one
    skipped; (None, None, ()) for `auto` where there is no checkpoint at all."""
    found = checkpoint_folders(out)
    if not found:
        if spec == "auto":
            return None, None, ()
        raise CheckpointError(f"no complete checkpoint in {out}")
    why = []
    for folder in found:
        try:
            meta = verify(folder, crc)
        except CheckpointError as e:
            why.append((folder.name, str(e).removeprefix(f"{folder}: ")))
            continue
        skipped = tuple(f"{name} does not verify ({reason}): resuming from {folder.name}, the newest "
                        "checkpoint before it that does" for name, reason in why)  # fmt: skip
        return folder, meta, skipped
    raise CheckpointError(
        f"none of the {len(found)} checkpoint(s) in {out} verifies (the newest, {why[0][0]}: {why[0][1]}); "
        "move them out of train.output_dir to start afresh"
    )


def _refuse_newer(folder: Path, meta: dict, out: Path) -> None:
    """An explicit checkpoint with newer ones beside it: this run's checkpoints would mix with the
    run that went on from it, and a restart with `auto` would resume that run's newest."""
    newer = [p.name for p in reversed(checkpoint_folders(out)) if step_of(p) > meta["step"]]
    if newer:
        raise CheckpointError(
            f"train.output_dir holds checkpoints newer than {folder.name} ({', '.join(newer)}), of the run "
            "that went on from it: this run's would be mixed with them (the newest is what a restart "
            "resumes); resume with train.resume_from_checkpoint=latest (the newest that verifies), or "
            "move them out of train.output_dir"
        )


def _check_fits(folder: Path, meta: dict, args: Any, world_size: int, numel, model_label: str) -> None:
    """The checkpoint is one this run can continue: its method, world size, model size and data."""
    if meta["method"] != args.method_name:
        raise CheckpointError(
            f"{folder} was written by method {meta['method']!r}, this run is {args.method_name!r}"
        )
    if args.method_name in SAME_WORLD_ONLY and meta["world_size"] != world_size:
        raise CheckpointError(
            f"{folder} was written by {meta['world_size']} workers, this run has {world_size}; "
            f"{args.method_name} resumes only on the world size it was saved with"
        )
    _check_sharding(folder, meta, args, world_size)
    mine = numel(folder) if numel is not None else None
    if mine is not None and mine != meta["numel"]:
        raise CheckpointError(
            f"{folder} holds a model of {meta['numel']:,} parameters, {model_label} has {mine:,}"
        )
    changed = data_changes(meta.get("train") or {}, vars(args), meta["world_size"] == world_size)
    if changed:
        raise CheckpointError(
            f"{', '.join(changed)}: the run would resume on other samples than those it stopped at; "
            "keep the checkpoint's values (a changed batch_size resumes only on another world size)"
        )


def _check_sharding(folder: Path, meta: dict, args: Any, world_size: int) -> None:
    """diloco's and streaming-diloco's checkpoints sharded inside the node (train.shard_inside_node)
    hold each node's local vector: they resume sharded on their own world size only, and an unsharded
    one does not resume sharded (the engine refuses another layout of the same world size, which
    meta.json's workers_per_node records). ddp, dpu, wp and acco reshard between any layouts
    (acco/engine/shard_map.py)."""
    if args.method_name not in ("diloco", "streaming-diloco"):
        return
    saved = bool((meta.get("train") or {}).get("shard_inside_node", False))
    mine = bool(getattr(args, "shard_inside_node", False))
    if saved == mine and (not saved or meta["world_size"] == world_size):
        return
    sharded = ", sharded inside the node" if saved else ""
    here = ", sharded inside the node" if mine else ""
    raise CheckpointError(
        f"{folder} was written by {meta['world_size']} workers{sharded}, this run has {world_size}{here}: "
        f"a checkpoint {'sharded inside the node' if saved else 'of unsharded rounds'} resumes with "
        f"train.shard_inside_node={str(saved).lower()}{' on its own layout' if saved else ''} only"
    )


def decide_resume(args: Any, world_size: int, numel=None, model_label: str = "this run's model",
                  crc: bool = True) -> ResumePoint:  # fmt: skip
    """Whether and from where a run of `args` (train.resume_from_checkpoint, output_dir, method_name,
    nb_steps_tot and the data keys) on `world_size` workers resumes; `numel(folder)`: the number of
    parameters this run's model has (None: not checked). With `crc`, every worker's file is read for
    its CRC: once per job. Raises CheckpointError with one line where it cannot resume."""
    spec = args.resume_from_checkpoint
    if not spec:
        return ResumePoint()
    out = Path(os.path.expanduser(str(args.output_dir)))
    if spec in ("auto", "latest") or spec is True:
        folder, meta, skipped = _newest_that_verifies(out, "auto" if spec == "auto" else "latest", crc)
        if folder is None:
            return ResumePoint()
    else:
        folder, skipped = Path(os.path.expanduser(str(spec))), ()
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: no such checkpoint folder")
        meta = verify(folder, crc)
        _refuse_newer(folder, meta, out)
    _check_fits(folder, meta, args, world_size, numel, model_label)
    return ResumePoint(folder, meta, skipped, already_completed(folder, meta, args.nb_steps_tot))


def say_skipped(point: ResumePoint) -> None:
    """The decision's lines about the checkpoints passed over, said by whoever decided."""
    for line in point.skipped:
        sys.stderr.write(f"acco: warning: {line}\n")
    sys.stderr.flush()
