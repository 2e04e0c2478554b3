"""The order of collectives, recorded: what NCCL needs and gloo hides.

NCCL matches the collectives of a group by the order in which each rank issues them. The comm
thread issues a round's collectives whenever it gets to them, so a collective of the main thread
(an evaluation's barrier or all-reduce, a checkpoint's flag) issued on a group while a round on that
group may be in flight lands before the round's on one rank and after it on another: a hang, or a
wrong sum. gloo's ring runs on tagged point-to-point messages and hides it. So these tests do not
wait for a hang: every torch.distributed call is recorded with its thread and group, and a round
counts as in flight from its submission until the main thread has seen its result. Asserted, for
every method through the trainer with evaluations, checkpoints and a stop at the eval loss (then
the final save), and for diloco and streaming-diloco on 2 nodes of 2 workers (one replica per node:
the main thread all-reduces the inner step's gradients over the node while a fragment's round runs
between nodes, on other groups):

- no main-thread collective on a group that a round in flight uses (checked once the round has
  landed, when every group it used is known);
- no collective inside what rank 0 does alone (after_rank0): the others never join it;
- every rank issues the same sequence of collectives on each thread;
- on 2 nodes x 2 workers (the two-level rounds: an inner group per node, an outer group per local
  index), for acco and wp (whose committed parameters the main thread gathers over both levels):
  on each group, every member issues the same sequence of collectives, the comm thread's and the
  main thread's together, which is the order NCCL matches them by on that group's communicator.
"""

from __future__ import annotations

import inspect
import threading

import pytest
import torch.distributed as dist
from distributed import run_distributed
from trainer_helpers import TINY

from acco.engine.config import METHODS

# (torch 2.13 names all_gather_into_tensor / reduce_scatter_tensor *_single; acco calls the new names)
COLLECTIVES = ("all_reduce", "barrier", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter",
               "all_to_all_single", "isend", "irecv", "send", "recv", "all_gather_object",
               "broadcast_object_list")  # fmt: skip
# Variants with comm paths of their own: acco's int8 estimate round (an all-to-all) with the split
# that follows the rounds' durations.
VARIANTS = {"acco-int8-auto": ("acco", dict(estimate_comm="int8", estimate_micro_batches="auto",
                                            n_grad_accumulation=2, accumulate_while_waiting=False))}


# The helpers that run their first argument on rank 0 alone while the others wait on the store.
RANK0_ALONE = ("after_rank0", "decided_by_rank0", "_finish_on_rank0")


class Recorder:
    """Wraps torch.distributed's collectives and BackgroundComm.submit in this process."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, str, tuple | str]] = []  # (thread, function, group), in issue order
        self.violations: list[str] = []
        self.in_flight: set = set()
        self.running = None  # the round the comm thread is inside
        self.overlapped = 0  # main-thread collectives issued beside a round in flight (other groups)
        # The thread running rank 0's work alone (after_rank0), else None: a checkpoint's is the
        # writer thread (train.async_save) while the comm thread's rounds go on.
        self.rank0_alone: threading.Thread | None = None
        self.context = "setup"
        lock = threading.Lock()
        for name in COLLECTIVES:
            if hasattr(dist, name):
                monkeypatch.setattr(dist, name, self._wrap(name, getattr(dist, name), lock))
        from acco.engine.background import BackgroundComm

        submit = BackgroundComm.submit
        recorder = self

        class Tracked:  # a round is in flight until the main thread has seen its result
            def __init__(self, comm, fn):
                self.groups: set = set()  # the groups the round issued on
                self.beside: list = []  # (context, function, group) the main thread issued meanwhile
                recorder.in_flight.add(self)
                self.future = submit(comm, lambda: self._run(fn))

            def _run(self, fn):
                recorder.running = self
                try:
                    return fn()
                finally:
                    recorder.running = None

            def done(self):
                return self.future.done()

            def result(self):
                out = self.future.result()
                recorder.in_flight.discard(self)
                for context, name, group in self.beside:
                    if group in self.groups:
                        recorder.violations.append(
                            f"{context}: main-thread {name} on a group of the round in flight"
                        )
                    else:
                        recorder.overlapped += 1
                return out

        monkeypatch.setattr(BackgroundComm, "submit", lambda comm, fn: Tracked(comm, fn))
        import acco.checkpoint
        import acco.trainer

        # Rank 0's work alone (its first argument), as each module runs it: none may issue a collective.
        for module in (acco.trainer, acco.checkpoint):
            alone = [n for n in RANK0_ALONE if hasattr(module, n)]
            assert alone, f"{module.__name__} runs rank 0's work alone through none of {RANK0_ALONE}"
            for name in alone:
                monkeypatch.setattr(module, name, self._alone(getattr(module, name)))

    def _wrap(self, name, fn, lock):
        signature = inspect.signature(fn)

        def recorded(*args, **kwargs):
            main = threading.current_thread() is threading.main_thread()
            group = signature.bind(*args, **kwargs).arguments.get("group")
            group = dist.GroupMember.WORLD if group is None else group
            # the group by its members' global ranks: the same key on every member
            world = group is dist.GroupMember.WORLD
            members = "world" if world else tuple(dist.get_process_group_ranks(group))
            with lock:
                self.calls.append(("main" if main else "comm", name, members))
            if main:
                for tracked in list(self.in_flight):
                    tracked.beside.append((self.context, name, group))
            elif self.running is not None:
                self.running.groups.add(group)
            if self.rank0_alone is threading.current_thread():
                # the other ranks never issue it: record and skip, or the test would hang
                self.violations.append(f"{self.context}: {name} inside rank 0's work alone (after_rank0)")
                return None
            return fn(*args, **kwargs)

        return recorded

    def _alone(self, run_on_rank0):
        def wrapped(work, *args, **kwargs):
            def flagged():
                self.rank0_alone = threading.current_thread()
                try:
                    return work()
                finally:
                    self.rank0_alone = None

            return run_on_rank0(flagged, *args, **kwargs)

        return wrapped


# Every run stops at its first evaluation (update 4, stop_at_eval_loss above any loss), and its
# budget of micro-batches is far out of reach: acco, accumulating while it waits, takes as many per
# update as its rounds' time allows, so a budget of 48 could run out before update 4. Finite, so
# that a run that failed to stop ends (and fails the test) within seconds.
OUT_OF_REACH = 1000


def _train_every_method(rank, world, out_dir, methods, overrides=None, per_node=None):
    from omegaconf import OmegaConf

    from acco.data import load_tokenizer, synthetic_corpus
    from acco.models import build_model
    from acco.trainer import DecoupledTrainer

    mp = pytest.MonkeyPatch()
    if per_node is not None:  # the local launcher's emulated nodes (launch.workers_per_node)
        mp.setenv("ACCO_WORKERS_PER_NODE", str(per_node))
    recorder = Recorder(mp)
    docs = synthetic_corpus(160)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=300)
    results = {}
    try:
        for name in methods:
            method, extra = VARIANTS.get(name, (name, {}))
            recorder.calls.clear()
            recorder.context, recorder.overlapped = name, 0
            model = build_model(
                {**OmegaConf.load(TINY), "num_layers": 2}, vocab_size=len(tokenizer), max_length=16
            )
            args = dict(
                method_name=method,
                batch_size=2,
                n_grad_accumulation=1,
                use_mixed_precision=False,
                learning_rate=1e-3,
                nb_steps_tot=OUT_OF_REACH,
                max_length=16,
                eval_step=4,
                save_step=2,
                max_eval_batches=2,
                stop_at_eval_loss=100.0,
                output_dir=f"{out_dir}/{name}",
                cache_dir=f"{out_dir}/cache",
                log_step=1,
                accumulate_while_waiting=method == "acco",
                sync_every=4,
                num_fragments=2 if method == "streaming-diloco" else 1,
                fragment_sync_delay=1 if method == "streaming-diloco" else 0,
            )
            args.update(extra, **(overrides or {}))
            trainer = DecoupledTrainer(model=model, tokenizer=tokenizer, train_dataset=docs, args=args)
            summary = trainer.train()  # stops at the first evaluation (step 4), checkpoints at 2 and 4
            results[name] = (summary["updates"], list(recorder.calls), recorder.overlapped)
            del trainer
    finally:
        mp.undo()
    return results, recorder.violations


@pytest.mark.parametrize("methods", [("acco", "ddp", "dpu", "wp", "torch-hsdp"),
                                     ("torch-ddp", "diloco", "streaming-diloco", "acco-int8-auto")])
def test_no_collective_while_a_round_is_in_flight_nor_on_rank0_alone(tmp_path, methods):
    assert set(METHODS) == {"acco", "ddp", "dpu", "wp", "torch-ddp", "torch-hsdp", "diloco",
                            "streaming-diloco"}
    per_rank = run_distributed(_train_every_method, 2, str(tmp_path), methods)
    for _, violations in per_rank:
        assert violations == []
    (results, _), (others, _) = per_rank
    for method in methods:
        step, calls, _ = results[method]
        assert step == 4, (method, step)  # stopped at the first evaluation
        assert any(thread == "main" for thread, _, _ in calls)
        if method in ("acco", "ddp", "dpu", "wp", "acco-int8-auto"):  # the rounds' statistics are seen
            assert ("comm" if method != "ddp" else "main", GATHER, "world") in calls, (method, calls)
        if method == "acco-int8-auto":
            assert ("comm", "all_to_all_single", "world") in calls
        for thread in ("main", "comm"):
            mine = [name for t, name, _ in calls if t == thread]
            theirs = [name for t, name, _ in others[method][1] if t == thread]
            assert mine == theirs, (method, thread)


def test_one_replica_per_node_keeps_each_group_s_order(tmp_path, monkeypatch):
    """diloco and streaming-diloco on 2 nodes of 2 workers (the launcher's ACCO_WORKERS_PER_NODE;
    rounds=nodes, the default): a fragment's round touches the outer group alone, and the node's
    gather of it runs on the main thread when it lands, so the inner step's gradient all-reduce on
    the main thread, issued while a streaming fragment's round is in flight, shares no group with
    it. No checkpoint at step 2, where fragment 0's round is launched: step 3's inner all-reduce
    then runs beside it (a checkpoint's quiesce would land it first)."""
    methods = ("diloco", "streaming-diloco")
    per_rank = run_distributed(_train_every_method, 4, str(tmp_path), methods, dict(save_step=3), 2)
    for _, violations in per_rank:
        assert violations == []
    results = per_rank[0][0]
    for method in methods:
        step, calls, overlapped = results[method]
        assert step == 4, (method, step)
        # the inner step's all-reduce on the main thread, the flags' in the round
        assert {("main", "all_reduce"), ("comm", "all_reduce")} <= {(t, name) for t, name, _ in calls}
        if method == "streaming-diloco":  # the overlap this test is about happened
            assert overlapped > 0
        for others, _ in per_rank[1:]:
            for thread in ("main", "comm"):
                mine = [name for t, name, _ in calls if t == thread]
                theirs = [name for t, name, _ in others[method][1] if t == thread]
                assert mine == theirs, (method, thread)


GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
INNER, OUTER = ((0, 1), (2, 3)), ((0, 2), (1, 3))  # 2 x 2: the nodes' groups, the local indices'


def _on_two_nodes(tmp_path, overrides=None) -> dict:
    """acco and wp through the trainer on 2 x 2 (the launcher's ACCO_WORKERS_PER_NODE), each stopped
    at its first evaluation with no violation: each method's recorded calls, per rank."""
    per_rank = run_distributed(_train_every_method, 4, str(tmp_path), ("acco", "wp"), overrides, 2)
    for _, violations in per_rank:
        assert violations == []
    runs = {}
    for method in ("acco", "wp"):
        assert all(results[method][0] == 4 for results, _ in per_rank), method
        runs[method] = [results[method] for results, _ in per_rank]
    return runs


def _each_group_in_one_order(calls: list, method: str) -> None:
    """On each group, every member issued the same sequence (both threads'): NCCL's matching order."""
    for group in ("world", *INNER, *OUTER):
        members = range(4) if group == "world" else group
        seen = [[(t, name) for t, name, g in calls[rank] if g == group] for rank in members]
        assert seen[0] and all(s == seen[0] for s in seen), (method, group)


def test_on_two_nodes_each_group_sees_the_same_collectives_in_the_same_order_on_every_member(tmp_path):
    for method, results in _on_two_nodes(tmp_path).items():
        calls = [r[1] for r in results]
        for rank, mine in enumerate(calls):
            groups = {group for _, _, group in mine}
            assert groups == {"world", INNER[rank // 2], OUTER[rank % 2]}, (method, rank, groups)
            # the rounds cross both levels on the comm thread; wp's committed parameters too, gathered
            # on the main thread (evaluations, checkpoints, the end of the run)
            for group in (INNER[rank // 2], OUTER[rank % 2]):
                assert any(t == "comm" and g == group for t, _, g in mine), (method, rank, group)
                on_main = any(t == "main" and g == group for t, _, g in mine)
                assert on_main == (method == "wp"), (method, rank, group)
        _each_group_in_one_order(calls, method)


def test_sharded_inside_the_node_the_two_threads_share_no_group(tmp_path):
    """train.shard_inside_node on 2 x 2: FSDP2's all-gathers and reduce-scatters run on the main
    thread over the node's group, every micro-batch, while a round runs; the round's collectives
    (the comm thread) use the outer group and the whole job's only, which the main thread uses only
    while no round is in flight (the recorder's violations). Each group's members issue one sequence."""
    for method, results in _on_two_nodes(tmp_path, dict(shard_inside_node=True)).items():
        calls = [r[1] for r in results]
        for rank, mine in enumerate(calls):
            comm = {g for t, _, g in mine if t == "comm"}
            main = {g for t, _, g in mine if t == "main"}
            assert comm == {"world", OUTER[rank % 2]}, (method, rank, comm)
            assert INNER[rank // 2] in main, (method, rank, main)  # FSDP2's, the main thread's alone
            assert results[rank][2] > 0  # FSDP2's collectives ran beside a round in flight
        _each_group_in_one_order(calls, method)
