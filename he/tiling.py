"""Batch packing in tiles: a group's intermediate values held a part at a time.

In batch packing every element of a value is a ciphertext, so a group's memory is that of the
values alive at once: a Mu-Layer's hidden values (``AX``, ``BDX`` and their product, three
times the channels of its input over every token) dominate it. Most of them are read only by
the next few steps, and row by row: the product of two rows, a channel map of one token's rows.

A **segment** is a run of consecutive steps: those read after it (or the output) are *kept*
whole, the others are *inner*. Its live rows fall into independent **components**: rows with
the rows of the segment they read, transitively, no row shared between two components (for a
Mu-Layer on tokens: one per token; a spatial shift joins neighbours when the value it reads is
in the segment, so segments end there). Run tile by tile (a few components at a time), the
inner values live one tile at a time, and every row is computed exactly as it would be in one
pass: the results are bit-identical, only the memory differs.

:func:`find_segments` cuts the program into single steps and segments so that the peak with the
most tiles is lowest, by :func:`batch_memory` (every value at its own level's size, so that the
pieces of a program contribute independently); :func:`allocated_memory` is the rule for what a
group allocates as the runtime reuses its buffers, with or without tiles, which the compiler
reports and a server checks; :func:`choose_tiles` takes the fewest tiles whose allocation fits a
budget (none where the group fits whole: fewer, larger matrix products).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from polynets.ir.lowering import Lowered, affine_is_free, step_levels

__all__ = ["Segment", "find_segments", "tile_masks", "batch_memory", "allocated_memory",
           "choose_tiles", "row_bytes_of", "MAX_TILES"]

#: Most tiles a segment is cut into (each tile's fused maps are built on their own)
MAX_TILES = 64


@dataclass
class Segment:
    """Consecutive steps run tile by tile: ``keep`` (read after the segment, or the output)
    assembled whole, ``inner`` (read only inside it) held one tile at a time.

    ``labels[s]``: the component of every live row of step ``s`` (``-1``: not live), components
    numbered by their first row of the last step; ``components``: how many.
    """

    keep: tuple[int, ...]
    inner: tuple[int, ...]
    labels: dict[int, np.ndarray]
    components: int

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(sorted((*self.keep, *self.inner)))

    @property
    def end(self) -> int:
        """The step at whose place the segment runs (its last)."""
        return max(self.keep)


def _readers(lowered: Lowered) -> list[set[int]]:
    out: list[set[int]] = [set() for _ in lowered.steps]
    for si, st in enumerate(lowered.steps):
        for j in st.inputs:
            out[j].add(si)
    return out


def _components(lowered: Lowered, live: Sequence[np.ndarray], members: Sequence[int]
                ) -> tuple[dict[int, np.ndarray], int]:
    """Connected components of the live rows of ``members``: a row joins the rows of members
    it reads (an affine map's nonzero weights, a product's or scaling's own row)."""
    steps = lowered.steps
    offset, base = {}, 0
    for s in members:
        offset[s] = base
        base += steps[s].n
    rows_i: list[np.ndarray] = []
    cols_i: list[np.ndarray] = []
    for k in members:
        st, lk = steps[k], live[k]
        for t, j in enumerate(st.inputs):
            if j not in offset:
                continue
            if st.kind == "affine":
                coo = st.terms[t].tocoo()
                keep = lk[coo.row] & live[j][coo.col]
                r, c = coo.row[keep], coo.col[keep]
            else:
                r = c = np.flatnonzero(lk & live[j])
            rows_i.append(offset[k] + r)
            cols_i.append(offset[j] + c)
    r = np.concatenate(rows_i) if rows_i else np.zeros(0, dtype=np.int64)
    c = np.concatenate(cols_i) if cols_i else np.zeros(0, dtype=np.int64)
    graph = sp.coo_matrix((np.ones(r.size, dtype=np.int8), (r, c)), shape=(base, base))
    _, label = connected_components(graph, directed=False)
    last = members[-1]
    live_labels = [label[offset[s] + np.flatnonzero(live[s])] for s in (last, *members)]
    order = {lab: i for i, lab in enumerate(dict.fromkeys(np.concatenate(live_labels).tolist()))}
    labels = {}
    for s in members:
        lab = np.full(steps[s].n, -1, dtype=np.int64)
        rows = np.flatnonzero(live[s])
        lab[rows] = [order[v] for v in label[offset[s] + rows].tolist()]
        labels[s] = lab
    return labels, len(order)


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
    last[lowered.output] = n
    if keep_inputs:
        last[0] = n
    return last


class _Memory:
    """The memory rule of one batch group: a step's value lives from when it runs until its
    last reader has (the output until the end, and the group's inputs too unless
    ``keep_inputs`` is false: a server that loaded them from bytes frees them); a weighted map's rows are computed at its inputs' level (``scratch``: a prime wider
    than the values they are rescaled into). A segment runs all its steps at its end; since its
    steps are consecutive and its inner values read only inside it, what is alive around a step
    or a segment does not depend on how the other steps are grouped."""

    def __init__(self, lowered: Lowered, live: Sequence[np.ndarray],
                 row_bytes: Callable[[int], float], keep_inputs: bool = True):
        self.lowered, self.live, self.row_bytes = lowered, live, row_bytes
        steps = lowered.steps
        last = _last_use(lowered, keep_inputs)
        self.full = [row_bytes(j) * float(live[j].sum()) for j in range(len(steps))]
        # before[a]: bytes of the values computed before step a that are still read at a or later
        self.before = [sum(self.full[j] for j in range(a) if last[j] >= a)
                       for a in range(len(steps) + 1)]

    def scratch(self, s: int, rows: np.ndarray) -> float:
        st = self.lowered.steps[s]
        if st.kind == "affine" and not affine_is_free(st, "batch"):
            return self.row_bytes(-s - 1) * float(rows.sum())
        return 0.0

    def step(self, si: int) -> float:
        return self.before[si] + self.full[si] + self.scratch(si, self.live[si])

    def segment(self, seg: Segment, tiles: int) -> float:
        """What the segment's values from before, its kept values and its inner values of the
        largest tile hold (every inner value of a tile counted as alive at once)."""
        return self.before[min(seg.steps)] + sum(self.full[s] for s in seg.keep) + max(
            sum(self.row_bytes(s) * float(m[s].sum()) for s in seg.inner)
            + max(self.scratch(s, m[s]) for s in seg.steps)
            for m in tile_masks(seg, tiles))


def _candidates(lowered: Lowered, live: Sequence[np.ndarray]) -> dict[tuple[int, int], Segment]:
    """Every run of consecutive steps ``[a, e]`` whose live rows split into two or more
    components and that has inner steps. For each end, runs reach back until their rows stop
    splitting (a step reading its neighbours' rows, such as a spatial shift, joins them once
    the value it reads is in the run; reaching further only joins more)."""
    steps = lowered.steps
    readers = _readers(lowered)
    found: dict[tuple[int, int], Segment] = {}
    for end in range(1, len(steps)):
        if steps[end].kind == "input" or not live[end].any():
            continue
        for a in range(end - 1, 0, -1):
            if steps[a].kind == "input" or not live[a].any():
                break
            members = list(range(a, end + 1))
            inside = set(members)
            keep = tuple(s for s in members
                         if s == lowered.output or not readers[s] <= inside)
            inner = tuple(s for s in members if s not in keep)
            if not inner:
                continue
            labels, count = _components(lowered, live, members)
            if count < 2:
                break
            found[a, end] = Segment(keep, inner, labels, count)
    return found


def find_segments(lowered: Lowered, live: Sequence[np.ndarray],
                  row_bytes: Callable[[int], float], keep_inputs: bool = True) -> list[Segment]:
    """The segments that give a batch group the lowest peak memory when each runs in as many
    tiles as it can (:data:`MAX_TILES`): the program's steps are cut into single steps and runs
    of :func:`_candidates` by dynamic programming on the peak, which each piece contributes to
    independently (:class:`_Memory`). Empty where no segment lowers the peak."""
    mem = _Memory(lowered, live, row_bytes, keep_inputs)
    cands = _candidates(lowered, live)
    n = len(lowered.steps)
    # best[i]: (lowest peak of steps 0..i-1 cut into pieces, the pieces)
    best: list[tuple[float, list[Segment]]] = [(0.0, [])]
    for i in range(n):
        options = [(max(best[i][0], mem.step(i)), best[i][1])]
        for (a, e), seg in cands.items():
            if e == i:
                peak = mem.segment(seg, min(seg.components, MAX_TILES))
                options.append((max(best[a][0], peak), [*best[a][1], seg]))
        best.append(min(options, key=lambda o: (o[0], len(o[1]))))
    peak, segments = best[n]
    untiled = max(mem.step(i) for i in range(n))
    return segments if peak < untiled else []


def tile_masks(seg: Segment, tiles: int) -> list[dict[int, np.ndarray]]:
    """Rows of every step of the segment computed in each of ``tiles`` tiles (consecutive
    components, as even as the components allow)."""
    tiles = max(1, min(int(tiles), seg.components))
    bounds = np.linspace(0, seg.components, tiles + 1).round().astype(np.int64)
    return [{s: (lab >= lo) & (lab < hi) for s, lab in seg.labels.items()}
            for lo, hi in zip(bounds[:-1], bounds[1:])]


def batch_memory(lowered: Lowered, live: Sequence[np.ndarray], row_bytes: Callable[[int], float],
                 segments: Sequence[Segment] = (), tiles: dict[int, int] | None = None,
                 keep_inputs: bool = True) -> float:
    """Bytes of ciphertexts a batch group holds at its peak (:class:`_Memory`), its segments
    run in ``tiles[end]`` tiles each (one, or none given: not tiled). ``row_bytes(s)``: one
    row of step ``s``; ``row_bytes(-s - 1)``: one row of ``s`` at its inputs' level."""
    mem = _Memory(lowered, live, row_bytes, keep_inputs)
    tiles = tiles or {}
    tiled = [seg for seg in segments if tiles.get(seg.end, 1) > 1]
    covered = {s for seg in tiled for s in seg.steps}
    peaks = [mem.step(si) for si in range(len(lowered.steps)) if si not in covered]
    peaks += [mem.segment(seg, tiles[seg.end]) for seg in tiled]
    return max(peaks, default=0.0)


def allocated_memory(lowered: Lowered, live: Sequence[np.ndarray],
                     row_bytes: Callable[[int], float], segments: Sequence[Segment] = (),
                     tiles: dict[int, int] | None = None, keep_inputs: bool = True) -> float:
    """Bytes of ciphertext storage a batch group allocates, as the runtime reuses it: a server
    recycles the buffers of values that died for the next results (the smallest free buffer
    that holds a result, else a new one, :class:`he.runtime._Buffers`), and SEAL's pool keeps
    whatever was allocated, so the peak is everything allocated. A recycled buffer keeps the
    primes of the level it was first allocated at, which :func:`batch_memory` does not see:
    values of low levels written into buffers of high ones. Simulated step by step (tile by
    tile in segments) with counts of buffers per size: a weighted map's rows computed at its
    inputs' level then rescaled into new ones, a product's in three-polynomial scratch a few
    at a time."""
    steps = lowered.steps
    tiles = tiles or {}
    tiled = [seg for seg in segments if tiles.get(seg.end, 1) > 1]
    last = _last_use(lowered, keep_inputs, {s: seg.end for seg in tiled for s in seg.steps})
    free: dict[float, int] = {}
    total = 0.0

    def take(need: float, n: int) -> dict[float, int]:
        nonlocal total
        held: dict[float, int] = {}
        for cap in sorted(c for c, k in free.items() if c >= need and k > 0):
            k = min(n, free[cap])
            free[cap] -= k
            held[cap] = held.get(cap, 0) + k
            n -= k
            if n == 0:
                break
        if n:
            total += n * need
            held[need] = held.get(need, 0) + n
        return held

    def release(held: dict[float, int]) -> None:
        for cap, k in held.items():
            free[cap] = free.get(cap, 0) + k

    def compute(s: int, rows: np.ndarray) -> dict[float, int]:
        st, n = steps[s], int(rows.sum())
        if st.kind == "affine" and not affine_is_free(st, "batch"):
            scratch = take(row_bytes(-s - 1), n)
        elif st.kind == "mul":
            scratch = take(1.5 * row_bytes(-s - 1), min(n, 8))
        else:
            scratch = {}
        out = take(row_bytes(s), n)
        release(scratch)
        return out

    end_of = {seg.end: seg for seg in tiled}
    deferred = {s for seg in tiled for s in seg.steps if s != seg.end}
    vals: dict[int, dict[float, int]] = {0: take(row_bytes(0), int(live[0].sum()))}
    for si in range(1, len(steps)):
        if si in deferred:
            continue
        seg = end_of.get(si)
        if seg is None:
            vals[si] = compute(si, live[si])
            ran: tuple[int, ...] = (si,)
        else:
            kept: dict[int, dict[float, int]] = {s: {} for s in seg.keep}
            for masks in tile_masks(seg, tiles[si]):
                part = []
                for s in seg.steps:
                    out = compute(s, live[s] & masks[s])
                    if s in kept:
                        for cap, k in out.items():
                            kept[s][cap] = kept[s].get(cap, 0) + k
                    else:
                        part.append(out)
                for held in part:
                    release(held)
            vals.update(kept)
            ran = seg.steps
        for j in [j for j in vals if last[j] <= si and j != lowered.output and j not in ran]:
            release(vals.pop(j))
    return total


def choose_tiles(lowered: Lowered, live: Sequence[np.ndarray], row_bytes: Callable[[int], float],
                 segments: Sequence[Segment], budget: float, keep_inputs: bool = True
                 ) -> dict[int, int]:
    """Per segment end, the tiles (1: not tiled, 2, 4, ... up to its components or
    :data:`MAX_TILES`) that keep what the group allocates (:func:`allocated_memory`) within
    ``budget`` bytes: none where it fits whole, else more tiles segment by segment, the first
    first, until it fits; where the most do not, the most (the least memory)."""
    tiles: dict[int, int] = {seg.end: 1 for seg in segments}

    def fits() -> bool:
        return allocated_memory(lowered, live, row_bytes, segments, tiles, keep_inputs) <= budget

    if fits():
        return tiles
    for seg in segments:
        top = min(seg.components, MAX_TILES)
        while tiles[seg.end] < top:
            tiles[seg.end] = min(2 * tiles[seg.end], top)
            if fits():
                return tiles
    return tiles


def row_bytes_of(lowered: Lowered, ring: int, limbs: Callable[[int], int]
                 ) -> Callable[[int], float]:
    """``row_bytes`` for :func:`batch_memory`: two polynomials of ``ring`` words per limb of
    the step's level (``-s - 1``: of its inputs' level)."""
    levels = step_levels(lowered.steps, "batch")
    word = 2 * ring * 8

    def of(s: int) -> float:
        if s >= 0:
            return float(word * limbs(levels[s]))
        st = lowered.steps[-s - 1]
        return float(word * limbs(max((levels[j] for j in st.inputs), default=0)))
    return of
