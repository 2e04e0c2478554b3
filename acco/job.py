"""One training job, typed: what every process of a job acts on once its config is composed.

``job_of(cfg, world_size)`` turns a composed config into a ``Job``: the train, launch and data
groups as their dataclasses (their value checks run), the model group as a plain dict, the number
of workers, and the whole config resolved (what ``output_dir/config.yaml`` records, and what the
functions that take a config read). It reads no file: the job's one validation pass
(``acco.validate.check_job``) does that, and may leave what it loaded in ``Job.loaded`` for the
worker of its own process, whose data preparation (``acco.data.prepare.prepare_data``) takes it.

Imports neither torch nor transformers: the local launcher builds its job while its workers
import them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from acco.config import DataConfig, InputError, LaunchConfig, TrainArgs, one_line_error
from acco.engine.config import ConfigError

__all__ = ["Job", "Loaded", "check_config_values", "job_of", "typed_config"]


@dataclass
class Loaded:
    """What a validation pass loaded, for the worker of its own process (launch.nproc=1, rank 0
    under torchrun) to start from instead of loading it again. Taken once (``Job.take_loaded``):
    nothing of it outlives that worker's data preparation."""

    corpus: Any = None  # documents or instruction records
    splits: tuple | None = None  # (train, eval) documents, where the pass had to split them
    tokenizer: Any = None  # model.tokenizer as loaded, or the BPE trained by the pass (None: not yet)


@dataclass
class Job:
    """A job's config, typed and resolved, for `world_size` workers."""

    args: TrainArgs
    launch: LaunchConfig
    data: DataConfig
    model: dict  # the model group, resolved (acco.models reads it)
    world_size: int
    config: DictConfig  # the whole config, resolved: output_dir/config.yaml, and what reads a config
    loaded: Loaded | None = None
    # whether and from where the job resumes (an acco.resume.ResumePoint), decided by the validation
    # pass: the workers take it as it is (None: no pass has run in this process)
    resume: Any = None
    # the configuration warnings said by the process that validated the job (the local launcher):
    # its workers do not say them again
    advised: frozenset = frozenset()

    def take_loaded(self) -> Loaded:
        """What the validation pass of this process loaded (empty if none), handed over once."""
        loaded, self.loaded = self.loaded or Loaded(), None
        return loaded


def _missing_values(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose value is the mandatory marker ``???`` (without resolving anything)."""
    out = []
    if isinstance(node, Mapping):
        for k, v in node.items():
            out += _missing_values(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _missing_values(v, f"{prefix}{i}.")
    elif node == "???":
        out.append(prefix[:-1])
    return out


def check_config_values(cfg: DictConfig) -> dict:
    """Mandatory values set, interpolations resolvable; returns the resolved config as a dict."""
    missing = _missing_values(OmegaConf.to_container(cfg, resolve=False))
    if missing:
        hints = {"data.path": " (a .txt, .jsonl, .json or .parquet file, a folder of them, or a Hub name)"}
        raise InputError(
            f"missing value for {', '.join(missing)}: set {missing[0]}=...{hints.get(missing[0], '')}"
        )
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:
        raise InputError(f"bad config value: {one_line_error(e)}") from e
    for group in ("train", "model", "data"):
        if not isinstance(resolved.get(group), Mapping):
            raise InputError(f"config group {group!r} is missing (use {group}=NAME)")
    return resolved


def typed_config(cfg: DictConfig) -> tuple[TrainArgs, LaunchConfig, DataConfig]:
    """The train, launch and data groups as their dataclasses: their own value checks run here."""
    try:
        return tuple(OmegaConf.to_object(cfg[group]) for group in ("train", "launch", "data"))
    except ConfigError as e:  # its messages already name the key
        raise InputError(one_line_error(e)) from e


def job_of(cfg: DictConfig, world_size: int | None = None) -> Job:
    """The job of a composed config, for `world_size` workers (default: launch.nproc's); one
    ``InputError`` line for a missing value, a broken interpolation or a value a group refuses."""
    resolved = check_config_values(cfg)
    args, launch, data = typed_config(cfg)
    if world_size is None:
        from acco.launch.local import local_nproc

        world_size = local_nproc(launch.nproc)
    config = OmegaConf.create(resolved)
    return Job(args, launch, data, resolved["model"], world_size, config)
