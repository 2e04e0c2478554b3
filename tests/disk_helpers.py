"""Folders that cannot take a write, for the tests of bad input at save time: a small tmpfs (a full
disk) and a read-only bind mount (a folder without write permission: root ignores a folder's
mode, not a read-only mount). Both need root's mount rights; each is unmounted after its test."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


def _mount(*args: str) -> bool:
    try:
        return subprocess.run(["mount", *args], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int):
    """`path`, a tmpfs of `size_kib` KiB: yields True; False where no mount can be made here (the
    caller then fakes the full disk at the write call)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)):
        yield False
        return
    try:
        yield True
    finally:
        _umount(path)


@contextlib.contextmanager
def read_only(path: Path):
    """`path` (a folder) read-only while inside: its mode for a user, a read-only bind mount of it
    for root; skips the test where root cannot mount."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    if not _mount("--bind", str(path), str(path)):
        pytest.skip("root without mount rights: no way to make a folder unwritable here")
    try:
        if not _mount("-o", "remount,bind,ro", str(path)):
            pytest.skip("root without mount rights: no way to make a folder unwritable here")
        yield
    finally:
        _umount(path)
