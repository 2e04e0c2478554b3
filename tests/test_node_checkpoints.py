"""Checkpoints across node layouts, through DecoupledTrainer on 4 real workers (gloo) and a tiny
GPT-Neo: a run of the two-level rounds on 2 nodes x 2 workers (each worker's
ACCO_WORKERS_PER_NODE, as the local launcher sets it) resumes exactly on its own layout, and its
checkpoint resumes on one node of 4 (the flat ring) and on 2 workers, a flat one on 2 x 2, each
with the saved committed parameters: the rank files hold shard s * R + r on rank (r, s), and
meta.json says which order (workers_per_node), so that a resume on another layout reshards."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from safetensors.torch import load_file
from trainer_helpers import tiny_args, tiny_data, tiny_model, train_losses

from acco.resume import load_meta

BUDGET = 48  # micro-batches: acco on 4 workers, 1 per round, takes 8 an update: 6 updates


def _resume(root: Path, name: str, per_node: int, folder: Path | None, seed: int = 1) -> dict:
    """acco trained to BUDGET on nodes of `per_node` workers (from `folder` if given, from other
    initial weights then): its losses, what rank 0 printed, and the model's parameters when
    training was about to start (after the resume)."""
    from acco.trainer import DecoupledTrainer

    os.environ["ACCO_WORKERS_PER_NODE"] = str(per_node)  # the local launcher's emulated nodes
    torch.manual_seed(seed)
    args = tiny_args("acco", root / name, nb_steps_tot=BUDGET, n_grad_accumulation=1)
    started = {}

    def on_start() -> None:  # rank 0, once the resume has loaded
        started.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args,
                                   on_train_start=on_start)  # fmt: skip
        summary = trainer.train(resume_from_checkpoint=str(folder) if folder else None)
    return {"summary": summary, "printed": printed.getvalue(), "started": started}


def _layouts(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    runs = {"nodes": _resume(root, "nodes", 2, None, seed=0)}  # uninterrupted, 2 x 2
    runs["nodes-again"] = _resume(root, "nodes-again", 2, root / "nodes" / "checkpoint-2")
    runs["flat"] = _resume(root, "flat", 4, root / "nodes" / "checkpoint-2")  # 2 x 2 -> one node of 4
    runs["flat-to-nodes"] = _resume(root, "flat-to-nodes", 2, root / "flat" / "checkpoint-4")
    return {"runs": runs}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    per_rank = run_distributed(_layouts, 4, str(root))
    return root, per_rank[0]["runs"]


def _saved_params(folder: Path, started: dict) -> None:
    """The parameters a resume started from are the checkpoint's committed ones (its model/)."""
    saved = load_file(str(folder / "model" / "model.safetensors"))
    shared = [n for n in started if n in saved]
    assert len(shared) >= len(started) - 1, (sorted(started), sorted(saved))  # the tied head at most
    for name in shared:
        assert torch.equal(started[name], saved[name]), (folder, name)


def test_two_nodes_of_two_save_and_resume_exactly(layouts):
    root, runs = layouts
    printed = runs["nodes"]["printed"]
    assert printed.count("layout: 2 nodes x 2 workers: two-level rounds") == 1, printed
    meta = load_meta(root / "nodes" / "checkpoint-2")
    assert meta["world_size"] == 4 and meta["workers_per_node"] == 2
    reference, resumed = train_losses(root / "nodes"), train_losses(root / "nodes-again")
    assert sorted(reference) == list(range(1, BUDGET // 8 + 1))
    assert "resuming exactly from" in runs["nodes-again"]["printed"]
    assert resumed == {step: loss for step, loss in reference.items() if step > 2}  # fp32: bit-identical
    _saved_params(root / "nodes" / "checkpoint-2", runs["nodes-again"]["started"])


def test_a_two_level_checkpoint_resumes_flat_and_a_flat_one_on_two_levels(layouts):
    root, runs = layouts
    flat, back = runs["flat"], runs["flat-to-nodes"]
    assert "layout: 1 node x 4 workers: flat ring" in flat["printed"], flat["printed"]
    assert ("resuming from 4 workers (2 nodes x 2 workers' shard order), resharded to 4 (flat shard "
            "order) from") in flat["printed"], flat["printed"]  # fmt: skip
    _saved_params(root / "nodes" / "checkpoint-2", flat["started"])
    assert load_meta(root / "flat" / "checkpoint-4")["workers_per_node"] == 0
    assert ("resuming from 4 workers (flat shard order), resharded to 4 (2 nodes x 2 workers' shard "
            "order)") in back["printed"], back["printed"]  # fmt: skip
    _saved_params(root / "flat" / "checkpoint-4", back["started"])
    for run in (flat, back):  # and trained on to the budget from there
        assert run["summary"]["samples"] >= BUDGET and not run["summary"].get("nothing_to_do")


def _on_two_workers(rank: int, world_size: int, root: str) -> dict:
    return _resume(Path(root), "two", 1, Path(root) / "nodes" / "checkpoint-2")  # 2 nodes x 1 worker


def test_a_two_level_checkpoint_resumes_on_two_workers(layouts):
    root, _ = layouts
    got = run_distributed(_on_two_workers, 2, str(root))[0]
    assert "layout: 2 nodes x 1 worker: flat ring" in got["printed"], got["printed"]
    resumed = "resuming from 4 workers (2 nodes x 2 workers' shard order), resharded to 2 (flat shard order)"
    assert resumed in got["printed"], got["printed"]
    _saved_params(root / "nodes" / "checkpoint-2", got["started"])
    assert got["summary"]["samples"] >= BUDGET
