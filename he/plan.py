"""Vector-packing plans: layouts, diagonal matrix-vector products and their modelled cost.

A program is first lowered to steps (:mod:`polynets.ir.lowering`: affine maps between ciphertext
products, composed, one level each). **Vector packing** then places one sample's value in slot
vectors:

* **Layouts.** A value of logical shape ``S`` sits in slots by a *layout*: ``None`` is the
  row-major order, slots ``[0, n)``; an axis order such as ``(2, 1)`` puts axis 2 outermost and
  pads the inner axes to powers of two, so that the axis a map acts on has a power-of-two stride.
  A map acting on one axis (a Mu-Layer's channel maps repeated over tokens, a token map repeated
  over channels) then has as many diagonals as that axis has offsets, each a multiple of the
  stride, and its baby-step/giant-step rotations number about twice the square root of the
  channel count, not of tokens x channels.
* **Periods and interleaving.** A value of slot width ``w`` is zero-padded to its period
  ``p = next_pow2(w)`` and repeated, so a cyclic rotation of the ciphertext is a rotation of the
  value modulo ``p``. When the widest value needs ``P`` slots of ``slots``, ``k = slots / P``
  samples share one ciphertext, interleaved (slot ``i k + j`` holds slot ``i`` of sample ``j``):
  every rotation moves all samples alike, so k samples cost what one does.
* **Diagonal method.** An affine step is ``sum_g rot(sum_b diag_{g,b} * rot(x, b), giant_g)``
  (:class:`MatVec`); a map with fewer outputs than inputs works in the larger period and folds
  with ``log2(p_in / p_out)`` rotations. When the first map reads only the input and each output
  uses few inputs (convolutions, patch embeddings), the client encrypts *planes* (plane ``t`` holds
  every output's ``t``-th input) and the server needs no rotation for it, whatever layout the next
  step wants.
* **Search.** :func:`search_layouts` chooses every value's layout to minimise the whole program's
  time under a :class:`~he.costmodel.CostModel`; values multiplied together or summed without a
  map share one layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import scipy.sparse as sp

from he.params import read_levels
from polynets.ir.lowering import Lowered, affine_is_free, input_offsets, is_identity, step_levels

__all__ = ["MatVec", "VStep", "VectorPlan", "BatchPlan", "next_pow2", "slot_map", "key_basis",
           "rotation_path",
           "candidate_orders", "layout_groups", "search_layouts", "build_vector_plan",
           "choose_plane_packing", "widest_period", "batch_counts", "batch_step_counts",
           "choose_fanin", "FANIN_CANDIDATES", "shared_splits", "layout_shapes", "same_terms",
           "padded_layouts_fit", "input_patches", "value_orders", "planes_readers",
           "MAX_PLANES", "lazy_candidates", "choose_lazy", "rows_reading", "step_readers"]

Order = tuple[int, ...] | None

#: Most inputs per output of a first map the client's input planes replace (one plane per input)
MAX_PLANES = 64


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- layouts
def dense(order: tuple[int, ...]) -> tuple[int, ...]:
    """The unpadded variant of an axis order (written with the axes as ``-(axis + 1)``)."""
    return tuple(-(a + 1) for a in order)


def layout_axes(order: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
    """The axes of a layout, outermost first, and whether its inner axes are padded."""
    if order[0] < 0:
        return tuple(-a - 1 for a in order), False
    return tuple(order), True


def slot_map(shape: Sequence[int], order: Order) -> np.ndarray:
    """Slot of every element (row-major flat index) of a value of ``shape`` in layout ``order``.

    ``None`` is row-major. An axis order lays the axes out outermost first with every inner
    axis padded to a power of two (so that each axis is a fixed stride of a power-of-two block:
    folds and rotations stay inside it); its :func:`dense` variant pads nothing, for values
    whose padded layout would not fit (144 channels of a 7 x 7 grid channel-major need 9,216
    slots padded, 7,056 dense), where a map's diagonals still stay few because each axis keeps
    one stride."""
    shape = tuple(int(s) for s in shape)
    n = int(np.prod(shape, dtype=np.int64))
    if order is None:
        return np.arange(n, dtype=np.int64)
    order, pad = layout_axes(order)
    sizes = [shape[a] for a in order]
    padded = [sizes[0]] + [next_pow2(s) if pad else s for s in sizes[1:]]
    strides = [1] * len(order)
    for i in range(len(order) - 2, -1, -1):
        strides[i] = strides[i + 1] * padded[i + 1]
    idx = np.indices(shape, dtype=np.int64).reshape(len(shape), -1)
    out = np.zeros(n, dtype=np.int64)
    for a, s in zip(order, strides):
        out += idx[a] * s
    return out


def _suffix_products(shape: Sequence[int]) -> set[int]:
    out, acc = set(), 1
    for n in reversed(shape):
        acc *= int(n)
        out.add(acc)
    return out


def layout_shapes(lowered: Lowered) -> list[tuple[int, ...]]:
    """The shape each value is laid out by: its own, or the finest shape of another value of
    the program that refines it by splitting axes (a patch embedding's ``(49, 32)`` tokens are
    the Mu-Layer's ``(7, 7, 32)`` grid). Row-major element order is the same under the split, so
    a value and its refinement can share a layout, which no order of the coarser shape's own
    axes reaches (channel-major over a 7 x 7 grid pads each row, not the 49 tokens). The input
    is laid out by its patch refinement where it has one (:func:`input_patches`)."""
    shapes = [tuple(int(n) for n in st.shape) for st in lowered.steps]
    distinct = sorted(set(shapes), key=lambda t: -sum(n > 1 for n in t))
    out = []
    for sh in shapes:
        size, sp_ = int(np.prod(sh, dtype=np.int64)), _suffix_products(sh)
        out.append(next((t for t in distinct if int(np.prod(t, dtype=np.int64)) == size
                         and sp_ <= _suffix_products(t)), sh))
    patches = input_patches(lowered)
    if patches is not None:
        out[0] = patches[0]
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


#: Most splits of the input's axes tried for its patch refinement
_PATCH_SPLITS = 4096


def input_patches(lowered: Lowered) -> tuple[tuple[int, ...], list[tuple[int, ...]]] | None:
    """The input's *patch refinement* and its two layouts, where the maps that read the input
    read it by patches: every input element is read by the outputs of one patch, the same
    outputs for every element of a patch (a patch embedding, a convolution whose stride is its
    kernel, a per-token map of a token sequence).

    The refinement splits each axis of the input's shape into an outer part (which patch) and
    an inner part (where in the patch), e.g. ``(3, 32, 32)`` with 8 x 8 patches into
    ``(3, 4, 8, 4, 8)``; the layouts put the inner parts outside the outer ones (features
    outermost, patches innermost: every output of a patch then reads its inputs at offsets that
    are multiples of the patch stride, as a channel map repeated over tokens does) or the
    reverse. The client encrypts the input in either at no cost, so the search prices them with
    the others (where the client's input planes replace those maps, the input's own layout is
    not used). None where the input is read otherwise."""
    memo = lowered.__dict__.get("_input_patches", _UNSET)
    if memo is _UNSET:
        memo = lowered.__dict__["_input_patches"] = _input_patches(lowered)
    return memo


_UNSET = object()


def _input_patches(lowered: Lowered) -> tuple[tuple[int, ...], list[tuple[int, ...]]] | None:
    steps = lowered.steps
    readers = [st for st in steps if st.kind == "affine" and 0 in st.inputs]
    shape = tuple(int(n) for n in steps[0].shape)
    n = int(np.prod(shape, dtype=np.int64))
    if not readers or n < 4:
        return None
    keys: np.ndarray | None = None
    for st in readers:
        m = sp.csc_matrix(st.terms[st.inputs.index(0)])
        if np.any(np.diff(m.indptr) == 0):
            return None                 # an input element no map reads: not by patches
        rows = np.split(m.indices, m.indptr[1:-1])
        _, part = np.unique(np.array([hashlib.blake2b(np.sort(r).tobytes(), digest_size=8)
                                      .hexdigest() for r in rows]), return_inverse=True)
        # an element of a patch is read by the same outputs as its patch's others, and by no
        # output another patch's elements have
        if keys is not None and not _same_partition(keys, part):
            return None
        keys = part
    assert keys is not None
    groups = int(keys.max()) + 1
    if groups < 2 or groups == n:
        return None
    idx = np.indices(shape, dtype=np.int64).reshape(len(shape), -1)
    axes = [a for a, s in enumerate(shape) if s > 1]
    combos = itertools.islice(itertools.product(*[_divisors(shape[a]) for a in axes]),
                              _PATCH_SPLITS)
    for inner in combos:
        label = np.zeros(n, dtype=np.int64)
        for a, p in zip(axes, inner):
            label = label * (shape[a] // p) + idx[a] // p
        if int(label.max()) + 1 != groups or not _same_partition(label, keys):
            continue
        factor = dict(zip(axes, inner))
        refined: list[int] = []
        outer_axes: list[int] = []
        inner_axes: list[int] = []
        for a, size in enumerate(shape):
            p = factor.get(a, 1)
            if size == 1:
                refined.append(1)
                continue
            # index o * p + r of the axis is (o, r) of the split: row-major order unchanged
            if size // p > 1:
                outer_axes.append(len(refined))
                refined.append(size // p)
            if p > 1:
                inner_axes.append(len(refined))
                refined.append(p)
        if not inner_axes or not outer_axes:
            return None
        return tuple(refined), [tuple(inner_axes + outer_axes), tuple(outer_axes + inner_axes)]
    return None


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two labellings of the same elements group them alike."""
    pairs = np.unique(np.stack([a, b]), axis=1).shape[1]
    return pairs == np.unique(a).size == np.unique(b).size


def candidate_orders(shape: Sequence[int], max_axes: int = 3) -> list[Order]:
    """Layouts worth pricing: row-major, every order of the (at most 3) non-trivial axes, and the
    :func:`dense` variant of each order whose padding widens the value."""
    axes = [a for a, s in enumerate(shape) if s > 1]
    orders: list[tuple[int, ...]] = []
    if 2 <= len(axes) <= max_axes:
        orders = [tuple(p) for p in itertools.permutations(axes)]
    elif len(axes) > max_axes:
        orders = [tuple(axes), tuple(reversed(axes))]
    cands: list[Order] = [None, *orders]
    # the unpadded variant where padding widens the value
    cands += [dense(o) for o in orders if _width(shape, dense(o)) < _width(shape, o)]
    return cands


def padded_layouts_fit(lowered: Lowered, slots: int) -> bool:
    """Whether every value with axes to order has a padded axis order (every inner axis a
    power of two) within ``slots``; where one has only unpadded orders left (144 channels over a
    7 x 7 grid at 8,192 slots), its maps take strides the baby/giant steps fit less well."""
    for sh in set(layout_shapes(lowered)):
        widths = [next_pow2(_width(sh, o)) for o in candidate_orders(sh)
                  if o is not None and o[0] >= 0]
        if widths and min(widths) > slots:
            return False
    return True


def _width(shape: Sequence[int], order: Order) -> int:
    sm = slot_map(shape, order)
    return int(sm.max()) + 1 if sm.size else 1


# ----------------------------------------------------------------------------- diagonal method
@dataclass
class MatVec:
    """``y = A x`` on periodic slot vectors by the BSGS diagonal method.

    ``groups[g]`` maps a baby step ``b`` to a diagonal of length ``big`` (already rotated by
    ``-giants[g]``; tiled to the slots when encoded); the result is
    ``sum_g rot(sum_b diag * rot(x, b), giants[g])``, then folded by the rotations in ``folds``.
    """

    p_in: int
    p_out: int
    giants: list[int]
    groups: list[dict[int, np.ndarray]]
    folds: list[int]

    @property
    def babies(self) -> list[int]:
        return sorted({b for g in self.groups for b in g})

    def rotations(self, include_babies: bool = True, include_folds: bool = True) -> set[int]:
        steps = set(self.giants) | (set(self.folds) if include_folds else set())
        if include_babies:
            steps |= set(self.babies)
        return {s for s in steps if s}

    @property
    def n_diagonals(self) -> int:
        return sum(len(g) for g in self.groups)


def _diagonal_index(a: sp.spmatrix, p_in: int, p_out: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Row (within the larger period), diagonal offset and value of every nonzero; the period."""
    coo = a.tocoo()
    rows, d, big = _diagonals_of(coo.row.astype(np.int64), coo.col.astype(np.int64), p_in, p_out)
    return rows, d, coo.data, big


def _diagonals_of(r: np.ndarray, c: np.ndarray, p_in: int, p_out: int
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    if p_in & (p_in - 1) == 0 and p_out & (p_out - 1) == 0:
        # powers of two (every layout period): masks and shifts instead of divisions
        mask = p_in - 1
        if p_out >= p_in:
            return r, (c - r) & mask, p_out
        rows = r + (((c - r) & mask) & ~(p_out - 1))
        return rows, (c - rows) & mask, p_in
    if p_out >= p_in:
        return r, (c - r) % p_in, p_out
    rows = r + (((c - r) % p_in) // p_out) * p_out
    return rows, (c - rows) % p_in, p_in


def _key_units(keys: np.ndarray, step: int, period: int) -> np.ndarray | None:
    """Each diagonal offset of ``keys`` (residues modulo the power-of-two ``period``) in units
    of ``step``: ``key = unit * step (mod period)``. ``step = 2**a * odd`` needs ``2**a`` to
    divide every key; the odd part is inverted modulo the period, so a stride that does not
    divide the period (49 tokens of a 7 x 7 grid laid out unpadded) is a unit too, its negative
    multiples wrapping to the top of the range (a power-of-two baby count splits them as well
    as the positive ones). None when ``step`` does not fit the keys."""
    step = int(step)
    a = (step & -step).bit_length() - 1
    if step <= 0 or (1 << a) > period or np.any(keys & ((1 << a) - 1)):
        return None
    m = period >> a
    return ((keys >> a) * pow(step >> a, -1, m)) % m


def _units(keys: np.ndarray, step: int, period: int) -> np.ndarray | None:
    """The distinct units of :func:`_key_units` (sorted)."""
    units = _key_units(keys, step, period)
    if units is None:
        return None
    step = int(step)
    return _unique_small(units, period >> ((step & -step).bit_length() - 1))


#: Odd strides tried as BSGS units when a map's diagonals are spread thinly over the period
#: (a token grid of up to 255 tokens laid out unpadded, e.g. 7 x 7 = 49).
MAX_ODD_STRIDE = 255


def _cyclic_span(units: np.ndarray, m: int) -> int:
    """Length of the shortest arc of ``Z_m`` holding every unit (sorted, distinct)."""
    if units.size < 2:
        return 1
    gaps = np.diff(units, append=units[0] + m)
    return m - int(gaps.max()) + 1


def _step_candidates(keys: np.ndarray, period: int) -> list[int]:
    """Unit steps worth trying: the gcd of the offsets and, where the offsets are spread thinly
    over the period, the odd stride (times the gcd's power of two) that packs them into the
    shortest arc (an unpadded grid of 49 tokens gives offsets ``49 k mod period``)."""
    g = int(np.gcd.reduce(keys)) if keys.size else 1
    g = g or 1
    cands = [g]
    units = _units(keys, g, period)
    if units is None or keys.size < 16:
        return cands
    a = (g & -g).bit_length() - 1
    m = period >> a
    span = _cyclic_span(units, m)
    if span <= 4 * keys.size:
        return cands
    red = keys >> a
    odds = np.arange(3, min(MAX_ODD_STRIDE, m) + 1, 2)
    if odds.size == 0:
        return cands
    # every odd stride at once: each row the offsets' units under one stride, sorted; the
    # shortest arc holding a row is the period less its largest gap (repeats add no gap)
    inv = np.array([pow(int(o), -1, m) for o in odds], dtype=np.int64)
    rows = np.sort((red[None, :] * inv[:, None]) % m, axis=1)
    gaps = np.diff(rows, axis=1, append=rows[:, :1] + m)
    spans = m - gaps.max(axis=1) + 1
    first = int(np.argmin(spans))
    if spans[first] < span:
        cands.append(int(odds[first]) << a)
    return cands


def _unit_rotations(units: np.ndarray, n1: int) -> int:
    """Distinct nonzero baby plus giant rotations of ``units`` split by ``n1`` (a unit is
    ``giant * n1 + baby``; a nonzero unit multiple of the step is a nonzero rotation)."""
    if units.size == 0:
        return 0
    # units are sorted: their giant parts are too, so distinct ones are where they change
    giants = units // n1
    distinct_giants = int(np.count_nonzero(np.diff(giants))) + 1 - int(giants[0] == 0)
    return int(np.count_nonzero(_unique_small(units % n1, n1))) + distinct_giants


def _bsgs(keys: np.ndarray, period: int) -> tuple[int, int]:
    """Unit ``step`` and baby-step count ``n1`` (a power of two) that minimise the distinct
    rotations, baby plus giant, of diagonal offsets ``keys`` modulo ``period``."""
    if keys.size == 0:
        return 1, 1
    best = (math.inf, (1, 1))
    for step in _step_candidates(keys, period):
        units = _units(keys, step, period)
        if units is None:
            continue
        for n1 in (1 << k for k in range(0, (int(units.max()) + 1).bit_length() + 1)):
            cost = _unit_rotations(units, n1)
            if cost < best[0]:
                best = (cost, (step, n1))
    return best[1]


def _coo_int(a: sp.spmatrix) -> tuple[np.ndarray, np.ndarray]:
    coo = a.tocoo()
    return coo.row.astype(np.int64), coo.col.astype(np.int64)


def _rotations_of(split: tuple[int, int], keys: np.ndarray, period: int
                  ) -> tuple[set[int] | None, set[int]]:
    """Baby and giant rotation offsets (nonzero, modulo ``period``) of diagonal offsets
    ``keys`` under ``split``; ``(None, set())`` when the split's step does not fit the keys."""
    step, n1 = split
    units = _units(keys, step, period)
    if units is None:
        return None, set()
    babies = {(int(b) * step) % period for b in np.unique(units % n1)}
    giants = {(int(g) * n1 * step) % period for g in np.unique(units // n1)}
    return babies - {0}, giants - {0}


#: prices of hoisted baby steps at one level, each in rotations there: ``(baby, decompose,
#: divide)`` -- a hoisted rotation, an input's decomposition, a giant step's division by the
#: special prime (:mod:`he.hoist`)
HoistWeights = Callable[[int], tuple[float, float, float]]


def _hoisted_groups(split: tuple[int, int], keys: np.ndarray, period: int) -> int:
    """Giant steps (the one of no rotation among them) under ``split`` that hold a term of a
    nonzero baby step: a hoisted plan divides each one's sum by the special prime."""
    step, n1 = split
    units = _units(keys, step, period)
    if units is None:
        return 0
    return int(np.unique(units[units % n1 != 0] // n1).size)


def shared_splits(terms: Sequence[tuple[int, int, int, int, np.ndarray]], sweeps: int = 3
                  ) -> dict[tuple[int, int], tuple[int, int]]:
    """BSGS splits ``(step, n1)`` of every (affine step, input period) that minimise the
    rotations of the whole plan (:func:`bsgs_plan` with no hoisting)."""
    return bsgs_plan(terms, sweeps)[0]


def bsgs_plan(terms: Sequence[tuple[int, int, int, int, np.ndarray]], sweeps: int = 3,
              weights: HoistWeights | None = None
              ) -> tuple[dict[tuple[int, int], tuple[int, int]], set[tuple[Any, int]]]:
    """BSGS splits ``(step, n1)`` of every (affine step, input period) and the inputs (``(input,
    level)``) whose baby steps are hoisted, that minimise the rotations of the whole plan.

    ``terms``: ``(step, input, level, p_in, diagonal offsets)`` of every materialised map. The
    terms of one step and input period share one split (they share giant rotations); the baby
    rotations of an input at a level are shared by every map that reads it there, so maps of one
    input (a Mu-Layer's A and BD read the same X) gain from more baby steps and fewer giants
    than each would choose alone. Maps linked by shared inputs (one level, so rotations of one
    price) are searched together: coordinate descent over unit steps dividing each map's offsets
    and power-of-two baby counts, from each map's own best split and from every split shared by
    all of them; the cost is distinct baby rotations per (input, level) plus giant rotations per
    (step, period).

    With ``weights`` (per level, what hoisted baby steps cost in rotations: :data:`HoistWeights`)
    every group of linked maps is also searched hoisted, where a baby step costs ``baby``, each
    input ``decompose`` once and each giant step holding a baby step's term ``divide``
    (cheap baby steps favour more of them and fewer giants), and keeps the cheaper of the two
    searches: its inputs are hoisted where the hoisted search won."""
    Var = tuple[int, int]
    var_keys: dict[Var, list[tuple[tuple[int, int], np.ndarray]]] = {}
    for si, j, lvl, p_in, d in terms:
        var_keys.setdefault((si, p_in), []).append(((j, lvl), np.unique(d)))
    union = {v: np.unique(np.concatenate([k for _, k in ts])) for v, ts in var_keys.items()}
    choice = {v: _bsgs(u, v[1]) for v, u in union.items()}
    hoisted: set[tuple[Any, int]] = set()
    readers: dict[tuple[int, int], list[Var]] = {}
    for v, ts in var_keys.items():
        for src, _ in ts:
            readers.setdefault(src, []).append(v)
    for comp in _components(var_keys, readers):
        if len(comp) < 2 and weights is None:
            continue
        cands: dict[Var, list[tuple[int, int]]] = {}
        for v in comp:
            u, p_in = union[v], v[1]
            g = int(np.gcd.reduce(u)) or 1
            steps = {g, choice[v][0]} | {math.gcd(g, choice[w][0]) for w in comp}
            cands[v] = []
            for st in sorted(steps):
                units = _units(u, st, p_in)
                if units is not None:
                    span = int(units.max()) + 1
                    cands[v] += [(st, 1 << e) for e in range(0, span.bit_length() + 1)]

        memo: dict[tuple[Any, ...], Any] = {}

        def rotations(key: tuple[Any, ...], split: tuple[int, int], keys: np.ndarray,
                      period: int) -> tuple[set[int] | None, set[int]]:
            if (key, split) not in memo:
                memo[key, split] = _rotations_of(split, keys, period)
            return memo[key, split]

        def divided(v: Var, split: tuple[int, int]) -> int:
            if ("groups", v, split) not in memo:
                memo["groups", v, split] = _hoisted_groups(split, union[v], v[1])
            return memo["groups", v, split]

        def cost(ch: dict[Var, tuple[int, int]], hoist: bool = False) -> float:
            babies: dict[tuple[int, int], set[int]] = {}
            n = 0.0
            for v in comp:
                n += len(rotations((v,), ch[v], union[v], v[1])[1])
                if hoist:
                    n += divided(v, ch[v]) * weights(var_keys[v][0][0][1])[2]
                for i, (src, k) in enumerate(var_keys[v]):
                    babies.setdefault(src, set()).update(
                        rotations((v, i), ch[v], k, v[1])[0] or ())
            for (_, lvl), b in babies.items():
                if hoist and b:
                    baby, decompose, _ = weights(lvl)
                    n += decompose + baby * len(b)
                else:
                    n += len(b)
            return n

        def descend(ch: dict[Var, tuple[int, int]], hoist: bool) -> dict[Var, tuple[int, int]]:
            for _ in range(sweeps):
                before = dict(ch)
                for v in comp:
                    ch = min(({**ch, v: s} for s in cands[v]),
                             key=lambda c: (cost(c, hoist), c[v] != ch[v]))
                if ch == before:
                    break
            return ch

        own = {v: choice[v] for v in comp}
        starts = [own] + [{v: s if s in cands[v] else own[v] for v in comp}
                          for s in sorted({s for v in comp for s in cands[v]})]
        # the cheapest search, not hoisting where both cost the same
        best = min(((cost(ch, hoist), hoist, ch)
                    for hoist in ((False, True) if weights is not None else (False,))
                    for ch in (descend(s, hoist) for s in starts)), key=lambda t: t[:2])
        choice.update(best[2])
        if best[1]:
            hoisted |= {src for v in comp for src, _ in var_keys[v]}
    return choice, hoisted


def _components(var_keys: dict[Any, list[tuple[Any, np.ndarray]]],
                readers: dict[Any, list[Any]]) -> list[list[Any]]:
    """Groups of maps linked by the inputs they read."""
    seen: set[Any] = set()
    comps = []
    for v0 in var_keys:
        if v0 in seen:
            continue
        comp, todo = [], [v0]
        seen.add(v0)
        while todo:
            v = todo.pop()
            comp.append(v)
            for src, _ in var_keys[v]:
                for w in readers[src]:
                    if w not in seen:
                        seen.add(w)
                        todo.append(w)
        comps.append(sorted(comp))
    return comps


def _folds(p_in: int, p_out: int) -> list[int]:
    folds, s = [], p_out
    while s < p_in:
        folds.append(s)
        s *= 2
    return folds


#: the most rotated copies plus one that a hoisted fold sums from one decomposition (a group
#: of ``r - 1`` rotations needs a Galois key for each where ``log2(r)`` folds need one each:
#: the bound keeps the keys a group adds to at most 4)
MAX_FOLD_RADIX = 8

#: prices of a hoisted fold at one level, each in rotations there: ``(copy, decompose,
#: divide)`` -- a rotated copy without its division by the special prime and its addition in
#: the extended primes, the decomposition, the division of the sum (:func:`fold_groups`)
FoldWeights = Callable[[int], tuple[float, float, float]]


def fold_groups(folds: Sequence[int], weights: tuple[float, float, float] | None
                ) -> list[list[int]]:
    """The rotations that fold ``folds`` (a doubling chain ``s, 2s, 4s...``: ``x += rot(x, f)``
    for each in turn), grouped: each group ``[b, 2b, ... (r - 1) b]`` adds ``r - 1`` rotated
    copies of the value to it at once, all from one decomposition and summed before one
    division by the special prime (:meth:`he.hoist.Hoister.rotate_ext`), which replaces
    ``log2(r)`` folds; a group of one step is a rotation as before. The grouping minimises
    the cost under ``weights`` (:data:`FoldWeights` at the fold's level), ``r`` up to
    :data:`MAX_FOLD_RADIX`, by dynamic programming over the chain. Without ``weights``, or
    for a chain that does not double, every fold is a group of its own."""
    folds = [int(f) for f in folds]
    doubling = all(b == 2 * a for a, b in zip(folds, folds[1:]))
    if weights is None or len(folds) < 2 or not doubling:
        return [[f] for f in folds]
    copy, decompose, divide = weights
    most = MAX_FOLD_RADIX.bit_length() - 1
    best = [0.0] + [math.inf] * len(folds)
    cut = [0] * (len(folds) + 1)
    for i in range(1, len(folds) + 1):
        for t in range(1, min(most, i) + 1):
            r = 1 << t
            cost = 1.0 if t == 1 else decompose + (r - 1) * copy + divide
            if best[i - t] + cost < best[i] - 1e-9:
                best[i], cut[i] = best[i - t] + cost, i - t
    groups, i = [], len(folds)
    while i:
        lo = cut[i]
        base = folds[lo]
        groups.append([j * base for j in range(1, 1 << (i - lo))])
        i = lo
    return groups[::-1]


def _step_total(terms: list[dict[str, int]]) -> dict[str, int]:
    """Counts of an affine step from its terms' (:func:`_counts_of`): the terms are summed
    before one rescale and share the folds of the widest."""
    total: dict[str, int] = {}
    for c in terms:
        for k, v in c.items():
            if k != "folds":
                total[k] = total.get(k, 0) + v
    folds = max((c.get("folds", 0) for c in terms), default=0)
    total["rotate"] = total.get("rotate", 0) + folds
    total["add"] = total.get("add", 0) + folds
    total["rescale"] = int(any("folds" in c for c in terms))
    return total


def _unique_small(values: np.ndarray, bound: int) -> np.ndarray:
    """Sorted distinct values of non-negative ints below ``bound`` (a bitmap, no sort)."""
    seen = np.zeros(bound, dtype=bool)
    seen[values] = True
    return np.flatnonzero(seen)


def _counts_of(r: np.ndarray, c: np.ndarray, p_in: int, p_out: int) -> dict[str, int]:
    _, d, _ = _diagonals_of(r, c, p_in, p_out)
    keys = _unique_small(d, p_in)
    step, n1 = _bsgs(keys, p_in)
    units = _units(keys, step, p_in)
    return {"rotate": _unit_rotations(units, n1) if units is not None else 0,
            "mul_plain": int(keys.size), "add": int(keys.size), "plaintexts": int(keys.size),
            "folds": len(_folds(p_in, p_out))}


def same_terms(terms: Sequence[sp.spmatrix], rtol: float = 1e-12) -> list[int]:
    """For each term of an affine step, the first term with the same matrix (itself when none
    is): a map applied to several inputs (a Mu-Layer's A on the block's input and on the
    residual branch, a head on the summed stages) runs once on the sum of the inputs. Identity
    terms stay as they are (they cost an addition either way)."""
    reps: list[int] = []
    for t, m in enumerate(terms):
        rep = t
        if not is_identity(m):
            scale = abs(m).max() if m.nnz else 0.0
            for u in range(t):
                o = terms[u]
                if reps[u] == u and o.shape == m.shape and o.nnz == m.nnz and \
                        not is_identity(o) and abs(o - m).max() <= rtol * scale:
                    rep = u
                    break
        reps.append(rep)
    return reps


def make_matvec(a: sp.spmatrix, p_in: int, p_out: int,
                bsgs: tuple[int, int] | None = None) -> MatVec:
    """Plan ``a`` (shape (width_out, width_in)) for inputs of period ``p_in``, outputs ``p_out``;
    ``bsgs``: the ``(step, n1)`` split to use (default: the best for ``a`` alone)."""
    rows, d, v, big = _diagonal_index(a, p_in, p_out)
    keep = v != 0
    rows, d, v = rows[keep], d[keep], v[keep]
    keys = np.unique(d)
    step, n1 = bsgs if bsgs is not None else _bsgs(keys, p_in)
    units = _key_units(keys, step, p_in)
    if units is None:
        raise ValueError(f"BSGS step {step} does not fit the diagonals of this map")
    by_giant: dict[int, dict[int, np.ndarray]] = {}
    order = np.argsort(d, kind="stable")
    rows, d, v = rows[order], d[order], v[order]
    bounds = np.searchsorted(d, keys)
    for unit, lo, hi in zip(units, bounds, np.append(bounds[1:], d.size)):
        vec = np.zeros(big)
        np.add.at(vec, rows[lo:hi], v[lo:hi])
        if not np.any(vec):
            continue
        g, b = divmod(int(unit), n1)
        shift = (g * n1 * step) % p_in
        by_giant.setdefault(shift, {})[(b * step) % p_in] = np.roll(vec, shift)
    giants = sorted(by_giant)
    return MatVec(p_in, p_out, giants, [by_giant[g] for g in giants], _folds(p_in, p_out))


# ----------------------------------------------------------------------------- plan
@dataclass
class VStep:
    """One vector-packing step; ``kind`` in input, affine, planes, mul, mul_int, half (the
    second map of a stacked pair, see :func:`_stack_pairs`)."""

    kind: str
    inputs: tuple[int, ...]
    n: int
    level: int
    slots_of: np.ndarray                 # element (row-major) -> slot within one period
    period: int
    matvecs: list[MatVec | None] = field(default_factory=list)   # None: the identity term
    bias: np.ndarray | None = None       # slot vector of one period
    factor: int = 1
    planes: list[np.ndarray] = field(default_factory=list)   # per input ct: (per_ct * p_out,)
    plane_folds: list[int] = field(default_factory=list)
    plane_cts: list[int] = field(default_factory=list)       # which input cts the planes read
    sums: list[tuple[int, ...]] = field(default_factory=list)  # per term: terms summed first
    shift: int = 0                       # half: rotation bringing a stacked map's half in place

    def sources(self) -> list[tuple[int, ...] | None]:
        """Per term, the steps whose values are summed before its map (one map applied to
        several inputs runs once on their sum); None for a term summed into an earlier one."""
        if not self.sums:
            return [(j,) for j in self.inputs]
        return [tuple(self.inputs[u] for u in g) if g else None for g in self.sums]


def half_runs_at(stacked_level: int) -> int:
    """The level at which a stacked pair's ``half`` step runs, given the stacked value's: it
    rotates the stacked sum before that sum's rescale (at the product's scale, where key
    switching adds no noise worth counting), a level below, then rescales on its own."""
    return stacked_level - 1


def key_basis(slots: int) -> list[int]:
    """Rotation steps of a power-of-two key basis: ``2^i`` and ``-2^i`` (mod ``slots``), from
    which :func:`rotation_path` composes every rotation (about ``2 log2(slots)`` Galois keys
    instead of one per distinct rotation)."""
    out: set[int] = set()
    p = 1
    while p < slots:
        out |= {p, slots - p}
        p *= 2
    return sorted(out)


def rotation_path(step: int, slots: int, keys: Sequence[int] | None) -> list[int]:
    """The rotations (mod ``slots``) whose composition rotates by ``step``: the step itself when
    ``keys`` is None (every rotation has its own key) or holds it, else the signed powers of two
    of its non-adjacent form (the fewest of :func:`key_basis`). Empty for no rotation."""
    step = int(step) % slots
    if step == 0:
        return []
    if keys is None or step in keys:
        return [step]
    best: list[int] | None = None
    for target in (step, step - slots):
        n, bit, path = abs(target), 1, []
        sign = 1 if target > 0 else -1
        while n:
            if n & 1:
                d = 2 - (n & 3)                   # +1 or -1: the non-adjacent form's digit
                path.append((sign * d * bit) % slots)
                n -= d
            n >>= 1
            bit <<= 1
        if best is None or len(path) < len(best):
            best = path
    assert best is not None
    missing = [r for r in best if r not in keys]
    if missing:
        raise ValueError(f"rotation by {step} needs keys for {missing}, which the key set lacks")
    return best


def _plan_repr(kind: str, fields: dict[str, Any], predicted: dict[str, Any], why: str) -> str:
    """One readable line for a plan (its arrays summarised, not printed)."""
    parts = [f"{k}={v}" for k, v in fields.items()]
    if predicted:
        parts.append(f"predicted={predicted.get('seconds_per_ciphertext', float('nan')):.3g} s "
                     f"per ciphertext")
    if why:
        parts.append(f"why={why!r}")
    return f"{kind}({', '.join(parts)})"


@dataclass(repr=False)
class VectorPlan:
    """Steps of a vector-packed program, the client's input layout and the rotations used.

    ``interleave`` samples share each ciphertext (slot ``i * interleave + j`` holds slot ``i`` of
    sample ``j``); ``input_layout[c][i]`` is the flat input element in slot ``i`` of input
    ciphertext ``c`` (``-1``: zero); ``orders`` are the layouts chosen, one per lowered step.
    """

    steps: list[VStep]
    output: int
    input_layout: list[np.ndarray]
    output_shape: tuple[int, ...]
    slots: int
    interleave: int
    orders: list[Order]
    stacked: list[tuple[int, int]] = field(default_factory=list)   # (a, b): b in a's 2nd half
    predicted: dict[str, Any] = field(default_factory=dict)
    why: str = ""
    #: physical rotation steps with Galois keys when they are a :func:`key_basis` (the others
    #: composed from them); None: one key per distinct rotation
    key_steps: list[int] | None = None
    #: ``(input, level)`` whose baby steps are hoisted, ``input`` as :meth:`VStep.sources`
    #: names it (:mod:`he.hoist`; which baby steps: :meth:`hoists`)
    hoisted_sources: list[tuple[Any, int]] = field(default_factory=list)
    #: a server shares the work of each rotation or decomposition that runs alone (a fold, a
    #: single giant step) among its threads (:meth:`he.backend.Engine.rotate_alone`): compiled
    #: where hoisting is and the cost model prices the plan faster so than not
    shares_rotations: bool = False
    #: per level, what a hoisted fold costs (:data:`FoldWeights`): folds are grouped by
    #: :func:`fold_groups` (None: every fold a rotation of its own)
    fold_weights: FoldWeights | None = None
    #: the steps whose values the server returns where the client applies the program's last
    #: map (:attr:`polynets.ir.lowering.Lowered.post`); empty: ``output`` alone
    outputs: tuple[int, ...] = ()

    @property
    def results(self) -> tuple[int, ...]:
        """The steps the server returns, one ciphertext each, in this order."""
        return self.outputs or (self.output,)

    @property
    def levels(self) -> int:
        return max(s.level for s in self.steps)

    def returned_levels(self, pending: int) -> list[int]:
        """Per result (:attr:`results`), the level whose primes it travels on
        (:func:`he.params.read_levels`) on a chain whose levels of parity ``pending`` are
        pending."""
        return [to for _, to in read_levels(self.results, [s.level for s in self.steps],
                                            pending)]

    def __repr__(self) -> str:
        return _plan_repr("VectorPlan", {
            "steps": len(self.steps), "levels": self.levels, "slots": self.slots,
            "interleave": self.interleave, "input_ciphertexts": len(self.input_layout),
            "rotations": len(self.rotations())}, self.predicted, self.why)

    @property
    def virtual_slots(self) -> int:
        return self.slots // self.interleave

    def order(self) -> list[int]:
        """Step indices in an order that runs every step after its inputs: index order, except
        that a stacked pair's ``half`` step, which takes the place of the pair's second map and
        may come before the stacked map it rotates, runs right after that map."""
        done: set[int] = set()
        waiting: dict[int, list[int]] = {}
        out: list[int] = []

        def run(si: int) -> None:
            out.append(si)
            done.add(si)
            for later in waiting.pop(si, []):
                run(later)

        for si, s in enumerate(self.steps):
            missing = [j for j in s.inputs if j not in done]
            if missing:
                if s.kind != "half" or len(missing) != 1 or missing[0] <= si:
                    raise ValueError(f"plan step {si} reads steps {missing} not run before it")
                waiting.setdefault(missing[0], []).append(si)
                continue
            run(si)
        if waiting:
            raise ValueError(f"plan steps {sorted(waiting.values())} read steps never run")
        return out

    def concurrent_planes(self) -> list[int]:
        """The planes steps, which read only the client's input ciphertexts: a server with
        several threads runs them all at once, before the other steps
        (:func:`he.runtime.run_vector`; the prediction takes their makespan)."""
        return [si for si, s in enumerate(self.steps) if s.kind == "planes"]

    def rotations(self) -> list[int]:
        """Physical rotation steps the server needs Galois keys for."""
        steps: set[int] = set()
        for si, s in enumerate(self.steps):
            for mv in s.matvecs:
                if mv is not None:
                    steps |= mv.rotations(include_folds=False)
            for group in self.step_folds(si):
                steps |= set(group)
            if s.kind == "half":
                steps.add(s.shift)
        return sorted((r * self.interleave) % self.slots for r in steps if r)

    def fold_plan(self, folds: Sequence[int], level: int) -> list[list[int]]:
        """The groups of rotations (virtual slots) that fold ``folds`` at ``level``
        (:func:`fold_groups`; every fold a group of its own where the plan has no
        :attr:`fold_weights` or its keys are a basis that composes rotations)."""
        weights = None if self.fold_weights is None or self.key_steps is not None else \
            self.fold_weights(level)
        return fold_groups(folds, weights)

    def fold_segments(self, si: int) -> list[list[int]]:
        """The folds of step ``si``'s maps in the order :func:`he.runtime._affine` takes them:
        the widest term's chain from its end, cut where the sum of a narrower input period
        joins it (that period's own folds follow)."""
        mvs = [mv for mv in self.steps[si].matvecs if mv is not None]
        if not mvs:
            return []
        widest = max(mvs, key=lambda mv: len(mv.folds)).folds
        cuts = sorted({len(mv.folds) for mv in mvs}, reverse=True) + [0]
        return [list(widest[lo:hi]) for hi, lo in zip(cuts, cuts[1:]) if hi > lo]

    def step_folds(self, si: int) -> list[list[int]]:
        """Every group of fold rotations step ``si`` takes (:meth:`fold_plan` of its maps'
        :meth:`fold_segments`, or of a planes step's folds), at the level it runs at."""
        s, level = self.steps[si], self.runs_at(si)
        segments = self.fold_segments(si) + ([list(s.plane_folds)] if s.plane_folds else [])
        return [g for seg in segments for g in self.fold_plan(seg, level)]

    def galois_steps(self) -> list[int]:
        """Physical rotation steps the client makes Galois keys for."""
        return list(self.key_steps) if self.key_steps is not None else self.rotations()

    def runs_at(self, si: int) -> int:
        """The level at which step ``si``'s operations run: the highest of its inputs' levels
        (a ``half``'s: :func:`half_runs_at`)."""
        s = self.steps[si]
        lin = max((self.steps[j].level for j in s.inputs), default=0)
        return half_runs_at(lin) if s.kind == "half" else lin

    def rotation_weight(self, step: int) -> int:
        """Key switchings one rotation by ``step`` (virtual slots) takes with this key set."""
        return len(rotation_path(step * self.interleave, self.slots, self.key_steps))

    @property
    def uses_hoister(self) -> bool:
        """Whether a server of this plan rotates with a hoister (:mod:`he.hoist`): it hoists
        baby steps, or shares the work that runs alone among its threads."""
        return bool(self.hoisted_sources) or self.shares_rotations

    def hoists(self, key: tuple[Any, int, int]) -> bool:
        """Whether the baby step ``key`` = ``(input, level, step)`` (``step`` in virtual slots)
        is hoisted: its input is among :attr:`hoisted_sources`, and its rotation is one key
        switching (a rotation composed from a key basis rotates its first hop's result, which
        no other baby step shares)."""
        return tuple(key[:2]) in self._hoisted_set and bool(key[2] % self.virtual_slots) \
            and self.rotation_weight(key[2]) == 1

    @property
    def _hoisted_set(self) -> frozenset[tuple[Any, int]]:
        return frozenset((src, int(lvl)) for src, lvl in self.hoisted_sources)

    def hoisted_steps(self) -> list[int]:
        """Physical rotation steps of the hoisted baby steps (a permuted copy of each one's
        Galois key is kept, :class:`he.hoist.Hoister`) and of the hoisted folds."""
        out = set()
        for si, s in enumerate(self.steps):
            lin = max((self.steps[j].level for j in s.inputs), default=0)
            for src, mv in zip(s.sources(), s.matvecs):
                if mv is not None and self.hoisted_sources:
                    out |= {b * self.interleave % self.slots for b in mv.babies
                            if self.hoists((src, lin, b))}
        out |= {f * self.interleave % self.slots for g in self.hoisted_folds() for f in g}
        return sorted(out)

    def hoisted_folds(self) -> list[list[int]]:
        """The groups of fold rotations (virtual slots) of every step that are summed from
        one decomposition (:meth:`step_folds` of more than one rotation)."""
        return [g for si in range(len(self.steps)) for g in self.step_folds(si) if len(g) > 1]

    @property
    def widest(self) -> int:
        return max(s.period for s in self.steps)

    def op_counts(self) -> list[dict[str, int]]:
        """Primitive counts of every step (per ciphertext of ``interleave`` samples), as
        :func:`he.runtime.run_vector` runs them: baby-step rotations of one input shared by all
        maps that read it, giant steps shared by a step's terms of one input period, one
        rescale per step, folds shared by the step's terms; a rotation composed from a key basis
        counts each key switching it takes. ``babies`` and ``giants`` (where a step has maps)
        count the rotations among ``rotate`` that the runtime spreads over its threads
        (``baby_items`` the distinct baby steps, each one rotation of one or more key
        switchings), ``giant_items`` the giant steps it spreads (each sums its products, then
        rotates; the giant step of no rotation too) and ``giant_products`` the plaintext
        products among ``mul_plain`` that they take, ``giant_zero`` and
        ``giant_zero_products`` those of the giant steps of no rotation; ``fold_groups`` and
        ``fold_copies`` the folds summed a group at a time (:meth:`step_folds`), their
        rotations not among ``rotate``."""
        w = self.rotation_weight
        out = []
        babies_done: set[tuple[int, int, int]] = set()
        for si, s in enumerate(self.steps):
            c = {"rotate": 0, "mul_plain": 0, "mul_ct": 0, "rescale": 0, "add": 0,
                 "plaintexts": 0}
            mvs = [(j, mv) for j, mv in zip(s.sources(), s.matvecs) if mv is not None]
            if mvs:
                lin = max(self.steps[j].level for j in s.inputs)
                new = {(j, lin, b) for j, mv in mvs for b in mv.babies if b} - babies_done
                babies_done |= new
                lifted = {key for key in new if self.hoists(key)}
                # (input period, giant) -> its terms' baby steps
                giants: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
                for j, mv in mvs:
                    for g, grp in zip(mv.giants, mv.groups):
                        giants.setdefault((mv.p_in, g), []).extend((j, lin, b) for b in grp)
                ext = sum(self.hoists(key) for keys in giants.values() for key in keys)
                diags = sum(mv.n_diagonals for _, mv in mvs)
                # the giant steps of no rotation (one per input period at most) and their
                # products: the runtime spreads them over its threads like the others
                zero = [len(bs) for (_, g), bs in giants.items() if not g]
                lone, folds = self._fold_counts(c, si)
                c["babies"] = sum(w(b) for _, _, b in new - lifted)
                c["baby_items"] = len(new)
                c["giants"] = sum(w(g) for _, g in giants if g)
                c["giant_items"] = len(giants)
                c["giant_products"] = diags
                c["giant_zero"] = sum(1 for _, g in giants if not g)
                c["giant_zero_products"] = sum(zero)
                c["rotate"] += c["babies"] + c["giants"] + lone
                if self.shares_rotations:
                    c["alone"] = lone
                c["mul_plain"] += diags - ext
                c["plaintexts"] += diags
                c["add"] += diags - ext + folds + len(s.matvecs) - 1
                c["rescale"] += 1
                if lifted or ext:
                    # hoisted: an input's decomposition, a rotation without its division by
                    # the special prime per baby step, the extended products of a giant step
                    # summed and divided once (he.hoist)
                    c["decompose"] = len({key[:2] for key in lifted})
                    c["rotate_hoisted"] = len(lifted)
                    c["mul_ext"] = ext
                    c["mod_down"] = sum(any(self.hoists(key) for key in keys)
                                        for keys in giants.values())
                    c["plaintexts_ext"] = ext
            elif s.matvecs:
                c["add"] += len(s.matvecs) - 1
            if s.kind == "planes":
                lone, folds = self._fold_counts(c, si)
                c["mul_plain"] += len(s.planes)
                c["plaintexts"] += len(s.planes)
                c["add"] += len(s.planes) + folds
                c["rotate"] += lone
                c["rescale"] += 1
            elif s.kind == "mul":
                c["mul_ct"] += 1
                c["rescale"] += 1
            elif s.kind == "mul_int":
                c["mul_plain"] += 1
            elif s.kind == "half":                  # rotated before the rescale: its own
                c["rotate"] += w(s.shift)
                if self.shares_rotations:
                    c["alone"] = w(s.shift)
                c["rescale"] += 1
            if s.bias is not None:
                c["add"] += 1
                c["plaintexts"] += 1
            out.append(c)
        return out

    def _fold_counts(self, c: dict[str, int], si: int) -> tuple[int, int]:
        """Step ``si``'s folds (:meth:`step_folds`): the key switchings of the rotations folded
        one at a time, and the additions of all; the hoisted groups go into ``c`` as
        ``fold_groups`` (a decomposition and a division each) and ``fold_copies`` (a rotation
        without its division each)."""
        lone = adds = 0
        for g in self.step_folds(si):
            adds += len(g)
            if len(g) == 1:
                lone += self.rotation_weight(g[0])
            else:
                c["fold_groups"] = c.get("fold_groups", 0) + 1
                c["fold_copies"] = c.get("fold_copies", 0) + len(g)
        return lone, adds

    def lifts(self) -> list[list[tuple[int, int]]]:
        """Per step, the lifts (from level, to level) :func:`he.runtime.run_vector` takes
        values through (:meth:`he.backend.Engine.lift`): an affine step's inputs to the highest
        of their levels, its identity terms to its products' level, the lower input of a
        ciphertext product to the other's level."""
        out = []
        for s in self.steps:
            moves: list[tuple[int, int]] = []
            levels = [self.steps[j].level for j in s.inputs]
            if s.kind == "affine":
                lin = max(levels)
                moves += [(lv, lin) for lv in levels if lv < lin]
                # the maps' sum rescaled a level up, where the identity terms join it
                here = lin + 1 if any(mv is not None for mv in s.matvecs) else lin
                moves += [(lin, here) for mv, src in zip(s.matvecs, s.sources())
                          if mv is None and src is not None and here > lin]
                if s.bias is not None and s.level > here:
                    moves.append((here, s.level))
            elif s.kind == "mul" and min(levels) < max(levels):
                moves.append((min(levels), max(levels)))
            out.append(moves)
        return out

    def cost(self) -> dict[str, int]:
        counts = self.op_counts()
        return {"rotations": sum(c["rotate"] for c in counts),
                "hoisted_rotations": sum(c.get("rotate_hoisted", 0) for c in counts),
                "decompositions": sum(c.get("decompose", 0) for c in counts),
                "fold_copies": sum(c.get("fold_copies", 0) for c in counts),
                "fold_groups": sum(c.get("fold_groups", 0) for c in counts),
                "plain_mults": sum(c["mul_plain"] + c.get("mul_ext", 0) for c in counts),
                "ct_mults": sum(c["mul_ct"] for c in counts),
                "plaintexts": sum(c["plaintexts"] for c in counts),
                "input_ciphertexts": len(self.input_layout)}


@dataclass(repr=False)
class BatchPlan:
    """Batch packing: one sample per slot, one ciphertext per live element of every value.

    ``live[s]``: which elements of step ``s`` reach the output; ``inputs``: the flat input
    elements the client encrypts (ascending).
    """

    live: list[np.ndarray]
    inputs: np.ndarray
    slots: int
    predicted: dict[str, Any] = field(default_factory=dict)
    why: str = ""

    @property
    def interleave(self) -> int:
        """Samples per ciphertext."""
        return self.slots

    def __repr__(self) -> str:
        return _plan_repr("BatchPlan", {
            "steps": len(self.live), "input_ciphertexts": int(self.inputs.size),
            "live_elements": int(sum(int(np.count_nonzero(v)) for v in self.live)),
            "slots": self.slots}, self.predicted, self.why)

    def rotations(self) -> list[int]:
        return []

    def galois_steps(self) -> list[int]:
        return []


def layout_groups(lowered: Lowered) -> list[int]:
    """Group id of every step: steps multiplied together, or summed without a map, share one
    layout (union-find over ``mul``, ``mul_int`` and all-identity affine steps)."""
    parent = list(range(len(lowered.steps)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for si, st in enumerate(lowered.steps):
        if st.kind in ("mul", "mul_int") or (st.kind == "affine"
                                             and affine_is_free(st, "vector")):
            for j in st.inputs:
                parent[find(j)] = find(si)
    return [find(i) for i in range(len(lowered.steps))]


def planes_readers(lowered: Lowered, max_planes: int) -> list[int]:
    """Steps the client's input planes can replace: one-term affine maps of the input whose
    outputs each read at most ``max_planes`` inputs (convolutions, patch embeddings and what
    the lowering composed with them)."""
    out = []
    for i, st in enumerate(lowered.steps):
        if st.kind != "affine" or st.inputs != (0,) or i == lowered.output:
            continue
        nnz = np.diff(st.terms[0].tocsr().indptr)
        k = int(nnz.max()) if nnz.size else 0
        if 0 < k <= max_planes:
            out.append(i)
    return out


def _slot_matrix(m: sp.csr_matrix, out_map: np.ndarray, out_width: int, in_map: np.ndarray,
                 in_width: int) -> sp.csr_matrix:
    coo = m.tocoo()
    return sp.csr_matrix((coo.data, (out_map[coo.row], in_map[coo.col])),
                         shape=(out_width, in_width))


def _term_is_identity(m: sp.csr_matrix, out_map: np.ndarray, in_map: np.ndarray) -> bool:
    return is_identity(m) and out_map.size == in_map.size and np.array_equal(out_map, in_map)


def search_layouts(lowered: Lowered, slots: int, price: Callable[[dict[str, int], int], float],
                   *, max_planes: int = MAX_PLANES, sweeps: int = 2) -> tuple[list[Order], float]:
    """Layouts (one per step) minimising the modelled time of all affine steps.

    ``price(counts, level)`` gives seconds for primitive counts at a level. Coordinate descent
    over layout groups (see :func:`layout_groups`) from several starts (row-major everywhere,
    and each axis order applied to every value that has those axes); each group tries every
    candidate order that fits ``slots``. Returns the orders and the modelled seconds of the
    affine steps.
    """
    search = _LayoutSearch(lowered, slots, price, max_planes)
    # starts: row-major everywhere, and each order applied to every group that admits it (maps
    # are cheapest when their input and output agree, which one group at a time cannot find)
    cands = search.cands
    starts: list[dict[int, Order]] = [{g: None for g in cands}]
    for o in sorted({o for opts in cands.values() for o in opts if o is not None}):
        starts.append({g: o if o in opts else None for g, opts in cands.items()})
    best_cost, best_choice = min((search.descend(s, sweeps) for s in starts),
                                 key=lambda t: (t[0], sum(o is not None for o in t[1].values())))
    return [best_choice[search.group[i]] for i in range(len(lowered.steps))], best_cost


#: primitive counts of a map's sparsity pattern in a pair of layouts, shared by searches
_PATTERN_COUNTS: dict[tuple[Any, ...], dict[str, int]] = {}
_PATTERN_COUNTS_MAX = 200_000


class _LayoutSearch:
    """The modelled cost of affine steps under a choice of layouts, one per layout group, with
    the slot maps, term counts and step costs memoised across the choices tried."""

    def __init__(self, lowered: Lowered, slots: int,
                 price: Callable[[dict[str, int], int], float], max_planes: int) -> None:
        self.steps = steps = lowered.steps
        self.price = price
        self.shapes = layout_shapes(lowered)
        self.levels = step_levels(steps, "vector")
        self.group = group = layout_groups(lowered)
        gids = sorted(set(group))
        members = {g: [i for i in range(len(steps)) if group[i] == g] for g in gids}
        self.planes = set(planes_readers(lowered, max_planes))
        self.cands: dict[int, list[Order]] = {}
        for g in gids:
            kinds = {self.shapes[i] for i in members[g]}
            opts = value_orders(lowered, self.shapes, members[g][0]) if len(kinds) == 1 \
                else [None]
            self.cands[g] = [o for o in opts
                             if next_pow2(_width(self.shapes[members[g][0]], o)) <= slots]
        self.affected = {g: sorted({i for i, s in enumerate(steps) if s.kind == "affine" and
                                    (group[i] == g or any(group[j] == g for j in s.inputs))})
                         for g in gids}
        self.identity = {(si, t): is_identity(m) for si, st in enumerate(steps)
                         for t, m in enumerate(st.terms)}
        self.maps: dict[tuple[int, Order], tuple[np.ndarray, int]] = {}
        self.coos: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, tuple[Any, ...]]] = {}
        self.term_memo: dict[tuple[Any, ...], dict[str, int]] = {}
        self.memo: dict[tuple[Any, ...], float] = {}
        self.reps: dict[int, list[int]] = {}

    def smap(self, si: int, order: Order) -> tuple[np.ndarray, int]:
        key = (si, order)
        if key not in self.maps:
            sm = slot_map(self.shapes[si], order)
            self.maps[key] = (sm, int(sm.max()) + 1 if sm.size else 1)
        return self.maps[key]

    def term_counts(self, si: int, t: int, o_out: Order, o_in: Order) -> dict[str, int]:
        key = (si, t, o_out, o_in)
        if key not in self.term_memo:
            st = self.steps[si]
            out_map, out_w = self.smap(si, o_out)
            in_map, in_w = self.smap(st.inputs[t], o_in)
            if self.identity[si, t] and np.array_equal(out_map, in_map):
                self.term_memo[key] = {"add": 1}
            else:
                if (si, t) not in self.coos:
                    coo = st.terms[t].tocoo()
                    keep = coo.data != 0
                    r, c = coo.row[keep].astype(np.int64), coo.col[keep].astype(np.int64)
                    digest = hashlib.blake2b(r.tobytes() + b"|" + c.tobytes(),
                                             digest_size=16).digest()
                    self.coos[si, t] = (r, c, (digest, self.shapes[si],
                                               self.shapes[st.inputs[t]]))
                r, c, pattern = self.coos[si, t]
                # maps of one sparsity pattern between values of one shape (the blocks of a
                # split value, the narrow and wide chains' searches) count alike
                shared = (pattern, o_out, o_in)
                if shared not in _PATTERN_COUNTS:
                    if len(_PATTERN_COUNTS) > _PATTERN_COUNTS_MAX:
                        _PATTERN_COUNTS.clear()
                    _PATTERN_COUNTS[shared] = _counts_of(out_map[r], in_map[c],
                                                         next_pow2(in_w), next_pow2(out_w))
                self.term_memo[key] = _PATTERN_COUNTS[shared]
        return self.term_memo[key]

    def step_cost(self, si: int, choice: dict[int, Order]) -> float:
        st, group, shapes = self.steps[si], self.group, self.shapes
        if st.kind != "affine" or si in self.planes:
            return 0.0
        o_out = choice[group[si]]
        key = (si, o_out) + tuple(choice[group[j]] for j in st.inputs)
        if key not in self.memo:
            if si not in self.reps:
                self.reps[si] = same_terms(st.terms)
            # a term with the same map and input layout as an earlier one is summed into it
            total = _step_total([{"add": 1} if u != t and shapes[j] == shapes[st.inputs[u]] and
                                 choice[group[j]] == choice[group[st.inputs[u]]] else
                                 self.term_counts(si, t, o_out, choice[group[j]])
                                 for (t, j), u in zip(enumerate(st.inputs), self.reps[si])])
            self.memo[key] = self.price(total, max(self.levels[j] for j in st.inputs))
        return self.memo[key]

    def descend(self, choice: dict[int, Order], sweeps: int) -> tuple[float, dict[int, Order]]:
        """Coordinate descent over the groups from ``choice``: the modelled seconds and orders."""
        for _ in range(sweeps):
            changed = False
            for g, opts in self.cands.items():
                if len(opts) < 2 or not self.affected[g]:
                    continue
                scored = [(sum(self.step_cost(i, {**choice, g: o}) for i in self.affected[g]),
                           o is not None, o) for o in opts]
                best = min(scored, key=lambda t: (t[0], t[1]))
                changed |= best[2] != choice[g]
                choice = {**choice, g: best[2]}
            if not changed:
                break
        return sum(self.step_cost(i, choice) for i in range(len(self.steps))), choice


def widest_period(lowered: Lowered, orders: Sequence[Order]) -> int:
    """Slots the widest value needs in the given layouts (a power of two)."""
    return max(next_pow2(_width(sh, o)) for sh, o in zip(layout_shapes(lowered), orders))


def choose_plane_packing(lowered: Lowered, orders: Sequence[Order], vslots: int,
                         price: Callable[[dict[str, int]], float], *,
                         max_planes: int = MAX_PLANES) -> dict[int, int]:
    """Planes per input ciphertext for every planes step: ``per_ct`` planes in one ciphertext
    cost the client ``ceil(k / per_ct)`` encryptions and the server ``log2(per_ct)`` folds;
    ``price(counts)`` prices both (primitives ``encrypt``, ``mul_plain``, ``rotate``, ``add``)."""
    out = {}
    shapes = layout_shapes(lowered)
    for si in planes_readers(lowered, max_planes):
        st = lowered.steps[si]
        k = int(np.diff(st.terms[0].tocsr().indptr).max())
        p_out = next_pow2(_width(shapes[si], orders[si]))
        best = None
        per_ct = 1
        while per_ct * p_out <= vslots:
            n_cts = math.ceil(k / per_ct)
            folds = len(_folds(per_ct * p_out, p_out))
            cost = price({"encrypt": n_cts, "mul_plain": n_cts, "add": n_cts + folds,
                          "rotate": folds})
            if best is None or cost < best[0]:
                best = (cost, per_ct)
            if per_ct >= k:
                break
            per_ct *= 2
        out[si] = best[1] if best is not None else 1
    return out


def _checked_orders(lowered: Lowered, orders: Sequence[Order] | None) -> list[Order]:
    """``orders`` (default row-major everywhere), checked: one per step, shared by each layout
    group, each an order of its value's layout shape."""
    steps = lowered.steps
    orders = list(orders) if orders is not None else [None] * len(steps)
    if len(orders) != len(steps):
        raise ValueError(f"{len(orders)} layouts for {len(steps)} steps")
    for i, g in enumerate(layout_groups(lowered)):
        if orders[i] != orders[g]:
            raise ValueError(f"steps {i} and {g} must share a layout")
    shapes = layout_shapes(lowered)
    for si, (sh, o) in enumerate(zip(shapes, orders)):
        if o is not None and o not in value_orders(lowered, shapes, si):
            raise ValueError(f"step {si}: layout {o} is not an order of the axes of {sh}")
    return orders


def value_orders(lowered: Lowered, shapes: Sequence[tuple[int, ...]], si: int) -> list[Order]:
    """Layouts a value may take: :func:`candidate_orders` of its layout shape, and for the
    input (and values of its shape multiplied with it) the two of its patch refinement
    (:func:`input_patches`)."""
    opts = candidate_orders(shapes[si])
    patches = input_patches(lowered)
    groups = layout_groups(lowered) if patches is not None and si else None
    if patches is not None and shapes[si] == shapes[0] and \
            (groups is None or groups[si] == groups[0]):
        # the input's own axis orders, each axis as the run of its refined parts
        coarse = tuple(int(n) for n in lowered.steps[0].shape)
        parts = _split_axes(coarse, shapes[0])
        for o in candidate_orders(coarse):
            if o is not None and o[0] >= 0:
                fine = tuple(r for a in o for r in parts[a] if shapes[0][r] > 1)
                if fine not in opts:
                    opts.append(fine)
        opts += [o for o in patches[1] if o not in opts]
    return opts


def _split_axes(coarse: Sequence[int], fine: Sequence[int]) -> list[list[int]]:
    """The axes of ``fine`` (a refinement of ``coarse`` by splitting axes) each axis of
    ``coarse`` is split into."""
    out: list[list[int]] = []
    r = 0
    for size in coarse:
        run, acc = [], 1
        while acc < size or (size == 1 and not run):
            run.append(r)
            acc *= int(fine[r])
            r += 1
        out.append(run)
    return out


def _affine_terms(lowered: Lowered, si: int, partner: int | None, maps: list[np.ndarray],
                  widths: list[int], periods: list[int], vs: VStep) -> list[sp.csr_matrix | None]:
    """Slot matrices of an affine step's terms (None: an identity term), with the partner's
    stacked in the second half of the period when the step is stacked; sets ``vs.sums``
    (terms with one map and one input layout are summed first, see :func:`same_terms`)."""
    steps = lowered.steps
    st = steps[si]
    half = periods[si] // 2
    mats: list[sp.csr_matrix | None] = []
    for t, (j, m) in enumerate(zip(st.inputs, st.terms)):
        if partner is None and _term_is_identity(m, maps[si], maps[j]):
            mats.append(None)
            continue
        a = _slot_matrix(m, maps[si], widths[si], maps[j], widths[j])
        if partner is not None:
            a = a + _slot_matrix(steps[partner].terms[t], maps[partner] + half, widths[si],
                                 maps[j], widths[j])
        mats.append(a)
    reps = same_terms(st.terms)
    if partner is not None:
        other = same_terms(steps[partner].terms)
        reps = [u if other[t] == u else t for t, u in enumerate(reps)]
    vs.sums = [(t,) for t in range(len(mats))]
    for t, u in enumerate(reps):
        ju, jt = st.inputs[u], st.inputs[t]
        if u != t and mats[u] is not None and mats[t] is not None and \
                periods[ju] == periods[jt] and np.array_equal(maps[ju], maps[jt]):
            vs.sums[u] += (t,)
            vs.sums[t], mats[t] = (), None
    return mats


def _stack_pairs(lowered: Lowered, maps: list[np.ndarray], periods: list[int], vslots: int,
                 planes_at: Sequence[int], price: Callable[[dict[str, int], int], float] | None,
                 fixed: Sequence[Sequence[int]] | None) -> tuple[dict[int, int], set[int]]:
    """Pairs ``a -> b`` of affine steps multiplied together (a Mu-Layer's AX and BDX) that run
    as one map stacked in a period twice as long: ``[a; b]``, then ``b``'s half rotated into
    place (one rotation) and multiplied, ``[ab; ba]``, which is ``ab`` at its own period.

    They must read the same inputs through no identity term, fit twice in the slots, and ``b``
    feed only the product. What ``a`` reaches through sums and products without a map (the
    Mu-Layer's ``+ AX``) holds a meaningful first half and a second half that no map reads: those
    values take the doubled period too (returned with the stacked steps). A pair is taken where
    the modelled time (``price(counts, level)``; without one, rotations and plaintext
    multiplications both) of the pair and of the maps reading the doubled values does not grow.
    ``fixed``: the pairs to take (a stored plan's), checked but not priced.
    """
    steps = lowered.steps
    periods = list(periods)
    readers: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(steps))}
    for si, st in enumerate(steps):
        for t, j in enumerate(st.inputs):
            readers[j].append((si, t))
    levels = step_levels(steps, "vector")
    used: set[int] = set(planes_at)
    pairs: dict[int, int] = {}
    wide: set[int] = set()
    want = None if fixed is None else {(int(a), int(b)) for a, b in fixed}
    for mi, st in enumerate(steps):
        if st.kind != "mul" or len(set(st.inputs)) != 2:
            continue
        for a, b in (st.inputs, st.inputs[::-1]):
            if want is not None and (a, b) not in want:
                continue
            reach = _stackable(lowered, a, b, mi, maps, periods, vslots, readers, used | wide)
            if reach is None:
                continue
            if want is None and not _stacking_pays(lowered, a, b, mi, reach, maps, periods,
                                                   readers, levels, price):
                continue
            pairs[a] = b
            used |= {a, b}
            wide |= reach
            for v in reach | {b}:
                periods[v] *= 2
            break
    if want is not None and set(pairs.items()) != want:
        raise ValueError(f"stacked pairs {sorted(want - set(pairs.items()))} do not fit the "
                         "program")
    return pairs, wide


def _stackable(lowered: Lowered, a: int, b: int, mi: int, maps: list[np.ndarray],
               periods: list[int], vslots: int, readers: dict[int, list[tuple[int, int]]],
               taken: set[int]) -> set[int] | None:
    """The values stacking ``a -> b`` (multiplied in ``mi``) doubles, or None when it cannot:
    the maps must read the same inputs through no identity term and fit twice in the slots,
    ``b`` feed only the product, and what ``a`` reaches without a map (sums through identity
    terms, products; ``mi`` excepted) be no planes step, input or output."""
    steps = lowered.steps
    sa, sb = steps[a], steps[b]
    p = periods[a]
    if {a, b} & taken or sa.kind != "affine" or sb.kind != "affine" or \
            sa.inputs != sb.inputs or periods[b] != p or 2 * p > vslots or \
            not np.array_equal(maps[a], maps[b]) or \
            any(is_identity(m) for m in (*sa.terms, *sb.terms)) or \
            any(c != mi for c, _ in readers[b]):
        return None
    reach, todo = {a}, [a]
    while todo:
        v = todo.pop()
        for c, t in readers[v]:
            if c == mi or c in reach:
                continue
            st = steps[c]
            if st.kind == "affine" and not is_identity(st.terms[t]):
                continue                         # a map reads only the first half
            if st.kind not in ("affine", "mul", "mul_int") or c in taken or \
                    c in lowered.outputs or periods[c] != p:
                return None
            reach.add(c)
            todo.append(c)
    return reach


def _stacking_pays(lowered: Lowered, a: int, b: int, mi: int, reach: set[int],
                   maps: list[np.ndarray], periods: list[int],
                   readers: dict[int, list[tuple[int, int]]], levels: list[int],
                   price: Callable[[dict[str, int], int], float] | None) -> bool:
    """Whether stacking ``a`` and ``b`` costs no more than the two maps apart: the pair's
    diagonals and rotations (plus the half's rotation), and the maps reading the doubled
    values, whose input period doubles."""
    steps = lowered.steps
    p = periods[a]
    apart: list[tuple[dict[str, int], int]] = []
    # the half's rotation, of the stacked sum before its rescale, then its own rescale
    stacked: list[tuple[dict[str, int], int]] = [({"rotate": 1, "rescale": 1},
                                                  half_runs_at(levels[a]))]

    def counts(rows: np.ndarray, cols: np.ndarray, p_in: int, p_out: int) -> dict[str, int]:
        c = _counts_of(rows, cols, p_in, p_out)
        return {"rotate": c["rotate"] + c["folds"], "mul_plain": c["mul_plain"]}

    def term(si: int, t: int, out_shift: int = 0) -> tuple[np.ndarray, np.ndarray]:
        coo = steps[si].terms[t].tocoo()
        keep = coo.data != 0
        j = steps[si].inputs[t]
        return maps[si][coo.row[keep]] + out_shift, maps[j][coo.col[keep]]

    lin = max(levels[j] for j in steps[a].inputs)
    for t, j in enumerate(steps[a].inputs):
        (ra, ca), (rb, cb) = term(a, t), term(b, t, p)
        apart += [(counts(ra, ca, periods[j], p), lin), (counts(rb - p, cb, periods[j], p), lin)]
        stacked.append((counts(np.concatenate([ra, rb]), np.concatenate([ca, cb]),
                               periods[j], 2 * p), lin))
    for v in reach:
        for c, t in readers[v]:
            if c in reach or c == mi:
                continue
            r, col = term(c, t)
            lc = max(levels[j] for j in steps[c].inputs)
            apart.append((counts(r, col, p, periods[c]), lc))
            stacked.append((counts(r, col, 2 * p, periods[c]), lc))
    if price is not None:
        return sum(price(c, lv) for c, lv in stacked) <= sum(price(c, lv) for c, lv in apart)
    return all(sum(c[k] for c, _ in stacked) <= sum(c[k] for c, _ in apart)
               for k in ("rotate", "mul_plain"))


def _vector_steps(lowered: Lowered, pairs: dict[int, int], maps: list[np.ndarray],
                  widths: list[int], periods: list[int], planes_at: Sequence[int],
                  hoist_weights: HoistWeights | None = None,
                  hoisted: set[tuple[Any, int]] | None = None) -> list[VStep]:
    """The plan's steps: affine steps with their diagonal maps (BSGS splits chosen jointly, see
    :func:`bsgs_plan`, with ``hoist_weights`` where baby steps may be hoisted: the inputs whose
    baby steps are go into ``hoisted``) and biases, stacked pairs' second halves as ``half``
    steps, products checked to multiply values of one layout. Planes steps are filled in
    later."""
    hoisted = set() if hoisted is None else hoisted
    steps = lowered.steps
    levels = step_levels(steps, "vector")
    vsteps = [VStep(st.kind, st.inputs, st.n, levels[si], maps[si], periods[si],
                    factor=st.factor) for si, st in enumerate(steps)]
    halves = {b: a for a, b in pairs.items()}
    step_mats: dict[int, list[sp.csr_matrix | None]] = {}
    for si, st in enumerate(steps):
        vs = vsteps[si]
        if si in halves:            # the stacked map's second half, rotated into place
            a, p = halves[si], periods[si] // 2
            vs.kind, vs.inputs, vs.shift = "half", (a,), p
            # rotated before the stacked map's bias is added: its own bias, the stacked one
            # rotated ([b; a] of [a; b])
            parts = [(st.bias, maps[si]), (steps[a].bias, maps[a] + p)]
            if any(v is not None and np.any(v) for v, _ in parts):
                vs.bias = np.zeros(periods[si])
                for v, at in parts:
                    if v is not None:
                        vs.bias[at] = v
            continue
        if st.kind == "affine" and si not in planes_at:
            step_mats[si] = _affine_terms(lowered, si, pairs.get(si), maps, widths, periods, vs)
        elif st.kind in ("mul", "mul_int"):
            if any(not np.array_equal(maps[j], maps[si]) for j in st.inputs):
                raise ValueError(f"step {si}: operands of a product in different layouts")
        if st.kind == "input":
            continue                # a value the client computes carries its bias already
        biases = [(st.bias, maps[si])]
        if si in pairs:
            biases.append((steps[pairs[si]].bias, maps[pairs[si]] + periods[si] // 2))
        if any(v is not None and np.any(v) for v, _ in biases):
            vs.bias = np.zeros(periods[si])
            for v, at in biases:
                if v is not None:
                    vs.bias[at] = v
    splits, lifted = bsgs_plan(
        [(si, src, max(levels[i] for i in steps[si].inputs), periods[j],
          _diagonals_of(*_coo_int(a), periods[j], periods[si])[1])
         for si, mats in step_mats.items()
         for j, src, a in zip(steps[si].inputs, vsteps[si].sources(), mats) if a is not None],
        weights=hoist_weights)
    hoisted.update(lifted)
    for si, mats in step_mats.items():
        vsteps[si].matvecs = [None if a is None else
                              make_matvec(a, periods[j], periods[si], splits[si, periods[j]])
                              for j, a in zip(steps[si].inputs, mats)]
    return vsteps


def build_vector_plan(lowered: Lowered, slots: int, orders: Sequence[Order] | None = None, *,
                      interleave: int | None = None, output_shape: tuple[int, ...] = (),
                      max_planes: int = MAX_PLANES, max_input_ciphertexts: int = 8,
                      planes_per_ct: dict[int, int] | None = None,
                      price: Callable[[dict[str, int], int], float] | None = None,
                      stacked: Sequence[Sequence[int]] | None = None,
                      hoist_weights: HoistWeights | None = None,
                      share_rotations: bool = True,
                      fold_weights: FoldWeights | None = None) -> VectorPlan:
    """Vector plan of ``lowered`` for ciphertexts of ``slots`` slots in the given layouts.

    ``interleave``: samples per ciphertext (a power of two); default: as many as the widest
    value leaves room for. ``planes_per_ct``: planes per input ciphertext of each planes step
    (see :func:`choose_plane_packing`); for the others, as few as keep the step within
    ``max_input_ciphertexts`` ciphertexts. Steps that read the same arrangement of the input
    share its ciphertexts. The two maps of a product stack where that is cheaper under
    ``price(counts, level)`` (see :func:`_stack_pairs`), or as ``stacked`` pairs say (a stored
    plan's ``VectorPlan.stacked``). ``hoist_weights``: what hoisted baby steps cost at each
    level (:func:`bsgs_plan`); the plan hoists those of the inputs where they are cheaper
    (None: no hoisting). ``share_rotations``: where hoisting is, a server shares the work of a
    rotation that runs alone among its threads (:attr:`VectorPlan.shares_rotations`).
    ``fold_weights``: what hoisted folds cost at each level (:data:`FoldWeights`); folds are
    grouped where that is cheaper (:func:`fold_groups`; None: one rotation per fold).
    """
    steps = lowered.steps
    orders = _checked_orders(lowered, orders)
    maps = [slot_map(sh, o) for sh, o in zip(layout_shapes(lowered), orders)]
    widths = [int(m.max()) + 1 if m.size else 1 for m in maps]
    periods = [next_pow2(w) for w in widths]
    planes_at = planes_readers(lowered, max_planes)
    widest = max(periods)
    if widest > slots:
        raise ValueError(f"a value needs {widest} slots, more than the {slots} available")
    k = interleave if interleave is not None else slots // widest
    if k < 1 or k & (k - 1) or widest * k > slots:
        raise ValueError(f"cannot interleave {k} samples of {widest} slots in {slots}")
    vslots = slots // k
    pairs, wide = _stack_pairs(lowered, maps, periods, vslots, planes_at, price, stacked)
    for v in wide | set(pairs.values()):
        widths[v] = periods[v] = 2 * periods[v]
    hoisted: set[tuple[Any, int]] = set()
    vsteps = _vector_steps(lowered, pairs, maps, widths, periods, planes_at, hoist_weights,
                           hoisted)
    plan = VectorPlan(vsteps, lowered.output, [], tuple(output_shape), slots, k, orders,
                      stacked=sorted(pairs.items()), hoisted_sources=sorted(hoisted),
                      shares_rotations=hoist_weights is not None and share_rotations,
                      fold_weights=fold_weights,
                      outputs=lowered.outputs if lowered.post is not None else ())
    for si in planes_at:
        _input_planes(plan, steps[si].terms[0], si, vslots, max_input_ciphertexts,
                      (planes_per_ct or {}).get(si))
    # the values the client computes from the input (client_first), each in its own layout,
    # their elements at their offsets in what it encrypts (client_inputs)
    offsets = input_offsets(lowered)
    read = {j for s in vsteps if s.kind != "planes" for j in s.inputs} | set(plan.results)
    for si, st in enumerate(steps):
        if si and st.kind == "input" and si in read:
            vsteps[si].plane_cts = [len(plan.input_layout)]
            plan.input_layout.append(_value_layout(maps[si], periods[si], vslots,
                                                   offsets[si]))
    # the input in its own layout, for the steps that rotate it and where the server returns
    # it to the client's last map
    if 0 in read or not plan.input_layout:
        plan.input_layout.insert(0, _value_layout(maps[0], periods[0], vslots, 0))
        for s in vsteps:
            s.plane_cts = [c + 1 for c in s.plane_cts]
        vsteps[0].plane_cts = [0]
    plan.order()                    # every step's inputs run before it
    return plan


def _value_layout(slots_of: np.ndarray, period: int, vslots: int, offset: int) -> np.ndarray:
    """An input ciphertext holding one value as its step's layout lays it out (``slots_of``:
    element -> slot of a ``period``), repeated over ``vslots``: per slot, the element's index
    in what the client encrypts, ``offset`` the value's first (-1: zero)."""
    base = np.full(period, -1, dtype=np.int64)
    base[slots_of] = offset + np.arange(len(slots_of))
    return np.tile(base, vslots // period)


def _input_planes(plan: VectorPlan, m: sp.csr_matrix, si: int, vslots: int,
                  max_cts: int, per_ct: int | None = None) -> None:
    """Client-side layout of the input as planes for step ``si``: turns it into a planes step
    reading its own input ciphertexts (weights in the output's slot order, so any layout costs
    the same). Planes are packed ``per_ct`` to a ciphertext (folded back by the server) only as
    far as needed to stay within ``max_cts`` ciphertexts, or as far as the slots allow."""
    st = plan.steps[si]
    m = m.tocsr()
    m.sort_indices()
    nnz = np.diff(m.indptr)
    k = int(nnz.max())
    p_out = st.period
    if per_ct is None:
        per_ct = next_pow2(math.ceil(k / max_cts))
    per_ct = max(1, min(per_ct, vslots // p_out))
    n_cts = math.ceil(k / per_ct)
    weights, cts = [], []
    for j in range(n_cts):
        idx = np.full(per_ct * p_out, -1, dtype=np.int64)
        w = np.zeros(per_ct * p_out)
        for t in range(per_ct):
            plane = j * per_ct + t
            rows = np.nonzero(nnz > plane)[0]
            cols = m.indices[m.indptr[rows] + plane]
            idx[t * p_out + st.slots_of[rows]] = cols
            w[t * p_out + st.slots_of[rows]] = m.data[m.indptr[rows] + plane]
        layout = np.tile(idx, vslots // (per_ct * p_out))
        # another planes step may read the same arrangement of the input: share its ciphertext
        same = next((c for c, other in enumerate(plan.input_layout)
                     if np.array_equal(other, layout)), None)
        if same is None:
            plan.input_layout.append(layout)
            same = len(plan.input_layout) - 1
        cts.append(same)
        weights.append(w)
    st.kind = "planes"
    st.planes = weights
    st.plane_folds = _folds(per_ct * p_out, p_out)
    st.plane_cts = cts
    st.matvecs = []


#: Fan-in thresholds :func:`choose_fanin` prices for each weighted step of batch packing (0: no
#: fused rows).
FANIN_CANDIDATES = (0, 2, 4, 8, 16, 32)


def batch_step_counts(st: Any, rows: np.ndarray, in_live: Sequence[np.ndarray],
                      moduli: Sequence[int] | None, scale: float | None,
                      min_fanin: int) -> dict[str, float]:
    """Primitive counts of one step in batch packing (one ciphertext per live element).

    Weighted affine rows with at least ``min_fanin`` ciphertext terms (``0``: none) go through
    :func:`he.fused.fuse_map`, as on the server: fused words (``fused_mac``, ``fused_in``,
    ``fused_out``, per ring coefficient) and a rescale each; the other rows one plaintext
    product and one addition per weight and a rescale.
    """
    from he.fused import fuse_map

    c: dict[str, float] = {"rotate": 0, "mul_plain": 0, "mul_ct": 0, "rescale": 0, "add": 0,
                           "encode": 0}
    n_live = int(rows.sum())
    if st.kind == "affine":
        mats = [m.tocsr() for m in st.terms]
        if affine_is_free(st, "batch"):
            c["add"] = sum(int(np.diff(m.indptr)[rows].sum()) for m in mats)
            return c
        rest = np.flatnonzero(rows)
        if min_fanin > 0 and moduli is not None and scale is not None:
            fmap, covered = fuse_map(mats, list(in_live), [np.full(v.size, scale) for v in in_live],
                                     rest, moduli, min_fanin=min_fanin)
            if fmap is not None:
                c.update(fmap.work(moduli))
                c["rescale"] += covered.size
                rest = np.setdiff1d(rest, covered)
        nnz = sum(int(np.diff(m.indptr)[rest].sum()) for m in mats)
        c["mul_plain"] += nnz
        c["add"] += nnz
        c["rescale"] += rest.size
    elif st.kind == "mul":
        c["mul_ct"] = n_live
        c["rescale"] = n_live
    elif st.kind == "mul_int":
        c["mul_plain"] = n_live
    return c


def batch_counts(lowered: Lowered, live: list[np.ndarray],
                 moduli: Sequence[Sequence[int]] | None = None, scale: float | None = None,
                 fanin: Sequence[int] | None = None, lazy: Sequence[int] = (),
                 only: set[int] | None = None) -> list[dict[str, float]]:
    """:func:`batch_step_counts` of every step; ``moduli`` (the primes of every level, top
    first), ``scale`` and the per-step ``fanin`` thresholds (default: no fused rows) say which
    rows are fused. ``lazy``: product steps left unrelinearised and unrescaled
    (:func:`choose_lazy`): each counts ``mul_lazy`` products, and the part of its readers' maps
    that reads it (at its primes, on three polynomials, each output then relinearised and
    rescaled once more) is counted with it, at its level, not with the readers. ``only``: the
    steps to count (the others count nothing)."""
    levels = step_levels(lowered.steps, "batch")
    lazy = set(int(m) for m in lazy)
    out: list[dict[str, float]] = []
    for si, st in enumerate(lowered.steps):
        level = max((levels[j] for j in st.inputs), default=0)
        if only is not None and si not in only:
            out.append({})
            continue
        if si in lazy:
            out.append({"mul_lazy": int(live[si].sum())})
            continue
        eager = _without_terms(st, lazy) if st.kind == "affine" else st
        out.append(batch_step_counts(
            eager, live[si], [live[j] for j in st.inputs],
            None if moduli is None else moduli[level], scale,
            0 if fanin is None else int(fanin[si])))
    for si, st in enumerate(lowered.steps):
        reads = [j for j in st.inputs if j in lazy]
        if st.kind != "affine" or not reads or (only is not None and reads[0] not in only):
            continue
        part = _lazy_part_counts(st, live[si], [live[j] for j in st.inputs], lazy,
                                 None if moduli is None else moduli[levels[reads[0]] - 1], scale)
        for k, v in part.items():
            out[reads[0]][k] = out[reads[0]].get(k, 0) + v
    return out


def batch_lifts(lowered: Lowered, live: list[np.ndarray],
                lazy: Sequence[int] = ()) -> list[dict[int, int]]:
    """Per step, the inputs batch packing lifts to its level before summing them (a step of
    sums alone, :func:`affine_is_free`, whose inputs lie at several levels: each input below
    the step's level, read by a live row, is lifted once, :meth:`he.backend.Engine.lift`), by
    the level they come from: ``{level: count}``. Steps reading ``lazy`` products sum them
    otherwise (none)."""
    levels = step_levels(lowered.steps, "batch")
    lazy = set(int(m) for m in lazy)
    out: list[dict[int, int]] = []
    for si, st in enumerate(lowered.steps):
        lifts: dict[int, int] = {}
        if st.kind == "affine" and affine_is_free(st, "batch") and st.inputs \
                and not lazy.intersection(st.inputs):
            level = max(levels[j] for j in st.inputs)
            for m, j in zip(st.terms, st.inputs):
                if levels[j] == level:
                    continue
                read = np.zeros(m.shape[1], dtype=bool)
                read[m.tocsr()[live[si]].indices] = True
                n = int((read & live[j]).sum())
                if n:
                    lifts[levels[j]] = lifts.get(levels[j], 0) + n
        out.append(lifts)
    return out


def step_readers(lowered: Lowered) -> dict[int, list[int]]:
    """The steps that read each step (in evaluation order; a step read by none is absent)."""
    readers: dict[int, list[int]] = {}
    for si, st in enumerate(lowered.steps):
        for j in st.inputs:
            readers.setdefault(j, []).append(si)
    return readers


def rows_reading(mats: Sequence[sp.csr_matrix], cols: Sequence[np.ndarray]) -> np.ndarray:
    """Which rows of an affine step's terms ``mats`` have a weight on one of the columns
    ``cols`` (per term, a bool mask of its input's elements): bool ``(n,)``."""
    reach = np.zeros(mats[0].shape[0], dtype=bool)
    for m, c in zip(mats, cols):
        reach |= np.asarray(m[:, np.flatnonzero(c)].getnnz(axis=1) > 0).ravel()
    return reach


def _without_terms(st: Any, drop: set[int]) -> Any:
    """An affine step with the terms of the inputs in ``drop`` zero (what its eager part
    reads where those inputs are lazy products)."""
    return dataclasses.replace(st, terms=[
        sp.csr_matrix(m.shape) if j in drop else m for j, m in zip(st.inputs, st.terms)])


def _lazy_part_counts(st: Any, rows: np.ndarray, in_live: Sequence[np.ndarray],
                      lazy: set[int], moduli: Sequence[int] | None,
                      scale: float | None) -> dict[str, float]:
    """The work of the rows of a weighted step over its lazy inputs (three-polynomial
    ciphertexts at the products' level): one fused map where it can be (else a plaintext
    product and an addition per weight), then per output row a relinearisation, a rescale to
    the step's level and an addition to the rest of the row's sum."""
    from he.fused import fuse_map

    mats = [m.tocsr() if j in lazy else sp.csr_matrix(m.shape)
            for j, m in zip(st.inputs, st.terms)]
    cols = [v if j in lazy else np.zeros(v.size, dtype=bool) for j, v in zip(st.inputs, in_live)]
    out_rows = np.flatnonzero(rows & rows_reading(mats, cols))
    c: dict[str, float] = {"relin": out_rows.size, "rescale": out_rows.size,
                           "add": out_rows.size}
    fmap = None
    if moduli is not None and scale is not None and out_rows.size:
        fmap, covered = fuse_map(mats, cols, [np.full(v.size, scale) for v in in_live],
                                 out_rows, moduli, min_fanin=1)
    if fmap is not None and covered.size == out_rows.size:
        for k, v in fmap.work(moduli, size=3).items():
            c[k] = c.get(k, 0) + v
    else:
        nnz = sum(int(np.diff(m.indptr)[out_rows].sum()) for m in mats)
        c["mul_plain"] = c.get("mul_plain", 0) + nnz
        c["add"] += nnz
    return c


def lazy_candidates(lowered: Lowered) -> list[int]:
    """Product steps that may stay unrelinearised and unrescaled: not the output, and read only
    by weighted maps (which can take three-polynomial ciphertexts at the products' level and
    relinearise and rescale their own outputs instead) that run at the products' level (a map
    whose other inputs lie deeper would need the products switched down the chain, which a
    three-polynomial product left at its inputs' primes is not)."""
    readers = step_readers(lowered)
    levels = step_levels(lowered.steps, "batch")

    def reads_at_its_level(si: int, r: int) -> bool:
        return max(levels[j] for j in lowered.steps[r].inputs) == levels[si]

    return [si for si, st in enumerate(lowered.steps)
            if st.kind == "mul" and si not in lowered.outputs and readers.get(si)
            and all(lowered.steps[r].kind == "affine"
                    and not affine_is_free(lowered.steps[r], "batch")
                    and reads_at_its_level(si, r) for r in readers[si])]


def choose_lazy(lowered: Lowered, live: list[np.ndarray], moduli: Sequence[Sequence[int]],
                scale: float, fanin: Sequence[int],
                price: Callable[[dict[str, float], int], float]) -> list[int]:
    """The product steps of :func:`lazy_candidates` whose products batch packing leaves
    unrelinearised and unrescaled, each where ``price(counts, level)`` says that costs less
    than finishing every product: it pays where the maps reading the products have fewer
    outputs than there are products (a classifier's head after the last Mu-Layer)."""
    levels = step_levels(lowered.steps, "batch")
    readers = step_readers(lowered)
    chosen = []
    for m in lazy_candidates(lowered):
        cost = {}
        near = {m, *readers[m]}
        for lazy in ((), (m,)):
            counts = batch_counts(lowered, live, moduli, scale, fanin, lazy, only=near)
            cost[lazy] = sum(price(counts[s], max((levels[j] for j in lowered.steps[s].inputs),
                                                  default=0))
                             for s in near)
        if cost[(m,)] < cost[()]:
            chosen.append(m)
    return chosen


def choose_fanin(lowered: Lowered, live: list[np.ndarray], moduli: Sequence[Sequence[int]],
                 scale: float, price: Callable[[dict[str, float], int], float]) -> list[int]:
    """Per step, the fan-in from which batch packing fuses a weighted row (0: never), the
    cheapest of :data:`FANIN_CANDIDATES` under ``price(counts, level)``."""
    levels = step_levels(lowered.steps, "batch")
    out = []
    for si, st in enumerate(lowered.steps):
        if st.kind != "affine" or affine_is_free(st, "batch"):
            out.append(0)
            continue
        level = max((levels[j] for j in st.inputs), default=0)
        ins = [live[j] for j in st.inputs]
        best = min(FANIN_CANDIDATES, key=lambda f: price(
            batch_step_counts(st, live[si], ins, moduli[level], scale, f), level))
        out.append(int(best))
    return out


