"""Tests of acco.data: the synthetic corpus, tokenizers, and loading documents and records.

Everything runs offline on files the tests write under tmp_path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from data_helpers import EOT, byte_ids, write_jsonl
from datasets import Dataset
from tokenizers import Tokenizer
from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

import acco.data.instruct
import acco.data.packing
import acco.data.tokenizer
from acco.data import (
    ALPACA_PROMPT_NO_INPUT,
    DataError,
    bos_to_prepend,
    cached_instructions,
    corpus_fingerprint,
    load_documents,
    load_records,
    load_tokenizer,
    open_documents,
    pack_documents,
    synthetic_corpus,
    tokenize_instructions,
    tokenizer_fingerprint,
    unigram_entropy,
)


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
    first = load_tokenizer(
        "bpe", train_texts=texts, vocab_size=400, cache_dir=cache, save_dir=str(tmp_path / "run1")
    )

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
    records = [
        {"instruction": f"Count to {i}.", "input": "", "output": " ".join(map(str, range(i)))}
        for i in range(1, 9)
    ]
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
    write_jsonl(
        tmp_path / "a.jsonl", [{"text": "alpha", "id": 1}, {"text": "beta", "id": 2}, {"text": "", "id": 3}]
    )
    (tmp_path / "b.json").write_text(json.dumps([{"body": "gamma"}, {"body": "delta"}]))
    pq.write_table(pa.table({"text": ["epsilon", "zeta"]}), tmp_path / "c.parquet")
    cache = str(tmp_path / "hf-cache")

    # empty text dropped
    assert load_documents(str(tmp_path / "a.jsonl"), cache_dir=cache) == ["alpha", "beta"]
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
    assert (
        isinstance(one, Dataset) and one.column_names == ["text"] and list(one["text"]) == ["alpha", "beta"]
    )
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
    with pytest.raises(DataError, match=r"n.jsonl, line 1 \(row 0\): 'text' is a number \(1\), not a string"):
        open_documents(str(tmp_path / "n.jsonl"), cache_dir=cache)


@pytest.mark.parametrize(
    ("value", "found"),
    [(5, "a number (5)"), (2.5, "a number (2.5)"), (True, "a boolean (true)"), (["a", "b"], "a list"),
     ({"body": "x"}, "an object")],
)
def test_a_text_that_is_not_a_string_is_named_by_row_line_and_type(tmp_path, value, found):
    """A text column of mixed values (datasets' Json type): the first bad row (a null before it
    counted, as datasets counts it), its file line and what it holds."""
    cache = str(tmp_path / "hf-cache")
    jsonl = tmp_path / "mixed.jsonl"
    rows = [{"text": "fine"}, {"text": None}, {"text": "also fine"}, {"text": value}, {"text": 7}]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = f"mixed.jsonl, line 4 (row 3): 'text' is {found}, not a string"
    for read in (open_documents, load_documents):
        with pytest.raises(DataError, match=re.escape(expected)):
            read(str(jsonl), cache_dir=cache)
    array = tmp_path / "mixed.json"  # one JSON array over several lines: no line to name, the row
    array.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    with pytest.raises(DataError, match=re.escape(f"mixed.json, row 3: 'text' is {found}, not a string")):
        open_documents(str(array), cache_dir=cache)


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

    rows_bad = [
        {"instruction": "a", "output": "b"},
        {"instruction": "c", "output": "d"},
        {"instruction": "e"},
    ]
    with pytest.raises(DataError, match=r"line 3 \(record 2\): no 'output' field \(fields: instruction\)$"):
        load_records(write_jsonl(tmp_path / "bad.jsonl", rows_bad), cache_dir=cache)
    no_instruction = r"line 1 \(record 0\): no 'instruction' field \(fields: output\)$"
    with pytest.raises(DataError, match=no_instruction):
        load_records(write_jsonl(tmp_path / "bad2.jsonl", [{"output": "x"}]), cache_dir=cache)
    spaced = tmp_path / "spaced.jsonl"  # blank lines are no records, but count as lines
    lines = [json.dumps(r) for r in rows_bad[:2]] + ["", '{"instruction": "e", "output": null}']
    spaced.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"spaced.jsonl, line 4 \(record 2\): 'output' is null, not a str"):
        load_records(str(spaced), cache_dir=cache)
    with pytest.raises(DataError, match="no such file"):
        load_records(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize(
    ("output", "found"), [(None, "null"), (3, "a number (3)"), (["a"], "a list"), ({"a": 1}, "an object")]
)
def test_a_record_whose_output_is_not_a_string_names_its_line_and_type(tmp_path, byte_tok, output, found):
    """The field is there, its value is wrong: said so (not that the record lacks it), with the
    file, its line and the record's index in it."""
    cache = str(tmp_path / "hf-cache")
    rows = [{"instruction": "a", "input": "", "output": "b"}, {"instruction": "c", "output": output}]
    path = write_jsonl(tmp_path / "ft.jsonl", rows)
    expected = f"ft.jsonl, line 2 (record 1): 'output' is {found}, not a string"
    with pytest.raises(DataError, match=re.escape(expected) + "$"):
        load_records(path, cache_dir=cache)
    (tmp_path / "ft.json").write_text(json.dumps(rows, indent=2))  # an array: the record's index only
    with pytest.raises(DataError, match=re.escape(f"ft.json, record 1: 'output' is {found}, not a string")):
        load_records(str(tmp_path / "ft.json"), cache_dir=cache)
    # records given to the trainer directly (no file): their index
    expected = f"instruction record 1: 'output' is {found}, not a string"
    with pytest.raises(DataError, match=re.escape(expected)):
        tokenize_instructions(rows, byte_tok, 64)
    with pytest.raises(DataError, match="no such file"):
        load_records(str(tmp_path / "missing.jsonl"))




def test_a_table_file_edited_under_its_old_timestamp_gets_another_cache_key(tmp_path):
    """datasets keys a local file by its path and modification time: a copy made with cp -p, or
    an edit followed by touch -r, kept the old key, and training read the old file's tokens."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(50)))
    stamp = path.stat().st_mtime_ns
    before = corpus_fingerprint(open_documents(str(path), cache_dir=str(tmp_path / "hf")))
    path.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(10)))
    os.utime(path, ns=(stamp, stamp))
    assert corpus_fingerprint(open_documents(str(path), cache_dir=str(tmp_path / "hf"))) != before
