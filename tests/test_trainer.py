"""The product surface: `python -m acco.cli` end to end, and DecoupledTrainer as in the seed README."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import free_port, run_distributed
from omegaconf import OmegaConf
from trainer_helpers import SMALL, small_run

from acco.data import DataError, load_tokenizer, synthetic_corpus
from acco.engine import EngineConfig, build_engine
from acco.models import build_model
from acco.trainer import DecoupledTrainer, causal_lm_loss

TINY = OmegaConf.load(Path(__file__).parents[1] / "acco" / "conf" / "model" / "tiny.yaml")


def cli(tmp_path: Path, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "acco.cli", "launch.nproc=2", f"train.cache_dir={tmp_path / 'cache'}",
        "train.learning_rate=1e-3", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow  # a whole CLI job on 2 workers (the slow tier: make test-slow)
def test_cli_trains_acco_and_ddp_with_all_outputs(tmp_path):
    common = (
        "data.n_docs=600",
        "train.nb_steps_tot=160",
        "train.eval_step=10",
        "train.accumulate_while_waiting=false",
    )
    runs = {
        "acco": ("train=acco", "train.n_grad_accumulation=1"),
        "ddp": ("train=ddp", "train.n_grad_accumulation=2"),
    }
    summaries = {}
    for name, overrides in runs.items():
        out = tmp_path / name
        proc = cli(tmp_path, *overrides, *common, f"train.output_dir={out}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"done: {name} 160 micro-batches" in proc.stdout

        config = OmegaConf.load(out / "config.yaml")
        assert config.train.method_name == name and config.model.name == "tiny"
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        train = [x for x in lines if x["type"] == "train"]
        evals = [x for x in lines if x["type"] == "eval"]
        assert [x["step"] for x in train] == list(range(1, 41))  # 160 micro-batches / 4 per update
        for key in ("samples", "tokens", "loss", "lr", "wall_time", "compute_s", "wait_s", "micro_batches"):
            assert all(key in x for x in train), key
        assert all(x["micro_batches"] == [2, 2] for x in train)
        assert train[-1]["tokens"] == 160 * 8 * 64
        assert all(x["target_tokens"] == 4 * 8 * 63 for x in train)  # packed blocks: every next token
        assert [x["step"] for x in evals] == [10, 20, 30, 40]
        assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
        for rank in (0, 1):
            timers = [
                json.loads(line) for line in (out / "workers" / f"rank{rank}.jsonl").read_text().splitlines()
            ]
            assert len(timers) == 40 and all(t["compute_s"] > 0 for t in timers)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["method"] == name and summary["world_size"] == 2 and summary["samples"] == 160
        assert summary["final_eval_loss"] == evals[-1]["eval_loss"]
        assert summary["tokens_per_s"] > 0 and 0 < summary["overlap_efficiency"] <= 1.5
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))
        assert (out / "loss.png").stat().st_size > 0
        assert (out / "model" / "model.safetensors").exists() and (out / "model" / "tokenizer.json").exists()
        summaries[name] = summary
    # Same data, same samples, same effective batch: acco lands where ddp does.
    acco, ddp = summaries["acco"]["final_eval_loss"], summaries["ddp"]["final_eval_loss"]
    assert abs(acco - ddp) / ddp < 0.03, (acco, ddp)


TRAINER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from datasets import Dataset
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM
    from acco import DecoupledTrainer
    from acco.data import eval_batches, load_tokenizer, synthetic_corpus
    from acco.models import build_model
    from acco.trainer import causal_lm_loss

    out, cache, tiny = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")  # the user's own process group is reused
    docs = synthetic_corpus(400)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=512)
    ds = Dataset.from_dict({"text": docs}).train_test_split(test_size=0.1, seed=0)
    ds = {"train": ds["train"], "validation": ds["test"]}
    model = build_model(OmegaConf.load(tiny), vocab_size=len(tokenizer), max_length=32)
    train_config = dict(method_name="acco", batch_size=4, n_grad_accumulation=1, learning_rate=2e-3,
                        nb_steps_tot=48, max_length=32, warmup=8, eval_step=4, output_dir=out, seed=0,
                        cache_dir=cache, save=False, accumulate_while_waiting=False,
                        use_mixed_precision=False)
    trainer = DecoupledTrainer(model=model, tokenizer=tokenizer, train_dataset=ds["train"],
                               eval_dataset=ds["validation"], text_column_name="text", args=train_config)
    summary = trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(out + "/saved")
    if dist.get_rank() == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out + "/saved")
        loss_sum = tokens = 0.0
        for batch in eval_batches(trainer.eval_data, 4):
            s, n = causal_lm_loss(reloaded, batch)
            loss_sum, tokens = loss_sum + s.item(), tokens + n.item()
        json.dump({"summary": summary, "metrics": metrics, "reloaded_eval_loss": loss_sum / tokens},
                  open(out + "/result.json", "w"))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow  # a whole job under torchrun
def test_decoupled_trainer_as_in_the_seed_readme_under_torchrun(tmp_path):
    script = tmp_path / "train_script.py"
    script.write_text(TRAINER_SCRIPT)
    tiny = Path(__file__).parents[1] / "acco" / "conf" / "model" / "tiny.yaml"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(script), str(tmp_path / "out"), str(tmp_path / "cache"),
        str(tiny),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    metrics = result["metrics"]
    assert set(metrics) == {"eval_loss", "eval_perplexity"}
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert metrics["eval_loss"] == pytest.approx(result["summary"]["final_eval_loss"], rel=1e-6)
    assert result["summary"]["samples"] == 48 and result["summary"]["world_size"] == 2
    # The saved model reloads with transformers and scores the same.
    assert result["reloaded_eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-4)


def test_single_process_trainer_with_omegaconf_args_and_processing_class(tmp_path):
    docs = synthetic_corpus(300)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=512)
    model = build_model(TINY, vocab_size=len(tokenizer), max_length=32)
    args = OmegaConf.create(
        dict(
            method_name="ddp",
            batch_size=4,
            n_grad_accumulation=2,
            use_mixed_precision=False,
            learning_rate=2e-3,
            nb_steps_tot=24,
            max_length=32,
            eval_step=100,
            output_dir=str(tmp_path / "run"),
            cache_dir=str(tmp_path / "cache"),
            save=False,
        )
    )
    trainer = DecoupledTrainer(model=model, processing_class=tokenizer, train_dataset=docs, args=args)
    before = trainer.evaluate()["eval_loss"]
    summary = trainer.train()
    assert summary["world_size"] == 1 and summary["updates"] == 12
    assert summary["peak_rss_mb"] > 0 and "peak_gpu_mem_mb" not in summary  # the CPU's memory, named so
    assert summary["final_eval_loss"] < before


@pytest.mark.slow  # a timed 2-worker job: the serial tier
def test_a_slow_worker_is_not_stretched_by_the_trainers_evaluations(tmp_path, monkeypatch):
    """The trainer evaluates and checkpoints inside `OnDevice.not_compute()`: with train.slowdown,
    an evaluation's CPU must not be stretched into the next micro-batch (it was once: the race saw
    the slow worker's compute alternate 1.76 / 2.36 s, and --comm-share 0.40 measured 0.34)."""
    import time
    import types

    from acco.data import on_device

    slept: list[float] = []
    clock = types.SimpleNamespace(thread_time=time.thread_time, sleep=slept.append)
    monkeypatch.setattr(on_device, "time", clock)  # this module's sleeps only, recorded
    evaluate = DecoupledTrainer._evaluate_and_log

    def slow_evaluation(self, log, record):  # 0.4 s of this thread's CPU, as a bigger eval set would
        start = time.thread_time()
        while time.thread_time() - start < 0.4:
            torch.ones(64, 64) @ torch.ones(64, 64)
        return evaluate(self, log, record)

    monkeypatch.setattr(DecoupledTrainer, "_evaluate_and_log", slow_evaluation)
    docs = synthetic_corpus(120)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=320)
    args = dict(method_name="ddp", batch_size=2, n_grad_accumulation=1, use_mixed_precision=False,
                learning_rate=1e-3, nb_steps_tot=6, max_length=16, eval_step=1, slowdown=2.0,
                output_dir=str(tmp_path / "run"), save=False)  # fmt: skip
    trainer = DecoupledTrainer(
        model=build_model(SMALL, vocab_size=len(tokenizer), max_length=16),
        processing_class=tokenizer, train_dataset=docs, eval_dataset=docs[:8], args=args,
    )  # fmt: skip
    assert trainer.train()["updates"] == 6
    # (2 - 1) x one micro-batch of a 1-layer model: milliseconds; with the evaluation stretched in,
    # over its 0.4 s after every one of the 5 evaluations (0.8 s and more, seen with not_compute()
    # removed). On a loaded machine a micro-batch's own sleep reached 0.2 s, twice in one run (the
    # first micro-batch's set-up, a garbage collection): only a sleep holding the evaluation's 0.4 s
    # counts, one of them allowed.
    assert len(slept) >= 3 and sum(x >= 0.4 for x in slept) <= 1, slept


def test_unknown_train_key_is_rejected():
    from acco.engine import ConfigError
    from acco.trainer import TrainArgs

    with pytest.raises(ConfigError, match="unknown train key.*batchsize"):
        TrainArgs.from_any({"batchsize": 4})


@pytest.mark.parametrize("method", ["acco", "ddp", "dpu", "wp", "torch-ddp", "torch-hsdp", "diloco",
                                    "streaming-diloco"])
def test_the_api_takes_the_engines_method_key_and_the_command_lines_defaults(method):
    """DecoupledTrainer's args as a dict: the engine's key `method` (the seed's `method_name` as
    well), and every key it leaves out as `python main.py train=METHOD` sets it (the tiny model's
    recipe aside, being model=tiny's: a model without one here)."""
    from acco.config import ConfigError, TrainArgs, compose
    from acco.job import typed_config

    command_line = typed_config(compose([f"train={method}", "model=gptneo-36m"]))[0]
    assert TrainArgs.from_any({"method": method}) == command_line
    defaults = TrainArgs.from_any({"method": method})  # as docs/training.md, "In your own script", says
    assert (defaults.batch_size, defaults.max_length, defaults.use_mixed_precision, defaults.nb_steps_tot,
            defaults.eval_step, defaults.max_eval_batches, defaults.output_dir) == (
        24, 1024, True, 50000, 100, 50, f"outputs/{method}")
    assert TrainArgs.from_any({"method_name": method, "method": method}) == command_line
    assert TrainArgs.from_any(OmegaConf.create({"method_name": method})) == command_line
    given = TrainArgs.from_any({"method": method, "max_length": 64, "output_dir": "run"})
    assert (given.max_length, given.output_dir, given.eval_step) == (64, "run", command_line.eval_step)
    with pytest.raises(ConfigError, match=r"^method='ddp' and method_name='acco': the same key"):
        TrainArgs.from_any({"method": "ddp", "method_name": "acco"})


def test_the_api_s_defaults_compose_inside_a_hydra_app():
    """The seed's scripts run under their own @hydra.main: Hydra holds one app at a time, and
    reading train=METHOD's defaults hands theirs back as it was."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from acco.config import TrainArgs, compose

    with initialize_config_module(config_module="acco.conf", version_base="1.3"):
        app = GlobalHydra.instance().hydra
        assert TrainArgs.from_any({"method": "wp"}).n_grad_accumulation == 2
        compose(["train=ddp"])
        assert GlobalHydra.instance().hydra is app
    assert not GlobalHydra.instance().is_initialized()


def test_the_seed_configs_keys_and_numbers_as_strings():
    """The schema reads YAML 1.1's "6e-4" as a number; the seed's keys that acco does not need
    are ignored with one warning, unless their value would change the training."""
    from acco.engine import ConfigError
    from acco.trainer import TrainArgs

    with pytest.warns(
        UserWarning, match="ignoring the seed's train key.*group_by_length, dataloader_num_workers"
    ):
        args = TrainArgs.from_any(
            {"learning_rate": "6e-4", "group_by_length": False, "dataloader_num_workers": 4}
        )
    assert args.learning_rate == 6e-4
    with pytest.raises(ConfigError, match="label_smoothing_factor=0.1 is not supported"):
        TrainArgs.from_any({"label_smoothing_factor": 0.1})
    with pytest.raises(ConfigError, match="train.learning_rate must be a number, got 'fast'"):
        TrainArgs.from_any({"learning_rate": "fast"})


def test_loss_is_normalised_by_target_tokens_across_micro_batches():
    """Two micro-batches with 3 and 7 target tokens: the update uses the mean over all 10 tokens."""
    torch.manual_seed(0)
    cfg = {**TINY, "num_layers": 1}
    model = build_model(cfg, vocab_size=50, max_length=8)
    reference = build_model(cfg, vocab_size=50, max_length=8)
    reference.load_state_dict(model.state_dict())
    engine_free_state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 50, (2, 1, 8))
    labels = ids.clone()
    labels[0, 0, :5] = -100  # 3 targets (positions 5..7)
    labels[1, 0, :1] = -100  # 7 targets
    batches = [{"input_ids": ids[i], "labels": labels[i]} for i in range(2)]
    engine = build_engine(
        model,
        EngineConfig(
            method="ddp",
            n_grad_accumulation=2,
            nb_steps_tot=2,
            learning_rate=1e-2,
            scheduler_name="constant",
            weight_decay=0.0,
            adam_eps=1e-3,
            max_grad_norm=None,  # clipping would hide the normalisation
        ),
    )
    records = list(engine.run(iter(batches), causal_lm_loss))
    sums = [causal_lm_loss(reference, b) for b in batches]
    total = sum(s for s, _ in sums) / sum(n for _, n in sums)
    total.backward()
    # A large eps keeps Adam's first step proportional to the gradient (not just its sign), so a
    # wrong normalisation shows; it also damps rounding noise on near-zero gradients.
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-3)
    opt.step()
    assert records[0].loss == pytest.approx(total.item(), rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    # A per-micro-batch mean would weigh the 3-token batch like the 7-token one: another update.
    wrong = build_model(cfg, vocab_size=50, max_length=8)
    wrong.load_state_dict(engine_free_state)
    sums = [causal_lm_loss(wrong, b) for b in batches]
    ((sums[0][0] / sums[0][1] + sums[1][0] / sums[1][1]) / 2).backward()
    torch.optim.AdamW(wrong.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-3).step()
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), wrong.parameters()))
    assert diff > 1e-4, diff


ALPACA = [
    {"instruction": "Give the opposite of the word.", "input": "hot", "output": "cold"},
    {"instruction": "Name a color.", "input": "", "output": "Blue is a color."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."},
    {"instruction": "Say hello.", "input": "", "output": "Hello there!"},
]


@pytest.mark.slow  # a whole CLI job on 2 workers (the slow tier: make test-slow)
def test_cli_fine_tunes_on_alpaca_records(tmp_path):
    data = tmp_path / "alpaca.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ALPACA * 30) + "\n")
    out = tmp_path / "ft"
    proc = cli(
        tmp_path, "train=acco-ft", "data=alpaca", f"data.path={data}", f"train.output_dir={out}",
        "train.max_length=128", "train.batch_size=4", "train.nb_steps_tot=32", "train.eval_step=4",
        "train.save=false",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "acco" and summary["samples"] >= 32
    assert math.isfinite(summary["final_eval_loss"])
    # Throughput in labelled tokens: prompts and padding (most of each 128-token row) do not count.
    train = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    for x in train:
        assert 0 < x["target_tokens"] < sum(x["micro_batches"]) * 4 * 128 / 4, x
    assert 0 < summary["target_tokens_per_s"] < summary["tokens_per_s"] / 4




def test_data_collator_examples_train_and_evaluate(tmp_path):
    from transformers import DataCollatorForLanguageModeling

    docs = synthetic_corpus(120)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=300)
    model = build_model(SMALL, vocab_size=len(tokenizer), max_length=32)
    # Examples of 10 to 29 tokens: the collator pads each batch.
    rows = [{"input_ids": tokenizer(d)["input_ids"][: 10 + i % 20]} for i, d in enumerate(docs)]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    args = small_run(tmp_path, method_name="acco", eval_batch_size=5, accumulate_while_waiting=False)
    # exactly 4 samples
    trainer = DecoupledTrainer(
        model=model, processing_class=tokenizer, train_dataset=rows, data_collator=collator, args=args
    )
    # The eval loss is the mean over all target tokens of the eval examples, whatever the batching.
    eval_rows = [rows[i] for i in trainer.eval_data.indices]
    loss_sum = tokens = 0.0
    with torch.no_grad():
        for row in eval_rows:
            s, n = causal_lm_loss(model.eval(), collator([row]))
            loss_sum, tokens = loss_sum + s.item(), tokens + n.item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(loss_sum / tokens, rel=1e-5)
    summary = trainer.train()  # evaluates after every update (this raised TypeError before)
    assert summary["samples"] == 4 and math.isfinite(summary["final_eval_loss"])


def test_pretokenized_dataset_needs_no_collator(tmp_path):
    from datasets import Dataset

    docs = synthetic_corpus(120)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=300)
    model = build_model(SMALL, vocab_size=len(tokenizer), max_length=32)
    ids = tokenizer("".join(docs))["input_ids"][: 32 * 40]
    blocks = [ids[i : i + 32] for i in range(0, len(ids), 32)]  # run_clm.py's group_texts output
    ds = Dataset.from_dict({"input_ids": blocks, "attention_mask": [[1] * 32] * 40, "labels": blocks})
    trainer = DecoupledTrainer(
        model=model, processing_class=tokenizer, train_dataset=ds, args=small_run(tmp_path)
    )
    assert len(trainer.train_data) + len(trainer.eval_data) == 40
    batch = trainer.train_data.take([0, 1])
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (2, 32)
    assert trainer.train()["samples"] == 4
    with pytest.raises(DataError, match="more than max_length 16"):
        DecoupledTrainer(model=model, processing_class=tokenizer, train_dataset=ds,
                         args=small_run(tmp_path, max_length=16))


def _prepare_on_rank(rank, world_size, tokenizer_dir, cache):
    """Builds a trainer on text documents; counts the batches of documents this rank tokenized."""
    import acco.data.packing as packing

    calls = []
    encode = packing._encode
    packing._encode = lambda texts, *args, **kw: calls.append(len(texts)) or encode(texts, *args, **kw)
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_model(SMALL, vocab_size=len(tokenizer), max_length=32)
    trainer = DecoupledTrainer(model=model, tokenizer=tokenizer, train_dataset=synthetic_corpus(200),
                               args=dict(max_length=32, batch_size=2, cache_dir=cache, seed=5))
    columns = trainer.train_data.columns
    return {
        "tokenized": len(calls),
        "memory_mapped": isinstance(columns["input_ids"], np.memmap),
        "train": trainer.train_data.take(range(len(trainer.train_data)))["input_ids"],
        "eval_index": trainer.eval_data.index,
    }


def test_rank0_tokenizes_once_and_the_others_map_its_cache(tmp_path):
    load_tokenizer("bpe", train_texts=synthetic_corpus(200), vocab_size=300, save_dir=str(tmp_path / "tok"))
    first, second = run_distributed(_prepare_on_rank, 2, str(tmp_path / "tok"), str(tmp_path / "cache"))
    assert first["tokenized"] > 0 and second["tokenized"] == 0
    assert first["memory_mapped"] and second["memory_mapped"]
    assert torch.equal(first["train"], second["train"])  # the same blocks and split on every rank
    assert np.array_equal(first["eval_index"], second["eval_index"])
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1


def test_bpe_trains_on_the_training_split_only_and_is_cached(tmp_path, monkeypatch):
    from datasets import Dataset

    import acco.data.tokenizer as tokenizer_module
    from acco.data import prepare
    from acco.trainer import TrainArgs

    docs = synthetic_corpus(200)
    args = TrainArgs(eval_fraction=0.1, seed=3)
    train_docs, eval_docs = prepare.split_corpus(docs, args)
    assert len(eval_docs) == 20 and sorted(train_docs + eval_docs) == sorted(docs)
    as_dataset = prepare.split_corpus(Dataset.from_dict({"text": docs}), args)
    assert [list(part["text"]) for part in as_dataset] == [train_docs, eval_docs]
    assert prepare.split_corpus(docs, TrainArgs(eval=False)) == (docs, None)

    trained_on = []
    train_bpe = tokenizer_module.train_bpe
    def recording_train_bpe(texts, *args, **kwargs):
        trained_on.append(list(texts))
        return train_bpe(texts, *args, **kwargs)

    monkeypatch.setattr(tokenizer_module, "train_bpe", recording_train_bpe)
    cfg = OmegaConf.create(
        {
            "train": {"output_dir": str(tmp_path / "run1"), "cache_dir": str(tmp_path / "cache")},
            "data": {"format": "pretrain", "text_column": "text"},
            "model": {"tokenizer": "bpe", "vocab_size": 400},
        }
    )
    first = prepare.prepare_tokenizer(cfg, train_docs)
    assert trained_on == [train_docs]  # not the eval documents
    cfg.train.output_dir = str(tmp_path / "run2")
    second = prepare.prepare_tokenizer(cfg, train_docs)
    assert len(trained_on) == 1  # the second run reuses the cached BPE
    assert (tmp_path / "run2" / "tokenizer" / "tokenizer.json").exists()  # and saves it with the run
    assert second(docs[0])["input_ids"] == first(docs[0])["input_ids"]
