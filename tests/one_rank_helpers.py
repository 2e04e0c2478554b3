"""One rank in a process group of its own, for the tests that run on one GPU and their CPU variants
(tests/test_cuda_one_gpu.py, tests/test_cuda_graphs.py): the group, what its rounds issue, and the
models, data and single-process references both compare with."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import tempfile
import threading
from datetime import timedelta

import fake_cuda
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_helpers import Reference, config, micro_batch, reference_acco, reference_delayed, reference_diloco
from torch.nn.utils import parameters_to_vector


def _why_no_gpu() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (a CPU-only torch build or no GPU visible)"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    return None


NO_GPU = _why_no_gpu()
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")


def _in_group(device_type: str, fn, args):
    """fn(device, *args) in a one-rank group of this process: NCCL on cuda:0, gloo on the CPU."""
    if device_type == "cuda":
        # Before the group, as acco's init_distributed sets it: the group's own stream high-priority.
        os.environ["TORCH_NCCL_HIGH_PRIORITY"] = "1"
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls, to compare with the CPU references
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=300), device_id=device)  # fmt: skip
    else:
        device = torch.device("cpu")
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60)
        )
    try:
        with fake_cuda.maybe_installed(device_type):
            return fn(device, *args)
    finally:
        gc.collect()  # DDP's reducer holds the group: free it while the group is whole
        dist.destroy_process_group()


def _entry(_: int, device_type: str, fn, args, path: str) -> None:
    torch.save(_in_group(device_type, fn, args), path)


def run_one_rank(device_type: str, fn, *args):
    """fn(device, *args) on one rank: on the GPU in a process of its own (a CUDA or NCCL failure
    cannot take pytest down), on the CPU (or the fake GPU) in this one."""
    if device_type != "cuda":
        return _in_group(device_type, fn, args)
    with tempfile.TemporaryDirectory() as out_dir:
        path = os.path.join(out_dir, "rank0.pt")
        mp.start_processes(_entry, args=("cuda", fn, args, path), nprocs=1, start_method="spawn")
        return torch.load(path, weights_only=False)


# torch.distributed's collectives that acco's rounds call, by the name a test expects (torch 2.13
# renamed *_tensor / *_into_tensor to *_single)
ISSUED = {"reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
          "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
          "all_to_all_single": "all_to_all"}  # fmt: skip


@contextlib.contextmanager
def issued():
    """The set of (thread, collective) that torch.distributed saw issued inside (thread: "main"
    or "comm", the round's background thread)."""
    seen, originals = set(), {name: getattr(dist, name) for name in ISSUED if hasattr(dist, name)}

    def wrap(name, fn):
        def call(*args, **kwargs):
            main = threading.current_thread() is threading.main_thread()
            seen.add(("main" if main else "comm", ISSUED[name]))
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def train_each(device, build, cfgs, batches, loss):
    """Train a fresh model per config; its final parameters (fp32, CPU), its records and the
    collectives it issued."""
    from acco.engine import build_engine

    out = []
    for cfg in cfgs:
        model = build().to(device)
        with issued() as seen:
            engine = build_engine(model, cfg)
            records = list(engine.run(batches(device), loss))
            engine.close()
        theta = parameters_to_vector(model.parameters()).detach().float().cpu()
        kept = [(r.loss, r.micro_batches, r.committed_micro_batches) for r in records]
        out.append((cfg.method, theta, kept, seen))
    return out


N, UPDATES, CLIP = 2, 6, 0.45


def method_configs() -> list:
    budget = N * UPDATES
    common = dict(nb_steps_tot=budget, max_grad_norm=CLIP)
    return [
        config(method="ddp", n_grad_accumulation=N, **common),
        config(method="torch-ddp", n_grad_accumulation=N, **common),
        config(method="torch-hsdp", n_grad_accumulation=N, **common),
        config(method="dpu", n_grad_accumulation=N, **common),
        config(method="wp", n_grad_accumulation=N, **common),
        config(method="acco", n_grad_accumulation=N // 2, acco_estimate="paper", **common),
        config(method="acco", n_grad_accumulation=N // 2, acco_estimate="lean", **common),
        config(method="diloco", n_grad_accumulation=N, nb_steps_tot=N * 10, sync_every=3, max_grad_norm=0.5),
        config(method="streaming-diloco", n_grad_accumulation=N, nb_steps_tot=N * 11, sync_every=4,
               num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5, outer_lr=0.5,
               outer_momentum=0.8),
    ]  # fmt: skip


def mlp_batches(device):
    for j in itertools.count():  # one worker reads every micro-batch: 0, 1, 2, ...
        x, y = micro_batch("mlp", j)
        yield x.to(device), y.to(device)


def expected(cfg) -> tuple[torch.Tensor, list[float]]:
    """The single-process reference's final parameters and losses for `cfg` on one worker."""
    if cfg.method in ("diloco", "streaming-diloco"):
        return reference_diloco("mlp", cfg, 1)
    ref = Reference("mlp", cfg, 1, [cfg.n_grad_accumulation])
    if cfg.method in ("ddp", "torch-ddp", "torch-hsdp"):
        theta = ref.ddp(UPDATES)
    elif cfg.method in ("dpu", "wp"):
        theta = reference_delayed(ref, UPDATES, predict=cfg.method == "wp")
    else:
        theta = reference_acco(ref, UPDATES, lean=cfg.acco_estimate == "lean")
    return theta, ref.losses


GPT_NEO = dict(
    arch="gpt_neo", hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=32, window_size=8
)
VOCAB, SEQ, BATCH, MICRO_BATCHES = 64, 32, 4, 24


def gpt_neo_tokens(device):
    """Two fixed batches of random tokens, again and again: a model that learns them drives the
    loss well below its start (log 64 = 4.16)."""
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device) for _ in range(2)]
    return itertools.cycle([{"input_ids": x, "labels": x} for x in pool])


def tiny_gpt_neo():
    from acco.models import build_model

    torch.manual_seed(0)
    return build_model(GPT_NEO, vocab_size=VOCAB, max_length=SEQ)
