"""The acco engine: flat buffers, sharded AdamW, the comm round, and the schedules of each method.

It imports nothing from transformers or datasets: give it any nn.Module, a function that computes
one micro-batch's loss, and an iterator of micro-batches.

    engine = build_engine(model, EngineConfig(method="acco", n_grad_accumulation=2, nb_steps_tot=800))
    for record in engine.run(batches, lambda model, batch: model(**batch).loss):
        print(record.step, record.loss)
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from acco.engine.config import METHODS, ConfigError, EngineConfig, UpdateRecord
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


def build_engine(
    module: nn.Module, cfg: EngineConfig, group: dist.ProcessGroup | None = None
) -> DecoupledEngine:
    """The engine for `cfg.method`; the module must already be on its device."""
    if cfg.method == "torch-ddp":
        # Imported here: torch.distributed.optim costs seconds of start-up for every other method.
        from acco.engine.torch_ddp import TorchDDPEngine

        return TorchDDPEngine(module, cfg, group)
    return DecoupledEngine(module, cfg, group)
