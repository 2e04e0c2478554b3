"""What DecoupledTrainer reads of a user's dataset, as transformers.Trainer does: token ids already
there are used as they are (a text column beside them is not tokenized again), a data collator is
given only the fields the model's forward takes (remove_unused_columns), and a Trainer key whose
value acco would not honour is refused with what to set instead."""

from __future__ import annotations

import math

import pytest
import transformers
from trainer_helpers import SMALL, small_run

from acco.data import load_tokenizer, synthetic_corpus
from acco.models import build_model
from acco.trainer import DecoupledTrainer


@pytest.fixture(scope="module")
def setting():
    docs = synthetic_corpus(120)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=300)
    return docs, tokenizer


def test_token_ids_beside_their_text_are_used_as_they_are(tmp_path, setting):
    """ds.map(tokenize) without remove_columns keeps the text: the user's ids (here each with a
    prefix token the text alone would not give) are what trains, not the text packed anew."""
    from datasets import Dataset

    docs, tokenizer = setting
    model = build_model(SMALL, vocab_size=len(tokenizer), max_length=32)
    ids = [[7] + tokenizer(d)["input_ids"][:31] for d in docs[:40]]
    ds = Dataset.from_dict({"text": docs[:40], "input_ids": ids})
    trainer = DecoupledTrainer(
        model=model, processing_class=tokenizer, train_dataset=ds, args=small_run(tmp_path)
    )
    assert len(trainer.train_data) + len(trainer.eval_data) == 40  # one row per example, none packed
    rows = trainer.train_data.take(list(range(len(trainer.train_data))))["input_ids"]
    assert all(row[0] == 7 for row in rows.tolist())
    assert trainer.train()["samples"] == 4


def test_a_collator_is_given_only_what_the_model_takes(tmp_path, setting):
    """Examples with a string and an integer field beside input_ids: the collator sees input_ids
    only (a string breaks DataCollatorForLanguageModeling, an unknown integer would reach the
    model's forward); with remove_unused_columns=false it gets every field."""
    from transformers import DataCollatorForLanguageModeling

    docs, tokenizer = setting
    model = build_model(SMALL, vocab_size=len(tokenizer), max_length=32)
    rows = [{"input_ids": tokenizer(d)["input_ids"][: 10 + i % 20], "note": d[:8], "idx": i}
            for i, d in enumerate(docs)]  # fmt: skip
    pads = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    seen = set()

    def collator(examples):
        seen.update(k for e in examples for k in e)
        return pads(examples)

    trainer = DecoupledTrainer(model=model, processing_class=tokenizer, train_dataset=rows,
                               data_collator=collator, args=small_run(tmp_path))  # fmt: skip
    summary = trainer.train()
    assert summary["samples"] == 4 and math.isfinite(summary["final_eval_loss"])
    assert seen == {"input_ids"}

    seen.clear()
    keep_all = DecoupledTrainer(model=model, processing_class=tokenizer, train_dataset=rows,
                                data_collator=collator, args=small_run(tmp_path, remove_unused_columns=False))
    with pytest.raises(ValueError):  # what transformers.Trainer does with remove_unused_columns=False
        keep_all.evaluate()
    assert seen == {"input_ids", "note", "idx"}


def test_gradient_accumulation_steps_is_refused_unless_it_is_one():
    from acco.engine import ConfigError
    from acco.trainer import TrainArgs

    with pytest.raises(ConfigError, match="args must be a dict.*got 'acco'"):
        TrainArgs.from_any("acco")

    with pytest.raises(ConfigError, match="accumulation_steps=4 is not supported.*n_grad_accumulation"):
        TrainArgs.from_any({"gradient_accumulation_steps": 4})
    with pytest.warns(UserWarning, match="ignoring the seed's train key.*gradient_accumulation_steps"):
        assert TrainArgs.from_any({"gradient_accumulation_steps": 1}).n_grad_accumulation == 1


def test_no_eval_fraction_and_no_eval_set_says_what_to_do(tmp_path, setting):
    from acco.data import DataError

    docs, tokenizer = setting
    model = build_model(SMALL, vocab_size=len(tokenizer), max_length=32)
    with pytest.raises(DataError, match="got 0.0 .give an eval set, or set train.eval=false"):
        DecoupledTrainer(model=model, processing_class=tokenizer, train_dataset=docs,
                         args=small_run(tmp_path, eval_fraction=0.0))  # fmt: skip
    quiet = DecoupledTrainer(model=model, processing_class=tokenizer, train_dataset=docs,
                             args=small_run(tmp_path, eval_fraction=0.0, eval=False))  # fmt: skip
    assert quiet.eval_data is None


def test_a_model_that_cannot_take_the_tokenizer_or_the_length_is_one_line(tmp_path, setting):
    """A user's model whose embedding has fewer rows than the tokenizer has tokens, or fewer
    positions than max_length, or an encoder: refused as DecoupledTrainer is built (an IndexError
    in the first forward otherwise; an encoder would train, seeing the tokens it predicts)."""
    from acco.models import ModelError

    docs, tokenizer = setting
    small = build_model(SMALL, vocab_size=len(tokenizer) - 10, max_length=32)
    with pytest.raises(ModelError, match=f"the tokenizer has {len(tokenizer)} tokens, more than the "
                                         f"{len(tokenizer) - 10} rows of the model's input embedding"):
        DecoupledTrainer(
            model=small, processing_class=tokenizer, train_dataset=docs, args=small_run(tmp_path)
        )
    bert = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=64)
    with pytest.raises(ModelError, match="BertForMaskedLM is not a causal language model"):
        DecoupledTrainer(model=transformers.BertForMaskedLM(bert), processing_class=tokenizer,
                         train_dataset=docs, args=small_run(tmp_path))
    model = build_model(SMALL, vocab_size=len(tokenizer), max_length=32)
    with pytest.raises(ModelError, match="max_length 128 exceeds the model's max_position_embeddings .64."):
        DecoupledTrainer(model=model, processing_class=tokenizer, train_dataset=docs,
                         args=small_run(tmp_path, max_length=128))  # fmt: skip


def test_a_token_id_outside_the_vocabulary_is_one_clear_error_in_training_and_evaluation(tmp_path):
    """Pre-tokenized ids the model has no row for: a DataError on the host that names the id and
    the vocabulary (on a GPU it would be a device-side assert naming nothing), not an IndexError."""
    import torch
    from trainer_helpers import tiny_args, tiny_data, tiny_model

    from acco.data import DataError

    bad = tiny_data()
    bad["input_ids"][:, 3] = 96  # the tiny model has 96 rows: ids 0 to 95
    args = tiny_args("ddp", tmp_path / "run", nb_steps_tot=4, save=False)
    trainer = DecoupledTrainer(model=tiny_model(), train_dataset=bad, args=args)
    said = r"input_ids holds token id 96 \(2 such in this micro-batch\), outside the model's vocabulary of 96"
    with pytest.raises(DataError, match=said + r" \(ids 0 to 95\)"):
        trainer.train()
    good = tiny_data()
    trainer = DecoupledTrainer(model=tiny_model(), train_dataset=good, eval_dataset=bad, args=args)
    with pytest.raises(DataError, match="input_ids holds token id 96"):
        trainer.evaluate()
    labels = good | {"labels": good["input_ids"].clone().index_fill_(1, torch.tensor([2]), -100)}
    labels["labels"][0, 5] = 500  # a label the head has no logit for
    with pytest.raises(DataError, match="labels holds token id 500"):
        DecoupledTrainer(model=tiny_model(), train_dataset=labels, eval_dataset=labels, args=args).evaluate()
    labels["labels"][0, 5] = 7  # -100 labels are no token: they pass
    assert math.isfinite(DecoupledTrainer(model=tiny_model(), train_dataset=labels, eval_dataset=labels,
                                          args=args).evaluate()["eval_loss"])
