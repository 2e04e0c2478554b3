"""Data for acco: raw text and instruction records in, fixed-shape tensor batches out.

    docs = load_documents("stories.txt")            # or synthetic_corpus(2000)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=8192)
    blocks = pack_documents(docs, tokenizer, max_length=256)   # uint16/int32, memory-mapped
    for batch in MicroBatchStream(blocks, batch_size=8, rank=rank, world_size=world_size):
        loss = model(**batch).loss

What a training job does with a config (load the corpus, split it, build the tokenizer, turn any
dataset into what the streams read) is in ``acco.data.prepare``.

Names are imported from their module on first use: the launcher checks a synthetic or text corpus
without importing torch, transformers or datasets, which its workers import meanwhile.
"""

from __future__ import annotations

import importlib

_MODULES = {
    "errors": ["DataError"],
    "instruct": ["ALPACA_PROMPT", "ALPACA_PROMPT_NO_INPUT", "IGNORE_INDEX", "cached_instructions",
                 "format_alpaca", "prompt_ids", "tokenize_instructions"],
    "loader": ["MicroBatchStream", "Rows", "as_columns", "eval_batches", "split_train_eval"],
    "packing": ["blocks_of", "cache_path", "pack_documents", "packing_cache_key", "token_stream"],
    "prepare": ["build_tokenizer", "is_prepared", "load_corpus_rank0_first", "prepare_dataset",
                "prepare_tokenizer", "rank0_first", "split_corpus"],
    "synthetic": ["synthetic_corpus", "unigram_entropy"],
    "text": ["corpus_fingerprint", "is_hf_dataset", "load_corpus", "load_documents", "load_records",
             "open_documents", "text_bytes"],
    "tokenized": ["pad_token_ids"],
    "tokenizer": ["EOS_TOKEN", "as_saved", "bos_to_prepend", "bpe_cache_folder", "load_tokenizer",
                  "tokenizer_fingerprint", "train_bpe"],
}  # fmt: skip
_WHERE = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
