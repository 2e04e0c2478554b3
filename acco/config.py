"""The config schema: what `python main.py train=... model=... data=... launch....` may say.

The four groups are dataclasses registered in Hydra's ConfigStore (``acco/conf/config.yaml``
lists the schema first in its defaults), so Hydra and OmegaConf check types, refuse unknown keys
and turn numbers given as strings ("6e-4") into numbers while they compose. Each dataclass then
checks its own values in ``__post_init__``: ``TrainArgs`` the trainer's keys (and, through
``EngineConfig``, the engine's), ``LaunchConfig`` the launcher's. What a schema cannot know (files,
data sizes, the tokenizer against the model, resume compatibility) is ``acco.validate``'s job.

``compose(overrides)`` composes once per command, runs those value checks (``check_values``: merging
runs no ``__post_init__``) and turns Hydra's reports into one ``InputError`` line. Nothing here
imports torch: the launcher composes and checks before its workers have finished importing it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from acco.engine.config import METHODS, ConfigError, ConfigWarning, EngineConfig, EngineSettings, unheard
from acco.messages import did_you_mean, key_hint, one_line_error
from acco.model_config import ARCHS, GPT_NEO_WINDOW, ModelError, check_model_config, gpt_neo_attention_types

__all__ = [
    "ARCHS",
    "DEFAULT_CACHE_DIR",
    "GPT_NEO_WINDOW",
    "AlreadyCompleted",
    "Config",
    "DataConfig",
    "InputError",
    "LaunchConfig",
    "ModelConfig",
    "ModelError",
    "TrainArgs",
    "check_model_config",
    "check_values",
    "compose",
    "gpt_neo_attention_types",
    "one_line_error",
    "register_schema",
    "train_defaults",
]

DEFAULT_CACHE_DIR = "~/.cache/acco"
# train.save_on_signal's choices (SIGKILL and SIGSTOP cannot be caught; SIGINT stays Ctrl-C's stop)
CATCHABLE_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU")
# The exit code of a job that saved a checkpoint on such a signal and stopped (sysexits' EX_TEMPFAIL:
# "try again later"): run the same command with train.resume_from_checkpoint=auto to continue.
EXIT_SAVED_ON_SIGNAL = 75


class InputError(ValueError):
    """A bad input found before training: the message is one line naming the key and the value."""


class AlreadyCompleted(Exception):
    """Not an error: the checkpoint to resume has already consumed train.nb_steps_tot. The message
    is the one line to print; the run then exits 0 without writing anything."""


# Keys of the seed repository's train configs (the paper's Listing 1) that acco does not need,
# with the only value acco honours (None: any). Accepted so those configs run unchanged, with one
# warning; a value that would change the training if it were honoured is refused.
SEED_ONLY_KEYS = {
    "group_by_length": False, "dataloader_num_workers": None, "dataloader_pin_memory": None,
    "dataloader_persistent_workers": None, "label_smoothing_factor": 0, "run_baseline_ddp": None,
    "run_expe_slow": False, "const_len_batch": False, "finetune": None, "gradient_accumulation_steps": 1,
}  # fmt: skip


@dataclass
class _Method:  # a base of its own so that method_name comes first in TrainArgs and `--cfg job`
    method_name: str = "acco"
    """The training method, one of acco.engine.METHODS (the engine's ``method``)."""


@dataclass
class TrainArgs(EngineSettings, _Method):
    """The ``train`` group: the seed's train keys (same names), plus output_dir, seed and run settings.

    The engine's settings and their meaning are inherited from ``EngineSettings``
    (acco/engine/config.py), the trainer's are declared below: one declaration and one default
    each. ``acco/conf/train/*.yaml`` set only the values of the paper's configurations that differ.
    Units (docs/training.md, "Glossary"): nb_steps_tot and warmup count micro-batches over all workers;
    n_warmup_steps, eval_step, save_step and log_step count optimizer updates.
    """

    batch_size: int = 8  # sequences per micro-batch
    max_length: int = 1024  # tokens per sequence
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, 1/3 more compute
    eval: bool = True  # evaluate every eval_step updates and at the end
    eval_step: int = 50  # optimizer updates between evaluations
    eval_batch_size: int | None = None  # sequences per eval micro-batch (None: batch_size)
    eval_fraction: float = 0.05  # carved out of the training data when no eval set is given
    max_eval_batches: int | None = None  # per worker, None: the whole eval set
    # With a data collator: give it only the fields the model's forward takes (transformers.Trainer's
    # default); false when the collator needs others (a text field it tokenizes itself)
    remove_unused_columns: bool = True
    stop_at_eval_loss: float | None = None  # stop after the first evaluation at or below it (acco-bench race)
    save: bool = True  # the final model (save_pretrained) and a final checkpoint
    save_step: int = 0  # also checkpoint every that many updates (0: only at the end)
    save_total_limit: int | None = None  # keep only the newest checkpoints
    async_save: bool = True  # write checkpoints in the background: training pauses for a host copy only
    # a checkpoint folder; "latest" (true): the newest complete one in output_dir; "auto": that one if
    # any, else a fresh start (one command for a first start, a requeue and a torchrun restart)
    resume_from_checkpoint: Any = None
    # On any of these signals (a cluster's preemption notice) every worker finishes its update, a
    # checkpoint is written and the job exits with EXIT_SAVED_ON_SIGNAL; [] leaves them to kill
    save_on_signal: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    overwrite_output_dir: bool = False  # a finished run in output_dir is never overwritten without it
    output_dir: str = "outputs/run"
    seed: int = 0
    log_step: int = 10  # optimizer updates between log lines
    slowdown: float = 1.0  # benchmarks, CPU only: this worker sleeps (slowdown - 1) x its compute (CPU) time
    cache_dir: str | None = DEFAULT_CACHE_DIR  # tokenized corpora and trained tokenizers (acco-prepare)
    timeout_s: float = 30.0  # collectives give up after this long: a dead or stalled worker
    # The seed's keys that have no effect here (SEED_ONLY_KEYS); null when not given.
    group_by_length: Any = None
    dataloader_num_workers: Any = None
    dataloader_pin_memory: Any = None
    dataloader_persistent_workers: Any = None
    label_smoothing_factor: Any = None
    run_baseline_ddp: Any = None
    run_expe_slow: Any = None
    const_len_batch: Any = None
    finetune: Any = None
    gradient_accumulation_steps: Any = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_length", "eval_step", "log_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"train.{name} must be a positive integer, got {value!r}")
        if self.save_step < 0:
            raise ConfigError(f"train.save_step must be >= 0, got {self.save_step!r}")
        limit = self.save_total_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(
                f"train.save_total_limit must be null (keep all) or a positive integer, got {limit!r}"
            )
        if self.resume_from_checkpoint is True:  # transformers' convention: the newest checkpoint
            self.resume_from_checkpoint = "latest"
        elif self.resume_from_checkpoint is False or self.resume_from_checkpoint == "":
            self.resume_from_checkpoint = None
        self.save_on_signal = list(self.save_on_signal or [])
        for name in self.save_on_signal:
            if name not in CATCHABLE_SIGNALS:
                raise ConfigError(
                    f"train.save_on_signal: {name!r} is not a signal acco can catch "
                    f"(one of {', '.join(sorted(CATCHABLE_SIGNALS))})"
                )
        for name in ("eval_batch_size", "max_eval_batches"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"train.{name} must be null or a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"train.seed must be a non-negative integer, got {self.seed!r}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"train.eval_fraction must be in [0, 1), got {self.eval_fraction!r}")
        if self.stop_at_eval_loss is not None and not 0 <= self.stop_at_eval_loss < math.inf:
            raise ConfigError(  # a cross-entropy: a negative target would never stop the run
                f"train.stop_at_eval_loss must be null or a finite loss >= 0, got {self.stop_at_eval_loss!r}"
            )
        if not 1 <= self.slowdown < math.inf:
            raise ConfigError(f"train.slowdown must be >= 1, got {self.slowdown!r}")
        if not 0 < self.timeout_s < math.inf:
            raise ConfigError(f"train.timeout_s must be a positive finite number, got {self.timeout_s!r}")
        self._check_seed_only_keys()
        self.engine_config()  # the engine's own keys: method, budget, optimizer, schedule, clipping

    def _check_seed_only_keys(self) -> None:
        seen = [k for k in SEED_ONLY_KEYS if getattr(self, k) is not None]
        for key in seen:
            value, neutral = getattr(self, key), SEED_ONLY_KEYS[key]
            if neutral is not None and value != neutral:
                instead = (": set train.n_grad_accumulation, micro-batches per worker per update (acco: per "
                           "round, two rounds per update)") if key == "gradient_accumulation_steps" else ""
                raise ConfigError(
                    f"train.{key}={value!r} is not supported by acco (only {neutral!r}){instead}"
                )
            if key == "run_baseline_ddp" and value and self.method_name != "ddp":
                raise ConfigError(
                    f"train.run_baseline_ddp=true conflicts with method_name={self.method_name!r}: "
                    "set method_name=ddp instead"
                )
        if seen:
            warnings.warn(
                f"ignoring the seed's train key(s) {', '.join(seen)}: they have no effect in acco",
                ConfigWarning, stacklevel=4,
            )

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_mapping(dataclasses.asdict(self), key_prefix="train.")

    @classmethod
    def from_any(cls, args: Any) -> TrainArgs:
        """From a TrainArgs (taken as it is), or a dict, an OmegaConf config, any dataclass or object
        holding train keys: those keys over the command line's for their method (``train_defaults``),
        so that a script and ``python main.py train=METHOD`` train alike. ``method``, the engine's
        name, is the same key as the seed's ``method_name``. OmegaConf checks the types (and reads
        "6e-4" as a number); an unknown key is refused with the closest ones."""
        if isinstance(args, cls):
            return args
        values = _train_values(args)
        method = values.get("method_name", "acco")
        defaults = train_defaults(method if method in METHODS else "acco")  # an unknown one is refused below
        return as_object({**defaults, **values}, cls, "train")


def _train_values(args: Any) -> dict:
    """The train keys given to ``TrainArgs.from_any``, as a plain dict, ``method`` as method_name."""
    if args is None:
        return {}
    if dataclasses.is_dataclass(args):
        args = dataclasses.asdict(args)
    elif isinstance(args, DictConfig):  # resolved where it stands: ${launch.timeout_s} needs its root
        args = OmegaConf.to_container(args, resolve=True)
    elif not isinstance(args, Mapping):
        if not hasattr(args, "__dict__"):
            raise ConfigError(
                f"args must be a dict, an OmegaConf config or a dataclass of train keys, got {args!r}"
            )
        args = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    values = dict(args)
    if "method" in values:
        method = values.pop("method")
        if values.setdefault("method_name", method) != method:
            raise ConfigError(
                f"method={method!r} and method_name={values['method_name']!r}: the same key (method_name "
                "is the seed's name for it), give one"
            )
    return values


def train_defaults(method: str = "acco") -> dict:
    """The train keys of ``python main.py train=METHOD``, resolved: acco/conf/train/METHOD.yaml over
    base.yaml over TrainArgs' declarations (the paper's settings), the single source of the command
    line's defaults and the Python API's. The tiny model's recipe (acco/conf/recipe/tiny.yaml) is
    left out: it is model=tiny's, not the method's."""
    return copy.deepcopy(_composed_train(method))


@functools.cache
def _composed_train(method: str) -> dict:
    cfg = compose([f"train={method}", "~recipe", "~data_recipe"])
    return OmegaConf.to_container(cfg.train, resolve=True)


def as_object(values: Any, schema: type, group: str):
    """`values` (a mapping or a DictConfig) checked against the dataclass `schema`, as an instance;
    a wrong type or an unknown key is a ConfigError naming ``group.key``."""
    try:
        if isinstance(values, DictConfig):  # resolved where it stands: ${launch.timeout_s} needs its root
            values = OmegaConf.to_container(values, resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(schema), values)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as e:
        from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

        if isinstance(e, ConfigKeyError | ConfigAttributeError):
            known = [f.name for f in dataclasses.fields(schema) if f.name not in SEED_ONLY_KEYS]
            key = str(getattr(e, "key", "?"))
            raise ConfigError(f"unknown {group} key {key!r}{key_hint(key, known, f'of {group}')}") from None
        if isinstance(e, OmegaConfBaseException):
            raise ConfigError(schema_message(e, prefix=f"{group}.")) from None
        raise


_KINDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def schema_message(e: BaseException, prefix: str = "") -> str:
    """One line for OmegaConf's type and missing-value errors: ``train.batch_size must be an
    integer, got 'x'``."""
    from omegaconf.errors import MissingMandatoryValue, ValidationError

    key = f"{prefix}{getattr(e, 'full_key', '') or ''}"
    if isinstance(e, MissingMandatoryValue):
        return f"missing value for {key}: set {key}=..."
    if isinstance(e, ValidationError) and " could not be converted to " in str(e):
        target = one_line_error(e).rsplit(" could not be converted to ", 1)[1]
        kind = _KINDS.get(target, f"a {target}")
        return f"{key} must be {kind}, got {getattr(e, 'value', None)!r}"
    return f"{key}: {one_line_error(e)}" if key else one_line_error(e)


@dataclass
class LaunchConfig:
    """The ``launch`` group: how a plain ``python main.py`` starts its workers."""

    nproc: Any = "auto"  # local workers: a positive integer, or "auto" (one per GPU, else 2)
    # The local workers grouped into emulated nodes of this many (train.rounds=nodes runs its
    # two-level rounds on them); null: one node. torchrun and srun say their own layout.
    workers_per_node: int | None = None
    timeout_s: float = TrainArgs.timeout_s  # a collective that waits longer fails the run (train.timeout_s)
    debug: bool = False  # full tracebacks instead of one-line errors

    def __post_init__(self) -> None:
        nproc = self.nproc
        if nproc not in (None, "auto") and (
            isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1
        ):
            raise ConfigError(f"launch.nproc must be a positive integer or 'auto', got {nproc!r}")
        per_node = self.workers_per_node
        if per_node is not None and (isinstance(per_node, bool) or not isinstance(per_node, int)
                                     or per_node < 1):
            raise ConfigError(f"launch.workers_per_node must be null or a positive integer, got {per_node!r}")
        if not 0 < self.timeout_s < math.inf:
            raise ConfigError(f"launch.timeout_s must be a positive finite number, got {self.timeout_s!r}")


@dataclass
class ModelConfig:
    """The ``model`` group (acco/models.py reads it; keys an architecture does not use stay null)."""

    name: str = "?"
    arch: str = MISSING  # gpt_neo or llama
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None  # llama
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    window_size: int | None = None  # gpt_neo
    rope_theta: float | None = None  # llama
    rope_scaling: Any = None  # llama
    rms_norm_eps: float | None = None  # llama
    attention_types: Any = None  # gpt_neo, EleutherAI's form
    tie_word_embeddings: bool | None = None
    attn_implementation: str | None = None
    pretrained: str | None = None  # a folder or a hub name: fine-tune those weights
    tokenizer: str | None = None  # a folder, a hub name, or bpe
    vocab_size: int | None = None


@dataclass
class DataConfig:
    """The ``data`` group."""

    name: str = "?"
    format: str = "pretrain"  # pretrain (documents) or instruct (Alpaca records)
    path: str | None = None  # a file, a folder of them, or a hub name
    text_column: str = "text"
    n_docs: int | None = None  # synthetic

    def __post_init__(self) -> None:
        if self.format not in ("pretrain", "instruct"):
            raise ConfigError(f"data.format must be 'pretrain' or 'instruct', got {self.format!r}")
        if self.name == "synthetic" and (self.n_docs is None or self.n_docs < 1):
            raise ConfigError(f"data.n_docs must be a positive integer, got {self.n_docs!r}")
        if self.name == "synthetic" and self.path is not None:  # else training on it would ignore the file
            raise ConfigError(
                f"data.path={self.path!r} with data=synthetic, which generates its corpus and reads no "
                "file: add data=text for a local file (or data=tinystories, openwebtext, alpaca)"
            )


@dataclass
class Config:
    train: TrainArgs = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def register_schema() -> None:
    """Register the schema as ``acco_schema`` (acco/conf/config.yaml's first default)."""
    from hydra.core.config_store import ConfigStore

    schema = OmegaConf.structured(Config)
    # Keys a group file must set (train.method_name, which each train/<method>.yaml sets; data/text.yaml's
    # `path: ???`): MISSING here, since merging ??? onto a default would keep the default.
    schema.train = OmegaConf.structured(TrainArgs)
    schema.train.method_name = MISSING
    schema.data = OmegaConf.structured(DataConfig)
    schema.data.path = MISSING
    ConfigStore.instance().store(name="acco_schema", node=schema)


def compose(
    overrides: list[str], config_module: str = "acco.conf", config_name: str = "config"
) -> DictConfig:
    """The config for these command-line overrides, composed once; one ``InputError`` line for an
    unknown group, option or key, a value of the wrong type or that its group refuses, or an override
    that does not parse."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    # Hydra holds one app at a time: a script under its own @hydra.main (the seed's) gets it back
    app = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=config_module, version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except Exception as e:
        raise InputError(hydra_message(e, overrides)) from e
    finally:
        if app is not None:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(app)
    check_values(cfg, overrides)
    return cfg


_SCHEMAS = {"train": TrainArgs, "model": ModelConfig, "data": DataConfig, "launch": LaunchConfig}


def check_values(cfg: DictConfig, overrides: list[str] = ()) -> None:
    """Each group's ``__post_init__`` checks (merging runs none; ``OmegaConf.to_object`` does) as one
    ``InputError`` line; a group with a ``???`` or a broken interpolation is left to acco.validate.
    Also a key the schema does not have, which Hydra lets a ``+key=value`` override add (it would
    be ignored), and train.eval with no eval set to carve (the command line's data has none other)."""
    from omegaconf.errors import OmegaConfBaseException

    for group, schema in [(None, Config), *_SCHEMAS.items()]:
        node = cfg if group is None else cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        known = {f.name for f in dataclasses.fields(schema)} | ({"hydra"} if group is None else set())
        for key in node.keys():
            if key not in known:
                name = f"{group}.{key}" if group else str(key)
                override = next((a for a in overrides if a.split("=", 1)[0].lstrip("+~") == name), None)
                names = sorted(k for k in known - {"hydra"} if k not in SEED_ONLY_KEYS)
                place, prefix = (f"of {group}", f"{group}.") if group else ("at the top level", "")
                raise InputError(unknown_key_line(name, override, key_hint(str(key), names, place, prefix)))
    train = cfg.get("train")
    if isinstance(train, DictConfig) and train.get("eval") is True and train.get("eval_fraction") == 0:
        raise InputError(
            "train.eval_fraction=0 leaves no eval set to carve out of the training data: raise it "
            "or set train.eval=false"
        )

    for group in ("launch", "train", "data"):  # launch first: train.timeout_s is ${launch.timeout_s}
        node = cfg.get(group)
        try:
            if not isinstance(node, DictConfig) or OmegaConf.missing_keys(node):
                continue
            with unheard():  # the warnings: once, where the values are used
                OmegaConf.to_object(node)
        except ConfigError as e:
            raise InputError(one_line_error(e)) from e
        except OmegaConfBaseException:
            continue


def unknown_key_line(key: str, override: str | None, hint: str) -> str:
    """``unknown config key 'train.x' in 'train.x=1'`` and `hint` (``acco.messages.key_hint``), in
    at most LINE_CHARS characters where the key allows: the override is left out if it would not fit."""
    line = f"unknown config key {key!r}{f' in {override!r}' if override else ''}{hint}"
    return line if len(line) <= LINE_CHARS else f"unknown config key {key!r}{hint}"


LINE_CHARS = 200


def hydra_message(e: Exception, argv: list[str]) -> str:
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause = e.__cause__
    key = getattr(cause, "full_key", None)
    if key and isinstance(cause, ConfigKeyError | ConfigAttributeError):
        parent = getattr(cause, "parent_node", None)
        known = ""
        if isinstance(parent, DictConfig):
            names = [str(k) for k in parent.keys() if k != "hydra" and k not in SEED_ONLY_KEYS]
            where, leaf = key.rpartition(".")[::2]
            place = f"of {where}" if where else "at the top level"
            known = key_hint(leaf, names, place, f"{where}." if where else "")
            if not where and not did_you_mean(leaf, names):  # a group's key given at the top level (nproc=4)
                groups = [(g, parent.get(g)) for g in names]
                meant = next((hit for g, node in groups if isinstance(node, DictConfig)
                              and (hit := did_you_mean(key, list(map(str, node.keys())), f"{g}."))), "")
                known = meant + known
        named = [a.split("=", 1)[0].lstrip("+~") for a in argv]  # a key, or a group under it ("lanch.nproc")
        override = next((a for a, k in zip(argv, named) if k == key or k.startswith(key + ".")), key)
        return unknown_key_line(key, override, known)
    if isinstance(cause, OmegaConfBaseException) and key:
        return schema_message(cause)
    if isinstance(e, MissingConfigException) and getattr(e, "missing_cfg_file", None):
        group, _, option = e.missing_cfg_file.rpartition("/")
        options = getattr(e, "options", None)
        listed = f" (available: {', '.join(options)})" if options else ""
        close = did_you_mean(option, options or [])
        return f"unknown {group} {option!r}{close}: no config {group}/{option}.yaml{listed}"
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    keep = []
    for ln in lines:
        if ln.startswith(("Config search path", "See https://hydra.cc", "Set the environment variable")):
            break
        keep.append(ln)
    text = "; ".join(keep) or type(e).__name__
    if isinstance(e, OverrideParseException) and "Error parsing override" not in text:
        text = f"cannot parse override: {text}"
    return text
