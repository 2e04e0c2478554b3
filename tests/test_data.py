"""Tests of acco.data: corpus, tokenizers, loading, packing, instruction masking, micro-batches.

Everything runs offline on files the tests write under tmp_path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

import acco.data.instruct
import acco.data.packing
import acco.data.tokenizer
from acco.data import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    DataError,
    MicroBatchStream,
    Rows,
    bos_to_prepend,
    cached_instructions,
    eval_batches,
    format_alpaca,
    load_documents,
    load_records,
    load_tokenizer,
    open_documents,
    pack_documents,
    pad_token_ids,
    split_train_eval,
    synthetic_corpus,
    tokenize_instructions,
    tokenizer_fingerprint,
    unigram_entropy,
)

EOT = "<|endoftext|>"


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def corpus():
    return synthetic_corpus(400, seed=1)


@pytest.fixture(scope="module")
def bpe(corpus):
    return load_tokenizer("bpe", train_texts=corpus[:300], vocab_size=600)


def _bytes_to_unicode():
    """GPT-2's printable stand-in character for each byte (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def byte_tok():
    """A hand-made tokenizer whose ids we know: byte b -> id b + 1, eos -> 0, pad -> 257.

    No merges, so every byte is one token and expected ids can be written from the text alone.
    Pad differs from eos so tests can tell padding from the end-of-text label.
    """
    vocab = {EOT: 0, **{ch: b + 1 for b, ch in _bytes_to_unicode().items()}, "<pad>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def bos_tok():
    """byte_tok's ids plus a bos (258) that the tokenizer puts in front of every text, as Llama 3's does."""
    vocab = {EOT: 0, **{ch: b + 1 for b, ch in _bytes_to_unicode().items()}, "<pad>": 257, "<bos>": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 258)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=EOT, pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)


def byte_ids(text: str) -> list[int]:
    return [b + 1 for b in text.encode("utf-8")]


def test_byte_tokenizer_fixture_is_what_the_tests_assume(byte_tok):
    assert byte_tok("Hi é\n", add_special_tokens=False)["input_ids"] == byte_ids("Hi é\n")
    assert (byte_tok.eos_token_id, byte_tok.pad_token_id) == (0, 257)


# ---------------------------------------------------------------- synthetic corpus

def test_synthetic_corpus_is_deterministic_and_seeded():
    a = synthetic_corpus(50, seed=3)
    assert a == synthetic_corpus(50, seed=3)
    assert a != synthetic_corpus(50, seed=4)
    assert synthetic_corpus(80, seed=3)[:50] == a  # a bigger corpus extends a smaller one
    assert len(set(a)) > 45  # stories differ from one another
    assert synthetic_corpus(0) == []
    # Pinned: the corpus is a dataset, and stored loss curves are only comparable if it stays put.
    assert synthetic_corpus(1, seed=0)[0].startswith(
        "There once was a smart girl named Rosa. Rosa lived in a tall tree with her sister. "
        "Rosa loved to sing songs every day. One day, Rosa saw a broken cup in the garden."
    )
    assert hashlib.sha256("\n".join(a).encode()).hexdigest()[:16] == "48c9bccf76c8d672"


def test_unigram_entropy_values():
    assert unigram_entropy([[1, 2], [1, 2]]) == pytest.approx(math.log(2))
    assert unigram_entropy([["a", "b", "c", "d"]]) == pytest.approx(math.log(4))
    assert unigram_entropy([[7, 7, 7]]) == 0.0


def test_synthetic_corpus_has_structure_a_bigram_model_learns(corpus, bpe):
    """On held-out stories, a bigram model fitted on others beats the unigram entropy by far."""
    ids = [bpe(d)["input_ids"] for d in corpus]
    train, held_out = ids[:300], ids[300:]
    vocab = len(bpe)
    pairs = Counter((a, b) for s in train for a, b in zip(s, s[1:]))
    contexts = Counter(a for s in train for a in s[:-1])
    alpha = 0.01  # add-alpha smoothing so unseen pairs have a finite cost
    nll = n = 0
    for s in held_out:
        for a, b in zip(s, s[1:]):
            nll -= math.log((pairs[(a, b)] + alpha) / (contexts[a] + alpha * vocab))
            n += 1
    bigram = nll / n
    unigram = unigram_entropy(train)
    assert unigram > 3.5  # a real vocabulary, not a handful of tokens
    assert bigram < 0.6 * unigram, (bigram, unigram)


def test_synthetic_stories_repeat_their_names():
    for story in synthetic_corpus(30, seed=0):
        hero = re.search(r"(?:named|called) (\w+)\.", story).group(1)
        # The hero's name comes back in later sentences: predicting it needs the context.
        assert story.count(hero) >= 3, story


# ---------------------------------------------------------------- tokenizers

def test_bpe_round_trips_and_reloads(tmp_path, corpus):
    save = tmp_path / "tok"
    tok = load_tokenizer("bpe", train_texts=corpus[:300], vocab_size=500, save_dir=str(save))
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 500
    assert tok.eos_token == EOT and tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(EOT)
    for text in [corpus[350], 'Odd  spacing , é ü 漢字\n\n"quoted" .', "x" * 50]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    # Learned merges: a story takes far fewer tokens than bytes.
    assert len(tok(corpus[350])["input_ids"]) < len(corpus[350].encode()) / 2

    assert (save / "tokenizer.json").exists()
    again = load_tokenizer(str(save))
    assert again(corpus[351])["input_ids"] == tok(corpus[351])["input_ids"]
    assert again.eos_token_id == tok.eos_token_id and again.pad_token_id == tok.pad_token_id


def test_gpt2_style_vocab_and_merges_folder_loads(tmp_path, bpe, corpus):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    bpe.backend_tokenizer.model.save(str(folder))
    assert sorted(os.listdir(folder)) == ["merges.txt", "vocab.json"]
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, GPT2TokenizerFast)
    assert len(tok) == len(bpe)
    text = corpus[360]
    assert tok(text)["input_ids"] == bpe(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == bpe.convert_tokens_to_ids(EOT)
    assert tok.pad_token_id == tok.eos_token_id


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="no such folder"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot load tokenizer from folder"):
        load_tokenizer(str(tmp_path / "broken"))
    with pytest.raises(DataError, match="train_texts"):
        load_tokenizer("bpe")
    with pytest.raises(DataError, match="vocab_size"):
        load_tokenizer("bpe", train_texts=["a b"], vocab_size=100)


def test_bpe_is_cached_by_training_texts_and_vocab_size(tmp_path, monkeypatch, corpus):
    cache = str(tmp_path / "cache")
    texts = corpus[:100]
    first = load_tokenizer("bpe", train_texts=texts, vocab_size=400, cache_dir=cache, save_dir=str(tmp_path / "run1"))

    def no_training(*args, **kwargs):
        raise AssertionError("the BPE was trained again")

    with monkeypatch.context() as m:
        m.setattr(acco.data.tokenizer, "train_bpe", no_training)
        again = load_tokenizer("bpe", train_texts=list(texts), vocab_size=400, cache_dir=cache,
                               save_dir=str(tmp_path / "run2"))
        assert again(corpus[200])["input_ids"] == first(corpus[200])["input_ids"]
        assert (again.eos_token_id, again.pad_token_id) == (first.eos_token_id, first.pad_token_id)
        assert (tmp_path / "run2" / "tokenizer.json").exists()  # still saved with the run
        for other_texts, vocab_size in [(corpus[:99], 400), (texts, 420)]:
            with pytest.raises(AssertionError, match="trained again"):
                load_tokenizer("bpe", train_texts=other_texts, vocab_size=vocab_size, cache_dir=cache)
    # A datasets.Dataset (read batch by batch) trains the same BPE as the list of its texts.
    from_dataset = load_tokenizer("bpe", train_texts=Dataset.from_dict({"text": texts}), vocab_size=400)
    from_list = load_tokenizer("bpe", train_texts=texts, vocab_size=400)
    assert from_dataset.backend_tokenizer.to_str() == from_list.backend_tokenizer.to_str()


def test_bos_is_prepended_when_the_tokenizer_adds_it(bos_tok, byte_tok, bpe):
    assert bos_tok("Hi")["input_ids"] == [258, *byte_ids("Hi")]  # the fixture behaves as Llama 3's
    assert bos_to_prepend(bos_tok) == 258
    # bpe has a bos token but does not add it; byte_tok has none.
    assert bpe.bos_token_id is not None and bos_to_prepend(bpe) is None and bos_to_prepend(byte_tok) is None

    blocks = pack_documents(["ab", "c"], bos_tok, max_length=7, cache_dir=None)
    assert blocks.tolist() == [[258, *byte_ids("ab"), 0, 258, *byte_ids("c"), 0]]

    rec = {"instruction": "Hi", "input": "", "output": "Yo"}
    p = byte_ids(ALPACA_PROMPT_NO_INPUT.format(instruction="Hi"))
    out = tokenize_instructions([rec], bos_tok, len(p) + 5)  # bos, prompt, "Yo", eos, one pad
    assert out["input_ids"][0].tolist() == [258, *p, *byte_ids("Yo"), 0, 257]
    assert out["labels"][0].tolist() == [-100] * (len(p) + 1) + byte_ids("Yo") + [0, -100]
    # Whether bos is added changes the packed tokens, so it is part of the cache key.
    no_bos = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bos_tok.backend_tokenizer.to_str()),
                                     eos_token=EOT, pad_token="<pad>")
    assert tokenizer_fingerprint(no_bos) != tokenizer_fingerprint(bos_tok)


def test_instruction_examples_are_cached(bpe, tmp_path, monkeypatch):
    records = [{"instruction": f"Count to {i}.", "input": "", "output": " ".join(map(str, range(i)))} for i in range(1, 9)]
    first = cached_instructions(records, bpe, 256, tmp_path)
    assert len(list(tmp_path.glob("instruct-v1-*.pt"))) == 1

    def no_tokenizing(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(acco.data.instruct, "tokenize_instructions", no_tokenizing)
    again = cached_instructions(records, bpe, 256, tmp_path)
    for key in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(again[key], first[key])
    # Other records or another max_length are another entry.
    for other, length in ((records[:-1], 256), (records, 250)):
        with pytest.raises(AssertionError, match="tokenized again"):
            cached_instructions(other, bpe, length, tmp_path)


# ---------------------------------------------------------------- loading documents and records

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_txt_with_endoftext_separators(tmp_path):
    f = tmp_path / "stories.txt"
    # Blank lines inside a story stay inside it when <|endoftext|> lines are the separators.
    f.write_text(f"One day.\n\nThe end.\n{EOT}\nSecond story.\n{EOT}\n\n{EOT}\nThird.\n")
    assert load_documents(str(f)) == ["One day.\n\nThe end.", "Second story.", "Third."]


def test_load_txt_with_blank_line_separators(tmp_path):
    f = tmp_path / "paras.txt"
    f.write_text("first line\nsame doc\n\n\n  \nsecond doc\n\nthird\n")
    assert load_documents(str(f)) == ["first line\nsame doc", "second doc", "third"]


def test_load_jsonl_json_parquet_and_folder(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "alpha", "id": 1}, {"text": "beta", "id": 2}, {"text": "", "id": 3}])
    (tmp_path / "b.json").write_text(json.dumps([{"body": "gamma"}, {"body": "delta"}]))
    pq.write_table(pa.table({"text": ["epsilon", "zeta"]}), tmp_path / "c.parquet")
    cache = str(tmp_path / "hf-cache")

    assert load_documents(str(tmp_path / "a.jsonl"), cache_dir=cache) == ["alpha", "beta"]  # empty text dropped
    assert load_documents(str(tmp_path / "b.json"), text_column="body", cache_dir=cache) == ["gamma", "delta"]
    assert load_documents(str(tmp_path / "c.parquet"), cache_dir=cache) == ["epsilon", "zeta"]

    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "1.jsonl", [{"text": "one"}])
    (folder / "sub" / "2.txt").write_text("two\n\nthree\n")
    (folder / "notes.md").write_text("ignored: not a data file")
    assert load_documents(str(folder), cache_dir=cache) == ["one", "two", "three"]


def test_load_documents_errors(tmp_path):
    cache = str(tmp_path / "hf-cache")
    with pytest.raises(DataError, match="no such file"):
        load_documents(str(tmp_path / "missing.txt"))
    with pytest.raises(DataError, match="no such file"):
        load_documents("missing.jsonl")  # not a Hub name: it has a file suffix

    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(DataError, match="empty.txt: empty file"):
        load_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl: empty file"):
        load_documents(str(tmp_path / "empty.jsonl"), cache_dir=cache)
    (tmp_path / "only_eos.txt").write_text(f"{EOT}\n{EOT}\n")
    with pytest.raises(DataError, match="no documents"):
        load_documents(str(tmp_path / "only_eos.txt"))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "no closing quote}\n{"text": "fine"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 2: malformed JSON"):
        load_documents(str(bad), cache_dir=cache)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[{"text": "a"},\n {"text": b}\n]')
    with pytest.raises(DataError, match=r"bad.json, line 2: malformed JSON"):
        load_documents(str(bad_json), cache_dir=cache)

    write_jsonl(tmp_path / "cols.jsonl", [{"content": "x"}])
    with pytest.raises(DataError, match=r"no column 'text' \(columns: content\)"):
        load_documents(str(tmp_path / "cols.jsonl"), cache_dir=cache)
    (tmp_path / "data.csv").write_text("text\nx\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_documents(str(tmp_path / "data.csv"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match="folder has no"):
        load_documents(str(tmp_path / "nothing"))


def test_open_documents_keeps_tables_memory_mapped(tmp_path):
    cache = str(tmp_path / "hf-cache")
    write_jsonl(tmp_path / "a.jsonl", [{"text": "alpha", "id": 1}, {"text": "beta", "id": 2}])
    pq.write_table(pa.table({"text": ["gamma"]}), tmp_path / "b.parquet")
    one = open_documents(str(tmp_path / "a.jsonl"), cache_dir=cache)
    assert isinstance(one, Dataset) and one.column_names == ["text"] and list(one["text"]) == ["alpha", "beta"]
    (tmp_path / "tables").mkdir()
    for name in ("a.jsonl", "b.parquet"):
        os.replace(tmp_path / name, tmp_path / "tables" / name)
    both = open_documents(str(tmp_path / "tables"), cache_dir=cache)
    assert list(both["text"]) == ["alpha", "beta", "gamma"]
    (tmp_path / "s.txt").write_text("one\n\ntwo\n")
    assert open_documents(str(tmp_path / "s.txt")) == ["one", "two"]  # plain text stays a list

    with pytest.raises(DataError, match="no column 'body'"):
        open_documents(str(tmp_path / "tables"), text_column="body", cache_dir=cache)
    write_jsonl(tmp_path / "n.jsonl", [{"text": 1}])
    with pytest.raises(DataError, match="not strings"):
        open_documents(str(tmp_path / "n.jsonl"), cache_dir=cache)


def test_load_records(tmp_path):
    cache = str(tmp_path / "hf-cache")
    rows = [
        {"instruction": "Add.", "input": "2 and 3", "output": "5"},
        {"instruction": "Greet.", "output": "Hello!"},  # no input field at all
    ]
    records = load_records(write_jsonl(tmp_path / "ok.jsonl", rows), cache_dir=cache)
    assert [(r["instruction"], r["input"], r["output"]) for r in records] == [
        ("Add.", "2 and 3", "5"), ("Greet.", "", "Hello!")]

    pq.write_table(pa.table({"instruction": ["a"], "input": [""], "output": ["b"]}), tmp_path / "r.parquet")
    assert load_records(str(tmp_path / "r.parquet"), cache_dir=cache)[0]["output"] == "b"

    rows_bad = [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "d"}, {"instruction": "e"}]
    with pytest.raises(DataError, match="record 2 lacks 'output'"):
        load_records(write_jsonl(tmp_path / "bad.jsonl", rows_bad), cache_dir=cache)
    with pytest.raises(DataError, match="record 0 lacks 'instruction'"):
        load_records(write_jsonl(tmp_path / "bad2.jsonl", [{"output": "x"}]), cache_dir=cache)
    with pytest.raises(DataError, match="no such file"):
        load_records(str(tmp_path / "missing.jsonl"))


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
        assert np.array_equal(pack_documents(docs, bpe, max_length=16, cache_dir=str(cache))[:2].flatten(), first[0])
        # Anything that changes the result changes the key, so these must tokenize (and fail here).
        for changed_docs, tok in [(edited, bpe), (docs, other_tok)]:
            with pytest.raises(AssertionError, match="tokenizer was called"):
                pack_documents(changed_docs, tok, max_length=32, cache_dir=str(cache))

    assert pack_documents(docs, other_tok, max_length=32, cache_dir=str(cache)).shape != first.shape  # fewer merges
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
    with pytest.raises(DataError, match="int, not a string"):
        pack_documents(["a", 1], bpe, max_length=2, cache_dir=None)


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
    assert out["labels"][0].tolist() == [-100] * len(ps) + byte_ids("y") + [0] + [-100] * (len(p) - len(ps) - 2)
    with pytest.raises(DataError, match="no instruction example fits"):
        tokenize_instructions([with_input], byte_tok, len(p))


# ---------------------------------------------------------------- train/eval split

def test_split_train_eval():
    train, evl = split_train_eval(100, 0.1, seed=0)
    assert len(evl) == 10 and len(train) == 90
    assert sorted(train.tolist() + evl.tolist()) == list(range(100))
    again_train, again_eval = split_train_eval(100, 0.1, seed=0)
    assert torch.equal(evl, again_eval) and torch.equal(train, again_train)
    assert not torch.equal(evl, split_train_eval(100, 0.1, seed=1)[1])
    assert evl.tolist() != list(range(90, 100)) and evl.tolist() != list(range(10))  # random, not a slice
    assert len(split_train_eval(10, 0.01, seed=0)[1]) == 1  # at least one eval example
    with pytest.raises(DataError):
        split_train_eval(1, 0.5, seed=0)
    with pytest.raises(DataError):
        split_train_eval(10, 1.0, seed=0)


# ---------------------------------------------------------------- micro-batch stream

def ids_of(batch):
    """The dataset rows are numbered: row i holds i, so a batch shows which rows it took."""
    return batch["input_ids"][:, 0].tolist()


def numbered(n, width=4):
    return torch.arange(n).unsqueeze(1).repeat(1, width)


def take(stream, k):
    return [ids_of(next(stream)) for _ in range(k)]


def test_stream_shards_are_disjoint_and_cover_the_epoch():
    data = numbered(23)  # 23 = 3 global batches of 6, and a tail of 5 that is dropped
    streams = [MicroBatchStream(data, batch_size=2, rank=r, world_size=3, seed=5) for r in range(3)]
    assert streams[0].batches_per_epoch == 3 and streams[0].samples_per_epoch == 18
    seen = [sum(take(s, 3), []) for s in streams]
    for r in range(3):
        assert len(set(seen[r])) == 6
        for q in range(r):
            assert not set(seen[r]) & set(seen[q])
    all_seen = sum(seen, [])
    assert len(set(all_seen)) == 18 and set(all_seen) <= set(range(23))

    # Divisible size: the ranks together read every sample exactly once per epoch, every epoch.
    data = numbered(24)
    streams = [MicroBatchStream(data, batch_size=2, rank=r, world_size=3, seed=5) for r in range(3)]
    for _epoch in range(3):
        assert sorted(sum((sum(take(s, 4), []) for s in streams), [])) == list(range(24))


def test_stream_global_batches_do_not_depend_on_world_size():
    data = numbered(40)
    two = [MicroBatchStream(data, batch_size=2, rank=r, world_size=2, seed=0) for r in range(2)]
    one = MicroBatchStream(data, batch_size=4, seed=0)
    for _ in range(25):  # across epoch boundaries
        assert sorted(ids_of(next(two[0])) + ids_of(next(two[1]))) == sorted(ids_of(next(one)))


def test_stream_is_deterministic_per_seed_and_reshuffles_each_epoch():
    data = numbered(32)
    a = take(MicroBatchStream(data, batch_size=4, seed=7), 16)
    assert a == take(MicroBatchStream(data, batch_size=4, seed=7), 16)
    assert a != take(MicroBatchStream(data, batch_size=4, seed=8), 16)
    epoch0, epoch1 = sum(a[:8], []), sum(a[8:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(32))
    assert epoch0 != epoch1
    assert epoch0 != list(range(32))  # shuffled
    # Seeds 0 and 1 must not give the same orders shifted by one epoch.
    s0, s1 = MicroBatchStream(data, 4, seed=0), MicroBatchStream(data, 4, seed=1)
    assert not torch.equal(s0.permutation(1), s1.permutation(0))


def test_stream_resumes_exactly_from_state_dict():
    data = {"input_ids": numbered(20), "attention_mask": torch.ones(20, 4, dtype=torch.long)}
    stream = MicroBatchStream(data, batch_size=3, rank=1, world_size=2, seed=11)  # 3 batches/epoch
    take(stream, 5)
    state = stream.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    expected = [next(stream) for _ in range(7)]

    resumed = MicroBatchStream(data, batch_size=3, rank=1, world_size=2, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    for want in expected:
        got = next(resumed)
        assert set(got) == {"input_ids", "labels", "attention_mask"}
        for key in want:
            assert torch.equal(got[key], want[key])
    # A fresh stream (no resume) would have given other batches.
    fresh = MicroBatchStream(data, batch_size=3, rank=1, world_size=2, seed=11)
    assert ids_of(next(fresh)) != ids_of(expected[0])

    with pytest.raises(DataError, match="seed"):
        MicroBatchStream(data, batch_size=3, rank=1, world_size=2, seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="global_batch_size"):
        MicroBatchStream(data, batch_size=2, rank=1, world_size=2, seed=11).load_state_dict(state)


def test_stream_batches_labels_and_errors():
    blocks = numbered(8)
    batch = next(MicroBatchStream(blocks, batch_size=2))
    assert set(batch) == {"input_ids", "labels"}
    assert torch.equal(batch["labels"], batch["input_ids"]) and batch["input_ids"].shape == (2, 4)

    labels = -numbered(8)
    batch = next(MicroBatchStream({"input_ids": blocks, "labels": labels}, batch_size=2))
    assert torch.equal(batch["labels"], -batch["input_ids"])  # rows stay aligned across columns

    with pytest.raises(DataError, match=r"5 samples.*batch_size 3 x world_size 2 = 6"):
        MicroBatchStream(numbered(5), batch_size=3, world_size=2)
    with pytest.raises(DataError, match="differ in length"):
        MicroBatchStream({"input_ids": blocks, "labels": labels[:7]}, batch_size=2)
    with pytest.raises(DataError, match="rank"):
        MicroBatchStream(blocks, batch_size=2, rank=2, world_size=2)


def test_eval_batches_fixed_order_and_complete():
    data = numbered(10)
    batches = [ids_of(b) for b in eval_batches(data, 4)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [ids_of(b) for b in eval_batches(data, 4)] == batches  # same every time
    shards = [sum((ids_of(b) for b in eval_batches(data, 2, rank=r, world_size=3)), []) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10)) and shards[1] == [1, 4, 7]
    with pytest.raises(DataError):
        eval_batches(data, 0)


def test_rows_select_is_an_index_view_and_take_widens_to_int64():
    blocks = np.arange(40, dtype=np.uint16).reshape(10, 4)
    rows = Rows(blocks)
    sub = rows.select(torch.tensor([9, 7, 5, 3])).select([3, 0])  # rows 3 and 9
    assert len(sub) == 2 and sub.columns["input_ids"] is blocks  # no tokens copied
    batch = sub.take([1, 0])
    assert batch["input_ids"].dtype == torch.long and ids_of(batch) == [36, 12]
    assert torch.equal(batch["labels"], batch["input_ids"])
    # A stream over a selection reads the selected rows only.
    evens = MicroBatchStream(rows.select(np.arange(0, 10, 2)), batch_size=5)
    assert sorted(ids_of(next(evens))) == [0, 8, 16, 24, 32]
    assert [ids_of(b) for b in eval_batches(rows.select([4, 1, 2]), 2)] == [[16, 4], [8]]


def test_eval_batches_collates_examples_per_rank():
    examples = [{"input_ids": [i] * (i % 3 + 1)} for i in range(7)]

    def collate(chunk):
        return {"input_ids": torch.tensor([e["input_ids"][0] for e in chunk])}

    shards = [[b["input_ids"].tolist() for b in eval_batches(examples, 2, r, 2, collate=collate)] for r in range(2)]
    assert shards == [[[0, 2], [4, 6]], [[1, 3], [5]]]


def test_pretokenized_rows_are_padded_and_checked():
    dataset = Dataset.from_dict({
        "input_ids": [[5, 6, 7], [8, 9]], "attention_mask": [[1, 1, 1], [1, 1]], "labels": [[-100, 6, 7], [8, 9]],
    })  # fmt: skip
    out = pad_token_ids(dataset, max_length=4, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]  # padded to the longest row
    assert out["labels"].tolist() == [[-100, 6, 7], [8, 9, -100]]  # the user's -100 kept
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    as_list = pad_token_ids(rows, max_length=4, pad_token_id=0)
    assert all(np.array_equal(as_list[k], out[k]) for k in out)
    # run_clm.py's blocks: equal lengths and no labels: labels = input_ids, nothing to pad.
    blocks = pad_token_ids(Dataset.from_dict({"input_ids": [[1, 2], [3, 4]]}), max_length=2, pad_token_id=None)
    assert set(blocks) == {"input_ids", "labels"} and blocks["labels"].tolist() == [[1, 2], [3, 4]]

    with pytest.raises(DataError, match="example 0 has 3 tokens, more than max_length 2"):
        pad_token_ids(dataset, max_length=2, pad_token_id=0)
    with pytest.raises(DataError, match="example 1: labels has 1 values, input_ids 2"):
        pad_token_ids([{"input_ids": [1], "labels": [1]}, {"input_ids": [2, 3], "labels": [2]}], 4, 0)
    with pytest.raises(DataError, match="pad token"):
        pad_token_ids(dataset, max_length=4, pad_token_id=None)
