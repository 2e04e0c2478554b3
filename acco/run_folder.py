"""What a run's output folder holds (its complete checkpoints, the files of a run that wrote to
it), read without torch: the local launcher checks the folder before its workers start
(acco/validate.py's check_folders, in check_at_once), so that a run that would overwrite another
is refused at once."""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
# Files that show that a run already wrote to an output_dir (config.yaml and tokenizer/ do not:
# they are written before training starts, so a run that failed early can simply be started again).
RUN_MARKERS = ("summary.json", "metrics.jsonl")


def step_of(folder: Path) -> int:
    return int(CHECKPOINT_NAME.match(folder.name).group(1))


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """Every checkpoint-N folder, whole or not (meta.json lost, files cut short), newest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted((p for p in out.iterdir() if CHECKPOINT_NAME.match(p.name) and p.is_dir()),
                  key=step_of, reverse=True)  # fmt: skip


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (with meta.json), oldest first."""
    return [p for p in reversed(checkpoint_folders(output_dir)) if (p / "meta.json").exists()]
