"""Tests of acco.data: packing documents into blocks (and its cache), and instruction data.

Everything runs offline on files the tests write under tmp_path.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from data_helpers import byte_ids
from datasets import Dataset

import acco.data.instruct
import acco.data.packing
import acco.data.tokenizer
from acco.data import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    DataError,
    format_alpaca,
    load_tokenizer,
    pack_documents,
    tokenize_instructions,
)

# ---------------------------------------------------------------- packing

def test_pack_documents_exact_stream(tmp_path, byte_tok):
    docs = ["ab", "c", "defg"]
    # Stream: a b <eos> c <eos> d e f g <eos>  (10 tokens) -> 3 blocks of 3, last token dropped.
    stream = byte_ids("ab") + [0] + byte_ids("c") + [0] + byte_ids("defg") + [0]
    blocks = pack_documents(docs, byte_tok, max_length=3, cache_dir=None)
    assert blocks.dtype == np.uint16 and blocks.shape == (3, 3)  # widened per micro-batch only
    assert blocks.flatten().tolist() == stream[:9]
    assert pack_documents(docs, byte_tok, max_length=5, cache_dir=None).tolist() == [stream[:5], stream[5:]]
    with pytest.raises(DataError, match="fewer than one block of max_length 11"):
        pack_documents(docs, byte_tok, max_length=11, cache_dir=None)


def test_pack_documents_bpe_shapes_and_eos(bpe, corpus):
    docs = corpus[:20]
    blocks = pack_documents(docs, bpe, max_length=64, cache_dir=None)
    stream = sum((bpe(d)["input_ids"] + [bpe.eos_token_id] for d in docs), [])
    n_blocks = len(stream) // 64
    assert blocks.shape == (n_blocks, 64)
    assert blocks.flatten().tolist() == stream[: n_blocks * 64]
    # Between two eos tokens lies exactly one document.
    flat = blocks.flatten().tolist()
    eos_positions = [i for i, t in enumerate(flat) if t == bpe.eos_token_id]
    assert bpe.decode(flat[: eos_positions[0]]) == docs[0]
    assert bpe.decode(flat[eos_positions[0] + 1 : eos_positions[1]]) == docs[1]


def test_pack_documents_cache_hit_skips_tokenizer(tmp_path, monkeypatch, bpe, corpus):
    cache = tmp_path / "cache"
    docs = corpus[:30]
    first = pack_documents(docs, bpe, max_length=32, cache_dir=str(cache))
    files = os.listdir(cache)
    assert len(files) == 1 and files[0].endswith(".npy")
    # Same special ids as `bpe`, other merges: only the tokenizer's serialization tells them apart.
    other_tok = load_tokenizer("bpe", train_texts=corpus[:50], vocab_size=300)
    assert (other_tok.eos_token_id, other_tok.pad_token_id) == (bpe.eos_token_id, bpe.pad_token_id)
    edited = docs[:-1] + ["X" + docs[-1][1:]]  # same lengths, other content

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the tokenizer was called although the result is cached")

    with monkeypatch.context() as m:
        m.setattr(acco.data.packing, "_encode", no_tokenizing)
        second = pack_documents(docs, bpe, max_length=32, cache_dir=str(cache))
        assert np.array_equal(first, second)
        # The cache holds the token stream: another block length reuses it.
        assert np.array_equal(
            pack_documents(docs, bpe, max_length=16, cache_dir=str(cache))[:2].flatten(), first[0]
        )
        # Anything that changes the result changes the key, so these must tokenize (and fail here).
        for changed_docs, tok in [(edited, bpe), (docs, other_tok)]:
            with pytest.raises(AssertionError, match="tokenizer was called"):
                pack_documents(changed_docs, tok, max_length=32, cache_dir=str(cache))

    # fewer merges
    assert pack_documents(docs, other_tok, max_length=32, cache_dir=str(cache)).shape != first.shape
    assert len(os.listdir(cache)) == 2  # the other tokenizer got its own entry


def test_pack_documents_cache_is_one_flat_memory_mapped_array(tmp_path, bpe, corpus):
    blocks = pack_documents(corpus[:30], bpe, max_length=32, cache_dir=str(tmp_path))
    (cached,) = tmp_path.glob("*.npy")
    stream = np.load(cached, mmap_mode="r")
    assert stream.ndim == 1 and stream.dtype == np.uint16  # a 600-token vocabulary fits in 16 bits
    assert isinstance(blocks, np.memmap) and blocks.shape == (len(stream) // 32, 32)  # a view of the file
    assert np.array_equal(blocks.flatten(), stream[: blocks.size])

    class WideTokenizer:  # a vocabulary above 65536 ids needs int32
        eos_token_id, bos_token_id = 69_999, None

        def __len__(self):
            return 70_000

        def __call__(self, texts, **kwargs):
            return {"input_ids": [[66_000 + len(t)] for t in texts]}

    wide = pack_documents(["ab", "c"], WideTokenizer(), max_length=2, cache_dir=None)
    assert wide.dtype == np.int32 and wide.tolist() == [[66_002, 69_999], [66_001, 69_999]]


def test_pack_documents_from_a_dataset(tmp_path, monkeypatch, bpe, corpus):
    docs = corpus[:30]
    texts = docs[:10] + ["", None, "  "] + docs[10:]
    dataset = Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    blocks = pack_documents(dataset, bpe, max_length=32, cache_dir=str(tmp_path))
    # Empty and missing texts are skipped and other columns ignored, as for a list of documents.
    assert np.array_equal(blocks, pack_documents(docs, bpe, max_length=32, cache_dir=None))

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as m:
        m.setattr(acco.data.packing, "_encode", no_tokenizing)
        # The key is datasets' fingerprint: the same content hits the cache, other content does not.
        same = Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
        assert np.array_equal(pack_documents(same, bpe, max_length=32, cache_dir=str(tmp_path)), blocks)
        with pytest.raises(AssertionError, match="tokenized again"):
            pack_documents(dataset.select(range(20)), bpe, max_length=32, cache_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"^document 1 is a number \(1\), not a string$"):
        pack_documents(["a", 1], bpe, max_length=2, cache_dir=None)


def test_what_packing_finds_wrong_is_said(tmp_path, bpe, corpus, caplog):
    """Documents without a text are counted (none at all: refused); a corpus of blank texts is a
    DataError, not the tokenizer's IndexError; a damaged cache file is named, with what to do."""
    import logging

    with caplog.at_level(logging.INFO, logger="acco.data.packing"):
        pack_documents(Dataset.from_dict({"text": corpus[:20] + [None] * 5}), bpe, 8, cache_dir=None)
    assert "5 of 25 documents have no text ('text' missing or null): skipped" in caplog.text
    with pytest.raises(DataError, match="none of the 3 documents has a text"):
        pack_documents(Dataset.from_dict({"text": [None] * 3}), bpe, max_length=8, cache_dir=None)
    with pytest.raises(DataError, match="every document is empty"):
        pack_documents(["", "  ", "\n"] * 4, bpe, max_length=8, cache_dir=None)
    pack_documents(corpus[:30], bpe, max_length=32, cache_dir=str(tmp_path))
    (cached,) = tmp_path.glob("*.npy")
    cached.write_bytes(cached.read_bytes()[:1000])  # cut short outside acco's atomic write
    with pytest.raises(DataError, match=f"cache file {cached} is damaged .*delete it, and the next run"):
        pack_documents(corpus[:30], bpe, max_length=32, cache_dir=str(tmp_path))


# ---------------------------------------------------------------- instruction data

def test_alpaca_templates_are_the_stanford_ones():
    prompt, response = format_alpaca({"instruction": "Name a color.", "input": "", "output": "Blue."})
    assert prompt == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nName a color.\n\n### Response:"
    )
    assert response == "Blue."
    prompt, _ = format_alpaca({"instruction": "Add.", "input": "2, 3", "output": "5"})
    assert prompt == (
        "Below is an instruction that describes a task, paired with an input that provides further "
        "context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd.\n\n### Input:\n2, 3\n\n### Response:"
    )
    assert prompt == ALPACA_PROMPT.format(instruction="Add.", input="2, 3")
    assert "{input}" not in ALPACA_PROMPT_NO_INPUT


def test_alpaca_masking_every_position(byte_tok):
    rec = {"instruction": "Hi", "input": "", "output": "Yo"}
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction="Hi")
    p = byte_ids(prompt)
    n_pad = 3
    max_length = len(p) + 3 + n_pad  # prompt, "Y", "o", eos, then padding
    out = tokenize_instructions([rec], byte_tok, max_length)
    ids, labels, mask = (out[k][0].tolist() for k in ("input_ids", "labels", "attention_mask"))
    assert all(out[k].shape == (1, max_length) and out[k].dtype == torch.long for k in out)

    for i in range(max_length):
        if i < len(p):  # prompt: model input, no loss
            assert (ids[i], labels[i], mask[i]) == (p[i], -100, 1), i
        elif i == len(p):  # "Y"
            assert (ids[i], labels[i], mask[i]) == (ord("Y") + 1, ord("Y") + 1, 1), i
        elif i == len(p) + 1:  # "o"
            assert (ids[i], labels[i], mask[i]) == (ord("o") + 1, ord("o") + 1, 1), i
        elif i == len(p) + 2:  # eos is learned: the model must learn to stop
            assert (ids[i], labels[i], mask[i]) == (0, 0, 1), i
        else:  # padding: pad id, no loss, not attended
            assert (ids[i], labels[i], mask[i]) == (257, -100, 0), i


def test_alpaca_truncation_and_dropping(byte_tok):
    with_input = {"instruction": "Add.", "input": "2, 3", "output": "five"}
    p = byte_ids(ALPACA_PROMPT.format(instruction="Add.", input="2, 3"))
    # Cut inside the response: "fi" kept, no eos, no padding.
    out = tokenize_instructions([with_input], byte_tok, len(p) + 2)
    assert out["input_ids"][0].tolist() == p + byte_ids("fi")
    assert out["labels"][0].tolist() == [-100] * len(p) + byte_ids("fi")
    assert out["attention_mask"][0].tolist() == [1] * (len(p) + 2)

    # A prompt that fills max_length leaves nothing to learn: that example is dropped.
    short = {"instruction": "x", "output": "y"}
    out = tokenize_instructions([with_input, short], byte_tok, len(p))
    assert out["input_ids"].shape == (1, len(p))
    ps = byte_ids(ALPACA_PROMPT_NO_INPUT.format(instruction="x"))
    assert out["input_ids"][0, : len(ps) + 2].tolist() == ps + byte_ids("y") + [0]  # the short one is kept
    assert out["labels"][0].tolist() == [-100] * len(ps) + byte_ids("y") + [0] + [-100] * (
        len(p) - len(ps) - 2
    )
    with pytest.raises(DataError, match="no instruction example fits"):
        tokenize_instructions([with_input], byte_tok, len(p))


