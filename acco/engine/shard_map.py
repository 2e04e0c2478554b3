"""Where each parameter's elements live in a layout's shards, so that a checkpoint of one layout
resumes on another (DecoupledEngine.load_state_dict).

A layout is what a checkpoint's header records (flat.py's state_header): the world size W, the
workers per node S of the two-level rounds (0: the flat ring), and whether the node's workers shard
the parameters (node_shards.py). Every worker's file holds one fp32 shard of the master and the
moments; an element is named by (parameter i, index j in its flattened storage), the parameters in
the flat order (decayed first), and `pieces` says which file and offset holds a run of them:

- unsharded: one flat vector of every parameter, padded to W shards; shard k is in the file of
  worker k on the flat ring, of worker (node r, local s) with k = s R + r on nodes (nodes.py);
- sharded inside the node: local index s holds rows [s c, s c + c) of each parameter (c =
  ceil(rows / S), padded), its local vector padded to R shards; shard r of it is worker (r, s)'s.

Runs, not elements: a resume walks its own shard in runs of contiguous elements and copies each from
the few old files that hold it (memory-mapped: only those slices are read), so its peak memory is
that of the run it resumes into.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from acco.engine.layout import shard_file_rank


@dataclass(frozen=True)
class Layout:
    world: int
    per_node: int  # 0: the flat ring
    sharded: bool
    shapes: tuple[tuple[int, ...], ...]  # the parameters', in the flat order (decayed first)

    def words(self) -> str:
        per_node = f"{self.per_node} per node" if self.per_node else "flat ring"
        return f"{self.world} workers ({per_node}{', sharded inside the node' if self.sharded else ''})"

    @classmethod
    def of_state(cls, state: dict, shapes) -> Layout:
        return cls(int(state["world_size"]), int(state.get("workers_per_node", 0)),
                   bool(state.get("shard_inside_node", False)), tuple(map(tuple, shapes)))

    def _row(self, i: int) -> int:  # elements per row of parameter i
        shape = self.shapes[i]
        return _numel(shape[1:])

    def _rows_per_chunk(self, i: int) -> int:  # sharded: the padded rows local index s holds
        return local_rows(self.shapes[i][0], self.per_node, 0)[1]

    def _offsets(self) -> list[int]:
        """Each parameter's start in the flat vector, or (sharded) in every local vector."""
        out, at = [], 0
        for i, shape in enumerate(self.shapes):
            out.append(at)
            at += self._rows_per_chunk(i) * self._row(i) if self.sharded else _numel(shape)
        out.append(at)
        return out

    def shard_numel(self) -> int:
        total = self._offsets()[-1]
        parts = self.world // self.per_node if self.sharded else self.world
        return -(-total // parts)

    def pieces(self, i: int, j0: int, j1: int) -> Iterator[tuple[int, int, int]]:
        """(file rank, offset in its shard, length) of parameter i's elements [j0, j1), in order."""
        offsets, n = self._offsets(), self.shard_numel()
        while j0 < j1:
            if self.sharded:
                row, S = self._row(i), self.per_node
                chunk = self._rows_per_chunk(i) * row
                s = j0 // chunk
                pos = offsets[i] + j0 - s * chunk  # in local index s's vector
                end = min(j1, (s + 1) * chunk)
                r = pos // n
                rank = r * S + s
            else:
                pos, end = offsets[i] + j0, j1
                r = pos // n
                rank = shard_file_rank(r, self.world, self.per_node) if self.per_node else r
            length = min(end - j0, (r + 1) * n - pos)
            yield rank, pos - r * n, length
            j0 += length

    def runs(self, rank: int) -> Iterator[tuple[int, int, int, int]]:
        """(parameter i, j0, j1, offset in the shard) of the real elements worker `rank`'s shard
        holds (padding skipped), in shard order."""
        offsets, n = self._offsets(), self.shard_numel()
        if self.sharded:
            S = self.per_node
            r, s = divmod(rank, S)
        else:
            s = 0
            r = rank if not self.per_node else _shard_of(rank, self.world, self.per_node)
        lo, hi = r * n, (r + 1) * n
        for i, shape in enumerate(self.shapes):
            a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
            if a >= b:
                continue
            first = s * self._rows_per_chunk(i) * self._row(i) if self.sharded else 0
            real = _numel(shape) - first  # this chunk's real elements (the rest is padding)
            j0, j1 = first + a - offsets[i], first + min(b - offsets[i], max(real, 0))
            if j0 < j1:
                yield i, j0, j1, a - lo


def local_rows(rows: int, workers: int, local: int) -> tuple[int, int]:
    """FSDP2's dim-0 shard of a parameter of `rows` rows over `workers` (torch.chunk's): (first
    row, padded rows) of local index `local`; it holds rows [first, min(first + padded, rows))."""
    padded = -(-rows // workers)
    return min(local * padded, rows), padded


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _shard_of(rank: int, world: int, per_node: int) -> int:
    """The flat shard worker `rank` owns on the two-level rounds (nodes.py: s R + r)."""
    node, local = divmod(rank, per_node)
    return local * (world // per_node) + node


def copy_from(new: Layout, rank: int, old: Layout, old_state, names: tuple[str, ...], into: dict) -> None:
    """into[name] (this worker's shard on `new`) = the same elements of the old layout's files
    (`old_state(r)`: a worker's saved state, memory-mapped), name by name; padding left zero."""
    for t in into.values():
        t.zero_()
    needed: dict[int, list] = {}
    for i, j0, j1, at in new.runs(rank):
        for old_rank, old_at, length in old.pieces(i, j0, j1):
            needed.setdefault(old_rank, []).append((at, old_at, length))
            at += length
    for old_rank, copies in sorted(needed.items()):
        saved = old_state(old_rank)
        for name in names:
            src, dst = saved[name], into[name]
            for at, old_at, length in copies:
                dst[at : at + length].copy_(src[old_at : old_at + length])
        del saved  # a memory-mapped file is released before the next one is touched
