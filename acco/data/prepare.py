"""From a config or any dataset to what the micro-batch streams read, as a training job needs it.

- ``prepare_data(job)``: a worker's whole data preparation, in one call: the tokenizer and the
  ready train and eval ``Rows``, through the steps below (what the trainer is then handed).
- ``load_corpus_rank0_first(data)``: documents or instruction records (``text.load_corpus``).
- ``split_corpus(corpus, args)``: the (train, eval) split, by document, from train.seed.
- ``prepare_tokenizer(cfg, train_corpus)``: the tokenizer the run saves and every rank loads
  (``build_tokenizer``: what rank 0 does for it).
- ``prepare_dataset(dataset, ...)``: any dataset DecoupledTrainer accepts (strings, a text column,
  instruction records, pre-tokenized ids, or examples for a data collator) as ``Rows`` of packed
  blocks, masked prompts or padded ids.
- ``micro_batches(data, ...)``: this worker's resumable stream of micro-batches over it.

One-off work that every rank would otherwise repeat (tokenizing into the cache, training the BPE)
runs on rank 0 while the others wait on the store (``acco.launch.process_group.after_rank0``).
The job's validation pass (acco/validate.py) calls these same functions, as one process
(``alone=True``, no store): what it loads it hands to a worker of its own process, and what it
tokenizes lands in the caches the workers then read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from acco.launch.process_group import after_rank0

from .errors import DataError
from .instruct import IGNORE_INDEX, cached_instructions, format_alpaca, tokenize_instructions
from .loader import MicroBatchStream, Rows, split_train_eval
from .packing import blocks_of, cache_path, pack_documents, token_stream
from .text import is_hf_dataset, load_corpus
from .tokenized import pad_token_ids
from .tokenizer import as_saved, bpe_cache_folder, load_tokenizer

if TYPE_CHECKING:
    from acco.job import Job


class PreparedData(NamedTuple):
    """What a worker trains on: the run's tokenizer and its ready train and eval rows."""

    tokenizer: Any
    train: Rows
    eval: Rows | None  # None with train.eval=false


def prepare_data(job: Job) -> PreparedData:
    """A worker's data: the corpus loaded (rank 0 first), split by document, the tokenizer built
    on rank 0 and loaded by every rank, both splits tokenized and packed (rank 0 first, into the
    cache). Starts from what this process's validation pass loaded (``job.take_loaded()``), and
    keeps neither the corpus nor the documents: only the rows the streams read."""
    loaded, args, text_column = job.take_loaded(), job.args, job.data.text_column
    corpus = load_corpus_rank0_first(dataclasses.asdict(job.data), loaded=loaded.corpus)
    train_docs, eval_docs = loaded.splits or split_corpus(corpus, args)
    tokenizer = prepare_tokenizer(job.config, train_docs, built=loaded.tokenizer)
    del corpus, loaded  # the documents of the splits only, until they are rows

    def rows(docs):
        return prepare_dataset(
            docs,
            tokenizer=tokenizer,
            max_length=args.max_length,
            cache_dir=args.cache_dir or None,
            text_column=text_column,
        )

    train = rows(train_docs)
    try:
        evaluation = rows(eval_docs) if eval_docs is not None else None
    except DataError as e:
        raise DataError(
            f"the eval set: {e} (give more eval data, raise train.eval_fraction or set train.eval=false)"
        ) from e
    return PreparedData(tokenizer, train, evaluation)


def rank0_first(work, key: str, alone: bool = False):
    """`work()` on rank 0 while the other ranks wait, then on them (they find what rank 0 cached,
    or compute it where they cannot see its cache), without the notes rank 0 has given of it (the
    cache found or written). `alone`: in this process only, the store not
    touched (the validation pass, which runs on rank 0 alone or in the launcher)."""
    if alone:
        return work()
    result = after_rank0(work, key=key)
    if result is not None:
        return result
    with _notes_from_rank0_only():
        return work()


@contextlib.contextmanager
def _notes_from_rank0_only():
    """The data package's notes (a cache found or written, documents skipped) silenced while a
    rank other than 0 repeats rank 0's work: rank 0 has said them, and every rank would say them
    again, the same line once per worker. Warnings still come through."""
    logger = logging.getLogger("acco.data")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def load_corpus_rank0_first(data: Mapping, loaded=None):
    """``load_corpus`` on rank 0 first, so that a Hub dataset is downloaded and converted once;
    the others then open that copy. `loaded`: the corpus this process's validation pass loaded,
    which rank 0 takes as it is."""
    corpus = after_rank0(lambda: load_corpus(data) if loaded is None else loaded, key="corpus")
    return corpus if corpus is not None else load_corpus(data)


def split_corpus(corpus, args):
    """(train, eval) documents or records, eval None when train.eval is off.

    The eval split is carved here, by document and from train.seed, rather than by the trainer
    from packed blocks: the BPE tokenizer can then be trained on the training split only, and no
    document is cut between the two splits. Both are index views of `corpus`, not copies of it.
    """
    if not args.eval:
        return corpus, None
    train_idx, eval_idx = split_train_eval(len(corpus), args.eval_fraction, args.seed)
    if is_hf_dataset(corpus):
        return corpus.select(train_idx.numpy()), corpus.select(eval_idx.numpy())
    return [corpus[i] for i in train_idx.tolist()], [corpus[i] for i in eval_idx.tolist()]


def prepare_tokenizer(cfg, train_corpus, built=None):
    """Rank 0 trains (on the training split only) or loads the tokenizer and saves it with the
    run; the others load that copy. A trained BPE is cached in train.cache_dir, keyed by the
    training texts and vocab_size, so that the next run on the same data reuses it. `built`: the
    tokenizer this process's validation pass built, which rank 0 saves rather than building again."""
    saved = Path(cfg.train.output_dir) / "tokenizer"
    work = (
        (lambda: build_tokenizer(cfg, train_corpus, save_dir=saved))
        if built is None
        else (lambda: built.save_pretrained(str(saved)))
    )
    after_rank0(work, key=f"tokenizer/{saved.resolve()}")
    return load_tokenizer(str(saved))


def build_tokenizer(cfg, train_corpus=None, save_dir=None):
    """What rank 0 does in `prepare_tokenizer`: load model.tokenizer, or train the BPE on the
    training split (from train.cache_dir when it was trained there before), saved to `save_dir`.
    Only the BPE reads `train_corpus` and model.vocab_size."""
    spec, texts, vocab_size = str(cfg.model.tokenizer), None, 0
    if spec == "bpe":
        texts = (
            train_corpus
            if cfg.data.format == "pretrain"
            else ["".join(format_alpaca(r)) for r in train_corpus]
        )
        vocab_size = int(cfg.model.vocab_size)
    return load_tokenizer(
        spec,
        train_texts=texts,
        vocab_size=vocab_size,
        save_dir=save_dir,
        cache_dir=cfg.train.get("cache_dir") or None,
        text_column=cfg.data.text_column,
    )


def is_prepared(splits, tokenizer, vocab_size: int, cache_dir, text_column: str = "text") -> bool:
    """Whether the token stream of every split is in `cache_dir`, for the tokenizer the run's
    workers will load: `tokenizer` (model.tokenizer's), or with None the BPE that rank 0 trains on
    the first split, looked up in the BPE cache (not there: nothing was prepared with it)."""
    if tokenizer is None:
        folder = bpe_cache_folder(splits[0], vocab_size, cache_dir, text_column)
        if not folder.is_dir():
            return False
        tokenizer = load_tokenizer(str(folder))  # as rank 0 finds it, before saving it for the run
    tokenizer = as_saved(tokenizer)
    return all(cache_path(docs, tokenizer, cache_dir, text_column).exists() for docs in splits)


def prepare_dataset(
    dataset,
    *,
    tokenizer,
    max_length: int,
    cache_dir: str | None,
    text_column: str = "text",
    data_collator=None,
    alone: bool = False,
):
    """What the streams read: `Rows` of padded token ids (pre-tokenized: an input_ids column
    wins over any other), masked prompts (instructions) or packed blocks (text); with a data
    collator, the examples themselves. Instruction records are told by their instruction and
    output fields, before a text column (the Hub's Alpaca has both). `alone`: tokenized in this
    process only (``rank0_first``)."""
    arrays = torch.Tensor | np.ndarray
    if isinstance(dataset, Rows | arrays) or (
        isinstance(dataset, Mapping) and all(isinstance(v, arrays) for v in dataset.values())
    ):
        return dataset if isinstance(dataset, Rows) else Rows(dataset)
    if data_collator is not None:
        # Examples, read one by one and collated per micro-batch.
        return dataset if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") else list(dataset)
    first = dataset[0] if len(dataset) else None
    if isinstance(first, str):
        docs = dataset if isinstance(dataset, list) else list(dataset)
        return Rows(_packed(docs, _need(tokenizer), max_length, cache_dir, text_column, alone))
    columns = getattr(dataset, "column_names", None) or (list(first) if isinstance(first, Mapping) else [])
    if "input_ids" in columns:  # pre-tokenized (run_clm.py's output): used as they are, as
        # transformers.Trainer does, also where the text they came from is still beside them
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        return Rows(pad_token_ids(dataset, max_length, pad))
    if "instruction" in columns and "output" in columns:
        records = list(dataset) if isinstance(dataset, list) else dataset.to_list()
        return Rows(_instructions(records, _need(tokenizer), max_length, cache_dir, alone))
    if text_column in columns:
        docs = dataset if is_hf_dataset(dataset) else [r[text_column] for r in dataset]
        return Rows(_packed(docs, _need(tokenizer), max_length, cache_dir, text_column, alone))
    raise DataError(
        f"dataset has neither a {text_column!r} column, instruction/output columns nor input_ids "
        f"(has {columns})"
    )


def _need(tokenizer):
    if tokenizer is None:
        raise DataError("a tokenizer (or processing_class) is needed to tokenize the dataset")
    return tokenizer


def _instructions(
    records: list[dict], tokenizer, max_length: int, cache_dir: str | None, alone: bool
) -> dict:
    """Masked instruction examples; with a cache, rank 0 tokenizes them into it while the
    other ranks wait, then they load that file (or tokenize, if they cannot see it)."""
    if not cache_dir:
        return tokenize_instructions(records, tokenizer, max_length)
    return rank0_first(
        lambda: cached_instructions(records, tokenizer, max_length, cache_dir), "instructions", alone
    )


def _packed(
    docs, tokenizer, max_length: int, cache_dir: str | None, text_column: str, alone: bool
) -> np.ndarray:
    """Packed blocks, memory-mapped: rank 0 tokenizes the corpus into the cache while the other
    ranks wait, then every rank maps the cache file (a rank that cannot see it, its cache
    folder being on another machine's disk, tokenizes for itself)."""
    if not cache_dir:
        return pack_documents(docs, tokenizer, max_length, None, text_column)
    return blocks_of(
        rank0_first(lambda: token_stream(docs, tokenizer, cache_dir, text_column), "packing", alone),
        max_length,
    )


def select(data, idx: torch.Tensor):
    """Rows `idx` of `data`, as an index view (no copy)."""
    if isinstance(data, Rows):
        return data.select(idx)
    return torch.utils.data.Subset(data, idx.tolist())


def forward_fields(model) -> frozenset[str] | None:
    """The example fields a data collator is given (transformers.Trainer's remove_unused_columns):
    the named parameters of the model's forward, labels included; None (every field) for a model
    whose forward names no input_ids (one that takes ``**kwargs`` only)."""
    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params:
        return None
    return frozenset(n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def collate(data_collator, examples: list, fields: frozenset[str] | None = None) -> dict:
    """A user's data collator on `examples` (only their `fields`, None: all), with labels added
    where it gives none."""
    if fields is not None:
        examples = [
            {k: v for k, v in e.items() if k in fields} if isinstance(e, Mapping) else e for e in examples
        ]
    batch = dict(data_collator(examples))
    if "labels" not in batch:  # a padding-only collator: every real token is a target
        labels = batch["input_ids"].clone()
        if "attention_mask" in batch:
            labels[batch["attention_mask"] == 0] = IGNORE_INDEX
        batch["labels"] = labels
    return batch


def micro_batches(
    data, batch_size: int, rank: int, world_size: int, seed: int, data_collator=None, fields=None
):
    """(this worker's resumable MicroBatchStream, the iterator of its micro-batches); a data
    collator is given the examples' `fields` only (`collate`)."""
    if isinstance(data, Rows):
        stream = MicroBatchStream(data, batch_size, rank, world_size, seed)
        return stream, stream
    index = MicroBatchStream(torch.arange(len(data)), batch_size, rank, world_size, seed)
    return index, (collate(data_collator, [data[i] for i in b["input_ids"].tolist()], fields) for b in index)
