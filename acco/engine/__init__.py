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
from typing import TYPE_CHECKING

from acco.engine.config import LOCAL_SGD_METHODS, METHODS, ConfigError, EngineConfig, UpdateRecord

if TYPE_CHECKING:
    from acco.engine.decoupled import CheckpointError, DecoupledEngine, LossFn

__all__ = [
    "CheckpointError",
    "METHODS",
    "ConfigError",
    "DecoupledEngine",
    "EngineConfig",
    "LossFn",
    "UpdateRecord",
    "build_engine",
]

_LAZY = {"CheckpointError": "acco.engine.decoupled", "DecoupledEngine": "acco.engine.decoupled",
         "LossFn": "acco.engine.decoupled"}  # fmt: skip


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'acco.engine' has no attribute {name!r}")


def build_engine(module, cfg: EngineConfig, group=None):
    """The engine for `cfg.method` (a DecoupledEngine); the module must already be on its device."""
    if cfg.method == "torch-ddp":
        # Imported here: torch.distributed.optim costs seconds of start-up for every other method.
        from acco.engine.torch_ddp import TorchDDPEngine

        return TorchDDPEngine(module, cfg, group)
    if cfg.method in LOCAL_SGD_METHODS:
        from acco.engine.diloco import DiLoCoEngine

        return DiLoCoEngine(module, cfg, group)
    from acco.engine.decoupled import DecoupledEngine

    return DecoupledEngine(module, cfg, group)
