"""NCCL asked for where no GPU is visible: one InputError line before any process group is made
(it was a ZeroDivisionError, `local_rank % 0`, in init_distributed's device choice). Checked on
this CPU-only torch, and with torch faked into a CUDA build that sees no device."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

import acco.launch.process_group as pg
from acco.config import InputError

LAUNCHER = {"rank": 1, "world_size": 2, "local_rank": 1, "master_addr": "127.0.0.1", "master_port": 29999}


@pytest.fixture(params=["cpu-build", "cuda-build-no-device"])
def no_gpu(request, monkeypatch):
    """What torch says on a machine without a GPU; the group calls are recorded, never made."""
    if request.param == "cuda-build-no-device":
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if it said yes
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    else:  # a CPU-only build, whichever build runs the test (a CUDA build without a device too)
        monkeypatch.setattr(torch.version, "cuda", None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for key in ("TORCH_NCCL_HIGH_PRIORITY", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)  # restored (unset) after the test
    made = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: made.append("init_process_group"))
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **kw: made.append("rendezvous"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: made.append("set_device"))
    monkeypatch.setattr(pg, "start_heartbeat", lambda *a: made.append("heartbeat"))
    return request.param, made


def _one_line_no_gpu(e: pytest.ExceptionInfo, kind: str, backend: str = "nccl") -> None:
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"backend {backend} needs a CUDA GPU and none is visible")
    assert ("CPU-only build" in message) == (kind == "cpu-build")
    assert ("built for CUDA 13.0" in message) == (kind == "cuda-build-no-device")


@pytest.mark.parametrize("env", [None, LAUNCHER], ids=["no-launcher", "launcher"])
def test_init_distributed_with_nccl_and_no_gpu_is_one_line_before_any_group(no_gpu, env, monkeypatch):
    kind, made = no_gpu
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pg, "dist_env", lambda: env)
    for backend in ("nccl", "cuda:nccl"):
        with pytest.raises(InputError) as e:
            pg.init_distributed(30, backend=backend)
        _one_line_no_gpu(e, kind, backend)
    assert made == []
    assert "TORCH_NCCL_HIGH_PRIORITY" not in os.environ  # nothing set up for NCCL either
    if kind == "cuda-build-no-device":  # torch said CUDA is there: nccl by default, refused the same way
        with pytest.raises(InputError) as e:
            pg.init_distributed(30)
        _one_line_no_gpu(e, kind)
        assert made == []


def test_an_existing_nccl_group_without_a_gpu_is_one_line(no_gpu, monkeypatch):
    kind, made = no_gpu
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(pg, "dist_env", lambda: None)
    backend = "nccl"
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    with pytest.raises(InputError) as e:
        pg.init_distributed(30)
    _one_line_no_gpu(e, kind)
    assert made == []  # no heartbeat either
    # A group with a CPU backend beside NCCL (or gloo alone) runs on the CPU as before.
    for backend in ("cpu:gloo,cuda:nccl", "gloo"):
        if kind == "cuda-build-no-device" and "nccl" in backend:
            continue  # torch never says "available" with no device; the CPU case is the real one
        made.clear()
        assert pg.init_distributed(30) == (0, 2, 0, torch.device("cpu"))
        assert made == ["heartbeat"]


def test_the_cli_prints_the_one_line_and_exits_non_zero(no_gpu, monkeypatch, capsys):
    import acco.cli

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pg, "dist_env", lambda: None)
    monkeypatch.setattr(sys, "argv", ["acco-train"])
    monkeypatch.delenv("ACCO_DEBUG", raising=False)
    # a worker that joins its group on NCCL, as a library user's script may
    monkeypatch.setattr(acco.cli, "run", lambda cfg: pg.init_distributed(30, backend="nccl"))
    with pytest.raises(SystemExit) as e:
        acco.cli.main()
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "acco: error: backend nccl needs a CUDA GPU and none is visible"
    ), err
