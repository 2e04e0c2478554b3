"""Shared by the trainer and checkpoint tests: a tiny GPT-Neo, its data and DecoupledTrainer
arguments for every method, the training losses a run wrote, and the tiny model config's path."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = Path(__file__).parents[1] / "acco" / "conf" / "model" / "tiny.yaml"
# A plain dict (no Hydra interpolation to resolve), smaller than tiny: for tests about data and runs.
SMALL = dict(
    name="small",
    arch="gpt_neo",
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    max_position_embeddings=64,
    window_size=64,
    pretrained=None,
)


def loss_test_config(arch: str) -> dict:
    """GPT-Neo (tied head) or Llama at 32 wide, two layers: the loss tests' models."""
    return dict(arch=arch, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                window_size=64, intermediate_size=64, tie_word_embeddings=arch == "gpt_neo")  # fmt: skip


def train_losses(out: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if x["type"] == "train"]
    assert len(steps) == len(set(steps)), f"duplicated steps in metrics.jsonl: {steps}"
    return {x["step"]: x["loss"] for x in lines if x["type"] == "train"}


def tiny_model():
    from acco.models import build_model

    config = dict(
        arch="gpt_neo", hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16, window_size=16
    )
    return build_model(config, vocab_size=96, max_length=16)


def tiny_args(method: str, output_dir, **more) -> dict:
    # 40 sequences, 2 per micro-batch on 2 workers: 10 micro-batches per worker and epoch, so the
    # runs cross epochs; fixed counts (no accumulate_while_waiting) make the runs reproducible.
    if method == "acco-paper":  # acco (its default, lean estimate) keeps its estimate error as state too
        method, more = "acco", {"acco_estimate": "paper", **more}
    if method == "diloco":
        more = {"sync_every": 3, **more}
    if method == "streaming-diloco":  # fragment 0's all-reduce is in flight at checkpoint-2
        more = {
            "sync_every": 4,
            "num_fragments": 2,
            "fragment_sync_delay": 1,
            "fragment_update_alpha": 0.5,
            **more,
        }
    return (
        dict(
            method_name=method,
            batch_size=2,
            n_grad_accumulation=2,
            nb_steps_tot=48,
            max_length=16,
            learning_rate=3e-3,
            accumulate_while_waiting=False,
            use_mixed_precision=False,  # the CPU's fp32 (train=<method>'s default is the paper's bf16)
            eval=False,
            save_step=2,
            output_dir=str(output_dir),
        )
        | more
    )


def tiny_data() -> dict:
    return {"input_ids": torch.randint(0, 96, (40, 16), generator=torch.Generator().manual_seed(0))}


def small_run(tmp_path, **overrides) -> dict:
    """DecoupledTrainer arguments for a 4-micro-batch ddp run of SMALL, evaluated after every update."""
    return {
        **dict(
            method_name="ddp",
            batch_size=4,
            n_grad_accumulation=1,
            use_mixed_precision=False,
            max_eval_batches=None,
            nb_steps_tot=4,
            max_length=32,
            eval_step=1,
            learning_rate=2e-3,
            output_dir=str(tmp_path / "run"),
            cache_dir=str(tmp_path / "cache"),
            save=False,
        ),
        **overrides,
    }


def write_checkpoint(out: Path, step: int, method: str = "ddp", keep=None, **train) -> Path:
    """checkpoint-`step` of a one-worker run, written by acco.checkpoint.save: a small state, a
    model folder, meta.json with its files' sizes, as a run writes them."""
    from acco import checkpoint
    from acco.config import TrainArgs

    args = {**vars(TrainArgs(method_name=method, output_dir=str(out))), **train}
    meta = {"step": step, "samples": 4 * step, "method": method, "world_size": 1, "numel": 6, "train": args}
    state = {"engine": {"master": torch.arange(6.0) + step, "step": step}, "data": {"position": step}}

    def model(folder: Path) -> None:
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"vocab_size": 96}))

    return checkpoint.save(out, step, state, meta, 0, 1, model, keep)
