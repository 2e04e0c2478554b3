"""Getting a tokenizer: train a byte-level BPE, or load one from a folder or the Hub.

Every tokenizer returned here is a fast (Rust-backed) `transformers` tokenizer with an
end-of-text token, and a pad token (the end-of-text token when it had none): packing puts the
end-of-text token between documents and instruction batches are padded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerFast

from .errors import DataError, looks_like_local_path, one_line
from .text import corpus_fingerprint, is_hf_dataset

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
_BPE_VERSION = "bpe-v1"  # bump when train_bpe changes, to invalidate cached tokenizers

# Files that mark a folder written by `save_pretrained` (or a Hub snapshot).
_TRANSFORMERS_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_bpe(texts, vocab_size: int = 8192, text_column: str = "text") -> PreTrainedTokenizerFast:
    """Train a GPT-2 style byte-level BPE on `texts` (as the ACCO paper did on TinyStories).

    `texts`: a list of strings or a `datasets.Dataset` with `text_column` (read batch by batch).
    Byte-level means every string can be encoded (no unknown token) and decoding gives the
    original text back exactly.
    """
    if not len(texts):
        raise DataError("cannot train a BPE tokenizer: no training texts were given")
    n_bytes = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= n_bytes:
        raise DataError(
            f"BPE vocab_size must exceed the {n_bytes} byte symbols + 1 special token, got {vocab_size}"
        )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # Start from all 256 bytes so that text unseen in training still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_text_batches(texts, text_column), trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        # The default clean-up turns " ." into "." and would break exact round trips.
        clean_up_tokenization_spaces=False,
    )


def _text_batches(texts, text_column: str):
    """Lists of strings for `train_from_iterator`, without reading a whole Dataset into memory."""
    if is_hf_dataset(texts):
        for batch in texts.select_columns([text_column]).iter(batch_size=1000):
            yield [t for t in batch[text_column] if t]
    else:
        for start in range(0, len(texts), 1000):
            yield list(texts[start : start + 1000])


def load_tokenizer(
    spec: str,
    train_texts=None,
    vocab_size: int = 8192,
    save_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    text_column: str = "text",
) -> PreTrainedTokenizerFast:
    """Return a fast tokenizer with an eos token (and pad = eos when it has no pad token).

    `spec` is one of:
    - "bpe": train a byte-level BPE of `vocab_size` on `train_texts` (a list of strings or a
      `datasets.Dataset` with `text_column`); with `cache_dir`, a BPE trained on the same texts
      with the same `vocab_size` before is loaded from there instead of trained again;
    - a folder written by `save_pretrained` (tokenizer.json / tokenizer_config.json);
    - a folder with only the GPT-2 files vocab.json + merges.txt;
    - otherwise a Hugging Face Hub name such as "EleutherAI/gpt-neo-125M".
    `save_dir`, when given, receives the tokenizer in `save_pretrained` form.
    """
    if spec == "bpe":
        if train_texts is None:
            raise DataError('tokenizer "bpe" needs train_texts to train on')
        tokenizer = _cached_bpe(train_texts, vocab_size, cache_dir, text_column)
    elif os.path.isdir(spec):
        tokenizer = _load_folder(spec)
    elif os.path.exists(spec) or looks_like_local_path(spec):
        raise DataError(f"tokenizer {spec!r}: no such folder (expected a folder with tokenizer files)")
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec, use_fast=True)
        except Exception as e:  # the Hub raises many types; the user needs the name and the cause
            raise DataError(f"cannot load tokenizer {spec!r} from the Hugging Face Hub: {one_line(e)}") from e

    _ensure_eos_and_pad(tokenizer, spec)
    if save_dir is not None:
        tokenizer.save_pretrained(os.fspath(save_dir))
    return tokenizer


def _cached_bpe(texts, vocab_size: int, cache_dir, text_column: str) -> PreTrainedTokenizerFast:
    """train_bpe, cached under a key of the training texts' fingerprint and vocab_size."""
    if cache_dir is None:
        return train_bpe(texts, vocab_size, text_column)
    folder = bpe_cache_folder(texts, vocab_size, cache_dir, text_column)
    if folder.is_dir():
        log.info("BPE tokenizer loaded from cache %s", folder)
        return _load_folder(str(folder))
    tokenizer = train_bpe(texts, vocab_size, text_column)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=folder.parent, prefix=f"{folder.name}.tmp")
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, folder)  # atomic: a reader sees no folder or a complete one
    except OSError:  # another process cached the same tokenizer first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("BPE tokenizer trained on the data (%d tokens of the %d asked), cached in %s", len(tokenizer),
             vocab_size, folder)
    return tokenizer


def bpe_cache_folder(texts, vocab_size: int, cache_dir: str | os.PathLike, text_column: str = "text") -> Path:
    """Where `load_tokenizer("bpe", ...)` caches the BPE trained on `texts` (it may not exist yet)."""
    key = hashlib.sha256(
        f"{_BPE_VERSION} vocab_size={vocab_size} {corpus_fingerprint(texts, text_column)}".encode()
    ).hexdigest()
    return Path(cache_dir).expanduser() / "tokenizers" / f"{_BPE_VERSION}-{key[:32]}"


def as_saved(tokenizer) -> PreTrainedTokenizerFast:
    """The tokenizer saved and loaded again, as every rank of a run loads it from
    output_dir/tokenizer: its fingerprint, and so its packing cache keys, are then the workers'."""
    with tempfile.TemporaryDirectory(prefix="acco-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        return load_tokenizer(tmp)


def bos_to_prepend(tokenizer) -> int | None:
    """The bos id when the tokenizer adds bos to every text itself (Llama 3 does), else None.

    Packing and instruction data tokenize with add_special_tokens=False, to place eos
    themselves; they put this bos back in front of each document or example, so that a
    pretrained model sees its inputs start as they did in its pretraining.
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    ids = tokenizer("x", add_special_tokens=True, verbose=False)["input_ids"]
    return bos if ids[:1] == [bos] else None


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash that changes whenever the token ids this tokenizer produces could change.

    Used as part of cache keys: the full serialization (vocab, merges, normalizer,
    pre-tokenizer, added tokens) plus the special-token ids that packing inserts.
    """
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow (pure Python) tokenizer has no serialization: use its vocabulary
        h.update(type(tokenizer).__name__.encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(
        f"eos={tokenizer.eos_token_id} pad={tokenizer.pad_token_id} bos={bos_to_prepend(tokenizer)}".encode()
    )
    return h.hexdigest()


def _load_folder(folder: str) -> PreTrainedTokenizerFast:
    files = set(os.listdir(folder))
    try:
        if files & set(_TRANSFORMERS_FILES):
            return AutoTokenizer.from_pretrained(folder, use_fast=True)
        if {"vocab.json", "merges.txt"} <= files:
            vocab_file = os.path.join(folder, "vocab.json")
            # Positional arguments: transformers 5 silently ignores `vocab_file=` keywords.
            tokenizer = GPT2TokenizerFast(vocab_file, os.path.join(folder, "merges.txt"))
            with open(vocab_file, encoding="utf-8") as f:
                n_vocab = len(json.load(f))
            if len(tokenizer) < n_vocab:
                raise DataError(
                    f"tokenizer folder {folder!r}: loaded {len(tokenizer)} tokens, vocab.json has {n_vocab}"
                )
            return tokenizer
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot load tokenizer from folder {folder!r}: {one_line(e)}") from e
    raise DataError(
        f"tokenizer folder {folder!r} has no tokenizer files "
        "(expected tokenizer.json, tokenizer_config.json, or vocab.json + merges.txt)"
    )


def _ensure_eos_and_pad(tokenizer, spec: str) -> None:
    if tokenizer.eos_token is None:
        if EOS_TOKEN in tokenizer.get_vocab():
            tokenizer.eos_token = EOS_TOKEN
        else:
            raise DataError(
                f"tokenizer {spec!r} has no end-of-text token and no {EOS_TOKEN!r} in its vocabulary"
            )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
