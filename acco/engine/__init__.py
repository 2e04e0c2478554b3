"""The acco engine: flat buffers, sharded AdamW, the comm round, the schedules of each method, and
diloco / streaming-diloco (local steps and outer steps, diloco.py).

It imports nothing from transformers or datasets: give it any nn.Module, a function that computes
one micro-batch's loss, and an iterator of micro-batches.

    engine = build_engine(model, EngineConfig(method="acco", n_grad_accumulation=2, nb_steps_tot=800))
    for record in engine.run(batches, lambda model, batch: model(**batch).loss):
        print(record.step, record.loss)

The engine classes are imported on first use: a launcher that only checks an EngineConfig (the
parent of local workers) then never pays for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from acco.engine.config import (
    LOCAL_SGD_METHODS,
    METHODS,
    CheckpointError,
    ConfigError,
    ConfigWarning,
    EngineConfig,
    UpdateRecord,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from contextlib import AbstractContextManager

    from torch import nn

    from acco.engine.decoupled import DecoupledEngine, LossFn

__all__ = [
    "CheckpointError",
    "METHODS",
    "ConfigError",
    "ConfigWarning",
    "DecoupledEngine",
    "Engine",
    "EngineConfig",
    "LossFn",
    "UpdateRecord",
    "build_engine",
]

_LAZY = {"DecoupledEngine": "acco.engine.decoupled", "LossFn": "acco.engine.decoupled"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'acco.engine' has no attribute {name!r}")


class Engine(Protocol):
    """What every engine offers its caller (DecoupledEngine, TorchDDPEngine, TorchHSDPEngine,
    DiLoCoEngine; the trainer and acco/checkpoint.py use nothing else; tests/test_engine_interface.py
    checks them all).

    Between two records that `run` yields no comm round of the decoupled methods is in flight, but
    diloco's fragment all-reduce may be: call `quiesce()` on every worker before a collective of
    your own (docs/internals.md, "Rules the pieces keep")."""

    @property
    def committed_micro_batches(self) -> int:
        """Micro-batches over all workers in committed updates (diloco: inner steps) so far, the
        budget's unit (checkpoints and metrics call it `samples`)."""

    @property
    def step(self) -> int:
        """Committed updates (diloco: inner steps) so far."""

    def run(self, batches: Iterable, loss_fn: LossFn) -> Iterator[UpdateRecord]:
        """Train until `nb_steps_tot` micro-batches over all workers are in, or data runs out."""

    def quiesce(self) -> None:
        """Land whatever may be in flight, so that the caller may issue collectives."""

    def finish(self) -> None:
        """Every worker, once training ends (also after an early stop): the model then holds the
        committed parameters, so that rank 0 alone may save it. Idempotent."""

    def committed_params(self) -> AbstractContextManager[nn.Module]:
        """The model holds the committed (diloco: global) parameters inside this block; every
        worker enters it together."""

    def compute_context(self) -> AbstractContextManager:
        """The precision context of training's forward passes; evaluation runs under it too."""

    def state_dict(self) -> dict:
        """This worker's training state, to resume from."""

    def load_state_dict(self, state: dict, old_state: Callable[[int], dict] | None = None) -> bool:
        """Restore `state` on every worker together; True when the run continues exactly, False
        when it was resharded from another world size (`old_state(r)`: old worker r's state)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes this worker holds for training, by component."""

    def close(self) -> None:
        """Stop the engine's background thread."""

    def request_stop(self) -> None:
        """Signal-safe: every worker stops after the same coming update (its record says `stop`)."""

    def sync_note(self) -> str | None:
        """For the log lines, where an evaluation does not see the parameters that the training loss
        is taken at: what it sees (diloco: the global parameters as of their last sync) and when they
        next change; None for the methods that evaluate the parameters they train."""


def build_engine(module, cfg: EngineConfig, group=None) -> Engine:
    """The engine for `cfg.method`; the module must already be on its device. With `cfg.compile`
    the module's blocks are compiled in place once the engine holds its parameters (compiling.py)."""
    from acco.engine.compiling import compile_module, compile_options

    _check_process_group(group)
    if cfg.method == "torch-ddp":
        # Imported here: torch.distributed.optim costs seconds of start-up for every other method.
        from acco.engine.torch_ddp import TorchDDPEngine

        engine = TorchDDPEngine(module, cfg, group)
    elif cfg.method == "torch-hsdp":
        from acco.engine.torch_hsdp import TorchHSDPEngine

        engine = TorchHSDPEngine(module, cfg, group)
    elif cfg.method in LOCAL_SGD_METHODS:
        from acco.engine.diloco import DiLoCoEngine

        engine = DiLoCoEngine(module, cfg, group)
    else:
        from acco.engine.decoupled import DecoupledEngine

        engine = DecoupledEngine(module, cfg, group)
    _check_budget(cfg, engine.world_size)
    _check_precision(cfg, engine.device.type)
    options = compile_options(cfg.compile, engine.device.type, cfg.compile_mode)
    compile_module(module, options, cfg.compile_scope)
    if cfg.method == "torch-hsdp":  # it trains a sharded copy; the module is its committed view
        compile_module(engine.sharded, options, cfg.compile_scope)
    return engine


def _check_process_group(group) -> None:
    """A launcher's worker (torchrun, SLURM: WORLD_SIZE above 1) with no process group would train
    alone, a copy of the others that nobody notices: refused."""
    import os

    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE", "")
    grouped = group is not None or (dist.is_available() and dist.is_initialized())
    if world.isdigit() and int(world) > 1 and not grouped:
        raise ConfigError(
            f"WORLD_SIZE={world}: this process is one of {world} workers, but there is no process group, "
            "so it would train alone; call acco.launch.init_distributed() (or "
            "torch.distributed.init_process_group) before build_engine"
        )


def _check_budget(cfg: EngineConfig, world: int) -> None:
    """A budget below one update still trains one whole update (the budget is checked between
    updates): legal, said in one line."""
    from acco.engine.config import advise

    per_update = cfg.n_grad_accumulation * (2 if cfg.method == "acco" else 1) * world
    if cfg.nb_steps_tot < per_update:
        k = getattr(cfg, "key_prefix", "")
        advise(f"{k}nb_steps_tot={cfg.nb_steps_tot} is below one update, {per_update} micro-batches over "
               f"{world} worker(s): training stops after the first update, which takes {per_update}")


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU's bf16 matrix products take oneDNN's kernels (AVX512 or AMX); on others
    (AVX2) torch falls back to a generic loop: 0.2-1.7 GFLOP/s against fp32's 40-103 measured on a
    2-core AVX2 VM at GPT-Neo 125M's shapes. True where torch cannot say."""
    import torch

    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return True if check is None else bool(check())
    except (RuntimeError, AttributeError):
        return True


def _check_precision(cfg: EngineConfig, device_type: str) -> None:
    """bf16 on a CPU without bf16 matrix kernels: legal (the results are right), but it trains tens
    to hundreds of times slower than fp32; said in one line."""
    from acco.engine.config import advise

    if device_type == "cpu" and cfg.use_mixed_precision and not cpu_has_bf16_matmul():
        k = getattr(cfg, "key_prefix", "")
        advise(f"{k}use_mixed_precision=true trains in bf16, which this CPU has no matrix kernels for "
               f"(no AVX512 or AMX): its matrix products run 25-300x slower than fp32; "
               f"{k}use_mixed_precision=false trains in fp32")
