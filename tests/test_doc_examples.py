"""The Python snippets of docs/training.md, run as written (tests/test_docs.py checks the shell
commands): the train_config of "In your own script" is a whole, valid config, and the query of
"Instruction data" runs on a tiny model fine-tuned here on instruction records, feeding it the
prompt its training saw. Nothing is downloaded."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def python_block(section: str, containing: str) -> str:
    """The ```python block of `section` (a ## heading of docs/training.md) that holds `containing`."""
    text = DOC.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", body, re.S) if containing in b]
    assert len(blocks) == 1, f"docs/training.md, {section!r}: {len(blocks)} python blocks with {containing!r}"
    return blocks[0]


def test_the_scripts_train_config_is_whole_and_valid():
    from acco.config import TrainArgs

    block = ast.parse(python_block("In your own script", "train_config = {"))
    given = next(ast.literal_eval(node.value) for node in block.body
                 if isinstance(node, ast.Assign) and node.targets[0].id == "train_config")  # fmt: skip
    args = TrainArgs.from_any(given)
    values = {"method_name" if k == "method" else k: v for k, v in given.items()}
    assert {k: getattr(args, k) for k in values} == values
    assert {"method", "batch_size", "max_length", "nb_steps_tot", "learning_rate", "output_dir"} <= set(given)


RECORDS = [
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
    {"instruction": "Name the capital of France.", "input": "", "output": "Paris."},
] * 8


def test_querying_the_fine_tuned_model_as_the_doc_says(tmp_path, monkeypatch, capsys):
    from acco.data import format_alpaca, load_tokenizer, tokenize_instructions
    from acco.models import build_model
    from acco.trainer import DecoupledTrainer

    monkeypatch.chdir(tmp_path)  # the snippet's folder, outputs/acco/model, is relative
    texts = ["".join(format_alpaca(r)) for r in RECORDS]
    tokenizer = load_tokenizer("bpe", train_texts=texts, vocab_size=400)
    model = build_model({"arch": "gpt_neo", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                         "max_position_embeddings": 256, "window_size": 256},
                        vocab_size=len(tokenizer), max_length=96)  # fmt: skip
    args = {"method": "acco", "batch_size": 2, "max_length": 96, "nb_steps_tot": 4,
            "use_mixed_precision": False, "eval": False, "output_dir": "outputs/acco", "cache_dir": None}
    DecoupledTrainer(model=model, tokenizer=tokenizer, train_dataset=RECORDS, args=args).train()
    capsys.readouterr()

    namespace: dict = {}
    exec(compile(python_block("Instruction data", "prompt_ids"), str(DOC), "exec"), namespace)
    ids = namespace["ids"][0].tolist()
    # the prompt of the record, as the training examples begin: up to the first labelled token
    example = tokenize_instructions(RECORDS[:1], namespace["tokenizer"], 96)
    labelled = int((example["labels"][0] != -100).nonzero()[0])
    assert ids == example["input_ids"][0, :labelled].tolist()
    printed = capsys.readouterr().out
    response = namespace["tokenizer"].decode(namespace["out"][0, len(ids):], skip_special_tokens=True)
    assert namespace["out"].shape[1] > len(ids) and printed == response + "\n"
    assert isinstance(namespace["model"], torch.nn.Module)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_instruction_records_given_as_text_point_to_data_alpaca(tmp_path, suffix):
    import json

    from acco.config import InputError, compose
    from acco.validate import validate_job

    path = tmp_path / f"records{suffix}"
    lines = "".join(json.dumps(r) + "\n" for r in RECORDS)
    path.write_text(lines if suffix == ".jsonl" else json.dumps(RECORDS))
    overrides = ["data=text", f"data.path={path}", f"train.output_dir={tmp_path / 'out'}",
                 f"train.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    with pytest.raises(InputError) as info:
        validate_job(compose(overrides), world_size=1)
    message = str(info.value)
    assert "has no column 'text' (columns: instruction, input, output); these are instruction records: " \
        "data=alpaca data.path=... fine-tunes on them (docs/training.md, 'Instruction data')" in message
    validate_job(compose([*overrides[1:], "data=alpaca"]), world_size=1)  # which reads them
