"""Tests of acco.data: the train/eval split and the micro-batch streams.

Everything runs offline on files the tests write under tmp_path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from datasets import Dataset

from acco.data import (
    DataError,
    MicroBatchStream,
    Rows,
    eval_batches,
    pad_token_ids,
    split_train_eval,
)

# ---------------------------------------------------------------- train/eval split

def test_split_train_eval():
    train, evl = split_train_eval(100, 0.1, seed=0)
    assert len(evl) == 10 and len(train) == 90
    assert sorted(train.tolist() + evl.tolist()) == list(range(100))
    again_train, again_eval = split_train_eval(100, 0.1, seed=0)
    assert torch.equal(evl, again_eval) and torch.equal(train, again_train)
    assert not torch.equal(evl, split_train_eval(100, 0.1, seed=1)[1])
    assert evl.tolist() != list(range(90, 100)) and evl.tolist() != list(range(10))  # random, not a slice
    assert len(split_train_eval(10, 0.01, seed=0)[1]) == 1  # at least one eval example
    with pytest.raises(DataError):
        split_train_eval(1, 0.5, seed=0)
    with pytest.raises(DataError):
        split_train_eval(10, 1.0, seed=0)


# ---------------------------------------------------------------- micro-batch stream

def ids_of(batch):
    """The dataset rows are numbered: row i holds i, so a batch shows which rows it took."""
    return batch["input_ids"][:, 0].tolist()


def numbered(n, width=4):
    return torch.arange(n).unsqueeze(1).repeat(1, width)


def take(stream, k):
    return [ids_of(next(stream)) for _ in range(k)]


def test_stream_shards_are_disjoint_and_cover_the_epoch():
    data = numbered(23)  # 23 = 3 global batches of 6, and a tail of 5 that is dropped
    streams = [MicroBatchStream(data, batch_size=2, rank=r, world_size=3, seed=5) for r in range(3)]
    assert streams[0].batches_per_epoch == 3 and streams[0].samples_per_epoch == 18
    seen = [sum(take(s, 3), []) for s in streams]
    for r in range(3):
        assert len(set(seen[r])) == 6
        for q in range(r):
            assert not set(seen[r]) & set(seen[q])
    all_seen = sum(seen, [])
    assert len(set(all_seen)) == 18 and set(all_seen) <= set(range(23))

    # Divisible size: the ranks together read every sample exactly once per epoch, every epoch.
    data = numbered(24)
    streams = [MicroBatchStream(data, batch_size=2, rank=r, world_size=3, seed=5) for r in range(3)]
    for _epoch in range(3):
        assert sorted(sum((sum(take(s, 4), []) for s in streams), [])) == list(range(24))


def test_stream_global_batches_do_not_depend_on_world_size():
    data = numbered(40)
    two = [MicroBatchStream(data, batch_size=2, rank=r, world_size=2, seed=0) for r in range(2)]
    one = MicroBatchStream(data, batch_size=4, seed=0)
    for _ in range(25):  # across epoch boundaries
        assert sorted(ids_of(next(two[0])) + ids_of(next(two[1]))) == sorted(ids_of(next(one)))


def test_stream_is_deterministic_per_seed_and_reshuffles_each_epoch():
    data = numbered(32)
    a = take(MicroBatchStream(data, batch_size=4, seed=7), 16)
    assert a == take(MicroBatchStream(data, batch_size=4, seed=7), 16)
    assert a != take(MicroBatchStream(data, batch_size=4, seed=8), 16)
    epoch0, epoch1 = sum(a[:8], []), sum(a[8:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(32))
    assert epoch0 != epoch1
    assert epoch0 != list(range(32))  # shuffled
    # Seeds 0 and 1 must not give the same orders shifted by one epoch.
    s0, s1 = MicroBatchStream(data, 4, seed=0), MicroBatchStream(data, 4, seed=1)
    assert not torch.equal(s0.permutation(1), s1.permutation(0))


def test_stream_resumes_exactly_from_state_dict():
    data = {"input_ids": numbered(20), "attention_mask": torch.ones(20, 4, dtype=torch.long)}
    stream = MicroBatchStream(data, batch_size=3, rank=1, world_size=2, seed=11)  # 3 batches/epoch
    take(stream, 5)
    state = stream.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    expected = [next(stream) for _ in range(7)]

    resumed = MicroBatchStream(data, batch_size=3, rank=1, world_size=2, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    for want in expected:
        got = next(resumed)
        assert set(got) == {"input_ids", "labels", "attention_mask"}
        for key in want:
            assert torch.equal(got[key], want[key])
    # A fresh stream (no resume) would have given other batches.
    fresh = MicroBatchStream(data, batch_size=3, rank=1, world_size=2, seed=11)
    assert ids_of(next(fresh)) != ids_of(expected[0])

    with pytest.raises(DataError, match="seed"):
        MicroBatchStream(data, batch_size=3, rank=1, world_size=2, seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="global_batch_size"):
        MicroBatchStream(data, batch_size=2, rank=1, world_size=2, seed=11).load_state_dict(state)


def test_stream_batches_labels_and_errors():
    blocks = numbered(8)
    batch = next(MicroBatchStream(blocks, batch_size=2))
    assert set(batch) == {"input_ids", "labels"}
    assert torch.equal(batch["labels"], batch["input_ids"]) and batch["input_ids"].shape == (2, 4)

    labels = -numbered(8)
    batch = next(MicroBatchStream({"input_ids": blocks, "labels": labels}, batch_size=2))
    assert torch.equal(batch["labels"], -batch["input_ids"])  # rows stay aligned across columns

    with pytest.raises(DataError, match=r"5 samples.*batch_size 3 x world_size 2 = 6"):
        MicroBatchStream(numbered(5), batch_size=3, world_size=2)
    with pytest.raises(DataError, match="differ in length"):
        MicroBatchStream({"input_ids": blocks, "labels": labels[:7]}, batch_size=2)
    with pytest.raises(DataError, match="rank"):
        MicroBatchStream(blocks, batch_size=2, rank=2, world_size=2)


def test_eval_batches_fixed_order_and_complete():
    data = numbered(10)
    batches = [ids_of(b) for b in eval_batches(data, 4)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [ids_of(b) for b in eval_batches(data, 4)] == batches  # same every time
    shards = [sum((ids_of(b) for b in eval_batches(data, 2, rank=r, world_size=3)), []) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10)) and shards[1] == [1, 4, 7]
    with pytest.raises(DataError):
        eval_batches(data, 0)


def test_rows_select_is_an_index_view_and_take_widens_to_int64():
    blocks = np.arange(40, dtype=np.uint16).reshape(10, 4)
    rows = Rows(blocks)
    sub = rows.select(torch.tensor([9, 7, 5, 3])).select([3, 0])  # rows 3 and 9
    assert len(sub) == 2 and sub.columns["input_ids"] is blocks  # no tokens copied
    batch = sub.take([1, 0])
    assert batch["input_ids"].dtype == torch.long and ids_of(batch) == [36, 12]
    assert torch.equal(batch["labels"], batch["input_ids"])
    # A stream over a selection reads the selected rows only.
    evens = MicroBatchStream(rows.select(np.arange(0, 10, 2)), batch_size=5)
    assert sorted(ids_of(next(evens))) == [0, 8, 16, 24, 32]
    assert [ids_of(b) for b in eval_batches(rows.select([4, 1, 2]), 2)] == [[16, 4], [8]]


def test_eval_batches_collates_examples_per_rank():
    examples = [{"input_ids": [i] * (i % 3 + 1)} for i in range(7)]

    def collate(chunk):
        return {"input_ids": torch.tensor([e["input_ids"][0] for e in chunk])}

    shards = [
        [b["input_ids"].tolist() for b in eval_batches(examples, 2, r, 2, collate=collate)] for r in range(2)
    ]
    assert shards == [[[0, 2], [4, 6]], [[1, 3], [5]]]


def test_pretokenized_rows_are_padded_and_checked():
    dataset = Dataset.from_dict(
        {
            "input_ids": [[5, 6, 7], [8, 9]],
            "attention_mask": [[1, 1, 1], [1, 1]],
            "labels": [[-100, 6, 7], [8, 9]],
        }
    )
    out = pad_token_ids(dataset, max_length=4, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]  # padded to the longest row
    assert out["labels"].tolist() == [[-100, 6, 7], [8, 9, -100]]  # the user's -100 kept
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    as_list = pad_token_ids(rows, max_length=4, pad_token_id=0)
    assert all(np.array_equal(as_list[k], out[k]) for k in out)
    # run_clm.py's blocks: equal lengths and no labels: labels = input_ids, nothing to pad.
    blocks = pad_token_ids(
        Dataset.from_dict({"input_ids": [[1, 2], [3, 4]]}), max_length=2, pad_token_id=None
    )
    assert set(blocks) == {"input_ids", "labels"} and blocks["labels"].tolist() == [[1, 2], [3, 4]]

    with pytest.raises(DataError, match="example 0 has 3 tokens, more than max_length 2"):
        pad_token_ids(dataset, max_length=2, pad_token_id=0)
    with pytest.raises(DataError, match="example 1: labels has 1 values, input_ids 2"):
        pad_token_ids([{"input_ids": [1], "labels": [1]}, {"input_ids": [2, 3], "labels": [2]}], 4, 0)
    with pytest.raises(DataError, match="pad token"):
        pad_token_ids(dataset, max_length=4, pad_token_id=None)


def test_packed_blocks_read_their_rows_once_and_their_labels_are_the_input_ids():
    from acco.data.on_device import OnDevice

    blocks = np.arange(40, dtype=np.uint16).reshape(10, 4)
    batch = next(MicroBatchStream(blocks, batch_size=2, rank=0, world_size=1, seed=0))
    assert batch["labels"] is batch["input_ids"]  # one read, one tensor: a causal LM shifts the labels itself
    sent = next(OnDevice(iter([batch]), torch.device("cpu")))
    assert sent["labels"] is sent["input_ids"] and torch.equal(sent["input_ids"], batch["input_ids"])
