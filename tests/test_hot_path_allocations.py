"""The training step allocates nothing model-sized: once training is steady (from the fourth update),
no method creates a tensor storage larger than the model's largest parameter, on the training
thread or on the comm thread; and no method but torch-ddp reads a device value on the training
thread (`.item()`, `bool()`: on a GPU a wait for every kernel queued). Every method at world size
2 on gloo, in mixed precision with clipping, and acco also with its int8 estimate round, the auto
split and the fp32 accumulator; on the host and under the fake GPU (the engines' device paths).

What a step may still allocate: autograd's gradient of each parameter (a parameter's size, then
added into the flat gradient buffer's view), and torch-ddp's bf16 copy of each bucket, which
torch's own bf16_compress_hook makes too (acco/engine/torch_ddp.py's `bf16_hook` mirrors it).

Every op's new storages are seen through a TorchDispatchMode entered on the training thread and,
around each comm round, on the comm thread (dispatch modes are per thread)."""

from __future__ import annotations

import collections
import threading
import traceback
from dataclasses import replace

import fake_cuda
import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from engine_helpers import config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import acco.engine.background
from acco.engine import build_engine

WIDTH, LAYERS = 64, 8  # 32768 parameters: a shard at W = 2 (16384) is larger than any parameter (4096)
STEADY_FROM = 4  # updates 1-3 allocate the engine's buffers, the collectives' scratch, AdamW's state
MP = dict(use_mixed_precision=True)
CONFIGS = {
    "ddp": config(method="ddp", n_grad_accumulation=2, max_grad_norm=1.0, **MP),
    "torch-ddp": config(method="torch-ddp", n_grad_accumulation=2, max_grad_norm=1.0, **MP),
    "acco": config(method="acco", n_grad_accumulation=1, max_grad_norm=1.0, accumulate_while_waiting=True,
                   **MP),
    "acco-int8-auto": config(method="acco", n_grad_accumulation=2, estimate_comm="int8",
                             estimate_micro_batches="auto", grad_accum_dtype="fp32", **MP),
    "dpu": config(method="dpu", n_grad_accumulation=2, max_grad_norm=1.0, **MP),
    "wp": config(method="wp", n_grad_accumulation=2, **MP),
    "diloco": config(method="diloco", n_grad_accumulation=1, sync_every=2, max_grad_norm=1.0, **MP),
    "streaming-diloco": config(method="streaming-diloco", n_grad_accumulation=1, sync_every=2,
                               num_fragments=2, **MP),
}  # fmt: skip
OVERLAPPED = {"acco", "acco-int8-auto", "dpu", "wp", "diloco", "streaming-diloco"}  # a comm thread


# ops that hand a device value to the host: on a GPU each waits for every kernel queued before it
HOST_READS = ("_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2")


class NewStorages(TorchDispatchMode):
    """Notes each op output whose storage is new (none of the op's inputs holds it) and larger
    than `limit` bytes, with the acco frames that called it, while `record["on"]`."""

    def __init__(self, record: dict, limit: int):
        super().__init__()
        self.record, self.limit = record, limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.record["on"]:
            return out
        thread = threading.current_thread().name.split("_")[0]
        self.record["ops"][thread] += 1
        if func.overloadpacket.__name__ in HOST_READS:
            frames = [f.name for f in traceback.extract_stack() if "/acco/" in f.filename]
            self.record["reads"].append((thread, str(func), frames[-3:]))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() <= self.limit:
                continue
            if t.untyped_storage().data_ptr() not in inputs:
                frames = [f.name for f in traceback.extract_stack() if "/acco/" in f.filename]
                self.record["new"].append((thread, str(func), t.untyped_storage().nbytes(), frames[-3:]))
        return out


def _batches(rank: int):
    gen = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randn(2, WIDTH, generator=gen)
        yield x, x


def _loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def _audit(rank, world, device):
    with fake_cuda.maybe_installed(device):
        return {name: _audit_one(cfg, world) for name, cfg in CONFIGS.items()}


def _audit_one(cfg, world):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    limit = max(p.numel() for p in model.parameters()) * 4  # the largest parameter, in fp32
    record = {"on": False, "ops": collections.Counter(), "new": [], "reads": []}
    submit = acco.engine.background.BackgroundComm.submit

    def audited_submit(self, round_fn):
        def audited_round():
            with NewStorages(record, limit):
                return round_fn()

        return submit(self, audited_round)

    acco.engine.background.BackgroundComm.submit = audited_submit
    try:
        updates = world * 2 * 8 if cfg.method not in ("diloco", "streaming-diloco") else world * 16
        engine = build_engine(model, replace(cfg, nb_steps_tot=updates))
        with NewStorages(record, limit):
            for update, _ in enumerate(engine.run(_batches(torch.distributed.get_rank()), _loss), start=1):
                record["on"] = update + 1 >= STEADY_FROM  # from the next update on
        engine.close()
    finally:
        acco.engine.background.BackgroundComm.submit = submit
    record["on"] = False
    return {"ops": dict(record["ops"]), "new": record["new"], "reads": record["reads"]}


@pytest.mark.parametrize("device", fake_cuda.DEVICES)
def test_no_method_allocates_anything_model_sized_or_reads_the_device_in_a_steady_step(device):
    for rank, results in enumerate(run_distributed(_audit, 2, device)):
        for name, r in results.items():
            assert r["ops"].get("MainThread", 0) > 0, (name, r["ops"])  # the audit saw the step
            if name in OVERLAPPED:
                assert r["ops"].get("acco-comm", 0) > 0, (name, r["ops"])  # and the comm rounds
            new = r["new"]
            if name == "torch-ddp":  # one bf16 copy of its one bucket per update, as torch's own hook
                hook = [n for n in new if n[1] == "aten._to_copy.default" and n[3][-1:] == ["bf16_hook"]]
                assert len(hook) <= 5, hook  # 5 steady updates
                new = [n for n in new if n not in hook]
            assert not new, f"rank {rank}, {name}: {new[:3]}"
            # nor does the training thread wait for the device (torch-ddp reads its record's
            # statistics and clipped norm there, as a plain PyTorch loop does, once per update)
            reads = [read for read in r["reads"] if read[0] == "MainThread"]
            assert name == "torch-ddp" or not reads, f"rank {rank}, {name}: {reads[:3]}"
