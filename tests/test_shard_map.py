"""acco/engine/shard_map.py: where each element lives in every layout's files, checked against the
layouts written out element by element (the flat vector, the two-level order, FSDP2's row chunks),
and a resharding between every pair of layouts that lands each element where the new layout keeps it."""

from __future__ import annotations

import itertools

import pytest
import torch

from acco.engine.layout import NodeLayout
from acco.engine.shard_map import Layout, copy_from

# matrices first (the flat order), rows that do and do not divide by 2 and 4, a single row
SHAPES = ((5, 3), (4, 2), (1, 6), (7,), (2,), (3,))


def files(world: int, per_node: int, sharded: bool) -> list[torch.Tensor]:
    """Each worker's shard of the element ids 1, 2, ... (0: padding), written out plainly."""
    ids, start = [], 1
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        ids.append(torch.arange(start, start + n, dtype=torch.float64).view(shape))
        start += n
    if not sharded:
        flat = torch.cat([t.flatten() for t in ids])
        n = -(-flat.numel() // world)
        flat = torch.cat([flat, torch.zeros(n * world - flat.numel(), dtype=flat.dtype)])
        R = world // per_node if per_node else world
        owned = [NodeLayout(R, per_node, r).shard_rank if per_node else r for r in range(world)]
        return [flat[k * n : (k + 1) * n] for k in owned]
    S, R = per_node, world // per_node
    local = []
    for s in range(S):
        parts = []
        for t in ids:
            c = -(-t.shape[0] // S)
            rows = t[s * c : (s + 1) * c].flatten()
            parts += [rows, torch.zeros(c * t[0].numel() - rows.numel(), dtype=t.dtype)]
        local.append(torch.cat(parts))
    n = -(-local[0].numel() // R)
    local = [torch.cat([v, torch.zeros(n * R - v.numel(), dtype=v.dtype)]) for v in local]
    return [local[rank % S][(rank // S) * n : (rank // S + 1) * n] for rank in range(world)]


LAYOUTS = [(1, 0, False), (2, 0, False), (4, 0, False), (3, 0, False), (4, 2, False), (6, 3, False),
           (6, 2, False), (4, 2, True), (6, 2, True), (6, 3, True), (8, 4, True), (8, 2, True)]


@pytest.mark.parametrize("old,new", list(itertools.permutations(LAYOUTS, 2)))
def test_resharding_lands_every_element_where_the_new_layout_keeps_it(old, new):
    saved = files(*old)
    want = files(*new)
    old_layout, new_layout = Layout(*old, SHAPES), Layout(*new, SHAPES)

    def old_state(rank):
        return {"master": saved[rank], "exp_avg": -saved[rank]}

    for rank in range(new[0]):
        into = {"master": torch.full_like(want[rank], 7.0), "exp_avg": torch.full_like(want[rank], 7.0)}
        copy_from(new_layout, rank, old_layout, old_state, ("master", "exp_avg"), into)
        assert torch.equal(into["master"], want[rank]), (old, new, rank)
        assert torch.equal(into["exp_avg"], -want[rank])


def test_each_layout_s_shard_size_is_its_files():
    for layout in LAYOUTS:
        assert Layout(*layout, SHAPES).shard_numel() == files(*layout)[0].numel(), layout
