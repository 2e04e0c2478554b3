"""Packing documents into fixed-length blocks for causal-LM pretraining, with a disk cache.

Every document is followed by the eos token, all documents are concatenated into one token
stream, and the stream is cut into rows of `max_length` (the last partial row is dropped). No
padding is needed, so every position of every block is a training target, as in GPT-2,
nanoGPT and the ACCO paper's runs.

Tokenizing a large corpus takes minutes, so the result is cached on disk under a key that
covers everything that determines it: the documents' content, the tokenizer (its full
serialization and special ids) and `max_length`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .errors import DataError
from .tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/acco"
_FORMAT_VERSION = "packed-v1"  # bump when the packing rule changes, to invalidate old caches
_TOKENIZE_BATCH = 1000


def pack_documents(
    docs: list[str],
    tokenizer,
    max_length: int,
    cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR,
) -> torch.Tensor:
    """Token blocks of shape [n_blocks, max_length] (int64) from `docs`.

    `cache_dir=None` turns the cache off. The cache file is written atomically, so several
    processes (ranks on one node) may pack the same corpus at once.
    """
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    if tokenizer.eos_token_id is None:
        raise DataError("packing needs a tokenizer with an eos token (use acco.data.load_tokenizer)")

    cache_file = None
    if cache_dir is not None:
        key = packing_cache_key(docs, tokenizer, max_length)
        cache_file = Path(cache_dir).expanduser() / f"{_FORMAT_VERSION}-{key[:32]}.safetensors"
        if cache_file.exists():
            log.info("packed tokens loaded from cache %s", cache_file)
            return load_file(cache_file)["blocks"].long()

    stream = _token_stream(docs, tokenizer)
    n_blocks = len(stream) // max_length
    if n_blocks == 0:
        raise DataError(
            f"{len(docs)} documents give {len(stream)} tokens, fewer than one block of max_length {max_length}"
        )
    # Keep int32 until the end: half the memory of int64 for a large corpus.
    blocks = torch.from_numpy(stream[: n_blocks * max_length].reshape(n_blocks, max_length))

    if cache_file is not None:
        _save_atomically(blocks, cache_file)
    return blocks.long()


def packing_cache_key(docs: list[str], tokenizer, max_length: int) -> str:
    """A sha256 over the documents' content, the tokenizer fingerprint and max_length."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT_VERSION} max_length={max_length} n_docs={len(docs)}\n".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    for doc in docs:
        data = doc.encode("utf-8")
        # Length-prefixed, so that ["ab", "c"] and ["a", "bc"] get different keys.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _token_stream(docs: list[str], tokenizer) -> np.ndarray:
    """All documents' tokens, each document followed by eos, as one int32 array."""
    eos = np.array([tokenizer.eos_token_id], dtype=np.int32)
    pieces = []
    for start in range(0, len(docs), _TOKENIZE_BATCH):
        batch = docs[start : start + _TOKENIZE_BATCH]
        # add_special_tokens=False: some tokenizers would add bos/eos themselves; we add eos
        # once per document. verbose=False silences the "longer than model_max_length" warning,
        # which does not apply since we cut the stream ourselves.
        encoded = tokenizer(batch, add_special_tokens=False, return_attention_mask=False, verbose=False)
        for ids in encoded["input_ids"]:
            pieces.append(np.asarray(ids, dtype=np.int32))
            pieces.append(eos)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def _save_atomically(blocks: torch.Tensor, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file({"blocks": blocks.contiguous()}, tmp)
        os.replace(tmp, path)  # readers see the old state or the whole new file, never half
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    log.info("packed tokens cached in %s", path)
