"""Sharding inside the node (train.shard_inside_node) through DecoupledTrainer on 2 nodes x 2 gloo
workers and a tiny GPT-Neo: acco's losses and evaluations equal the unsharded two-level rounds',
an eval set that splits unevenly over the workers evaluates without a hang, a checkpoint resumes
exactly, the saved model reloads with the committed parameters, compiled blocks train alike, the
unsharded rounds resume its checkpoint resharded, and diloco's across layouts is refused in one line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import clean_env, run_distributed
from trainer_helpers import tiny_args, tiny_data, tiny_model, train_losses

from acco.config import InputError, compose
from acco.data.loader import eval_batch_count
from acco.job import job_of
from acco.validate import check_node_layout, check_sharded_resume

BUDGET = 48  # micro-batches: acco on 4 workers, 1 per round, takes 8 an update: 6 updates
EVAL_ROWS, EVAL_BATCH = 9, 1  # rank 0 evaluates 3 batches, ranks 1-3 two: node 0 splits unevenly
TIMEOUT_S = 20  # a collective that waits longer fails the run: a hang would be an error


def _eval_data() -> dict:
    """Sequences the runs train on: their loss falls as the model fits them."""
    return {"input_ids": tiny_data()["input_ids"][:EVAL_ROWS]}


def _metrics(out: Path) -> tuple[dict, dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return train_losses(out), {x["step"]: x["eval_loss"] for x in lines if x["type"] == "eval"}


def _trainer(root: Path, name: str, sharded: bool, **more):
    from acco.trainer import DecoupledTrainer

    os.environ["ACCO_WORKERS_PER_NODE"] = "2"  # the local launcher's emulated nodes
    torch.manual_seed(0)
    # accumulate_while_waiting as train=acco's default: its cap rounds to 1 micro-batch per round
    settings = dict(nb_steps_tot=BUDGET, n_grad_accumulation=1, shard_inside_node=sharded,
                    accumulate_while_waiting=True, eval=True, eval_step=2, eval_batch_size=EVAL_BATCH,
                    timeout_s=TIMEOUT_S)  # fmt: skip
    args = tiny_args("acco", root / name, **{**settings, **more})
    return DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), eval_dataset=_eval_data(),
                            args=args)  # fmt: skip


def _train(root: Path, name: str, sharded: bool, resume=None, **more) -> dict:
    """A run's summary, what rank 0 printed, and (sharded) this worker's rows of each parameter."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = _trainer(root, name, sharded, **more)
        summary = trainer.train(resume_from_checkpoint=resume)
    rows = {}
    if sharded:  # the shards (the evaluations' unsharded root is dropped after each)
        rows = {n: p.to_local().detach().clone() for n, p in trainer.model.named_parameters()}
    return {"summary": summary, "printed": printed.getvalue(), "rows": rows}


def _unsharded_resume(root: Path, folder: Path) -> dict:
    """An unsharded 2 x 2 run resumed from the sharded checkpoint (resharded): what rank 0 printed,
    its summary, and the parameters it started from."""
    from acco.trainer import DecoupledTrainer

    started = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        torch.manual_seed(1)  # other initial weights: the checkpoint alone must bring them back
        args = tiny_args("acco", root / "unsharded", nb_steps_tot=BUDGET, n_grad_accumulation=1,
                         shard_inside_node=False, timeout_s=TIMEOUT_S)  # fmt: skip
        trainer = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args,
                                   on_train_start=lambda: started.update(
                                       {n: p.detach().clone() for n, p in trainer.model.named_parameters()}))
        summary = trainer.train(resume_from_checkpoint=str(folder))
    return {"summary": summary, "printed": printed.getvalue(), "started": started}


def _compiled(root: Path) -> dict:
    """The sharded run with its blocks compiled by aot_eager, behind a backend that counts the
    graphs traced from GPT-Neo's blocks (a module dynamo skips would run eagerly, and equal
    trivially) and dynamo's graph breaks."""
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters

    block_graphs = []

    @torch._dynamo.register_backend(name="block_spy")
    def block_spy(gm, example_inputs, **kwargs):
        stack = {str(m) for n in gm.graph.nodes for _, m in (n.meta.get("nn_module_stack") or {}).values()}
        block_graphs.append(any("GPTNeoMLP" in m for m in stack))  # traced from a block's forward
        return aot_eager(gm, example_inputs, **kwargs)

    counters.clear()
    run = _train(root, "compiled", True, compile="block_spy", save=False, save_step=0)
    run["block_graphs"] = sum(block_graphs)
    run["graph_breaks"] = sum(counters["graph_break"].values())
    return run


def _runs(rank: int, world_size: int, root: str) -> dict:

    root = Path(root)
    runs = {"sharded": _train(root, "sharded", True), "flat": _train(root, "flat", False)}
    folder = root / "sharded" / "checkpoint-2"
    runs["resumed"] = _train(root, "resumed", True, resume=str(folder))
    runs["unsharded"] = _unsharded_resume(root, folder)
    runs["compiled"] = _compiled(root)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    per_rank = run_distributed(_runs, 4, str(root), timeout_s=TIMEOUT_S)
    return root, per_rank


def test_sharded_acco_trains_and_evaluates_as_the_unsharded_rounds(runs):
    root, per_rank = runs
    sharded, flat = per_rank[0]["sharded"], per_rank[0]["flat"]
    assert sharded["printed"].count("layout: 2 nodes x 2 workers: sharded inside the node, rounds between "
                                    "nodes") == 1, sharded["printed"]  # fmt: skip
    assert "layout: 2 nodes x 2 workers: two-level rounds" in flat["printed"]
    (train, evals), (flat_train, flat_evals) = _metrics(root / "sharded"), _metrics(root / "flat")
    assert sorted(train) == sorted(flat_train) == list(range(1, BUDGET // 8 + 1))
    assert sorted(evals) == sorted(flat_evals) == [2, 4, 6]
    for step in train:
        assert train[step] == pytest.approx(flat_train[step], rel=1e-4), (step, train, flat_train)
    for step in evals:
        assert evals[step] == pytest.approx(flat_evals[step], rel=1e-4), (step, evals, flat_evals)
    assert evals[6] < evals[2]  # it trained
    final, flat_final = sharded["summary"]["final_eval_loss"], flat["summary"]["final_eval_loss"]
    assert final == evals[6] and flat_final == flat_evals[6]
    print(f"final eval loss: sharded {final!r}, unsharded {flat_final!r}, "
          f"relative difference {abs(final - flat_final) / flat_final:.2e}")


def test_an_eval_set_split_unevenly_inside_a_node_evaluates_every_sample_once(runs):
    """Rank 0 has three eval batches and its node's peer two: the peer runs a forward it does not
    count (else FSDP2's all-gather of rank 0's third forward would wait for it), and the eval loss
    is the unsharded run's (above), which counts every sample once."""
    counts = [eval_batch_count(EVAL_ROWS, EVAL_BATCH, r, 4) for r in range(4)]
    assert counts == [3, 2, 2, 2]
    root, per_rank = runs
    final = {run["sharded"]["summary"]["final_eval_loss"] for run in per_rank}
    assert len(final) == 1  # every worker's all-reduced totals
    assert final.pop() == pytest.approx(per_rank[0]["flat"]["summary"]["final_eval_loss"], rel=1e-4)


def test_a_sharded_checkpoint_resumes_exactly(runs):
    root, per_rank = runs
    assert "resuming exactly from" in per_rank[0]["resumed"]["printed"], per_rank[0]["resumed"]["printed"]
    (train, evals), (resumed, resumed_evals) = _metrics(root / "sharded"), _metrics(root / "resumed")
    assert resumed == {step: loss for step, loss in train.items() if step > 2}  # fp32: bit-identical
    assert resumed_evals == {step: loss for step, loss in evals.items() if step > 2}


def test_the_saved_model_reloads_with_the_committed_parameters(runs):
    """model/ (and the last checkpoint's) holds each parameter whole: the rows of a node's two
    workers, which both nodes hold alike."""
    from transformers import AutoModelForCausalLM

    root, per_rank = runs
    rows = [run["sharded"]["rows"] for run in per_rank]
    for folder in (root / "sharded" / "model", root / "sharded" / "checkpoint-6" / "model"):
        saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert rows[0].keys() <= saved.keys() and len(rows[0]) >= len(saved) - 1  # the tied head at most
        for name in rows[0]:
            for node in (0, 1):
                whole = torch.cat([rows[2 * node][name], rows[2 * node + 1][name]])
                assert torch.equal(whole, saved[name]), (folder, name, node)
    assert torch.equal(saved["lm_head.weight"], saved["transformer.wte.weight"])


def test_compiled_blocks_train_sharded_as_eager_ones(runs):
    root, per_rank = runs
    compiled = per_rank[0]["compiled"]
    # the blocks' global and local layers, each in training and in evaluation
    assert compiled["block_graphs"] >= 4 and compiled["graph_breaks"] == 0
    (train, evals), (eager, eager_evals) = _metrics(root / "compiled"), _metrics(root / "sharded")
    assert sorted(train) == sorted(eager)
    for step in train:
        assert train[step] == pytest.approx(eager[step], rel=1e-6), (train, eager)
    for step in evals:
        assert evals[step] == pytest.approx(eager_evals[step], rel=1e-6), (evals, eager_evals)


def test_a_sharded_checkpoint_resumes_unsharded_resharded(runs):
    """The unsharded rounds resume the sharded checkpoint: its master and moments resharded from the
    local vectors' shards (acco/engine/shard_map.py), the model the checkpoint's committed one."""
    from safetensors.torch import load_file

    root, per_rank = runs
    run = per_rank[0]["unsharded"]
    assert "resharded" in run["printed"] and "sharded inside the node" not in run["printed"].split(
        "layout:")[-1].splitlines()[0], run["printed"]
    saved = load_file(str(root / "sharded" / "checkpoint-2" / "model" / "model.safetensors"))
    shared = [n for n in run["started"] if n in saved]
    assert len(shared) >= len(run["started"]) - 1
    for name in shared:
        assert torch.equal(run["started"][name], saved[name]), name
    train, _ = _metrics(root / "unsharded")
    assert sorted(train) == list(range(3, BUDGET // 8 + 1))  # on from the checkpoint's update 2


def test_diloco_s_sharded_checkpoints_resume_on_their_own_layout_only(tmp_path):
    """8 workers: 2 nodes x 4 and 4 nodes x 2 are both layouts of a sharded run; the validation
    pass refuses diloco's checkpoint of one for the other (meta.json's workers_per_node), in one line;
    acco's reshards."""
    folder = tmp_path / "checkpoint-2"
    meta = {"world_size": 8, "workers_per_node": 4}
    for method in ("diloco", "acco"):
        cfg = compose([f"train={method}", f"train.output_dir={tmp_path}", "train.shard_inside_node=true",
                       "launch.workers_per_node=2", f"train.resume_from_checkpoint={folder}"])  # fmt: skip
        job = job_of(cfg, 8)
        if method == "acco":
            check_sharded_resume(job, folder, meta)
            continue
        with pytest.raises(InputError) as refused:
            check_sharded_resume(job, folder, meta)
        assert str(refused.value) == (
            f"train.resume_from_checkpoint={folder}: {folder} was written by 2 nodes x 4 workers, sharded "
            "inside the node, this run is 4 nodes x 2 workers: a checkpoint sharded inside the node resumes "
            "with train.shard_inside_node=true on its own layout only")
        check_sharded_resume(job, folder, {"world_size": 8, "workers_per_node": 2})


@pytest.mark.parametrize("overrides, said", [
    (["launch.workers_per_node=4"], "this job is 1 node x 4 workers (launch.workers_per_node=4): set "
                                    "launch.workers_per_node=2, or set train.shard_inside_node=false"),
    ([], "this job is 1 node x 4 workers (launch.workers_per_node unset): set launch.workers_per_node=2"),
    (["launch.workers_per_node=1"], "this job is 4 nodes x 1 worker (launch.workers_per_node=1)"),
])  # fmt: skip
def test_sharding_needs_several_nodes_of_several_workers(tmp_path, overrides, said):
    cfg = compose([f"train.output_dir={tmp_path}", "train.shard_inside_node=true", *overrides])
    with pytest.raises(InputError) as refused:
        check_node_layout(job_of(cfg, 4))
    assert str(refused.value).startswith("train.shard_inside_node=true needs more than one node of more than "
                                         "one worker; " + said), str(refused.value)  # fmt: skip
    check_node_layout(job_of(compose([f"train.output_dir={tmp_path}", "train.shard_inside_node=true",
                                      "launch.workers_per_node=2"]), 4))  # fmt: skip


@pytest.mark.slow  # a whole command-line job on 4 local workers
def test_the_command_line_trains_sharded_inside_emulated_nodes(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "acco.cli", "train=acco", "train.shard_inside_node=true", "launch.nproc=4",
           "launch.workers_per_node=2", "train.nb_steps_tot=48", "train.eval_step=2", "train.save_step=2",
           f"train.output_dir={out}", f"train.cache_dir={tmp_path / 'cache'}", f"train.timeout_s={TIMEOUT_S}"]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layout: 2 nodes x 2 workers: sharded inside the node, rounds between nodes" in proc.stdout
    assert "done: acco 48 micro-batches, final eval loss" in proc.stdout, proc.stdout
    train, evals = _metrics(out)
    assert sorted(train) == list(range(1, 7)) and sorted(evals) == [2, 4, 6]
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    in_checkpoint = AutoModelForCausalLM.from_pretrained(out / "checkpoint-6" / "model").state_dict()
    assert all(torch.equal(saved[name], in_checkpoint[name]) for name in saved)
