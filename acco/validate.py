"""The one validation pass of a job: what the config schema cannot check, before training.

The schema (acco/config.py) has already checked types, key names and each group's values. This
module checks the rest of a ``Job`` (acco/job.py), once per job: ``acco.cli`` runs ``check_job``
in the local launcher while its workers import torch, or on rank 0 under torchrun / srun (and in a
lone worker) while the other ranks wait on the store. Workers never repeat it. The pass loads what
the job needs once, through the functions the workers call (``acco.data.text.load_corpus``;
``split_corpus``, ``build_tokenizer`` and ``prepare_dataset`` of acco.data.prepare), and leaves it
in ``job.loaded``: a worker of the same process (launch.nproc=1, rank 0 under torchrun) takes it
rather than loading the corpus and the tokenizer again, and what the pass tokenizes lands in the
caches that the workers read. The
modules that own a thing expose what the checks need (``acco.models.trainable_parameters``,
``acco.resume.decide_resume``). In order, cheap checks first:

- mandatory values set and interpolations resolvable (``acco.job.job_of``, for ``validate_job``);
- ``check_at_once``, before any worker starts, every check that costs nothing, their problems
  reported together: ``check_folders`` (output and cache dirs writable, no run overwritten, a
  checkpoint to resume there: meta.json and sizes), the nodes the workers are grouped into
  (``check_node_layout``), the data's path, model.tokenizer set, the pretrained model's folder
  or the new model's positions;
- the model config, or the pretrained model's ``config.json``, against train.max_length;
- the tokenizer, loaded as rank 0 loads it, against the model's embedding;
- ``train.resume_from_checkpoint``: whether and from where the job resumes (the checkpoint's CRCs
  read, once for the job), left in ``job.resume`` for the workers;
- the data: readable, and at least one global batch. Its size tells at once for a large corpus;
  a small one is split, its BPE trained and its training split tokenized as the workers do it,
  into the packing cache where they then find it. A large corpus (``PREPARE_FROM_TOKENS``) must
  have been tokenized into the cache before the job, by ``acco-prepare`` (acco/prepare_cli.py).

Every failure is an ``InputError`` (a ValueError) whose message is one line naming the config key
and the file, value or numbers at fault (``check_at_once``'s: a line per problem). Nothing here
writes to ``train.output_dir``; writability is probed with a temporary file that is removed at
once. torch and transformers are imported only where a check needs them (a named tokenizer, a
small corpus, a pretrained model, a resume).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from acco.config import (
    GPT_NEO_WINDOW,
    AlreadyCompleted,
    DataConfig,
    InputError,
    ModelError,
    check_model_config,
    gpt_neo_attention_types,
    one_line_error,
)
from acco.data.errors import DataError, looks_like_local_path
from acco.data.text import corpus_sources, load_corpus, quiet_datasets, text_bytes
from acco.engine.config import ConfigError
from acco.engine.layout import check_layout, layout_from_env, layout_words
from acco.job import Job, Loaded, job_of
from acco.launch.env import dist_env
from acco.run_folder import RUN_MARKERS, list_checkpoints

__all__ = [
    "PREPARE_FROM_TOKENS",
    "InputError",
    "check_at_once",
    "check_folders",
    "check_job",
    "check_node_layout",
    "check_output_dir",
    "check_prepared",
    "validate_job",
]

# The data is tokenized in the validation pass only while its size alone cannot tell whether it
# fills one global batch: while an upper bound on its samples is below this many global batches.
EXACT_CHECK_MARGIN = 10
# A corpus of more than this many tokens (estimated at 4 bytes of text a token) must have been
# tokenized before the job, by acco-prepare: its workers do not wait on rank 0 tokenizing it.
PREPARE_FROM_TOKENS = 100_000_000


def _fail(message: str, cause: BaseException | None = None) -> None:
    raise InputError(message) from cause


@contextlib.contextmanager
def _named(source: str):
    """A DataError inside, as the InputError ``{source}: {its line}``."""
    try:
        yield
    except DataError as e:
        _fail(f"{source}: {one_line_error(e)}", e)


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and not p.is_symlink():
        if p.parent == p:
            break
        p = p.parent
    return p


def check_writable_dir(path: Path, key: str) -> None:
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
    check_writable_dir(out, "train.output_dir")
    if not out.is_dir():  # a new run's folder: nothing in it to keep
        return out
    if resume == "auto" and not overwrite and not list_checkpoints(out):
        if (out / "summary.json").exists():  # auto starts afresh before a first checkpoint, not over an end
            _fail(
                f"train.output_dir {str(out)!r} holds a finished run (summary.json) and no checkpoint "
                "for train.resume_from_checkpoint=auto to continue; choose another train.output_dir "
                "or set train.overwrite_output_dir=true to replace it"
            )
    elif not resume and not overwrite:
        found = [name for name in RUN_MARKERS if (out / name).exists()]
        found += sorted(p.name for p in out.glob("checkpoint-*"))[:1]
        if found:  # `latest` offered only where it can continue
            tail = (", or train.resume_from_checkpoint=latest to continue it" if list_checkpoints(out)
                    else " (it has no complete checkpoint to continue from)")
            _fail(f"train.output_dir {str(out)!r} already holds a run ({', '.join(found)}); choose another "
                  f"train.output_dir or set train.overwrite_output_dir=true to replace it{tail}")
    return out


def check_pretrained_path(name: str) -> str:
    """model.pretrained, a local path: a folder with a config.json (a Hub name is asked later)."""
    path = os.path.expanduser(str(name))
    if looks_like_local_path(path):
        if not os.path.isdir(path):
            _fail(f"model.pretrained {name!r}: no such folder")
        if not os.path.isfile(os.path.join(path, "config.json")):
            _fail(f"model.pretrained {name!r}: folder has no config.json")
    return path


def _pretrained_config(name: str):
    path = check_pretrained_path(name)
    from transformers import AutoConfig

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
    check_positions(model, max_length)
    return None


def check_positions(model: Mapping, max_length: int) -> None:
    """A new model (no model.pretrained) has positions for train.max_length tokens."""
    limit = model.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and max_length > limit:
        _fail(
            f"train.max_length {max_length} exceeds model.max_position_embeddings {limit} "
            f"(model {model.get('name', '?')!r})"
        )


def check_model_fits(model: Mapping, pretrained_config: Any, vocab_size: int, what: str) -> None:
    """The tokenizer's vocabulary fits the pretrained embedding; a new model's config is valid."""
    if pretrained_config is not None:
        rows = getattr(pretrained_config, "vocab_size", None)
        if isinstance(rows, int) and vocab_size > rows:
            _fail(
                f"{what} has {vocab_size} tokens, more than the {rows} rows of the embedding of "
                f"model.pretrained {str(model.get('pretrained'))!r}"
            )
        return
    try:
        check_model_config(dict(model), vocab_size)
    except ModelError as e:
        _fail(f"model config: {one_line_error(e)}", e)


def check_flash_window(model: Mapping, pretrained_config: Any, max_length: int) -> None:
    """transformers' GPT-Neo flash-attention-2 passes no sliding window: past window_size tokens its
    local layers would attend globally, another model than eager's or SDPA's. Also any name
    transformers does not know (found here, not in every worker)."""
    attn = model.get("attn_implementation")
    if attn is not None:
        from acco.models import unknown_attention
        if (known := unknown_attention(str(attn))) is not None:
            _fail(f"model.attn_implementation={attn!r} is not an attention transformers knows "
                  f"({', '.join(known)}, or a Hub kernel's org/repo)")  # fmt: skip
    if attn != "flash_attention_2":
        return
    if pretrained_config is not None:
        arch, window = pretrained_config.model_type, getattr(pretrained_config, "window_size", None)
        local = "local" in (getattr(pretrained_config, "attention_layers", None) or [])
    else:  # checked by check_model_config; GPT_NEO_WINDOW: acco.models' and transformers' default window
        arch, window = model.get("arch"), model.get("window_size") or GPT_NEO_WINDOW
        types = model.get("attention_types") or gpt_neo_attention_types(model["num_layers"])
        local = any("local" in kinds and n for kinds, n in types)
    if arch == "gpt_neo" and local and max_length > window:
        _fail(
            f"model.attn_implementation=flash_attention_2: transformers' GPT-Neo flash-attention has no "
            f"sliding window, so the local layers would attend beyond model.window_size {window} at "
            f"train.max_length {max_length}; use sdpa (the default) or train.max_length <= {window}"
        )


def job_tokenizer(cfg: DictConfig, train_corpus=None):
    """model.tokenizer as rank 0 builds it (acco.data.prepare.build_tokenizer): loaded, or the BPE
    trained on `train_corpus` (and cached in train.cache_dir, where rank 0 then finds it)."""
    from acco.data.prepare import build_tokenizer

    spec, pretrained = str(cfg.model.tokenizer), cfg.model.get("pretrained")
    try:
        return build_tokenizer(cfg, train_corpus)
    except DataError as e:
        if spec == "bpe":
            _fail(f"model.tokenizer=bpe: {one_line_error(e)}", e)
        if pretrained and spec == str(pretrained):  # the default: the pretrained model's own tokenizer
            _fail(
                f"model.pretrained {pretrained!r} has no tokenizer ({one_line_error(e)}): "
                "name one with model.tokenizer=PATH_OR_HUB_NAME",
                e,
            )
        _fail(f"model.tokenizer: {one_line_error(e)}", e)


def check_tokenizer(cfg: DictConfig, model: Mapping, pretrained_config: Any):
    """A named tokenizer, loaded, fits the model; for the BPE (trained by the workers, or below on a
    small corpus) model.vocab_size does. Returns the loaded tokenizer, or None for the BPE."""
    spec = check_tokenizer_spec(model)
    if spec != "bpe":
        tokenizer = job_tokenizer(cfg)
        check_model_fits(model, pretrained_config, len(tokenizer), f"model.tokenizer {spec!r}")
        return tokenizer
    check_model_fits(model, pretrained_config, model["vocab_size"], "model.tokenizer=bpe (model.vocab_size)")
    return None


def check_tokenizer_spec(model: Mapping) -> str:
    """model.tokenizer is set, and for the BPE model.vocab_size is a size it can train to."""
    spec = model.get("tokenizer")
    if not spec:
        _fail("model.tokenizer is not set (a folder, a Hub name, or bpe)")
    vocab = model.get("vocab_size")
    if str(spec) == "bpe" and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 257):
        _fail(f"model.vocab_size must be an integer above 257 for model.tokenizer=bpe, got {vocab!r}")
    return str(spec)


# --------------------------------------------------------------------------- resume


def _resume_error(spec: Any, e: BaseException) -> None:
    text = one_line_error(e).removeprefix(f"{os.path.expanduser(str(spec))}: ")
    _fail(f"train.resume_from_checkpoint={spec}: {text}", e)  # the path once


def check_resume(job: Job, pretrained_config: Any) -> None:
    """Whether and from where the job resumes (acco.resume.decide_resume, with the CRC read: here
    once for the job), with a model of as many parameters as the workers will build
    (acco.models.trainable_parameters) and the same architecture. The decision is left in
    ``job.resume`` for the workers; ``AlreadyCompleted`` passes through."""
    from acco import resume

    args, model = job.args, job.model
    job.resume = resume.ResumePoint()
    if not args.resume_from_checkpoint:
        return
    from acco import models
    from acco.engine import CheckpointError

    def numel(folder: Path) -> int | None:  # None: cannot be told here (the workers re-check)
        # the BPE is trained by the workers: the vocabulary the checkpoint's model was built for
        vocab = len(job.loaded.tokenizer) if job.loaded.tokenizer is not None else saved_vocab_size(folder)
        if vocab is None and pretrained_config is None:
            return None
        try:
            return models.trainable_parameters(dict(model), vocab, args.max_length, pretrained_config)
        except Exception:  # the model checks above report a bad model config
            return None

    label = f"model {model.get('name') or model.get('pretrained') or '?'!r}"
    try:
        point = resume.decide_resume(args, job.world_size, numel, label)
    except CheckpointError as e:
        _resume_error(args.resume_from_checkpoint, e)
    if point.folder is None:
        return
    resume.say_skipped(point)
    check_sharded_resume(job, point.folder, point.meta)
    if point.completed:
        raise AlreadyCompleted(point.completed)
    job.resume = point
    _check_architecture(job, pretrained_config, point.folder, label)


def check_sharded_resume(job: Job, folder: Path, meta: dict) -> None:
    """diloco's checkpoint sharded inside the node resumes on its own layout only: decide_resume
    compares the sharding and the world size; here, the workers per node, which only the job knows.
    ddp, dpu, wp and acco reshard (acco/engine/shard_map.py)."""
    if not job.args.shard_inside_node or job.args.method_name not in ("diloco", "streaming-diloco"):
        return
    world, saved = job.world_size, int(meta.get("workers_per_node", 0))
    mine = job_layout(job)[1] or world
    if saved != mine:
        _fail(f"train.resume_from_checkpoint={job.args.resume_from_checkpoint}: {folder} was written by "
              f"{layout_words(world, saved) if saved else f'{world} workers'}, sharded inside the node, this "
              f"run is {layout_words(world, mine)}: a checkpoint sharded inside the node resumes with "
              "train.shard_inside_node=true on its own layout only")


def saved_vocab_size(folder: Path) -> int | None:
    """The vocabulary the checkpoint's model was built for (its model/config.json), None when it
    cannot be read: a run whose BPE is not trained yet counts its model's size with it."""
    try:
        vocab = json.loads((folder / "model" / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) else None


def _check_architecture(job: Job, pretrained_config: Any, folder: Path, label: str) -> None:
    """As many parameters, but the same model? (4 heads or 2 of the same width have as many.)"""
    from acco import models

    try:
        saved = json.loads((folder / "model" / "config.json").read_text())
        vocab = saved.get("vocab_size") if job.loaded.tokenizer is None else len(job.loaded.tokenizer)
        mine = (pretrained_config or models.model_config(dict(job.model), vocab)).to_dict()
    except Exception:  # unreadable, or a model config the checks above report: the workers re-check
        return
    changed = [f"{k} {saved[k]!r} (this run: {mine[k]!r})" for k in models.ARCHITECTURE_KEYS
               if k in saved and k in mine and saved[k] != mine[k]]  # fmt: skip
    if changed:
        _fail(
            f"train.resume_from_checkpoint={job.args.resume_from_checkpoint}: {folder} holds another "
            f"architecture than {label}: {', '.join(changed)}"
        )


# --------------------------------------------------------------------------- data


def check_data_path(data: DataConfig) -> None:
    """data.path is set where the data needs one, and names files that are there (a Hub name is
    asked when the corpus is read)."""
    if data.name == "synthetic":
        return
    if not data.path:
        _fail(f"data.path is not set (data={data.name} needs a file, a folder or a Hub name)")
    with _named("data.path"):
        corpus_sources(str(data.path))


def read_corpus(data: DataConfig):
    """Documents or instruction records, loaded as the workers load them (acco.data.text)."""
    check_data_path(data)
    try:
        with quiet_datasets():
            return load_corpus(OmegaConf.structured(data))
    except DataError as e:
        _fail(f"data.path: {one_line_error(e)}", e)
    except OSError as e:  # unreadable file or folder
        where = e.filename or data.path
        _fail(f"data.path: cannot read {str(where)!r}: {e.strerror or one_line_error(e)}", e)


def _source(data: DataConfig) -> str:
    return "data.n_docs" if data.name == "synthetic" else f"data.path {str(data.path)!r}"


def check_fills_global_batch(job: Job, n_bytes: int | None) -> None:
    """The training split holds at least one global batch. Told from the corpus's size
    (`n_bytes` of text) where that is plenty; else the corpus is split, the BPE trained and the
    training split tokenized as the workers do it (acco.data.prepare), into their caches."""
    args, data, corpus = job.args, job.data, job.loaded.corpus
    need = args.batch_size * job.world_size
    instruct = data.format == "instruct"
    train_fraction = (1 - args.eval_fraction) if args.eval else 1.0
    if instruct:
        typical = len(corpus) * train_fraction
    else:  # one token per 2 bytes (+ one eos per document): with the margin, safe up to 20 bytes/token
        typical = (n_bytes / 2 + len(corpus)) * train_fraction / args.max_length
    if typical >= EXACT_CHECK_MARGIN * need:
        return  # plenty for any real tokenizer: the exact count below would tokenise it all
    from acco.data.prepare import prepare_dataset, split_corpus
    from acco.data.tokenizer import as_saved

    source = _source(data)
    with _named(source):
        job.loaded.splits = split_corpus(corpus, args)
    if job.loaded.tokenizer is None:  # bpe: trained as rank 0 will train it (the corpus is small here)
        job.loaded.tokenizer = job_tokenizer(job.config, job.loaded.splits[0])
    with _named(source):  # as the workers load the tokenizer: the packing cache entry is theirs
        rows = prepare_dataset(
            job.loaded.splits[0],
            tokenizer=as_saved(job.loaded.tokenizer),
            max_length=args.max_length,
            cache_dir=args.cache_dir or None,
            text_column=data.text_column,
            alone=True,
        )
    n = len(rows)
    what = f"{n} {'instruction examples' if instruct else 'blocks'} of train.max_length {args.max_length}"
    split = f" in its training split (train.eval_fraction {args.eval_fraction})" if args.eval else ""
    if n < need:
        _fail(
            f"dataset too small: {source} gives {what}{split}, fewer than one global batch of "
            f"train.batch_size {args.batch_size} x {job.world_size} worker(s) = {need}"
        )


def check_prepared(job: Job, n_bytes: int | None) -> None:
    """A corpus of more than PREPARE_FROM_TOKENS tokens (estimated from its size, so a small one
    costs nothing more) has been tokenized into train.cache_dir by acco-prepare, for the splits and
    tokenizer of this run. Without a cache every rank tokenizes for itself: the user's choice."""
    args, data = job.args, job.data
    if n_bytes is None or not args.cache_dir:  # instruction records: tokenized by the run itself
        return
    tokens = n_bytes // 4
    if tokens <= PREPARE_FROM_TOKENS:
        return
    from acco.data.prepare import is_prepared, split_corpus

    if job.loaded.splits is None:
        job.loaded.splits = split_corpus(job.loaded.corpus, args)
    splits = [docs for docs in job.loaded.splits if docs is not None]
    if is_prepared(
        splits, job.loaded.tokenizer, int(job.model.get("vocab_size") or 0), args.cache_dir, data.text_column
    ):
        return
    argv = sys.argv[1:]  # the launcher's or the worker's command line: the same overrides
    command = (
        f"`acco-prepare {shlex.join(argv)}`"
        if argv and all("=" in a and not a.startswith("-") for a in argv)
        else "acco-prepare with this run's overrides"
    )
    source = f"data.path {str(data.path)!r}" if data.path else f"data={data.name}"
    _fail(
        f"{source}: about {tokens:,} tokens, not prepared yet in train.cache_dir {str(args.cache_dir)!r}: "
        f"run {command} first (or set train.cache_dir to where it was prepared), rather than have "
        "every worker wait for rank 0 to tokenize it"
    )


# --------------------------------------------------------------------------- all together


def validate_job(cfg: DictConfig, world_size: int | None = None) -> Job:
    """``check_job`` on the job of a composed config (``acco.job.job_of``); returns the job."""
    job = job_of(cfg, world_size)
    check_job(job)
    return job


def check_folders(job: Job) -> None:
    """The output and cache folders; nothing heavy imported: the local launcher runs it first."""
    args = job.args
    check_output_dir(args.output_dir, overwrite=args.overwrite_output_dir, resume=args.resume_from_checkpoint)
    if args.cache_dir:
        check_writable_dir(Path(os.path.expanduser(str(args.cache_dir))), "train.cache_dir")
    if args.resume_from_checkpoint:  # meta.json and sizes, no CRC: `latest` with nothing to resume, at once
        from acco.engine import CheckpointError
        from acco.resume import decide_resume

        try:
            decide_resume(args, job.world_size, crc=False)
        except CheckpointError as e:
            _resume_error(args.resume_from_checkpoint, e)


def check_node_layout(job: Job) -> None:
    """The nodes the job's workers are grouped into divide them (acco.engine.layout.check_layout):
    a plain ``python main.py``'s launch.workers_per_node; under torchrun or srun the layout their
    environment says, where the method's rounds run on it (train.rounds=nodes). With
    train.shard_inside_node, that layout has several nodes of several workers."""
    args = job.args
    if dist_env() is None:  # the local launcher's emulated nodes
        hint = ""
    elif args.rounds == "nodes" and args.method_name != "torch-ddp":
        hint = ", or set train.rounds=flat (one ring)"
    else:
        return  # the engine never reads the launcher's layout (shard_inside_node needs rounds=nodes)
    where, per_node = job_layout(job)
    if per_node is not None:
        try:
            check_layout(job.world_size, per_node, where)
        except ConfigError as e:
            _fail(f"{e}{hint}", e)
    if args.shard_inside_node:
        said = (f"{where}={per_node}" if per_node is not None else f"{where} unset" if where
                else "no launcher variable says the workers per node")  # fmt: skip
        check_sharded_layout(job.world_size, per_node or job.world_size, said, local=dist_env() is None)


def job_layout(job: Job) -> tuple[str, int | None]:
    """Where the job's workers per node come from, and how many (None: unsaid, one node): a plain
    ``python main.py``'s launch.workers_per_node, else the launcher's variable."""
    if dist_env() is None:
        return "launch.workers_per_node", job.launch.workers_per_node
    return layout_from_env() or ("", None)


def check_sharded_layout(world_size: int, per_node: int, said: str, local: bool) -> None:
    """train.shard_inside_node shards inside each node and runs the rounds between nodes: a job of
    one node has no rounds to run, one of one worker per node nothing to shard. `said`: where the
    layout comes from; `local`: the local launcher's (launch.workers_per_node)."""
    if 1 < per_node < world_size:
        return
    ways = [str(d) for d in range(2, world_size) if world_size % d == 0]
    if not local:
        fix = "run it on several nodes of several workers each"
    elif ways:
        fix = f"set launch.workers_per_node={' or '.join(ways)}"
    else:
        fix = "run 4 workers or more (launch.nproc=4 launch.workers_per_node=2)"
    _fail(f"train.shard_inside_node=true needs more than one node of more than one worker; this job is "
          f"{layout_words(world_size, per_node)} ({said}): {fix}, or set train.shard_inside_node=false")


def check_at_once(job: Job) -> None:
    """Every check that costs nothing (a look at the file system, the config's own numbers), all
    run: their problems come in one ``InputError``, a line each, so that none hides another (a
    missing data file behind an output folder that holds a run). The local launcher runs them
    before it starts any worker; each is run again by the check that owns it, in check_job."""
    model, args = job.model, job.args
    checks = [
        lambda: check_folders(job),
        lambda: check_node_layout(job),
        lambda: check_data_path(job.data),
        lambda: check_tokenizer_spec(model),
        (lambda: check_pretrained_path(str(model["pretrained"]))) if model.get("pretrained")
        else (lambda: check_positions(model, args.max_length)),
    ]  # fmt: skip
    problems = []
    for check in checks:
        try:
            check()
        except InputError as e:
            problems.append(str(e))
    if problems:
        raise InputError("\n".join(problems))


def check_job(job: Job) -> None:
    """Check a job's output folders, model, tokenizer, checkpoint and data for its workers; raise
    ``InputError`` (or ``acco.config.AlreadyCompleted``). What it loads is left in ``job.loaded``,
    for a worker of this process to take."""
    args, data = job.args, job.data
    check_at_once(job)
    job.loaded = loaded = Loaded()
    pretrained_config = check_model(job.model, args.max_length)
    loaded.tokenizer = check_tokenizer(job.config, job.model, pretrained_config)
    check_flash_window(job.model, pretrained_config, args.max_length)
    check_resume(job, pretrained_config)

    loaded.corpus = read_corpus(data)
    n_bytes = None if data.format == "instruct" else text_bytes(loaded.corpus, data.text_column)  # for both
    check_fills_global_batch(job, n_bytes)
    check_prepared(job, n_bytes)
