"""Data for acco: raw text and instruction records in, fixed-shape tensor batches out.

    docs = load_documents("stories.txt")            # or synthetic_corpus(2000)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=8192)
    blocks = pack_documents(docs, tokenizer, max_length=256)   # uint16/int32, memory-mapped
    for batch in MicroBatchStream(blocks, batch_size=8, rank=rank, world_size=world_size):
        loss = model(**batch).loss
"""

from .errors import DataError
from .instruct import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    IGNORE_INDEX,
    cached_instructions,
    format_alpaca,
    tokenize_instructions,
)
from .loader import MicroBatchStream, Rows, as_columns, eval_batches, split_train_eval
from .packing import DEFAULT_CACHE_DIR, blocks_of, pack_documents, packing_cache_key, token_stream
from .synthetic import synthetic_corpus, unigram_entropy
from .text import corpus_fingerprint, is_hf_dataset, load_documents, load_records, open_documents
from .tokenized import pad_token_ids
from .tokenizer import EOS_TOKEN, bos_to_prepend, load_tokenizer, tokenizer_fingerprint, train_bpe

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "DEFAULT_CACHE_DIR",
    "EOS_TOKEN",
    "IGNORE_INDEX",
    "DataError",
    "MicroBatchStream",
    "Rows",
    "as_columns",
    "blocks_of",
    "bos_to_prepend",
    "corpus_fingerprint",
    "eval_batches",
    "format_alpaca",
    "cached_instructions",
    "is_hf_dataset",
    "load_documents",
    "load_records",
    "load_tokenizer",
    "open_documents",
    "pack_documents",
    "packing_cache_key",
    "pad_token_ids",
    "split_train_eval",
    "synthetic_corpus",
    "token_stream",
    "tokenize_instructions",
    "tokenizer_fingerprint",
    "train_bpe",
    "unigram_entropy",
]
