"""Batch packing in tiles: a group's intermediate values held a part at a time.

In batch packing every element of a value is a ciphertext, so a group's memory is that of the
values alive at once: a Mu-Layer's hidden values (``AX``, ``BDX`` and their product, three
times the channels of its input over every token) dominate it. Most rows are read only by a few
rows of the next steps: a product of two rows, a channel map of one token's rows, a spatial
shift of a token's neighbours'.

A **segment** is a run of consecutive steps: those read after it (or the output) are *kept*
whole, the others are *inner*. It runs tile by tile, as a wavefront: every live row of the
program has a **position** in one order of all rows in which rows that read one another sit
close (reverse Cuthill-McKee on the graph of reads: on a grid of tokens, a sweep across it), and
the segment's **sinks** (its kept rows) are cut into tiles by position, each tile computing about as
many rows as the next. A tile computes every row of the segment's steps that its sinks need and
no earlier tile computed; an inner row is freed in the last tile that reads it, as soon as the
last step reading it has run there (:func:`release_points`), and a server that owns the group's
inputs loads each in the first tile that reads it. So each row is computed once, exactly as in
one pass (the results are bit-identical), and the inner values alive at once are those of a
band of tiles: for a Mu-Layer on tokens, the tokens of a tile; with a spatial shift, also those
whose neighbours are still to come.

A segment may end with a **reduction**: a weighted map whose rows read the whole segment (a
classifier's head over every token) is summed tile by tile, each tile adding the products of the
rows it computed, and rescaled once at the end. Its inputs in the segment become inner values,
freed in the tile that computed them, where otherwise they would be kept whole. The sums are
those of one pass in another order: modular sums, so the same words up to where constants join.

Where no number of tiles fits, a segment's tiles also **spill** (:func:`spills`): a row is held
only in the tiles that read it, and between two of them that are not next to each other it is
written to disk at the end of the first and read back at the start of the second (the band a
spatial shift holds goes to disk).

:func:`find_segments` cuts the program into single steps and segments so that the peak with the
most tiles is lowest, by :func:`batch_memory` (every value at its own level's size, so that the
pieces of a program contribute independently); :func:`allocated_memory` is the rule for what a
group allocates as the runtime reuses its buffers, with or without tiles, which the compiler
reports and a server checks; :func:`choose_tiles` takes the fewest tiles whose allocation fits a
budget (none where the group fits whole: fewer, larger matrix products).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import reverse_cuthill_mckee

from polynets.ir.lowering import Lowered, affine_is_free, step_levels

__all__ = ["Segment", "Tile", "find_segments", "tile_plan", "batch_memory", "allocated_memory",
           "choose_tiles", "row_bytes_of", "RowBytes", "MAX_TILES", "weighted", "allocations",
           "finish_chunk", "buffer_bytes", "spills"]

#: Most tiles a segment is cut into (each tile's fused maps are built on their own)
MAX_TILES = 64

#: A row reading more than this share of a value's live rows (and more than
#: :data:`_DENSE_MIN` of them) reads "everything" (a head over all tokens): its reads do not
#: place rows close to one another in the order of rows
_DENSE_SHARE = 0.25
_DENSE_MIN = 64

_NONE = np.iinfo(np.int64).max


def finish_chunk(threads: int = 2) -> int:
    """Rows a server with ``threads`` threads finishes at once (relinearises, rescales;
    :func:`he.runtime._threaded`), whose scratch and results are held together. The memory rules
    here count them for two threads: a few rows either way."""
    return 4 * max(1, int(threads))


_CHUNK = finish_chunk()


@dataclass
class Segment:
    """Consecutive steps run tile by tile: ``keep`` (read after the segment, or the output)
    assembled whole, ``inner`` (read only inside it) held a band of tiles at a time.

    ``rank[s]``: per row of step ``s``, the position at which it is computed (the earliest
    position of a sink it leads to; ``-1``: not live); ``last[s]``: per row of an inner step
    (and of the group's inputs, ``last[0]``, where a server that owns them frees them tile by
    tile), the latest position of a row that reads it (it is freed after that position's tile);
    ``sinks``: the sorted distinct positions of the sinks, cut into tiles. ``reduce``: the end
    is a weighted map summed tile by tile (its rank and last are not used). ``load``: where the
    group's inputs are freed tile by tile (``0 in last``), per input row the earliest position
    of a row that reads it: a server that owns them loads each in the tile that first reads it.
    """

    keep: tuple[int, ...]
    inner: tuple[int, ...]
    rank: dict[int, np.ndarray]
    last: dict[int, np.ndarray]
    sinks: np.ndarray
    reduce: bool = False
    load: np.ndarray | None = None

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(sorted((*self.keep, *self.inner)))

    @property
    def end(self) -> int:
        """The step at whose place the segment runs (its last)."""
        return max(self.keep)

    @property
    def components(self) -> int:
        """The most tiles the segment can be cut into (its distinct sink positions)."""
        return int(self.sinks.size)


@dataclass
class Tile:
    """One tile of a segment: per step, the rows it computes (``compute``), per inner step the
    rows it frees (``free``: once the last step reading them has run in it,
    :func:`release_points`) and the group's input rows it loads first (``load``; empty where
    the inputs are not loaded tile by tile). Where the segment spills (:func:`spills`): per
    inner step the rows it reads back from disk before anything runs (``reload``) and those it
    writes out after everything has (``spill``)."""

    compute: dict[int, np.ndarray] = field(default_factory=dict)
    free: dict[int, np.ndarray] = field(default_factory=dict)
    load: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    spill: dict[int, np.ndarray] = field(default_factory=dict)
    reload: dict[int, np.ndarray] = field(default_factory=dict)


def weighted(lowered: Lowered, s: int) -> bool:
    """Whether step ``s`` is a weighted map in batch packing: its rows are sums of products
    computed at its inputs' level (a scratch row each) and rescaled once, so they can also be
    summed in parts (a segment may end with it as a reduction)."""
    st = lowered.steps[s]
    return st.kind == "affine" and not affine_is_free(st, "batch")


def _kept(lowered: Lowered, reads: "_Reads", s: int, end: int) -> bool:
    """Whether step ``s`` of a segment ending at ``end`` is kept whole: read after the segment,
    the output, or the end itself."""
    return s == end or s in lowered.outputs or any(k > end for k in reads.readers[s])


def _tile_indices(seg: Segment, tiles: int) -> tuple[int, dict[int, np.ndarray],
                                                      dict[int, np.ndarray], np.ndarray]:
    """``(tiles, tile_of, free_at, load_at)``: per step of the segment, the tile computing each
    row, per inner step the tile in which each row is freed and, per input row, the tile that
    loads it (``-1``: not live, or inputs not loaded tile by tile)."""
    tiles = max(1, min(int(tiles), seg.components))
    # cut where each tile computes about as many rows as the next (a row is computed at the
    # position of the first sink it leads to, so the first tiles of a wavefront compute the
    # most where sinks are cut evenly); every rank is a sink's position and every sink's
    # position a rank, so there are ``tiles`` nonempty tiles, each starting at a sink
    ranks = np.concatenate([r[r >= 0] for r in seg.rank.values()] or [seg.sinks])
    pos, rows = np.unique(np.concatenate([ranks, seg.sinks]), return_counts=True)
    cum = np.cumsum(rows)
    idx = np.searchsorted(cum, cum[-1] * np.arange(1, tiles) / tiles, side="left") + 1
    for j in range(idx.size):                       # strictly increasing, within the positions
        idx[j] = max(idx[j], idx[j - 1] + 1 if j else 1)
    for j in range(idx.size - 1, -1, -1):
        idx[j] = min(idx[j], idx[j + 1] - 1 if j + 1 < idx.size else pos.size - 1)
    bounds = pos[idx]

    def index(pos: np.ndarray) -> np.ndarray:
        return np.where(pos >= 0, np.searchsorted(bounds, pos, side="right"), -1)

    tile_of = {s: index(r) for s, r in seg.rank.items()}
    free_at = {s: index(v) for s, v in seg.last.items()}
    load_at = index(seg.load) if seg.load is not None else np.zeros(0, dtype=np.int64)
    return tiles, tile_of, free_at, load_at


def tile_plan(seg: Segment, tiles: int, lowered: Lowered | None = None) -> list[Tile]:
    """The segment cut into ``tiles`` tiles (at most its :attr:`~Segment.components`), each
    computing about as many rows as the others as far as the sinks' positions allow; with
    ``lowered`` (its program), spilling between the tiles that read a row (:func:`spills`)."""
    tiles, tile_of, free_at, load_at = _tile_indices(seg, tiles)
    out = [Tile({s: t == i for s, t in tile_of.items()},
                {s: f == i for s, f in free_at.items()}, load_at == i) for i in range(tiles)]
    if lowered is not None:
        for s, (rows, out_at, back_at) in spills(lowered, seg, tiles).items():
            n = seg.rank[s].size
            for i, tile in enumerate(out):
                tile.spill[s] = np.isin(np.arange(n), rows[out_at == i])
                tile.reload[s] = np.isin(np.arange(n), rows[back_at == i])
    return out


#: :func:`spills` of the last few (segment, tiles) asked for: the memory rules ask again for
#: every tile count they try
_SPILLS: list[tuple[Segment, int, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]] = []


def spills(lowered: Lowered, seg: Segment, tiles: int
           ) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Where a segment in ``tiles`` tiles spills its inner rows to disk: per inner step,
    ``(rows, out_at, back_at)``, one entry per spill: the row is written out at the end of tile
    ``out_at`` (one that reads it) and read back at the start of tile ``back_at``, the next
    that reads it, where that is not the next tile. A row is held only in the tiles that read it
    (its own, and every tile computing a row of a step of the segment that reads it; a
    reduction reads it in its own), so the band of rows a spatial shift keeps between the
    tokens it joins goes to disk. The one rule for the runtime and the memory rules."""
    for cached_seg, cached_tiles, result in _SPILLS:
        if cached_seg is seg and cached_tiles == tiles:
            return result
    tiles, tile_of, _, _ = _tile_indices(seg, tiles)
    steps = lowered.steps
    out: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for j in seg.inner:
        mine = tile_of[j]
        rows = [np.flatnonzero(mine >= 0)]
        at = [mine[rows[0]]]
        for k, tk in tile_of.items():
            st = steps[k]
            for t, i in enumerate(st.inputs):
                if i != j:
                    continue
                if st.kind == "affine":
                    m = st.terms[t].tocoo()
                    ok = (tk[m.row] >= 0) & (mine[m.col] >= 0)
                    rows.append(m.col[ok].astype(np.int64))
                    at.append(tk[m.row[ok]])
                else:
                    r = np.flatnonzero((tk >= 0) & (mine >= 0))
                    rows.append(r)
                    at.append(tk[r])
        key = np.unique(np.concatenate(rows) * tiles + np.concatenate(at))
        row, tile = key // tiles, key % tiles
        gap = (row[1:] == row[:-1]) & (tile[1:] > tile[:-1] + 1)
        out[j] = (row[1:][gap], tile[:-1][gap], tile[1:][gap])
    _SPILLS[:] = [*_SPILLS[-7:], (seg, tiles, out)]
    return out


def release_points(lowered: Lowered, seg: Segment) -> dict[int, tuple[int, ...]]:
    """Per step of the segment, the values whose rows a tile frees (:attr:`Tile.free`) as soon
    as that step has run in it: the last step of the segment that reads them, so a tile holds
    its rows of a value only while steps of the tile still read them (a reduction's inputs:
    after the tile's part of it, which runs after every step). The one rule for the runtime
    and the memory rules."""
    out: dict[int, list[int]] = {}
    for j in seg.last:
        readers = [s for s in seg.steps if j in lowered.steps[s].inputs]
        out.setdefault(max(readers), []).append(j)
    return {s: tuple(sorted(v)) for s, v in out.items()}


def _per_tile(index: np.ndarray, tiles: int) -> np.ndarray:
    """Rows per tile of a row -> tile index (``-1`` rows not counted)."""
    return np.bincount(index[index >= 0], minlength=tiles)[:tiles].astype(np.float64)


def _readers(lowered: Lowered) -> list[set[int]]:
    out: list[set[int]] = [set() for _ in lowered.steps]
    for si, st in enumerate(lowered.steps):
        for j in st.inputs:
            out[j].add(si)
    return out


class _Reads:
    """Who reads which row: per step ``j``, ``(reader, indptr, indices)`` for every term of a
    step reading it, the live rows of the reader reading each live row of ``j`` (compressed by
    columns; ``None`` for a product's or scaling's row-for-row read); and a position for every
    row (:func:`_positions`)."""

    def __init__(self, lowered: Lowered, live: Sequence[np.ndarray]):
        steps = lowered.steps
        self.by_input: list[list[tuple[int, np.ndarray | None, np.ndarray | None]]] = \
            [[] for _ in steps]
        self.readers = _readers(lowered)
        edges: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        for k, st in enumerate(steps):
            for t, j in enumerate(st.inputs):
                if st.kind != "affine":
                    self.by_input[j].append((k, None, None))
                    rows = np.flatnonzero(live[k] & live[j])
                    edges.append((k, j, rows, rows))
                    continue
                m = st.terms[t].tocoo()
                ok = live[k][m.row] & live[j][m.col]
                rows, cols = m.row[ok].astype(np.int64), m.col[ok].astype(np.int64)
                pat = sp.csc_matrix((np.ones(rows.size, dtype=np.int8), (rows, cols)),
                                    shape=m.shape)
                self.by_input[j].append((k, pat.indptr, pat.indices.astype(np.int64)))
                fan = np.bincount(rows, minlength=st.n)
                dense = fan > max(_DENSE_MIN, _DENSE_SHARE * float(live[j].sum()))
                near = ~dense[rows]
                edges.append((k, j, rows[near], cols[near]))
        self.position = _positions(lowered, edges)


def _positions(lowered: Lowered, edges: Sequence[tuple[int, int, np.ndarray, np.ndarray]]
               ) -> list[np.ndarray]:
    """Per step, the position of each row in one order of all the program's rows, reverse
    Cuthill-McKee on the graph of reads (``edges``: reader step, read step, rows, their rows):
    rows that read one another sit close, so that a band of positions is a band of tokens."""
    offset = np.cumsum([0] + [st.n for st in lowered.steps])
    total = int(offset[-1])
    r = np.concatenate([offset[k] + rows for k, _, rows, _ in edges] or [np.zeros(0, np.int64)])
    c = np.concatenate([offset[j] + cols for _, j, _, cols in edges] or [np.zeros(0, np.int64)])
    graph = sp.coo_matrix((np.ones(r.size, dtype=np.int8), (r, c)), shape=(total, total)).tocsr()
    graph = ((graph + graph.T) != 0).astype(np.int8).tocsr()
    order = reverse_cuthill_mckee(graph, symmetric_mode=True)
    pos = np.empty(total, dtype=np.int64)
    pos[order] = np.arange(total, dtype=np.int64)
    return [pos[offset[s]:offset[s + 1]] for s in range(len(lowered.steps))]


def _gather(indptr: np.ndarray | None, indices: np.ndarray | None, values: np.ndarray,
            fill: int, ufunc: np.ufunc) -> np.ndarray:
    """Per row of the read step, ``ufunc`` over ``values`` of the rows reading it."""
    if indptr is None:
        return values
    out = np.full(indptr.size - 1, fill, dtype=np.int64)
    starts = indptr[:-1]
    some = starts < indptr[1:]
    if some.any():
        out[some] = ufunc.reduceat(values[indices], starts[some])
    return out


def _sweep(lowered: Lowered, live: Sequence[np.ndarray], reads: _Reads, end: int,
           reduce: bool) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray],
                                  dict[int, np.ndarray], np.ndarray | None]:
    """For segments ending at ``end``: per step before it (and ``end`` itself unless it is a
    reduction), every row's rank and last reader's rank, and the positions of its sinks
    (``-1``/empty where none); where every reader of the group's inputs is in it, per input
    row its first reader's position (else None). A step's ranks depend only on the steps after
    it up to the end, so every segment ending there shares them."""
    steps = lowered.steps
    consumed: dict[int, np.ndarray] = {}
    if reduce:
        st = steps[end]
        for t, j in enumerate(st.inputs):
            used = np.asarray(abs(st.terms[t].tocsr()[live[end]]).sum(axis=0)).ravel() > 0
            consumed[j] = consumed.get(j, np.zeros(steps[j].n, dtype=bool)) | (used & live[j])
    rank: dict[int, np.ndarray] = {}
    last: dict[int, np.ndarray] = {}
    sinks: dict[int, np.ndarray] = {}
    for s in range(end - 1 if reduce else end, 0, -1):
        if steps[s].kind == "input":
            break
        lv = live[s]
        r = np.full(steps[s].n, _NONE, dtype=np.int64)
        hi = np.full(steps[s].n, -1, dtype=np.int64)
        sink = lv.copy() if _kept(lowered, reads, s, end) else consumed.get(s, np.zeros(steps[s].n, dtype=bool))
        r[sink] = reads.position[s][sink]
        sinks[s] = reads.position[s][sink]
        for k, indptr, indices in reads.by_input[s]:
            if k > end or (reduce and k == end) or k not in rank:
                continue
            rk = rank[k]
            r = np.minimum(r, _gather(indptr, indices, np.where(rk >= 0, rk, _NONE), _NONE,
                                      np.minimum))
            hi = np.maximum(hi, _gather(indptr, indices, rk, -1, np.maximum))
        ok = lv & (r != _NONE)
        rank[s] = np.where(ok, r, -1)
        last[s] = np.where(ok, np.maximum(hi, r), -1)
    # the group's inputs, where every reader is in the segment: freed after their last reader
    # and loaded where first read (what a reduction reads of them joins its first part, and is
    # loaded in the first tile, as is any row no step reads)
    load = None
    if max(reads.readers[0], default=end + 1) <= end:
        hi = np.full(steps[0].n, -1, dtype=np.int64)
        lo = np.full(steps[0].n, _NONE, dtype=np.int64)
        for k, indptr, indices in reads.by_input[0]:
            if k in rank:
                hi = np.maximum(hi, _gather(indptr, indices, rank[k], -1, np.maximum))
                lo = np.minimum(lo, _gather(indptr, indices, np.where(rank[k] >= 0, rank[k],
                                                                      _NONE), _NONE, np.minimum))
        first = min((int(v.min()) for v in sinks.values() if v.size), default=-1)
        if reduce and 0 in consumed:
            hi = np.where(consumed[0], np.maximum(hi, first), hi)
            lo = np.where(consumed[0], np.minimum(lo, first), lo)
        last[0] = np.where(live[0], hi, -1)
        load = np.where(live[0], np.where(lo == _NONE, first, lo), -1)
    return rank, last, sinks, load


def _segment(lowered: Lowered, reads: _Reads, swept: tuple[dict, dict, dict], start: int,
             end: int, reduce: bool, free_inputs: bool) -> Segment | None:
    """The segment of steps ``start..end`` (None where it would have no inner step);
    ``free_inputs``: the group's inputs, when every reader is in it, are freed tile by tile
    (``last[0]``)."""
    rank, last, sinks, load = swept
    members = range(start, end + 1)
    keep = tuple(s for s in members if _kept(lowered, reads, s, end))
    inner = tuple(s for s in members if s not in keep)
    if not inner:
        return None
    ranked = [s for s in members if not (reduce and s == end)]
    found = np.unique(np.concatenate([sinks[s] for s in ranked]))
    frees = {s: last[s] for s in inner}
    loads = None
    if free_inputs and start == 1 and 0 in last:
        frees[0], loads = last[0], load
    return Segment(keep, inner, {s: rank[s] for s in ranked}, frees, found, reduce, loads)


def _last_use(lowered: Lowered, keep_inputs: bool, at: dict[int, int] | None = None
              ) -> list[int]:
    """Per step, the step after which its value is no longer read: its last reader's (a step
    of a tiled segment runs at the segment's end, ``at``), the end for the output, and for the
    group's inputs where ``keep_inputs``."""
    at = at or {}
    n = len(lowered.steps)
    last = list(range(n))
    for si, st in enumerate(lowered.steps):
        for j in st.inputs:
            last[j] = max(last[j], at.get(si, si))
    for o in lowered.outputs:
        last[o] = n
    if keep_inputs:
        last[0] = n
    return last


class _Memory:
    """The memory rule of one batch group: a step's value lives from when it runs until its
    last reader has (the output until the end, and the group's inputs too unless
    ``keep_inputs`` is false: a server that loaded them from bytes frees them); a weighted
    map's rows are computed at its inputs' level (``scratch``: a prime wider than the values
    they are rescaled into). A segment runs all its steps at its end; since its steps are
    consecutive and its inner values read only inside it, what is alive around a step or a
    segment does not depend on how the other steps are grouped."""

    def __init__(self, lowered: Lowered, live: Sequence[np.ndarray],
                 row_bytes: Callable[[int], float], keep_inputs: bool = True,
                 spill: bool = False):
        self.lowered, self.live, self.row_bytes = lowered, live, row_bytes
        self.keep_inputs, self.spill = keep_inputs, spill
        steps = lowered.steps
        last = _last_use(lowered, keep_inputs)
        self.full = [row_bytes(j) * float(live[j].sum()) for j in range(len(steps))]
        # before[a]: bytes of the values computed before step a that are still read at a or later
        self.before = [sum(self.full[j] for j in range(a) if last[j] >= a)
                       for a in range(len(steps) + 1)]

    def scratch_row(self, s: int) -> float:
        return self.row_bytes(-s - 1) if weighted(self.lowered, s) else 0.0

    def step(self, si: int) -> float:
        return self.before[si] + self.full[si] + self.scratch_row(si) * float(
            self.live[si].sum())

    def segment(self, seg: Segment, tiles: int) -> float:
        """What the segment's values from before, its rows computed and not yet freed (the
        kept ones to its end), a reduction's sums and a step's scratch hold, at the moment of
        a tile where they are most: a tile frees its rows of a value once the last step
        reading them has run in it (:func:`release_points`), and loads the group's inputs it
        reads first where a server owns them (:attr:`Segment.load`); where it spills
        (:func:`spills`), a row read back is held from the tile's start, one written out until
        its end."""
        tiles, tile_of, free_at, load_at = _tile_indices(seg, tiles)
        zero = np.zeros(tiles)
        lazy = bool(load_at.size) and not self.keep_inputs
        made = {s: self.row_bytes(s) * _per_tile(t, tiles) for s, t in tile_of.items()}
        gone = {s: self.row_bytes(s) * _per_tile(f, tiles) for s, f in free_at.items()
                if s or not self.keep_inputs}
        loaded = self.row_bytes(0) * _per_tile(load_at, tiles) if lazy else zero
        out, back = zero.copy(), zero.copy()
        if self.spill:
            for s, (_, out_at, back_at) in spills(self.lowered, seg, tiles).items():
                out += self.row_bytes(s) * _per_tile(out_at, tiles)
                back += self.row_bytes(s) * _per_tile(back_at, tiles)
        start = loaded + back
        net = start + sum(made.values(), zero) - sum(gone.values(), zero) - out
        run = np.concatenate([[0.0], np.cumsum(net)[:-1]]) + start   # at a tile's start
        sums = self.scratch_row(seg.end) * float(self.live[seg.end].sum()) if seg.reduce \
            else 0.0
        peak = zero.copy()
        points = release_points(self.lowered, seg)
        for s in seg.steps:
            if s in made:
                run = run + made[s]
                rows = _per_tile(tile_of[s], tiles)
                peak = np.maximum(peak, run + self.scratch_row(s) * rows + sums)
            if s in points and not (seg.reduce and s == seg.end):
                run = run - sum((gone.get(j, zero) for j in points[s]), zero)
        top = float(np.max(peak))
        if seg.reduce:
            # a tile's part of the sums beside them; at the end, the rescaled result
            top = max(top, float(np.max(run + 2 * sums)))
            run = run - sum((gone.get(j, zero) for j in points.get(seg.end, ())), zero)
            top = max(top, float(run[-1]) + sums + self.full[seg.end])
        return self.before[min(seg.steps)] - (self.full[0] if lazy else 0.0) + top


def find_segments(lowered: Lowered, live: Sequence[np.ndarray],
                  row_bytes: Callable[[int], float], keep_inputs: bool = True) -> list[Segment]:
    """The segments that give a batch group the lowest peak memory when each runs in as many
    tiles as it can (:data:`MAX_TILES`): the program's steps are cut into single steps and runs
    of consecutive steps (every run with an inner step, ending as a reduction or not) by dynamic
    programming on the peak, which each piece contributes to independently (:class:`_Memory`).
    Empty where no segment lowers the peak."""
    mem = _Memory(lowered, live, row_bytes, keep_inputs)
    n = len(lowered.steps)
    if n < 3:
        return []
    reads = _Reads(lowered, live)
    # best[i]: (lowest peak of steps 0..i-1 cut into pieces, the pieces)
    best: list[tuple[float, list[Segment]]] = [(0.0, [])]
    for end in range(n):
        options = [(max(best[end][0], mem.step(end)), best[end][1])]
        if end > 0 and live[end].any():
            for reduce in (False, True) if weighted(lowered, end) else (False,):
                swept = _sweep(lowered, live, reads, end, reduce)
                for start in range(end - 1, 0, -1):
                    seg = _segment(lowered, reads, swept, start, end, reduce,
                                   not keep_inputs)
                    if seg is None or seg.components < 2:
                        continue
                    peak = mem.segment(seg, MAX_TILES)
                    options.append((max(best[start][0], peak), [*best[start][1], seg]))
        best.append(min(options, key=lambda o: (o[0], len(o[1]))))
    peak, segments = best[n]
    untiled = max(mem.step(i) for i in range(n))
    return segments if peak < untiled else []


def batch_memory(lowered: Lowered, live: Sequence[np.ndarray], row_bytes: Callable[[int], float],
                 segments: Sequence[Segment] = (), tiles: dict[int, int] | None = None,
                 keep_inputs: bool = True, spill: bool = False) -> float:
    """Bytes of ciphertexts a batch group holds at its peak (:class:`_Memory`), its segments
    run in ``tiles[end]`` tiles each (one, or none given: not tiled), spilling between the
    tiles that read a row where ``spill`` (:func:`spills`). ``row_bytes(s)``: one row of step
    ``s``; ``row_bytes(-s - 1)``: one row of ``s`` at its inputs' level."""
    mem = _Memory(lowered, live, row_bytes, keep_inputs, spill)
    tiles = tiles or {}
    tiled = [seg for seg in segments if tiles.get(seg.end, 1) > 1]
    covered = {s for seg in tiled for s in seg.steps}
    peaks = [mem.step(si) for si in range(len(lowered.steps)) if si not in covered]
    peaks += [mem.segment(seg, tiles[seg.end]) for seg in tiled]
    return max(peaks, default=0.0)


def allocated_memory(lowered: Lowered, live: Sequence[np.ndarray],
                     row_bytes: Callable[[int], float], segments: Sequence[Segment] = (),
                     tiles: dict[int, int] | None = None, keep_inputs: bool = True,
                     spill: bool = False) -> float:
    """Bytes of ciphertext storage a batch group allocates (:func:`allocations`, summed)."""
    return buffer_bytes(allocations(lowered, live, row_bytes, segments, tiles, keep_inputs,
                                    spill))


def buffer_bytes(buffers: dict[float, int]) -> float:
    """Bytes of ``buffers`` (bytes of one buffer -> how many)."""
    return float(sum(b * n for b, n in buffers.items()))


def allocations(lowered: Lowered, live: Sequence[np.ndarray],
                row_bytes: Callable[[int], float], segments: Sequence[Segment] = (),
                tiles: dict[int, int] | None = None, keep_inputs: bool = True,
                spill: bool = False) -> dict[float, int]:
    """The ciphertext buffers a batch group allocates, as the runtime reuses them (bytes of one
    buffer -> how many): a server recycles the buffers of values that died for the next results
    (the smallest free buffer that holds a result, else a new one, :class:`he.runtime._Buffers`),
    and SEAL's pool keeps whatever was allocated, so the peak is everything allocated (and a
    server can allocate it before its first request, :meth:`he.Server.warm`). A recycled
    buffer keeps the primes of the level it was first allocated at, which :func:`batch_memory`
    does not see: values of low levels written into buffers of high ones. Simulated step by step (tile by
    tile in segments, rows freed after the tile that last reads them) with counts of buffers per
    size: a weighted map's rows summed at its inputs' level, then rescaled a few at a time into
    the scratch of the rows before them, a product's in three-polynomial scratch a few at a
    time, a reduction's sums held to the segment's end; where ``spill``, rows read back at a
    tile's start into taken buffers and those written out released at its end (:func:`spills`).
    The count per size is the runtime's, the group's inputs among them (within a chunk of rows:
    tested)."""
    steps = lowered.steps
    tiles = tiles or {}
    tiled = [seg for seg in segments if tiles.get(seg.end, 1) > 1]
    last = _last_use(lowered, keep_inputs, {s: seg.end for seg in tiled for s in seg.steps})
    free: dict[float, int] = {}
    made: dict[float, int] = {}
    staged: list[bool] = []

    def take(need: float, n: int) -> dict[float, int]:
        held: dict[float, int] = {}
        for cap in sorted(c for c, k in free.items() if c >= need and k > 0):
            k = min(n, free[cap])
            free[cap] -= k
            held[cap] = held.get(cap, 0) + k
            n -= k
            if n == 0:
                break
        if n:
            made[need] = made.get(need, 0) + n
            held[need] = held.get(need, 0) + n
        return held

    def release(held: dict[float, int]) -> None:
        for cap, k in held.items():
            free[cap] = free.get(cap, 0) + k

    def part(held: dict[float, int], n: int) -> dict[float, int]:
        """``n`` of the buffers of ``held`` (taken out of it), largest first."""
        out: dict[float, int] = {}
        for cap in sorted(held, reverse=True):
            k = min(n, held[cap])
            if k:
                held[cap] -= k
                out[cap] = k
                n -= k
        return out

    lazy_steps = getattr(row_bytes, "lazy", frozenset())

    def lazy_part(s: int) -> float:
        """Bytes of a row of step ``s``'s sums over the lazy products it reads (three
        polynomials at their primes; 0: it reads none)."""
        return max((row_bytes(j) for j in steps[s].inputs if j in lazy_steps), default=0.0)

    def compute(s: int, n: int) -> dict[float, int]:
        if weighted(lowered, s):
            # every row summed at its inputs' level at once (one fused product), then rescaled
            # a few at a time: the first few into new buffers, the rest into the rows' scratch
            scratch = take(row_bytes(-s - 1), n)
            if lazy_part(s):
                # its sums over lazy products, each finished into a buffer of the step's
                # primes (the one before's) and added to the rest of its row's sum
                raw = take(lazy_part(s), n)
                done = take(row_bytes(-s - 1), min(n, 1))
                release(raw)
                release(done)
            first = take(row_bytes(s), min(n, _CHUNK))
            release(scratch)
            return merge([first, take(row_bytes(s), n - min(n, _CHUNK))])
        if steps[s].kind == "mul":
            scratch = take(1.5 * row_bytes(-s - 1), min(n, _CHUNK))
        else:
            scratch = {}
        out = take(row_bytes(s), n)
        release(scratch)
        return out

    def merge(parts: Sequence[dict[float, int]]) -> dict[float, int]:
        out: dict[float, int] = {}
        for held in parts:
            for cap, k in held.items():
                out[cap] = out.get(cap, 0) + k
        return out

    end_of = {seg.end: seg for seg in tiled}
    deferred = {s for seg in tiled for s in seg.steps if s != seg.end}
    # inputs a server loads tile by tile (Segment.load) are taken when a tile first reads them
    lazy = not keep_inputs and any(seg.load is not None for seg in tiled)
    vals: dict[int, dict[float, int]] = {0: {} if lazy else take(row_bytes(0),
                                                                 int(live[0].sum()))}
    for si in range(1, len(steps)):
        if si in deferred:
            continue
        seg = end_of.get(si)
        if seg is None:
            vals[si] = compute(si, int(live[si].sum()))
            ran: tuple[int, ...] = (si,)
        else:
            count, tile_of, free_at, load_at = _tile_indices(seg, tiles[si])
            spilled = spills(lowered, seg, tiles[si]) if spill else {}
            loads = lazy and seg.load is not None
            held: dict[int, list[dict[float, int]]] = {s: [] for s in tile_of}
            held[0] = [] if loads else [vals.get(0, {})]
            n_end = int(live[seg.end].sum())
            sums = take(row_bytes(-seg.end - 1), n_end) if seg.reduce else {}
            # a reduction's sums over lazy products, held to the end (three polynomials)
            lazy_sums = take(lazy_part(seg.end), n_end) \
                if seg.reduce and lazy_part(seg.end) else {}
            points = release_points(lowered, seg)

            def free_rows(js: Sequence[int], i: int) -> None:
                for j in js:
                    drop(j, int(np.count_nonzero(free_at[j] == i)) if j or not keep_inputs
                         else 0)

            def drop(j: int, k: int) -> None:
                """``k`` rows of ``j`` released (the largest buffers holding its rows)."""
                for h in held[j]:
                    if k == 0:
                        break
                    got = part(h, k)
                    k -= sum(got.values())
                    release(got)

            for i in range(count):
                for s, (_, _, back_at) in spilled.items():
                    held[s].append(take(row_bytes(s), int(np.count_nonzero(back_at == i))))
                if loads:
                    # loaded into the buffer of a value that died where one holds it (copied
                    # from one staging buffer of SEAL's pool), else into new memory
                    n_in = int(np.count_nonzero(load_at == i))
                    before = made.get(row_bytes(0), 0)
                    held[0].append(take(row_bytes(0), n_in))
                    if n_in and made.get(row_bytes(0), 0) - before < n_in and not staged:
                        staged.append(True)
                        made[row_bytes(0)] = made.get(row_bytes(0), 0) + 1
                for s in seg.steps:
                    if s in tile_of:
                        held[s].append(compute(s, int(np.count_nonzero(tile_of[s] == i))))
                    if s in points and not (seg.reduce and s == seg.end):
                        free_rows(points[s], i)
                if seg.reduce:
                    release(take(row_bytes(-seg.end - 1), n_end))
                    if lazy_sums:
                        release(take(lazy_part(seg.end), n_end))
                    free_rows(points.get(seg.end, ()), i)
                for s, (_, out_at, _) in spilled.items():
                    drop(s, int(np.count_nonzero(out_at == i)))
            for s in seg.keep:
                vals[s] = merge(held.get(s, []))
            if lazy_sums:
                # finished one by one, each into the buffer the one before freed
                done = take(row_bytes(-seg.end - 1), 1)
                release(lazy_sums)
                release(done)
            if seg.reduce:
                vals[seg.end] = take(row_bytes(seg.end), n_end)
                release(sums)
            ran = seg.steps
        for j in [j for j in vals if last[j] <= si and j not in lowered.outputs and j not in ran]:
            release(vals.pop(j))
    return made


def choose_tiles(lowered: Lowered, live: Sequence[np.ndarray], row_bytes: Callable[[int], float],
                 segments: Sequence[Segment], budget: float, keep_inputs: bool = True,
                 spill: bool = False) -> dict[int, int]:
    """Per segment end, the tiles (1: not tiled, 2, 4, ... up to its components or
    :data:`MAX_TILES`) that keep what the group allocates (:func:`allocated_memory`, spilling
    where ``spill``) within ``budget`` bytes: none where it fits whole, else more tiles segment
    by segment, the first first, until it fits; where the most do not, the most (the least
    memory)."""
    tiles: dict[int, int] = {seg.end: 1 for seg in segments}

    def fits() -> bool:
        return allocated_memory(lowered, live, row_bytes, segments, tiles, keep_inputs,
                                spill) <= budget

    if fits():
        return tiles
    for seg in segments:
        top = min(seg.components, MAX_TILES)
        while tiles[seg.end] < top:
            tiles[seg.end] = min(2 * tiles[seg.end], top)
            if fits():
                return tiles
    return tiles


class RowBytes:
    """``row_bytes`` of :func:`row_bytes_of`: bytes of one row of step ``s`` (``-s - 1``: of
    its inputs' level), and ``lazy``, the product steps whose rows are left unrelinearised
    (which :func:`allocations` also follows into the maps that read them)."""

    def __init__(self, lowered: Lowered, ring: int, limbs: Callable[[int], int],
                 lazy: Collection[int]) -> None:
        self._steps = lowered.steps
        self._levels = step_levels(lowered.steps, "batch")
        self._word = 2 * ring * 8
        self._limbs = limbs
        self.lazy = frozenset(int(m) for m in lazy)

    def __call__(self, s: int) -> float:
        levels, word = self._levels, self._word
        if s in self.lazy:
            return float(1.5 * word * self._limbs(levels[s] - 1))
        if s >= 0:
            return float(word * self._limbs(levels[s]))
        st = self._steps[-s - 1]
        return float(word * self._limbs(max((levels[j] for j in st.inputs), default=0)))


def row_bytes_of(lowered: Lowered, ring: int, limbs: Callable[[int], int],
                 lazy: Collection[int] = ()) -> RowBytes:
    """``row_bytes`` for :func:`batch_memory`: two polynomials of ``ring`` words per limb of
    the step's level (``-s - 1``: of its inputs' level); a product step in ``lazy`` (left
    unrelinearised and unrescaled, :func:`he.plan.choose_lazy`) holds three polynomials per
    limb of its inputs' level."""
    return RowBytes(lowered, ring, limbs, lazy)
