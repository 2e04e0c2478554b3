"""`acco-prepare ...`: tokenize a run's corpus into train.cache_dir once, before training.

It takes the training command's config groups and overrides (``acco-prepare train=acco data=text
data.path=corpus.jsonl model.tokenizer=bpe train.max_length=256``) and writes exactly the cache
entries that run's workers will look up, doing what they do (acco/cli.py ``train_worker``):

1. the corpus loaded and split by document from train.seed (``acco.data.prepare.split_corpus``);
2. the tokenizer built as rank 0 builds it (``build_tokenizer``: model.tokenizer loaded, or the
   BPE trained on the training split and cached in train.cache_dir), then saved and loaded again
   as every worker loads it from output_dir/tokenizer, so that its fingerprint is theirs;
3. the training and eval splits tokenized into the packing cache (``token_stream``), in
   ``--num-proc`` processes (default: one per CPU) with datasets' progress bar.

The run then memory-maps those files and starts at once: the packing cache key covers the
documents and the tokenizer, not train.max_length, so one preparation serves every block length.
A run on a corpus of more than ``acco.validate.PREPARE_FROM_TOKENS`` tokens that finds no such file
stops in its validation pass with one line naming this command. Nothing is written to
train.output_dir.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from acco.config import InputError, compose, one_line_error
from acco.data.errors import DataError

USAGE = "usage: acco-prepare [--num-proc N] [OVERRIDE ...]   (the training command's overrides)"

HELP = f"""{USAGE}

Tokenize a training run's corpus once, before the run, so that the run starts at once instead of
having every worker wait while rank 0 tokenizes it. Give it the overrides you give the training
command:

  acco-prepare train=acco data=openwebtext data.path=owt/ model=gptneo-125m
  torchrun --nproc-per-node 8 main.py train=acco data=openwebtext data.path=owt/ model=gptneo-125m

It reads and splits the corpus as the run will (train.seed, train.eval_fraction), builds the run's
tokenizer (model.tokenizer=bpe: trained on the training split, and kept in train.cache_dir), and
writes the tokens of the training and eval splits to train.cache_dir, with a progress bar. Nothing
is written to train.output_dir. One preparation serves every train.max_length. A run on a corpus
above 100M tokens that was not prepared stops before training with a line naming this command.
Instruction records (data=alpaca) are tokenized by the run itself.

options:
  --num-proc N   processes that tokenize (default: one per CPU, {{cpus}} here)
  -h, --help     show this help

More: docs/training.md, "Prepare the data once"."""


def default_num_proc() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parse_args(argv: list[str]) -> tuple[int, list[str]]:
    """(--num-proc, the config overrides); a bad flag is an InputError."""
    num_proc, overrides, rest = default_num_proc(), [], list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--num-proc" or arg.startswith("--num-proc="):
            value = arg.partition("=")[2] if "=" in arg else (rest.pop(0) if rest else "")
            if not value.isdigit() or int(value) < 1:
                raise InputError(f"--num-proc must be a positive integer, got {value!r}")
            num_proc = int(value)
        elif arg.startswith("-"):
            raise InputError(f"unknown option {arg!r} ({USAGE})")
        else:
            overrides.append(arg)
    return num_proc, overrides


def prepare(cfg, num_proc: int | None = None) -> dict:
    """Tokenize the run's training and eval splits into train.cache_dir; returns what was done:
    ``{"splits": {name: {"tokens", "path", "cached", "processes"}}, "tokens", "seconds",
    "tokenize_seconds"}``, processes being those that tokenized the split (0: already prepared)."""
    from acco.data.packing import cache_path, token_stream, tokenize_processes
    from acco.data.prepare import split_corpus
    from acco.data.text import temporary_environ
    from acco.data.tokenizer import as_saved
    from acco.job import job_of
    from acco.validate import check_writable_dir, job_tokenizer, read_corpus

    start = time.perf_counter()
    num_proc = num_proc or default_num_proc()
    job = job_of(cfg, world_size=1)  # the workers' number changes nothing here
    args, data = job.args, job.data
    if not args.cache_dir:
        raise InputError(
            "train.cache_dir is null: acco-prepare writes the tokenized corpus there, and the run "
            "reads it from there; set train.cache_dir=FOLDER (the same for training)"
        )
    check_writable_dir(Path(os.path.expanduser(str(args.cache_dir))), "train.cache_dir")
    if data.format != "pretrain":
        raise InputError(
            f"data.format={data.format}: acco-prepare tokenizes pretraining text; instruction "
            "records are tokenized by the run itself (they depend on train.max_length)"
        )
    if not job.model.get("tokenizer"):
        raise InputError("model.tokenizer is not set (a folder, a Hub name, or bpe)")
    # the corpus and the tokenizer as the validation pass and the workers load them
    splits = dict(zip(("train", "eval"), split_corpus(read_corpus(data), args)))
    tokenizer = as_saved(job_tokenizer(job.config, splits["train"]))

    done, tokenize_start = {}, time.perf_counter()
    # With several processes each tokenizes in one thread: tokenizers' own threads would only
    # compete with them (and a forked process warns about them); with one, they work.
    with temporary_environ("TOKENIZERS_PARALLELISM", "false" if num_proc > 1 else None):
        for name, docs in splits.items():
            if docs is None:  # train.eval=false
                continue
            path = cache_path(docs, tokenizer, args.cache_dir, data.text_column)
            cached = path.exists()
            stream = token_stream(docs, tokenizer, args.cache_dir, data.text_column, num_proc=num_proc)
            done[name] = {"tokens": len(stream), "path": str(path), "cached": cached,
                          "processes": 0 if cached else tokenize_processes(len(docs), num_proc)}  # fmt: skip
    end = time.perf_counter()
    return {
        "splits": done,
        "tokens": sum(s["tokens"] for s in done.values()),
        "num_proc": num_proc,
        "seconds": end - start,
        "tokenize_seconds": end - tokenize_start,
    }


def report(result: dict) -> str:
    """What was prepared, one line per split and one for the time and rate."""
    lines = []
    for name, split in result["splits"].items():
        procs = split.get("processes", 0)
        by = "" if split["cached"] else f" by {procs} process{'es' * (procs > 1)}"
        state = "already prepared" if split["cached"] else "written"
        lines.append(f"{name}: {split['tokens']:,} tokens{by}, {state}: {split['path']}")
    new = sum(s["tokens"] for s in result["splits"].values() if not s["cached"])
    # as many as tokenized (a split of fewer batches than --num-proc takes fewer, as its bar says)
    seconds, procs = result["tokenize_seconds"], max(s.get("processes", 0) for s in result["splits"].values())
    if new:
        done = (
            f"{new:,} tokenized in {seconds:.1f} s, {new / max(seconds, 1e-9):,.0f} tokens/s with {procs} "
            f"process{'es' if procs > 1 else ''}"
        )
    else:
        done = "nothing to tokenize"
    lines.append(
        f"{result['tokens']:,} tokens in {result['seconds']:.1f} s ({done}); a run with the same data, "
        "tokenizer and train.cache_dir maps these files"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(HELP.format(cpus=default_num_proc()))
        return
    handler = logging.StreamHandler(sys.stdout)  # acco's notes (caches found) as print's lines
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("acco").addHandler(handler)
    logging.getLogger("acco").setLevel(logging.INFO)
    try:
        num_proc, overrides = parse_args(argv)
        print(report(prepare(compose(overrides), num_proc)), flush=True)
    except Exception as e:  # one line for the user; ACCO_DEBUG=1 shows the traceback
        if os.environ.get("ACCO_DEBUG"):
            raise
        kind = "" if isinstance(e, InputError | DataError) else f"{type(e).__name__}: "
        sys.stderr.write(f"acco: error: {kind}{one_line_error(e)}\n")  # one write of the whole line
        sys.stderr.flush()
        sys.exit(1)
    finally:
        logging.getLogger("acco").removeHandler(handler)


if __name__ == "__main__":
    main()
