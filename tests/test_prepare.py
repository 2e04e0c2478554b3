"""acco-prepare: the corpus tokenized once, before training, into the cache the run looks up.

- prepare, then the job (validation and a worker, in-process as `acco.cli.run` runs them with
  launch.nproc=1) trains without tokenizing or training a BPE: for a .jsonl corpus (a Dataset) and
  a .txt one (a list of strings, tokenized in 2 processes with the cache key of a list);
- a large corpus that was not prepared stops the job in its validation pass with one line that
  names the acco-prepare command (the threshold lowered here);
- bad options and overrides are one line and exit 1.

Everything runs offline on files written under tmp_path.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import acco.data.packing
import acco.data.tokenizer
import acco.validate
from acco.cli import run
from acco.config import InputError, TrainArgs, compose
from acco.data import load_tokenizer, synthetic_corpus, token_stream, train_bpe
from acco.data.prepare import split_corpus
from acco.data.text import load_corpus
from acco.prepare_cli import main
from acco.validate import validate_job


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("corpus")
    docs = synthetic_corpus(300, seed=3)
    jsonl, txt = folder / "stories.jsonl", folder / "stories.txt"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    txt.write_text("\n<|endoftext|>\n".join(docs))
    return {"jsonl": jsonl, "txt": txt}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    train_bpe(synthetic_corpus(200, seed=0), vocab_size=400).save_pretrained(folder)
    return folder


def overrides(tmp_path: Path, corpus: Path, *more: str) -> list[str]:
    return ["data=text", f"data.path={corpus}", f"train.cache_dir={tmp_path / 'cache'}",
            f"train.output_dir={tmp_path / 'out'}", "launch.nproc=1", *more]  # fmt: skip


def no_tokenizing(*args, **kwargs):
    raise AssertionError("the job tokenized (or trained a BPE) although the data was prepared")


@pytest.mark.parametrize("kind, num_proc", [("jsonl", "2"), ("txt", "2"), ("txt", "1")])
def test_prepared_data_is_what_the_job_reads(tmp_path, corpora, monkeypatch, capsys, kind, num_proc):
    argv = overrides(tmp_path, corpora[kind], "train.nb_steps_tot=8", "train.eval_step=1", "train.save=false")
    monkeypatch.setattr(acco.data.packing, "_TOKENIZE_BATCH", 16)  # many batches, for 2 processes to share
    main(["--num-proc", num_proc, *argv])
    lines = capsys.readouterr().out.splitlines()
    written = {line.split(":")[0]: Path(line.rsplit(": ", 1)[1]) for line in lines if ", written: " in line}
    assert set(written) == {"train", "eval"} and all(p.exists() for p in written.values())
    assert f"with {num_proc} process" in lines[-1] and "tokens/s" in lines[-1]
    assert not (tmp_path / "out").exists()  # nothing written to the run's folder

    # The tokens are the workers' own: those of the training split with the run's tokenizer.
    cfg = compose(argv)
    args = TrainArgs.from_any(cfg.train)
    train_docs, _ = split_corpus(load_corpus(cfg.data), args)
    bpe = load_tokenizer("bpe", train_texts=train_docs, vocab_size=2048)
    assert np.array_equal(np.load(written["train"]), token_stream(train_docs, bpe, cache_dir=None))

    # The job (validation, then a worker) finds the files and the BPE, and trains at once.
    monkeypatch.setattr(acco.data.packing, "_encode", no_tokenizing)
    monkeypatch.setattr(acco.data.tokenizer, "train_bpe", no_tokenizing)
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # run() sets it: undone after the test
    assert run(cfg) == 0
    assert (tmp_path / "out" / "metrics.jsonl").exists()
    assert sorted((tmp_path / "cache").glob("tokens-v2-*.npy")) == sorted(written.values())

    # Preparing again finds everything there.
    main(["--num-proc", num_proc, *argv])
    assert capsys.readouterr().out.count("already prepared") == 2


def large_corpus_error(argv: list[str]) -> str:
    with pytest.raises(InputError) as info:
        validate_job(compose(argv), world_size=1)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("tokenizer", ["bpe", "folder"])
def test_large_unprepared_corpus_stops_the_job_naming_acco_prepare(
    tmp_path, corpora, tokenizer_dir, monkeypatch, capsys, tokenizer
):
    monkeypatch.setattr(acco.validate, "PREPARE_FROM_TOKENS", 1000)
    spec = "bpe" if tokenizer == "bpe" else str(tokenizer_dir)
    argv = overrides(tmp_path, corpora["jsonl"], f"model.tokenizer={spec}")
    monkeypatch.setattr(sys, "argv", ["acco-train", *argv])  # the launcher's command line
    message = large_corpus_error(argv)
    assert (
        message.startswith(f"data.path '{corpora['jsonl']}': about ")
        and "tokens, not prepared yet" in message
    )
    assert f"run `acco-prepare {' '.join(argv)}` first" in message
    assert not list((tmp_path / "cache").glob("tokens-v2-*.npy"))  # the job did not tokenize either

    main(["--num-proc", "1", *argv])
    capsys.readouterr()
    monkeypatch.setattr(acco.data.packing, "_encode", no_tokenizing)
    monkeypatch.setattr(acco.data.tokenizer, "train_bpe", no_tokenizing)
    validate_job(compose(argv), world_size=1)  # prepared: it passes, and tokenizes nothing
    # Another split (train.seed) or another tokenizer is another preparation.
    other = "model.vocab_size=600" if tokenizer == "bpe" else "model.tokenizer=bpe"
    for more in ("train.seed=1", other):
        assert "not prepared yet" in large_corpus_error([*argv, more])


def test_large_corpus_message_outside_a_command_line(tmp_path, corpora, monkeypatch):
    monkeypatch.setattr(acco.validate, "PREPARE_FROM_TOKENS", 1000)
    monkeypatch.setattr(sys, "argv", ["pytest", "-q", "tests"])  # not overrides: not quoted as such
    message = large_corpus_error(overrides(tmp_path, corpora["txt"]))
    assert "run acco-prepare with this run's overrides first" in message
    # Under the threshold, nothing is asked of a small corpus.
    monkeypatch.setattr(acco.validate, "PREPARE_FROM_TOKENS", 100_000_000)
    validate_job(compose(overrides(tmp_path, corpora["txt"])), world_size=1)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train.nope=1"], "unknown config key 'train.nope'"),
        (["data=nope"], "unknown data 'nope'"),
        (["--num-proc", "0", "data=text"], "--num-proc must be a positive integer, got '0'"),
        (["--workers=2"], "unknown option '--workers=2'"),
        (["data=text", "data.path=/no/such/file.jsonl"], "/no/such/file.jsonl: no such file or folder"),
        (["data=text", "data.path=x.txt", "train.cache_dir=null"], "train.cache_dir is null"),
        (
            ["model.tokenizer=./no-such-folder"],
            "model.tokenizer: tokenizer './no-such-folder': no such folder",
        ),
    ],
)
def test_bad_options_and_overrides_are_one_line(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("acco: error: ") and "\n" not in err and expected in err, err


def test_the_installed_command_is_one_line_and_exit_1():
    command = Path(sys.executable).parent / "acco-prepare"  # pyproject's [project.scripts]
    if not command.exists():
        pytest.skip("acco-prepare is not installed next to this Python (pip install -e .)")
    proc = subprocess.run([str(command), "train.batch_size=x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "acco: error: train.batch_size must be an integer, got 'x'"


def test_help_is_for_users(capsys):
    """`acco-prepare --help`: what it does and how to call it, not the module's notes for developers;
    its example's overrides are a valid run."""
    main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: acco-prepare [--num-proc N] [OVERRIDE ...]")
    assert "--num-proc N" in text and 'docs/training.md, "Prepare the data once"' in text
    for developer_word in ("train_worker", "split_corpus", "build_tokenizer", "token_stream", "``", "acco/"):
        assert developer_word not in text, developer_word
    example = next(line.split()[1:] for line in text.splitlines() if line.strip().startswith("acco-prepare "))
    compose(example)


@pytest.mark.parametrize("batch, processes", [(1000, 1), (16, 2)])
def test_the_progress_bar_and_the_summary_count_the_same_processes(
    tmp_path, corpora, monkeypatch, capsys, batch, processes
):
    """300 documents in one batch of 1000 take one process whatever --num-proc asks (the bar said
    1, the summary 2); in batches of 16 the training split takes 2, its eval split of 15 one:
    each split's line says what its bar says, the summary the most."""
    monkeypatch.setattr(acco.data.packing, "_TOKENIZE_BATCH", batch)
    main(["--num-proc", "2", *overrides(tmp_path, corpora["jsonl"])])
    out, err = capsys.readouterr()
    bars = [int(n) for n in re.findall(r"tokenizing \((\d+) process(?:es)?\):\s+0%", err)]  # a bar's start
    said = [int(n) for n in re.findall(r"^\w+: [\d,]+ tokens by (\d+) process(?:es)?, written: ", out, re.M)]
    assert said == bars == ([1, 1] if batch == 1000 else [2, 1]), (err, out)
    assert f"with {processes} process" in out.splitlines()[-1], out
