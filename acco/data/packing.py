"""Packing documents into fixed-length blocks for causal-LM pretraining, with a disk cache.

Every document is followed by the eos token (and preceded by bos when the tokenizer adds one
itself, as Llama 3's does), all documents are concatenated into one token stream, and the
stream is cut into rows of `max_length` (the last partial row is dropped). No padding is needed,
so every position of every block is a training target, as in GPT-2, nanoGPT and the ACCO paper.

The stream is built for corpora the size of openwebtext (9B tokens): it is written chunk by
chunk to a flat .npy file of uint16 (int32 for vocabularies above 65536) and read back
memory-mapped, so no process holds the corpus in memory; the blocks are a reshaped view of that
file and rows are widened to int64 only when a micro-batch takes them (`loader.Rows`).

The cache key covers the documents' content (`corpus_fingerprint`) and the tokenizer (its full
serialization and special ids), not `max_length`: one tokenization serves every block length.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from acco.config import DEFAULT_CACHE_DIR

from .errors import DataError, describe
from .text import corpus_fingerprint, is_hf_dataset
from .tokenizer import bos_to_prepend, tokenizer_fingerprint

log = logging.getLogger(__name__)

_FORMAT_VERSION = "tokens-v2"  # bump when the stream rule changes, to invalidate old caches
_TOKENIZE_BATCH = 1000
_HEADER_BYTES = 128  # room kept for the .npy header, written once the token count is known
_MAP_PROCESSES_FROM = 100_000  # documents; below this, worker processes cost more than they save


def pack_documents(
    docs,
    tokenizer,
    max_length: int,
    cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR,
    text_column: str = "text",
) -> np.ndarray:
    """Token blocks [n_blocks, max_length] of uint16 or int32, a view of `token_stream`.

    `docs` is a list of strings or a `datasets.Dataset` with `text_column`. With a cache the
    blocks are memory-mapped from it; `cache_dir=None` builds them in memory.
    """
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    return blocks_of(token_stream(docs, tokenizer, cache_dir, text_column), max_length)


def blocks_of(stream: np.ndarray, max_length: int) -> np.ndarray:
    """The stream cut into rows of `max_length`, the partial last row dropped (a view, no copy)."""
    n_blocks = len(stream) // max_length
    if n_blocks == 0:
        raise DataError(
            f"the corpus gives {len(stream)} tokens, fewer than one block of max_length {max_length}"
        )
    return stream[: n_blocks * max_length].reshape(n_blocks, max_length)


def token_stream(
    docs,
    tokenizer,
    cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR,
    text_column: str = "text",
    num_proc: int | None = None,
) -> np.ndarray:
    """All documents' tokens, each document as [bos] tokens eos, as one flat array.

    Empty and missing texts are skipped. The cache file is written atomically, so processes
    that share a cache may build the same entry at once; the trainer lets rank 0 build it while
    the others wait (`acco.launch.after_rank0`). `num_proc` (acco-prepare's): tokenize in that
    many processes, with a progress bar (`_parallel_chunks`); None: as a training job does.
    """
    if tokenizer.eos_token_id is None:
        raise DataError("packing needs a tokenizer with an eos token (use acco.data.load_tokenizer)")
    _say_missing_texts(docs, text_column)
    dtype = np.dtype("<u2") if len(tokenizer) <= 1 << 16 else np.dtype("<i4")
    chunks = functools.partial(_encoded_chunks, docs, tokenizer, text_column, dtype, num_proc)
    if cache_dir is None:
        stream = np.concatenate([np.zeros(0, dtype), *chunks()])
        if len(stream) == 0:
            raise DataError("no tokens to pack: every document is empty")
        return stream

    path = cache_path(docs, tokenizer, cache_dir, text_column)
    found = path.exists()
    if not found:
        _write_npy(path, chunks(), dtype)
    try:
        stream = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:  # truncated (a full disk, a kill outside acco) or overwritten
        raise DataError(f"cache file {path} is damaged ({e}); delete it, and the next run rebuilds it") from e
    if stream.ndim != 1 or stream.dtype != dtype:
        raise DataError(f"cache file {path} is not a token stream of {dtype}; delete it, and the next run "
                        "rebuilds it")
    if found:  # as _write_npy says it, with the count that tells one split's stream from another's
        log.info("token stream (%d tokens) loaded from cache %s", len(stream), path)
    return stream


def _say_missing_texts(docs, text_column: str) -> None:
    """Documents without a text (a null, or a record that lacks the field) are skipped: say how
    many, and refuse a corpus of none."""
    if is_hf_dataset(docs):
        if text_column not in docs.column_names:
            return
        missing, total = docs.data.column(text_column).null_count, len(docs)  # Arrow's count: no scan
    else:
        missing, total = sum(doc is None for doc in docs), len(docs)
    if missing and missing == total:
        raise DataError(f"none of the {total} documents has a text ({text_column!r} missing or null)")
    if missing:
        log.info("%d of %d documents have no text (%r missing or null): skipped", missing, total, text_column)


def packing_cache_key(docs, tokenizer, text_column: str = "text") -> str:
    """A sha256 over the documents' content and the tokenizer's fingerprint."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT_VERSION}\n".encode())
    h.update(corpus_fingerprint(docs, text_column).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()


def cache_path(docs, tokenizer, cache_dir: str | os.PathLike, text_column: str = "text") -> Path:
    """The cache file of these documents' token stream (it may not exist yet)."""
    key = packing_cache_key(docs, tokenizer, text_column)
    return Path(cache_dir).expanduser() / f"{_FORMAT_VERSION}-{key[:32]}.npy"


def _encode(texts, tokenizer, first: int | None = None) -> list[list[int]]:
    """[bos] tokens eos of every non-empty text; a non-string is a DataError (naming the document
    by its index where `first`, the index of texts[0], is known)."""
    kept = []
    for i, text in enumerate(texts):
        if text is None:
            continue
        if not isinstance(text, str):
            which = "a document" if first is None else f"document {first + i}"
            raise DataError(f"{which} is {describe(text)}, not a string")
        if text.strip():
            kept.append(text)
    if not kept:  # a chunk of blank documents (the tokenizer fails on an empty batch)
        return []
    # add_special_tokens=False: we add bos/eos ourselves, once per document. verbose=False
    # silences the "longer than model_max_length" warning: the stream is cut by us.
    ids = tokenizer(kept, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    bos = bos_to_prepend(tokenizer)
    head = [] if bos is None else [bos]
    return [head + row + [tokenizer.eos_token_id] for row in ids]


def _encode_batch(batch: dict, tokenizer, text_column: str) -> dict:
    return {"ids": _encode(batch[text_column], tokenizer)}


def _encoded_chunks(docs, tokenizer, text_column: str, dtype: np.dtype, num_proc: int | None = None):
    """The stream in flat pieces, so that no piece holds more than a batch of documents."""
    if num_proc is not None:
        yield from _parallel_chunks(docs, tokenizer, text_column, dtype, num_proc)
        return
    if is_hf_dataset(docs):
        yield from _dataset_chunks(docs, tokenizer, text_column, dtype)
        return
    for start in range(0, len(docs), _TOKENIZE_BATCH):
        rows = _encode(docs[start : start + _TOKENIZE_BATCH], tokenizer, first=start)
        yield np.fromiter(itertools.chain.from_iterable(rows), dtype, count=sum(map(len, rows)))


def _dataset_chunks(docs, tokenizer, text_column: str, dtype: np.dtype):
    import datasets
    import pyarrow.compute as pc

    if text_column not in docs.column_names:
        raise DataError(f"dataset has no column {text_column!r} (columns: {', '.join(docs.column_names)})")
    # Dataset.map tokenizes in worker processes on a large corpus and keeps its result in
    # datasets' own cache next to the corpus (in memory for an in-memory dataset).
    encoded = docs.select_columns([text_column]).map(
        _encode_batch,
        fn_kwargs={"tokenizer": tokenizer, "text_column": text_column},
        batched=True,
        batch_size=_TOKENIZE_BATCH,
        remove_columns=[text_column],  # rows of empty texts disappear
        features=datasets.Features({"ids": datasets.Sequence(datasets.Value(dtype.name))}),
        num_proc=min(os.cpu_count() or 1, 16) if len(docs) >= _MAP_PROCESSES_FROM else None,
        desc="tokenizing",
    )
    for table in encoded.with_format("arrow").iter(batch_size=100 * _TOKENIZE_BATCH):
        yield pc.list_flatten(table.column("ids")).to_numpy().astype(dtype, copy=False)


_WORKER: dict = {}  # what a process of `_parallel_chunks` tokenizes: set before it forks


def _set_worker(docs, tokenizer, text_column: str, dtype: np.dtype) -> None:
    _WORKER.update(docs=docs, tokenizer=tokenizer, text_column=text_column, dtype=dtype)


def _encode_from(start: int) -> np.ndarray:
    """The flat tokens of documents [start, start + _TOKENIZE_BATCH) of `_WORKER`'s corpus."""
    docs, dtype = _WORKER["docs"], _WORKER["dtype"]
    texts = docs[start : start + _TOKENIZE_BATCH]
    if is_hf_dataset(docs):  # read from the memory-mapped Arrow table, not copied
        texts = texts[_WORKER["text_column"]]
    rows = _encode(texts, _WORKER["tokenizer"], first=start)
    return np.fromiter(itertools.chain.from_iterable(rows), dtype, count=sum(map(len, rows)))


def tokenize_processes(n_docs: int, num_proc: int) -> int:
    """The processes that tokenize `n_docs` documents when `num_proc` are asked for: no more than
    its batches of _TOKENIZE_BATCH documents, and one where processes cannot be forked."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, min(num_proc, -(-n_docs // _TOKENIZE_BATCH)))


def _parallel_chunks(docs, tokenizer, text_column: str, dtype: np.dtype, num_proc: int):
    """The stream batch by batch, in corpus order, from `num_proc` forked processes that each read
    their batches of `docs` (a list, or a Dataset's memory-mapped table) and send back 2 or 4 bytes
    a token: neither the corpus nor its tokens are copied to disk on the way (Dataset.map would
    write all tokens to datasets' cache first). With one process, tokenizers' own threads work."""
    import multiprocessing

    from tqdm.auto import tqdm

    if is_hf_dataset(docs) and text_column not in docs.column_names:
        raise DataError(f"dataset has no column {text_column!r} (columns: {', '.join(docs.column_names)})")
    starts = range(0, len(docs), _TOKENIZE_BATCH)
    procs = tokenize_processes(len(docs), num_proc)
    _set_worker(docs, tokenizer, text_column, dtype)
    pool = multiprocessing.get_context("fork").Pool(procs) if procs > 1 else None
    bar = tqdm(total=len(docs), unit="docs", desc=f"tokenizing ({procs} process{'es' if procs > 1 else ''})")
    try:
        for start, chunk in zip(
            starts, pool.imap(_encode_from, starts) if pool else map(_encode_from, starts)
        ):
            bar.update(min(_TOKENIZE_BATCH, len(docs) - start))
            yield chunk
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
        _WORKER.clear()


def _write_npy(path: Path, chunks, dtype: np.dtype) -> None:
    """Stream `chunks` into a 1-D .npy file, atomically (readers never see a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.seek(_HEADER_BYTES)  # the header holds the length, known only at the end
            n = 0
            for chunk in chunks:
                f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
                n += len(chunk)
            if n == 0:
                raise DataError("no tokens to pack: every document is empty")
            f.seek(0)
            f.write(_npy_header(dtype, n))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    log.info("token stream (%d tokens) cached in %s", n, path)


def _npy_header(dtype: np.dtype, n: int) -> bytes:
    """A version 1.0 .npy header for a 1-D array of `n` items, padded to `_HEADER_BYTES`."""
    fields = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)}
    body = repr(fields).ljust(_HEADER_BYTES - 10 - 1) + "\n"  # 10: magic, version, length
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")
