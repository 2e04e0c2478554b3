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


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (with meta.json), oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in out.iterdir()
        if (m := CHECKPOINT_NAME.match(p.name)) and (p / "meta.json").exists()
    ]
    return [p for _, p in sorted(found)]
