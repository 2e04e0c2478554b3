"""What a checkpoint holds, each distinct tensor once (issue 12): no rank file holds the full
parameter vector, the accumulator is saved exactly when a fixed batch needs it, and a resharded
resume reads only the old shards that overlap each new worker's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from torch import nn

from acco.engine import CheckpointError, EngineConfig, build_engine


def _old_states(numel: int, old_world: int, full: dict) -> list[dict]:
    """The engine states `old_world` workers would have saved for these full fp32 vectors."""
    size = -(-numel // old_world)
    states = []
    for r in range(old_world):
        shard = {}
        for name, vector in full.items():
            padded = torch.zeros(size * old_world)
            padded[:numel] = vector
            shard[name] = padded[r * size : (r + 1) * size].clone()
        states.append({"method": "acco", "order": "decayed-first", "numel": numel, "world_size": old_world, "rank": r, "samples": 40,
                       "step": 5, "wall_time": 1.0, "predicted": None, "accumulator": torch.ones(numel),
                       "accumulator_stats": torch.ones(4), "estimate_error": None, **shard})  # fmt: skip
    return states


def _reshard_on(rank: int, world: int, old_world: int) -> dict:
    """A new worker of `world` loads the states `old_world` workers saved of a 24-parameter model; it
    returns its optimizer shard, its parameters and the old ranks whose state it read."""
    torch.manual_seed(0)
    model = nn.Linear(7, 3)  # 24 parameters: padded to 27 for 3 workers, to 24 for 1, 2 or 4
    engine = build_engine(model, EngineConfig(method="acco", nb_steps_tot=4))
    numel = engine.flat.layout.numel
    full = {name: torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i, name in
            enumerate(("master", "exp_avg", "exp_avg_sq"))}  # fmt: skip
    old, read = _old_states(numel, old_world, full), []

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
    return {"exact": exact, "read": read, "shards": {n: getattr(opt, n).clone() for n in full},
            "expected": expected, "params": engine.flat.params[:numel].clone(), "master": full["master"],
            "samples": engine.samples, "step_count": opt.step_count, "grads": engine.flat.grads.abs().sum().item()}  # fmt: skip


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


def test_resharding_refuses_another_method_or_model():
    torch.manual_seed(0)
    old = _old_states(24, 3, {name: torch.randn(24) for name in ("master", "exp_avg", "exp_avg_sq")})
    with pytest.raises(CheckpointError, match="method 'acco', this run is 'dpu'"):
        build_engine(nn.Linear(7, 3), EngineConfig(method="dpu")).load_state_dict(old[0], old.__getitem__)
    with pytest.raises(CheckpointError, match="parameters, the model has"):
        build_engine(nn.Linear(8, 3), EngineConfig(method="acco")).load_state_dict(old[0], old.__getitem__)
    with pytest.raises(CheckpointError, match="ordered the parameters otherwise"):
        older = [{k: v for k, v in state.items() if k != "order"} for state in old]
        build_engine(nn.Linear(7, 3), EngineConfig(method="acco")).load_state_dict(older[0], older.__getitem__)


def _save_every_method(rank: int, world_size: int, root: str) -> dict:
    """Each method trained briefly through DecoupledTrainer on 2 workers, with a fixed batch and
    with accumulate_while_waiting; then resumed on the same world size to the end of the budget."""
    from test_checkpoint import tiny_args, tiny_data, tiny_model

    from acco import checkpoint
    from acco.trainer import DecoupledTrainer

    found = {}
    for method in ("acco", "ddp", "dpu", "wp", "torch-ddp"):
        for fixed in (True, False):
            out = Path(root) / f"{method}-{fixed}"
            args = tiny_args(method, out, nb_steps_tot=16, accumulate_while_waiting=not fixed)
            torch.manual_seed(0)
            model = tiny_model()
            numel = sum(p.numel() for p in model.parameters())
            DecoupledTrainer(model=model, train_dataset=tiny_data(), args=args).train()
            folder = checkpoint.list_checkpoints(out)[0]  # checkpoint-2: mid-run
            state = checkpoint.load_worker(folder, rank, world_size)["engine"]
            resumed = DecoupledTrainer(model=tiny_model(), train_dataset=tiny_data(), args=args | {"nb_steps_tot": 24})
            summary = resumed.train(resume_from_checkpoint=str(folder))
            found[(method, fixed)] = {
                "numel": numel,
                "largest": max((t.numel(), name) for name, t in checkpoint.floating_tensors(state) if name != "accumulator"),
                "accumulator": state.get("accumulator") is not None,
                "dropped": state.get("dropped_micro_batches", 0),
                "samples": summary["samples"],
            }
    return found


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("contents")
    return root, run_distributed(_save_every_method, 2, str(root))[0]


@pytest.fixture(scope="module")
def saved(saved_root):
    return saved_root[1]


def test_no_rank_file_holds_the_parameter_vector_and_the_accumulator_only_for_a_fixed_batch(saved):
    for (method, fixed), got in saved.items():
        size, name = got["largest"]
        assert size <= -(-got["numel"] // 2), (method, fixed, name, size)  # at most one shard of 2
        # a fixed batch resumes exactly with the accumulator that an overlapped method holds
        assert got["accumulator"] == (fixed and method in ("acco", "dpu", "wp")), (method, fixed)
        # without it, the micro-batches it held are read again: the data position went back by them
        overlapped_and_timed = not fixed and method in ("acco", "dpu", "wp")
        assert (got["dropped"] > 0) == overlapped_and_timed, (method, fixed, got["dropped"])
        assert got["samples"] >= 24, (method, fixed)  # resumed (exactly, or from its warm start) to the budget


def test_a_resharded_resume_maps_the_old_files_instead_of_reading_them(saved_root, monkeypatch):
    """2 -> 1 worker through DecoupledTrainer: every old file is opened memory-mapped (only what
    is then touched is read), and the engine takes its slices from the old shards it overlaps."""
    from test_checkpoint import tiny_args, tiny_data, tiny_model

    from acco import checkpoint
    from acco.trainer import DecoupledTrainer

    root, _ = saved_root
    folder = checkpoint.list_checkpoints(root / "acco-True")[0]
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
