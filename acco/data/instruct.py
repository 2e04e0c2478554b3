"""Instruction fine-tuning data in the Stanford Alpaca format, with the prompt masked out.

Each example is the prompt's tokens followed by the response's tokens and eos. The loss is taken
on the response and eos only: labels hold -100 (PyTorch's ignore_index, which Hugging Face
models skip) on the prompt and on padding. Prompt and response are tokenized separately and
concatenated, so the boundary between them is exact whatever the tokenizer merges.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from .errors import DataError, string_field_problem
from .tokenizer import bos_to_prepend, tokenizer_fingerprint

log = logging.getLogger(__name__)

IGNORE_INDEX = -100

# The templates of Stanford Alpaca (github.com/tatsu-lab/stanford_alpaca, train.py).
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


def format_alpaca(record: dict, index: int | None = None) -> tuple[str, str]:
    """(prompt, response) of one record; the template with "### Input:" only when input is non-empty.
    `index`: the record's position, named in the error when its instruction or output is not a
    string."""
    for key in ("instruction", "output"):
        if problem := string_field_problem(record, key):
            which = "instruction record" if index is None else f"instruction record {index}"
            raise DataError(f"{which}: {problem}")
    instruction, output = record["instruction"], record["output"]
    input_text = record.get("input") or ""
    if input_text:
        prompt = ALPACA_PROMPT.format(instruction=instruction, input=input_text)
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
    return prompt, output


def prompt_ids(tokenizer, instruction: str, input: str = "") -> list[int]:
    """The token ids a model fine-tuned on these records was trained to answer: the Alpaca prompt of
    `instruction` (and `input`), as ``tokenize_instructions`` writes it before the response, bos
    first where the tokenizer adds one itself. Generate from them to query the model."""
    prompt, _ = format_alpaca({"instruction": instruction, "input": input, "output": ""})
    bos = bos_to_prepend(tokenizer)
    return ([] if bos is None else [bos]) + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def tokenize_instructions(records: list[dict], tokenizer, max_length: int) -> dict[str, torch.Tensor]:
    """Tensors `input_ids`, `labels`, `attention_mask`, each [n, max_length] (int64).

    A tokenizer that adds bos itself (Llama 3) gets it in front of each example, unlabelled.
    Sequences longer than `max_length` are cut at the end. An example whose prompt alone fills
    `max_length` would have no labelled token at all (a zero-token loss is NaN), so it is dropped
    with a warning: n is the number of examples kept.
    """
    if max_length < 2:
        raise DataError(f"max_length must be >= 2, got {max_length}")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is None or pad is None:
        raise DataError(
            "instruction data needs a tokenizer with eos and pad tokens (use acco.data.load_tokenizer)"
        )

    pairs = [format_alpaca(r, i) for i, r in enumerate(records)]
    prompts, responses = zip(*pairs) if pairs else ((), ())
    # Batched calls: the fast tokenizer encodes a list in parallel in Rust.
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False, verbose=False)["input_ids"]
    response_ids = tokenizer(list(responses), add_special_tokens=False, verbose=False)["input_ids"]
    bos = bos_to_prepend(tokenizer)
    head = [] if bos is None else [bos]

    rows_ids, rows_labels, rows_mask = [], [], []
    n_dropped = 0
    for p, r in zip(prompt_ids, response_ids):
        p = head + list(p)
        target = list(r) + [eos]
        ids = (p + target)[:max_length]
        labels = ([IGNORE_INDEX] * len(p) + target)[:max_length]
        if all(label == IGNORE_INDEX for label in labels):
            n_dropped += 1
            continue
        n_pad = max_length - len(ids)
        rows_ids.append(ids + [pad] * n_pad)
        rows_labels.append(labels + [IGNORE_INDEX] * n_pad)
        rows_mask.append([1] * len(ids) + [0] * n_pad)

    if n_dropped:
        log.warning("%d of %d instruction examples dropped: prompt longer than max_length %d",
                    n_dropped, len(records), max_length)
    if not rows_ids:
        raise DataError(
            f"no instruction example fits in max_length {max_length} ({len(records)} records given)"
        )
    return {
        "input_ids": torch.tensor(rows_ids, dtype=torch.long),
        "labels": torch.tensor(rows_labels, dtype=torch.long),
        "attention_mask": torch.tensor(rows_mask, dtype=torch.long),
    }


_CACHE_VERSION = "instruct-v1"  # bump when the masking or layout rule changes


def cached_instructions(
    records: list[dict], tokenizer, max_length: int, cache_dir
) -> dict[str, torch.Tensor]:
    """`tokenize_instructions`, computed once per (records, tokenizer, max_length) and kept in
    `cache_dir`: the next run, and the other ranks, memory-map the file instead of tokenizing
    again. Written atomically, so ranks sharing a cache never read half a file."""
    h = hashlib.sha256(f"{_CACHE_VERSION}\n{max_length}\n".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    for r in records:  # the fields format_alpaca reads, in a fixed order
        h.update(json.dumps([r.get("instruction"), r.get("input"), r.get("output")]).encode())
    path = Path(cache_dir).expanduser() / f"{_CACHE_VERSION}-{h.hexdigest()[:32]}.pt"
    if path.exists():
        log.info("instruction examples loaded from cache %s", path)
        return torch.load(path, mmap=True, weights_only=True)
    tensors = tokenize_instructions(records, tokenizer, max_length)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(tensors, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return tensors
