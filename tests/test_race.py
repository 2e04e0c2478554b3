"""acco-bench race: the crossing of a target by an eval-loss curve, bench.json's keys, the trainer's
stop at a target loss, and a tiny race on loopback (namespaces where they exist)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from acco.data import load_tokenizer, synthetic_corpus
from acco.models import build_model
from acco.trainer import DecoupledTrainer

TINY_MODEL = dict(name="small", arch="gpt_neo", hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64,
                  window_size=64, pretrained=None)


def _trainer(tmp_path, **overrides) -> DecoupledTrainer:
    docs = synthetic_corpus(200)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=300)
    model = build_model(TINY_MODEL, vocab_size=len(tokenizer), max_length=32)
    args = dict(method_name="ddp", batch_size=4, nb_steps_tot=12, max_length=32, eval_step=2, learning_rate=2e-3,
                output_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), save=False, **overrides)
    return DecoupledTrainer(model=model, processing_class=tokenizer, train_dataset=docs, args=OmegaConf.create(args))


def _evals(tmp_path) -> list[dict]:
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["type"] == "eval"]


def test_trainer_stops_at_the_first_evaluation_at_or_below_the_target(tmp_path):
    summary = _trainer(tmp_path, stop_at_eval_loss=1e6).train()  # any loss is below: stop at the first
    assert summary["updates"] == 2 and summary["stopped_at_eval_loss"] is True
    evals = _evals(tmp_path)
    assert [e["step"] for e in evals] == [2]  # no second evaluation after the stop
    assert evals[0]["eval_s"] > 0


def test_trainer_without_a_reachable_target_runs_its_budget(tmp_path):
    summary = _trainer(tmp_path, stop_at_eval_loss=-1.0).train()
    assert summary["updates"] == 12 and summary["stopped_at_eval_loss"] is False
    assert [e["step"] for e in _evals(tmp_path)] == [2, 4, 6, 8, 10, 12]
    assert math.isfinite(summary["final_eval_loss"])


def test_stop_at_eval_loss_must_be_finite(tmp_path):
    from acco.engine import ConfigError

    with pytest.raises(ConfigError, match="stop_at_eval_loss"):
        _trainer(tmp_path, stop_at_eval_loss=float("nan"))
