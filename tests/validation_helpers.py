"""Shared by the validation tests: a composed job config writing under a test's folder, and the one
line that composing and validating it raise."""

from __future__ import annotations

from pathlib import Path

import pytest

from acco.config import InputError, compose
from acco.validate import validate_job


def config(tmp_path: Path, *overrides: str):
    base = [f"train.output_dir={tmp_path / 'out'}", f"train.cache_dir={tmp_path / 'cache'}", "launch.nproc=2"]
    return compose([*base, *overrides])


def validation_error(tmp_path: Path, *overrides: str) -> str:
    """The message that composing and validating raise for these overrides (one line, and nothing
    in output_dir)."""
    with pytest.raises(InputError) as info:
        validate_job(config(tmp_path, *overrides))
    message = str(info.value)
    assert "\n" not in message and message.strip() == message
    assert not (tmp_path / "out" / "workers").exists() and not (tmp_path / "out" / "config.yaml").exists()
    return message


# A plain `python main.py` whose local launcher must refuse the job before it starts any worker:
# starting one fails the run, and it says at exit whether torch was imported (the checks must not).
NO_WORKER_LAUNCHER = """
    import atexit, sys
    import acco.cli

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    acco.cli.launch_local = no_worker
    atexit.register(lambda: print("torch imported:", "torch" in sys.modules, flush=True))
    acco.cli.main()
"""
