"""What a checkpoint holds, each distinct tensor once: no rank file holds the full
parameter vector, the accumulator is saved exactly when a fixed batch needs it, and a resharded
resume reads only the old shards that overlap each new worker's. Sizes are those of the bytes
written: torch.save writes the whole storage of a view. And every method resumes from
its checkpoint exactly: the same runs, saved and resumed once, serve both."""

from __future__ import annotations

import math
import re
import zipfile
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from torch import nn
from torch.utils._pytree import tree_leaves

from acco import checkpoint, checkpoint_writer
from acco.engine import CheckpointError, EngineConfig, build_engine
from acco.engine.layout import NodeLayout, shard_file_rank
from acco.resume import load_meta, rank_file
from acco.run_folder import list_checkpoints

# Every method with a fixed batch (acco also with the paper's estimate); the methods of the
# engine's timed mode also with accumulate_while_waiting.
EXACT = ("acco", "acco-paper", "ddp", "dpu", "wp", "torch-ddp", "torch-hsdp", "diloco", "streaming-diloco")
SAVED = [(m, True) for m in EXACT] + [(m, False) for m in ("acco", "ddp", "dpu", "wp", "torch-ddp")]
OVERLAPPED = ("acco", "acco-paper", "dpu", "wp")  # a pending accumulator between updates
UNSHARDED = ("diloco", "streaming-diloco")  # every worker's local parameters and moments are its own


def _old_states(numel: int, old_world: int, full: dict, per_node: int = 0) -> list[dict]:
    """The engine states `old_world` workers would have saved for these full fp32 vectors, in the
    flat ring's shard order (`per_node` 0: worker r holds shard r) or the two-level rounds' on
    nodes of `per_node` workers (worker r holds shard NodeLayout.shard_rank)."""
    size = -(-numel // old_world)
    states = []
    for r in range(old_world):
        i = NodeLayout(old_world // per_node, per_node, r).shard_rank if per_node else r
        shard = {}
        for name, vector in full.items():
            padded = torch.zeros(size * old_world)
            padded[:numel] = vector
            shard[name] = padded[i * size : (i + 1) * size].clone()
        states.append(
            {
                "method": "acco",
                "order": "decayed-first",
                "numel": numel,
                "world_size": old_world,
                "workers_per_node": per_node,
                "rank": r,
                "samples": 40,
                "step": 5,
                "wall_time": 1.0,
                "predicted": None,
                "accumulator": torch.ones(numel),
                "accumulator_stats": torch.ones(4),
                "estimate_error": None,
                **shard,
            }
        )
    return states


def _reshard_on(rank: int, world: int, old_world: int, per_node: int = 0, old_per_node: int = 0) -> dict:
    """A new worker of `world` (on nodes of `per_node` workers, 0: the flat ring) loads the states
    `old_world` workers saved of a 24-parameter model (in `old_per_node`'s shard order); it returns
    its optimizer shard, its parameters and the old ranks whose state it read."""
    torch.manual_seed(0)
    model = nn.Linear(7, 3)  # 24 parameters: padded to 27 for 3 workers, to 24 for 1, 2 or 4
    rounds = dict(rounds="nodes", workers_per_node=per_node) if per_node else dict(rounds="flat")
    engine = build_engine(model, EngineConfig(method="acco", nb_steps_tot=4, **rounds))
    numel = engine.flat.layout.numel
    full = {
        name: torch.randn(numel, generator=torch.Generator().manual_seed(i))
        for i, name in enumerate(("master", "exp_avg", "exp_avg_sq"))
    }
    old, read = _old_states(numel, old_world, full, old_per_node), []

    def old_state(r: int) -> dict:
        read.append(r)
        return old[r]

    exact = engine.load_state_dict(old[0], old_state)
    opt = engine.comm.optimizer
    # The concatenation path, as it was: every old shard in full, then this worker's slice.
    expected = {}
    for name, vector in full.items():
        padded = torch.zeros(engine.flat.layout.padded_numel)
        padded[:numel] = vector
        expected[name] = padded[engine.flat.shard]
    engine.close()
    return {
        "exact": exact,
        "shard": engine.rounds.shard_rank,
        "read": read,
        "shards": {n: getattr(opt, n).clone() for n in full},
        "expected": expected,
        "params": engine.flat.params[:numel].clone(),
        "master": full["master"],
        "samples": engine.committed_micro_batches,
        "step_count": opt.step_count,
        "grads": engine.flat.grads.abs().sum().item(),
    }


@pytest.mark.parametrize("old_world, world", [(3, 1), (2, 3), (3, 2), (2, 1)])
def test_resharding_reads_only_the_overlapping_old_shards(old_world, world):
    results = _reshard_on(0, 1, old_world) if world == 1 else None
    results = [results] if world == 1 else run_distributed(_reshard_on, world, old_world)
    size = -(-24 // old_world)
    new_size = -(-24 // world)
    for rank, got in enumerate(results):
        assert got["exact"] is False
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["shards"][name], got["expected"][name]), (rank, name)
        # the parameters are the gathered master, on every new worker
        assert torch.equal(got["params"], got["master"]) and got["samples"] == 40 and got["step_count"] == 5
        assert got["grads"] == 0  # a per-worker accumulator does not survive resharding
        lo, hi = rank * new_size, min((rank + 1) * new_size, 24)
        assert got["read"] == list(range(lo // size, -(-hi // size))), rank  # the overlapping old shards only


# (old world, its workers per node, new workers per node; 0: the flat ring) for 4 new workers: the
# two-level shard order (2 x 2: worker r holds shard [0, 2, 1, 3][r]) to the flat one and back, from
# other world sizes, and to 2 x 1 (a flat ring: S = 1) from 2 x 2.
LAYOUTS_OF_4 = ((4, 2, 0), (4, 0, 2), (2, 0, 2), (3, 0, 2))


def _reshard_layouts(rank: int, world: int, cases) -> list[dict]:
    return [_reshard_on(rank, world, old_world, per_node, old_per_node)
            for old_world, old_per_node, per_node in cases]  # fmt: skip


@pytest.mark.parametrize("world, cases", [(4, LAYOUTS_OF_4), (2, ((4, 2, 1),))])
def test_resharding_across_node_layouts_reads_each_shard_from_the_file_that_holds_it(world, cases):
    """A checkpoint of the two-level rounds holds shard s * R + r in rank (r, s)'s file (meta.json's
    workers_per_node): a resume on another layout (flat, another S, another world size) takes each
    of its new shards from the files that hold it, and gathers the saved parameters."""
    per_rank = run_distributed(_reshard_layouts, world, cases)
    for (old_world, old_per_node, per_node), got in zip(cases, zip(*per_rank)):
        size, new_size = -(-24 // old_world), -(-24 // world)
        if per_node > 1 and world // per_node > 1:  # the two-level order
            assert [g["shard"] for g in got] == [NodeLayout(world // per_node, per_node, r).shard_rank
                                                 for r in range(world)]  # fmt: skip
        else:
            assert [g["shard"] for g in got] == list(range(world))
        for rank, g in enumerate(got):
            case = (old_world, old_per_node, per_node, rank)
            assert g["exact"] is False
            for name in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(g["shards"][name], g["expected"][name]), (case, name)
            assert torch.equal(g["params"], g["master"]) and g["samples"] == 40, case
            lo, hi = g["shard"] * new_size, min((g["shard"] + 1) * new_size, 24)
            shards = range(lo // size, -(-hi // size))
            files = [shard_file_rank(i, old_world, old_per_node) if old_per_node else i for i in shards]
            assert g["read"] == files, case  # the files of the overlapping old shards only


def test_resharding_refuses_another_method_or_model():
    torch.manual_seed(0)
    old = _old_states(24, 3, {name: torch.randn(24) for name in ("master", "exp_avg", "exp_avg_sq")})
    with pytest.raises(CheckpointError, match="method 'acco', this run is 'dpu'"):
        build_engine(nn.Linear(7, 3), EngineConfig(method="dpu")).load_state_dict(old[0], old.__getitem__)
    with pytest.raises(CheckpointError, match="parameters, the model has"):
        build_engine(nn.Linear(8, 3), EngineConfig(method="acco")).load_state_dict(old[0], old.__getitem__)
    with pytest.raises(CheckpointError, match="ordered the parameters otherwise"):
        older = [{k: v for k, v in state.items() if k != "order"} for state in old]
        build_engine(nn.Linear(7, 3), EngineConfig(method="acco")).load_state_dict(
            older[0], older.__getitem__
        )


# With accumulate_while_waiting an update takes as many micro-batches as its rounds' time allows, so
# a budget of micro-batches may end before update 2 on one machine and after it on another (a
# budget of 16 gave no checkpoint-2 on a fast one). The timed runs are counted in updates instead:
# their micro-batch budget is far out of reach, and the evaluation after update TIMED_UPDATES always
# stops them (stop_at_eval_loss above any loss), so checkpoint-2 is always written mid-run.
TIMED_UPDATES = 3
OUT_OF_REACH = 1000  # micro-batches over all workers (finite: a run that failed to stop ends soon)
TIMED_RESUMED = 8  # micro-batches the resumed timed runs train past their checkpoint (at least one update)


def _save_and_resume_every_method(rank: int, world_size: int, root: str) -> dict:
    """Each method trained through DecoupledTrainer on 2 workers, then resumed from its
    checkpoint-2 on the same world size, from other initial weights, to the end of the budget:
    with a fixed batch 48 micro-batches (the runs cross epochs) and exactly; with
    accumulate_while_waiting TIMED_UPDATES updates, resumed to TIMED_RESUMED micro-batches past
    its checkpoint (from its warm start, not exactly)."""
    from trainer_helpers import tiny_args, tiny_data, tiny_model, train_losses

    from acco.trainer import DecoupledTrainer

    found = {}
    for method, fixed in SAVED:
        ref, resumed = (
            Path(root) / f"{method}-{fixed}" / "reference",
            Path(root) / f"{method}-{fixed}" / "resumed",
        )
        if fixed:
            args = tiny_args(method, ref, nb_steps_tot=48)
        else:
            args = tiny_args(
                method,
                ref,
                nb_steps_tot=OUT_OF_REACH,
                accumulate_while_waiting=True,
                eval=True,
                eval_step=TIMED_UPDATES,
                max_eval_batches=1,
                stop_at_eval_loss=1e30,
            )
        torch.manual_seed(0)
        model = tiny_model()
        numel = sum(p.numel() for p in model.parameters())
        reference = DecoupledTrainer(
            model=model, train_dataset=tiny_data(), eval_dataset=None if fixed else tiny_data(), args=args
        ).train()
        folder = ref / "checkpoint-2"  # mid-run
        state = checkpoint.load_worker(folder, rank, world_size)["engine"]
        resumed_budget = 48 if fixed else load_meta(folder)["samples"] + TIMED_RESUMED
        torch.manual_seed(1)  # other initial weights: the checkpoint must bring everything back
        args = tiny_args(method, resumed, nb_steps_tot=resumed_budget, accumulate_while_waiting=not fixed)
        summary = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train(
            resume_from_checkpoint=str(folder)
        )
        found[(method, fixed)] = {
            "numel": numel,
            # in elements of the storage written, not of the tensor (a view's is larger)
            "largest": max(
                (t.untyped_storage().nbytes() // t.element_size(), name)
                for name, t in checkpoint_writer.floating_tensors(state)
                if name != "accumulator"
            ),
            "accumulator": state.get("accumulator") is not None,
            "dropped": state.get("dropped_micro_batches", 0),
            "samples": summary["samples"],
            "budget": resumed_budget,
            "resumed": not summary.get("nothing_to_do", False),
            "updates": reference["updates"],  # the reference run's
            "losses": (train_losses(ref), train_losses(resumed)) if rank == 0 and fixed else None,
        }
    return {"runs": found, "torch-ddp shard": _torch_ddp_shard()}


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("contents")
    results = run_distributed(_save_and_resume_every_method, 2, str(root))
    return root, results[0]["runs"], [got["torch-ddp shard"] for got in results]


@pytest.fixture(scope="module")
def saved(saved_root):
    return saved_root[1]


@pytest.mark.parametrize("method", EXACT)
def test_resume_is_exact_for_every_method(saved, method):
    reference, resumed = saved[(method, True)]["losses"]
    updates = 48 // (8 if method.startswith("acco") else 4)  # micro-batches per update over both workers
    assert sorted(reference) == list(range(1, updates + 1))
    assert resumed == {step: loss for step, loss in reference.items() if step > 2}  # fp32: bit-identical


def test_no_rank_file_holds_the_parameter_vector_and_the_accumulator_only_for_a_fixed_batch(saved):
    assert set(saved) == set(SAVED)
    for (method, fixed), got in saved.items():
        # the timed runs stopped after TIMED_UPDATES updates, whatever the micro-batches per update
        assert got["updates"] == (
            48 // (8 if method.startswith("acco") else 4) if fixed else TIMED_UPDATES
        ), got
        # resumed (exactly, or from its warm start) and trained to the budget
        assert got["resumed"] and got["samples"] >= got["budget"], (method, fixed)
        # a fixed batch resumes exactly with the accumulator that an overlapped method holds
        assert got["accumulator"] == (fixed and method in OVERLAPPED), (method, fixed)
        if method in UNSHARDED:  # every worker's state is its own (test_diloco: what a resume reads again)
            continue
        size, name = got["largest"]
        assert size <= -(-got["numel"] // 2), (method, fixed, name, size)  # at most one shard of 2
        # without it, the micro-batches it held are read again: the data position went back by them
        overlapped_and_timed = not fixed and method in OVERLAPPED
        assert (got["dropped"] > 0) == overlapped_and_timed, (method, fixed, got["dropped"])


def test_a_resharded_resume_maps_the_old_files_instead_of_reading_them(saved_root, monkeypatch):
    """2 -> 1 worker through DecoupledTrainer: every old file is opened memory-mapped (only what
    is then touched is read), and the engine takes its slices from the old shards it overlaps."""
    from trainer_helpers import tiny_args, tiny_data, tiny_model

    from acco.trainer import DecoupledTrainer

    root = saved_root[0]
    folder = list_checkpoints(root / "acco-True" / "reference")[0]
    loads = []
    load_worker = checkpoint.load_worker

    def recording(folder, rank, world_size, mmap=False):
        loads.append((rank, mmap))
        return load_worker(folder, rank, world_size, mmap=mmap)

    monkeypatch.setattr(checkpoint, "load_worker", recording)
    args = tiny_args("acco", root / "one", nb_steps_tot=24)
    summary = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args).train(
        resume_from_checkpoint=str(folder)
    )
    assert summary["samples"] >= 24
    assert loads and {rank for rank, _ in loads} == {0, 1} and all(mmap for _, mmap in loads), loads


def _written(path: Path) -> int:
    """The bytes of tensor data in a torch.save file: its storages, one zip entry each."""
    with zipfile.ZipFile(path) as archive:
        return sum(e.file_size for e in archive.infolist() if re.search(r"/data/\d+$", e.filename))


def test_every_rank_file_writes_only_the_bytes_of_its_tensors(saved_root):
    """Every rank file of every checkpoint (of the runs and of their resumes) writes no tensor
    data beyond its tensors' own elements: torch.save writes the whole storage of a view (wp's
    prediction shard of the full vector, a streaming-diloco fragment of the buffer sized for the
    largest one). The sharded methods' largest tensor (but the accumulator) is one shard."""
    root = saved_root[0]
    seen = set()
    for method, fixed in SAVED:
        runs = (root / f"{method}-{fixed}" / run for run in ("reference", "resumed"))
        for folder in (folder for run in runs for folder in list_checkpoints(run)):
            numel = load_meta(folder)["numel"]
            for rank in range(2):
                path = rank_file(folder, rank, 2)
                state = checkpoint.load_worker(folder, rank, 2, mmap=True)
                where = (method, fixed, folder.parent.name, folder.name, rank)
                views = [
                    (name, t.numel() * t.element_size(), t.untyped_storage().nbytes())
                    for name, t in checkpoint_writer.floating_tensors(state)
                    if t.untyped_storage().nbytes() != t.numel() * t.element_size()
                ]
                assert not views, (where, views)
                storages = {
                    t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tree_leaves(state)
                    if isinstance(t, torch.Tensor)
                }
                assert _written(path) == sum(storages.values()), where
                engine = state["engine"]
                if method not in UNSHARDED:
                    shard = 4 * math.ceil(numel / 2)  # fp32
                    sizes = [
                        (t.untyped_storage().nbytes(), name)
                        for name, t in checkpoint_writer.floating_tensors(engine)
                        if name != "accumulator"
                    ]
                    assert all(size <= shard for size, _ in sizes), (where, sizes)
                if engine.get("predicted") is not None:
                    seen.add(("predicted", method))
                if engine.get("averaged") is not None:
                    seen.add(("averaged", method, engine["averaged_fragment"]))
    # what the sizes above cover: wp saved in its predicting state, and a landed fragment both of
    # the largest size and shorter than the buffer
    assert {
        ("predicted", "wp"),
        ("averaged", "streaming-diloco", 0),
        ("averaged", "streaming-diloco", 1),
    } <= seen, seen


def _largest_allocation(fn) -> int:
    """The most CPU memory that one operator (with those it calls) allocated while `fn` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([e.cpu_memory_usage for e in prof.events()] + [0])


def _torch_ddp_shard() -> dict:
    """A torch-ddp engine's state on a model of 90,601 parameters, in slices of 45,301 that start
    inside the weight; the last one padded."""
    torch.manual_seed(0)
    model = nn.Linear(300, 301)
    engine = build_engine(model, EngineConfig(method="torch-ddp", nb_steps_tot=4))
    states = []
    largest = _largest_allocation(lambda: states.append(engine.state_dict()))
    layout = engine._layout()
    padded = torch.zeros(layout.padded_numel)  # the whole vector, padded with zeros, as a reference
    torch.cat([p.detach().flatten() for p in model.parameters()], out=padded[: layout.numel])
    return {
        "largest": largest,
        "shard": states[0]["params_shard"],
        "expected": padded[layout.shard_slice].clone(),
    }


def test_torch_ddp_saves_its_parameter_slice_without_a_model_sized_temporary(saved_root):
    """Each worker copies its slice from the parameters it overlaps (it once built the whole
    padded vector first): nothing in state_dict allocates more than the slice."""
    for rank, got in enumerate(saved_root[2]):
        assert torch.equal(got["shard"], got["expected"]), rank
        assert got["largest"] <= got["shard"].numel() * 4, (rank, got["largest"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_non_finite_check_finds_nan_and_inf_only_and_allocates_nothing_tensor_sized(dtype):
    huge = torch.finfo(dtype).max
    # finite, though its sum is NaN (partial sums overflow, then inf - inf) and its norm inf
    finite = torch.full((100_000,), huge, dtype=dtype)
    finite[::2] = -huge
    assert (
        checkpoint_writer.non_finite(
            {"a": finite, "b": [torch.zeros(0, dtype=dtype)], "step": torch.tensor(3.0)},
            torch.device("cpu"),
            1,
        )
        == []
    )
    for value in (math.nan, math.inf, -math.inf):
        for where in (0, 4_321, 99_999):
            bad = finite.clone()
            bad[where] = value
            state = {"engine": {"master": finite, "exp_avg": [bad], "scalar": torch.tensor(value)}}
            assert checkpoint_writer.non_finite(state, torch.device("cpu"), 1) == [
                "engine.exp_avg.0",
                "engine.scalar",
            ], (value, where)
    # torch.isfinite(t) allocated t.abs() (as large as t) and four masks of a byte per element
    check = checkpoint_writer.non_finite
    assert _largest_allocation(lambda: check({"a": finite}, torch.device("cpu"), 1)) < 1_000
