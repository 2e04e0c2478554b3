"""Checks of a run's inputs before any worker starts: one clear line per problem, nothing written.

``acco.cli`` calls two things from here:

- ``check_overrides(argv)`` composes the Hydra config from the command line once, before Hydra
  itself runs, and turns an unknown config group, option or key (which Hydra reports in several
  lines and a hint about HYDRA_FULL_ERROR) into one ``InputError``;
- ``preflight(cfg, world_size)`` runs in the launcher (or, under torchrun / srun, in every
  process) before training: the config's values, ``train.output_dir`` and ``train.cache_dir``,
  the model config or the pretrained model's ``config.json``, the data, the tokenizer, and whether
  the data fills one global batch. Cheap checks come first; data is tokenized only when its size
  alone cannot tell (a small corpus), and packed blocks go to the packing cache, so the workers'
  own call is free.

Every failure is an ``InputError`` (a ValueError) whose message is one line naming the config key
and the file, value or numbers at fault. Nothing here writes to ``train.output_dir``; writability
is probed with a temporary file that is removed at once.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = [
    "AlreadyCompleted",
    "InputError",
    "check_output_dir",
    "check_overrides",
    "check_resume",
    "one_line_error",
    "preflight",
]

# The data is tokenized in preflight only while its size alone cannot tell whether it fills one
# global batch: while an upper bound on its samples is below this many global batches.
EXACT_CHECK_MARGIN = 10
# Files that show that a run already wrote to an output_dir (config.yaml and tokenizer/ do not:
# they are written before training starts, so a run that failed early can simply be started again).
RUN_MARKERS = ("summary.json", "metrics.jsonl")


class InputError(ValueError):
    """A bad input found before training: the message is one line naming the key and the value."""


class AlreadyCompleted(Exception):
    """Not an error: the checkpoint to resume has already consumed train.nb_steps_tot. The message
    is the one line to print; the run then exits 0 without writing anything."""


def one_line_error(e: BaseException, limit: int = 1000) -> str:
    """An exception's message on one line (OmegaConf's trailers "full_key: ..." dropped)."""
    text = str(e)
    try:
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(e, OmegaConfBaseException):
            text = text.strip().splitlines()[0] if text.strip() else ""
    except ImportError:  # pragma: no cover
        pass
    text = " ".join(text.split())
    return text[:limit] + (" ..." if len(text) > limit else "")


# --------------------------------------------------------------------------- Hydra overrides


def check_overrides(argv: list[str], config_module: str = "acco.conf", config_name: str = "config") -> None:
    """Compose the config from command-line overrides as Hydra will, or raise one ``InputError``.

    Command lines with Hydra flags (``--help``, ``-m``, ``--cfg`` ...) are left to Hydra.
    """
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_module

    try:
        with initialize_config_module(config_module=config_module, version_base="1.3"):
            compose(config_name=config_name, overrides=list(argv))
    except Exception as e:
        raise InputError(_hydra_message(e, argv)) from e


def _hydra_message(e: Exception, argv: list[str]) -> str:
    from hydra.errors import MissingConfigException, OverrideParseException

    cause = e.__cause__
    key = getattr(cause, "full_key", None)
    if key and "Could not override" in str(e):
        parent = getattr(cause, "parent_node", None)
        known = ""
        if isinstance(parent, DictConfig):
            names = [k for k in parent.keys() if k != "hydra"]
            where = key.rsplit(".", 1)[0] if "." in key else ""
            known = f"; keys {'of ' + where if where else 'at the top level'}: {', '.join(map(str, names))}"
        override = next((a for a in argv if a.split("=", 1)[0].lstrip("+~") == key), key)
        return f"unknown config key {key!r} in {override!r}{known}"
    if isinstance(e, MissingConfigException) and getattr(e, "missing_cfg_file", None):
        group, _, option = e.missing_cfg_file.rpartition("/")
        options = getattr(e, "options", None)
        listed = f" (available: {', '.join(options)})" if options else ""
        return f"unknown {group} {option!r}: no config {group}/{option}.yaml{listed}"
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


# --------------------------------------------------------------------------- small checks


def _fail(message: str, cause: BaseException | None = None) -> None:
    raise InputError(message) from cause


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(f"{key} must be a positive integer, got {value!r}")
    return value


def _positive_number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        _fail(f"{key} must be a positive finite number, got {value!r}")
    return float(value)


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
        _fail(f"missing value for {', '.join(missing)}: set {missing[0]}=...{hints.get(missing[0], '')}")
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:
        _fail(f"bad config value: {one_line_error(e)}", e)
    for group in ("train", "model", "data"):
        if not isinstance(resolved.get(group), Mapping):
            _fail(f"config group {group!r} is missing (use {group}=NAME)")
    return resolved


def check_launch(launch: Mapping, world_size: int | None) -> int:
    nproc = launch.get("nproc", "auto")
    if nproc not in (None, "auto"):
        _positive_int(nproc, "launch.nproc")
    timeout = launch.get("timeout_s", 300)
    if timeout is not None:
        _positive_number(timeout, "launch.timeout_s")
    if world_size is not None:
        return world_size
    if nproc in (None, "auto"):
        import torch

        return torch.cuda.device_count() or 2
    return nproc


def check_train(train: Mapping):
    """The keys users mistype most, with messages naming them, then everything TrainArgs checks."""
    from acco.engine import ConfigError
    from acco.trainer import TrainArgs

    for key in ("batch_size", "nb_steps_tot", "n_grad_accumulation", "max_length"):
        if key in train:
            _positive_int(train[key], f"train.{key}")
    if "learning_rate" in train:
        _positive_number(train["learning_rate"], "train.learning_rate")
    for key in ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "max_grad_norm", "eval_fraction", "slowdown"):
        value = train.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            _fail(f"train.{key} must be a number, got {value!r}")
    try:
        return TrainArgs.from_any(dict(train))
    except ConfigError as e:  # its messages already name the train.* key
        _fail(one_line_error(e), e)
    except (TypeError, ValueError) as e:
        _fail(f"bad train config: {one_line_error(e)}", e)


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and not p.is_symlink():
        if p.parent == p:
            break
        p = p.parent
    return p


def _check_writable_dir(path: Path, key: str) -> None:
    """``path`` is a folder we can write to, or one we can create; nothing is left behind."""
    existing = _nearest_existing(path)
    if existing != path and not existing.is_dir():
        _fail(f"{key} {str(path)!r} cannot be created: {str(existing)!r} is a file, not a folder")
    if existing == path and not path.is_dir():
        _fail(f"{key} {str(path)!r} is a file, not a folder")
    reason = None
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "permission denied"
    else:
        try:  # os.access says yes to root everywhere, and knows nothing of read-only mounts
            fd, probe = tempfile.mkstemp(dir=existing, prefix=".acco-write-test-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            reason = e.strerror or type(e).__name__
    if reason:
        where = "" if existing == path else f" (in {str(existing)!r})"
        _fail(f"{key} {str(path)!r} is not writable{where}: {reason}")


def check_output_dir(output_dir: str, overwrite: bool = False, resume: Any = None) -> Path:
    """``output_dir`` can be written, and holds no earlier run unless asked to resume or overwrite."""
    if output_dir is None or not str(output_dir).strip():
        _fail("train.output_dir is empty; give the folder the run writes to")
    out = Path(os.path.expanduser(str(output_dir)))
    _check_writable_dir(out, "train.output_dir")
    if out.is_dir() and not resume and not overwrite:
        found = [name for name in RUN_MARKERS if (out / name).exists()]
        found += sorted(p.name for p in out.glob("checkpoint-*"))[:1]
        if found:
            _fail(
                f"train.output_dir {str(out)!r} already holds a run ({', '.join(found)}); choose another "
                "train.output_dir, set train.overwrite_output_dir=true to replace it, or "
                "train.resume_from_checkpoint=latest to continue it"
            )
    return out


# --------------------------------------------------------------------------- model and tokenizer


def _pretrained_config(name: str):
    from transformers import AutoConfig

    from acco.models import _looks_local

    path = os.path.expanduser(str(name))
    if _looks_local(path):
        if not os.path.isdir(path):
            _fail(f"model.pretrained {name!r}: no such folder")
        if not os.path.isfile(os.path.join(path, "config.json")):
            _fail(f"model.pretrained {name!r}: folder has no config.json")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # the Hub and the config parser raise many types
        _fail(f"model.pretrained {name!r}: cannot load its config: {one_line_error(e, 300)}", e)


def _positions(config) -> int | None:
    for attr in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def check_model(model: Mapping, max_length: int) -> Any:
    """The model config alone (before the tokenizer is known): returns the pretrained config or None."""
    pretrained = model.get("pretrained")
    if pretrained:
        config = _pretrained_config(str(pretrained))
        limit = _positions(config)
        if limit is not None and max_length > limit:
            _fail(
                f"train.max_length {max_length} exceeds the {limit} positions (max_position_embeddings) "
                f"of model.pretrained {str(pretrained)!r}"
            )
        return config
    limit = model.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and max_length > limit:
        _fail(
            f"train.max_length {max_length} exceeds model.max_position_embeddings {limit} "
            f"(model {model.get('name', '?')!r})"
        )
    return None


def check_model_fits(model: Mapping, pretrained_config: Any, vocab_size: int, what: str) -> None:
    """The tokenizer's vocabulary fits the pretrained embedding; a new model's config is valid."""
    from acco.models import ModelError, model_config

    if pretrained_config is not None:
        rows = getattr(pretrained_config, "vocab_size", None)
        if isinstance(rows, int) and vocab_size > rows:
            _fail(
                f"{what} has {vocab_size} tokens, more than the {rows} rows of the embedding of "
                f"model.pretrained {str(model.get('pretrained'))!r}"
            )
        return
    try:
        model_config(dict(model), vocab_size)
    except ModelError as e:
        _fail(f"model config: {one_line_error(e)}", e)


def _load_tokenizer(spec: str, pretrained: str | None = None):
    from acco.data import DataError, load_tokenizer

    try:
        return load_tokenizer(spec)
    except DataError as e:
        if pretrained and spec == pretrained:  # the default: the pretrained model's own tokenizer
            _fail(f"model.pretrained {pretrained!r} has no tokenizer ({one_line_error(e)}): "
                  "name one with model.tokenizer=PATH_OR_HUB_NAME", e)
        _fail(f"model.tokenizer: {one_line_error(e)}", e)


def _train_bpe_as_rank0(texts: list[str], vocab_size: int):
    """The BPE rank 0 will train, saved and loaded again as the workers get it (same fingerprint)."""
    from acco.data import DataError, load_tokenizer

    try:
        with tempfile.TemporaryDirectory(prefix="acco-preflight-") as tmp:
            load_tokenizer("bpe", train_texts=texts, vocab_size=vocab_size, save_dir=tmp)
            return load_tokenizer(tmp)
    except DataError as e:
        _fail(f"model.tokenizer=bpe: {one_line_error(e)}", e)


def _as_workers_load_it(tokenizer):
    """The tokenizer saved and loaded again, as the workers load it from output_dir/tokenizer, so
    that packing here fills the cache entry the workers will look up."""
    from acco.data import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="acco-preflight-") as tmp:
        tokenizer.save_pretrained(tmp)
        return load_tokenizer(tmp)


# --------------------------------------------------------------------------- data


def load_corpus(data: Mapping):
    """Documents or instruction records, as the workers will load them."""
    from acco.data import DataError, load_records, open_documents, synthetic_corpus

    fmt = data.get("format", "pretrain")
    if fmt not in ("pretrain", "instruct"):
        _fail(f"data.format must be 'pretrain' or 'instruct', got {fmt!r}")
    if data.get("name") == "synthetic":
        return synthetic_corpus(_positive_int(data.get("n_docs"), "data.n_docs"), seed=0)
    path = data.get("path")
    if not path:
        _fail(f"data.path is not set (data={data.get('name', '?')} needs a file, a folder or a Hub name)")
    try:
        if fmt == "instruct":
            return load_records(str(path))
        # memory-mapped as the workers open it: an openwebtext-sized corpus is not read into a list
        return open_documents(str(path), text_column=data.get("text_column") or "text")
    except DataError as e:
        _fail(f"data.path: {one_line_error(e)}", e)
    except OSError as e:  # unreadable file or folder
        where = e.filename or path
        _fail(f"data.path: cannot read {str(where)!r}: {e.strerror or one_line_error(e)}", e)


def _text_bytes(docs, text_column: str) -> int:
    """UTF-8 bytes of the documents; for a memory-mapped Dataset its Arrow size (no reading)."""
    from acco.data import is_hf_dataset

    if is_hf_dataset(docs):
        return docs.data.nbytes
    return sum(len(d.encode("utf-8")) for d in docs)


def check_fills_global_batch(cfg: Mapping, args, corpus, tokenizer, world_size: int) -> None:
    """The training split holds at least one global batch. The split is by document, from
    train.seed, as the workers make it (acco.cli.split_corpus)."""
    from acco.cli import split_corpus
    from acco.data import DataError, format_alpaca, pack_documents, tokenize_instructions

    data = cfg["data"]
    need = args.batch_size * world_size
    instruct = data.get("format") == "instruct"
    text_column = data.get("text_column") or "text"
    train_fraction = (1 - args.eval_fraction) if args.eval else 1.0
    if instruct:
        typical = len(corpus) * train_fraction
    else:  # one token per 2 bytes (+ one eos per document): with the margin, safe up to 20 bytes/token
        typical = (_text_bytes(corpus, text_column) / 2 + len(corpus)) * train_fraction / args.max_length
    if typical >= EXACT_CHECK_MARGIN * need:
        return  # plenty for any real tokenizer: the exact count below would tokenise it all
    source = "data.n_docs" if data.get("name") == "synthetic" else f"data.path {str(data.get('path'))!r}"
    try:
        corpus, _ = split_corpus(corpus, args)
    except DataError as e:
        _fail(f"{source}: {one_line_error(e)}", e)

    if tokenizer is None:  # bpe: train it as rank 0 will (the corpus is small here)
        texts = ["".join(format_alpaca(r)) for r in corpus] if instruct else corpus
        tokenizer = _train_bpe_as_rank0(texts, int(cfg["model"]["vocab_size"]))
    else:
        tokenizer = _as_workers_load_it(tokenizer)
    try:
        if instruct:
            n = len(tokenize_instructions(corpus, tokenizer, args.max_length)["input_ids"])
            what = f"{n} instruction examples of train.max_length {args.max_length}"
        else:
            n = len(pack_documents(corpus, tokenizer, args.max_length, args.cache_dir, text_column))
            what = f"{n} blocks of train.max_length {args.max_length}"
    except DataError as e:
        _fail(f"{source}: {one_line_error(e)}", e)
    split = f" in its training split (train.eval_fraction {args.eval_fraction})" if args.eval else ""
    if n < need:
        _fail(
            f"dataset too small: {source} gives {what}{split}, fewer than one global batch of "
            f"train.batch_size {args.batch_size} x {world_size} worker(s) = {need}"
        )


# --------------------------------------------------------------------------- resume


def _model_numel(
    model: Mapping, pretrained_config: Any, tokenizer, folder: Path, max_length: int
) -> int | None:
    """Trainable parameters of the model the workers will build, counted on the meta device
    (nothing allocated); None when it cannot be told here."""
    import torch

    from acco.models import build_model, count_parameters

    try:
        with torch.device("meta"):
            if pretrained_config is not None:
                from transformers import AutoModelForCausalLM

                built = AutoModelForCausalLM.from_config(pretrained_config)
            else:
                if tokenizer is not None:
                    vocab = len(tokenizer)
                else:  # bpe, trained by the workers: the vocabulary the checkpoint's model was built for
                    import json

                    vocab = json.loads((folder / "model" / "config.json").read_text()).get("vocab_size")
                built = build_model(dict(model), vocab_size=vocab, max_length=max_length)
    except Exception:  # the model checks above report a bad model config; the workers re-check the size
        return None
    return count_parameters(built, trainable_only=True)


def check_resume(args, model: Mapping, pretrained_config: Any, tokenizer, world_size: int) -> None:
    """``train.resume_from_checkpoint`` names a complete checkpoint that this run can continue:
    meta.json and every worker's file present and whole, the same method, a model of the same
    size. Raises ``AlreadyCompleted`` when the checkpoint has consumed the budget already."""
    spec = args.resume_from_checkpoint
    if not spec:
        return
    from acco import checkpoint
    from acco.engine import CheckpointError

    key = f"train.resume_from_checkpoint={spec}"
    try:
        folder = checkpoint.resolve(spec, os.path.expanduser(str(args.output_dir)))
        meta = checkpoint.load_meta(folder)
        checkpoint.check_files(folder, meta)
    except CheckpointError as e:
        _fail(f"{key}: {one_line_error(e)}", e)
    if meta["method"] != args.method_name:
        _fail(f"{key}: {folder} was written by method {meta['method']!r}, this run is {args.method_name!r}")
    if args.method_name == "torch-ddp" and int(meta["world_size"]) != world_size:
        _fail(
            f"{key}: {folder} was written by {meta['world_size']} workers, this run has {world_size}; "
            "torch-ddp resumes only on the world size it was saved with"
        )
    numel = _model_numel(model, pretrained_config, tokenizer, folder, args.max_length)
    if numel is not None and numel != int(meta["numel"]):
        _fail(
            f"{key}: {folder} holds a model of {int(meta['numel']):,} parameters, "
            f"model {model.get('name') or model.get('pretrained') or '?'!r} has {numel:,}"
        )
    changed = checkpoint.data_changes(meta.get("train") or {}, vars(args), int(meta["world_size"]) == world_size)
    if changed:
        _fail(
            f"{key}: {', '.join(changed)}: the run would resume on other samples than those it stopped at; "
            "keep the checkpoint's values (a changed batch_size resumes only on another world size)"
        )
    done = checkpoint.already_completed(folder, meta, args.nb_steps_tot)
    if done:
        raise AlreadyCompleted(done)


# --------------------------------------------------------------------------- all together


def preflight(cfg: DictConfig, world_size: int | None = None) -> None:
    """Check a run's config, output folders, model, tokenizer and data; raise ``InputError``.

    ``world_size``: the number of workers (default: from ``launch.nproc``).
    """
    resolved = check_config_values(cfg)
    world_size = check_launch(resolved.get("launch") or {}, world_size)
    train = resolved["train"]
    args = check_train(train)
    check_output_dir(
        args.output_dir,
        overwrite=bool(train.get("overwrite_output_dir", False)),
        resume=train.get("resume_from_checkpoint"),
    )
    if args.cache_dir:
        _check_writable_dir(Path(os.path.expanduser(str(args.cache_dir))), "train.cache_dir")

    model = resolved["model"]
    pretrained_config = check_model(model, args.max_length)
    spec = model.get("tokenizer")
    if not spec:
        _fail("model.tokenizer is not set (a folder, a Hub name, or bpe)")
    spec = str(spec)
    tokenizer = None
    if spec == "bpe":
        vocab = model.get("vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 257:
            _fail(f"model.vocab_size must be an integer above 257 for model.tokenizer=bpe, got {vocab!r}")
        check_model_fits(model, pretrained_config, vocab, "model.tokenizer=bpe (model.vocab_size)")
    else:
        tokenizer = _load_tokenizer(spec, model.get("pretrained"))
        check_model_fits(model, pretrained_config, len(tokenizer), f"model.tokenizer {spec!r}")
    check_resume(args, model, pretrained_config, tokenizer, world_size)

    corpus = load_corpus(resolved["data"])
    check_fills_global_batch(resolved, args, corpus, tokenizer, world_size)
