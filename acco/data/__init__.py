"""Data for acco: raw text and instruction records in, fixed-shape tensor batches out.

    docs = load_documents("stories.txt")            # or synthetic_corpus(2000)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=8192)
    blocks = pack_documents(docs, tokenizer, max_length=256)
    for batch in MicroBatchStream(blocks, batch_size=8, rank=rank, world_size=world_size):
        loss = model(**batch).loss
"""

from .errors import DataError
from .instruct import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    IGNORE_INDEX,
    format_alpaca,
    tokenize_instructions,
)
from .loader import MicroBatchStream, as_columns, eval_batches, split_train_eval
from .packing import DEFAULT_CACHE_DIR, pack_documents, packing_cache_key
from .synthetic import synthetic_corpus, unigram_entropy
from .text import load_documents, load_records
from .tokenizer import EOS_TOKEN, load_tokenizer, tokenizer_fingerprint, train_bpe

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "DEFAULT_CACHE_DIR",
    "EOS_TOKEN",
    "IGNORE_INDEX",
    "DataError",
    "MicroBatchStream",
    "as_columns",
    "eval_batches",
    "format_alpaca",
    "load_documents",
    "load_records",
    "load_tokenizer",
    "pack_documents",
    "packing_cache_key",
    "split_train_eval",
    "synthetic_corpus",
    "tokenize_instructions",
    "tokenizer_fingerprint",
    "train_bpe",
    "unigram_entropy",
]
