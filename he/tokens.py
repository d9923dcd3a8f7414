"""Tokens packing: one ciphertext per channel, every token of ``k`` samples in its slots.

Batch packing holds one scalar of a value per ciphertext (one sample per slot), so a value of
``T`` tokens x ``C`` channels is ``T C`` ciphertexts: a two-Poly-Block MONet on 7 x 7 tokens of
96 channels holds 4,704 ciphertexts per value, gigabytes at N=16384. Vector packing holds a
sample's whole value in one ciphertext, and pays rotations for every map. Token models sit in
between: their channel maps are the same on every token, and only a few maps (the spatial shift,
the patch embedding, the head) move data between tokens. Tokens packing lays a value out as

* one ciphertext per channel (per element for a value without tokens, such as the logits);
* in its slots, the token grid padded to powers of two per axis (period ``p``), each position
  repeated for ``k = slots / p`` samples: slot ``P k + j`` holds position ``P`` of sample ``j``.

A linear map between token values is then a sum over *offsets* ``d`` of channel maps applied to
the inputs rotated by ``d`` positions (``d k`` slots): a Mu-Layer's channel maps have the one
offset 0 and are batch packing's fused scalar products (:mod:`he.fused`) on ``C`` ciphertexts
instead of ``T C``; a spatial shift composed into a map adds one offset per shifted direction
and costs one rotation per shifted input channel (or per output channel, whichever is fewer:
the partial sums are rotated instead, the giant-step form). The program is decomposed exactly:

* a channel pair's weights at one offset are a *scalar* where they are the same on every token
  whose source is a token (the padding reads as zero) -- this needs the input to be zero on the
  padding ("clean"), which the client's input and every bias are (a bias is a weight on an
  encrypted mask plane, 1 on tokens and 0 on padding, that the client sends with the input);
  otherwise a *slot vector* (a plaintext, zero on the padding);
* a rotated sum leaves other values on the padding ("dirty"); a product with a clean factor is
  clean again. A rotation of a dirty value is never scalar;
* the maps that read the input read *planes* the client gathers as they need them (plane ``q``
  of every token's patch, taken from the token each output token reads, zero where it reads
  none): a shifted patch embedding costs no rotation and its result stays clean;
* a shift that keeps its border (:class:`polynets.nn.layers.SpatialShift`) of a computed value
  is a *masked part*: its partial sums are rescaled, rotated and multiplied by the mask of the
  tokens whose source is a token, plus themselves times the mask of the border -- two shared
  plaintexts per offset and one level more for the map, and a clean result;
* a map from tokens to a value without tokens (a flattening head) multiplies each channel by its
  weights as a slot vector and sums the positions with ``log2 p`` rotations.

A value is a token grid where its count of elements is tokens x channels, channels last or
first; anything else (the logits) has one ciphertext per element, read at position 0. The
padding is chosen by the cost model: each axis padded to the next power of two, or to the one
after where that leaves no padding (so shifts find zeros), whichever prices lower. Levels follow
:func:`polynets.ir.lowering.step_levels` with vector packing's rule (only identity maps are
free; a rotation costs none), plus one for a map with masked parts.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import scipy.sparse as sp

from he.plan import _input_patches, input_patches, layout_shapes, next_pow2
from polynets.ir.lowering import Lowered, Step, step_levels

__all__ = ["TokenPlan", "TStep", "Part", "build_token_plan", "token_paddings", "token_grid",
           "TokensNotApplicable", "simulate_tokens", "token_step_counts", "LEVEL_RULE"]

#: the level rule of :func:`polynets.ir.lowering.step_levels` tokens packing counts with
LEVEL_RULE = "tokens"
#: Relative spread below which a channel pair's weights at one offset are one scalar (weights
#: composed from the same maps differ only by the rounding of their sums)
SCALAR_RTOL = 1e-12
#: Client input element index meaning "one" (the mask plane), beside -1 meaning zero
ONE = -2


class TokensNotApplicable(ValueError):
    """The program does not have the token structure tokens packing needs (the reason)."""


@dataclass
class Part:
    """The scalar channel maps of one affine step at one offset ``delta`` (positions): one
    ``(C_out, C_in)`` matrix per step input, the mask plane last (the bias, offset 0 only).
    ``giant``: the partial sums are rotated, not the inputs."""

    delta: int
    terms: list[sp.csr_matrix]
    giant: bool = False
    #: the rotated partial sums are multiplied by the mask of the positions whose source is a
    #: token (so a dirty input is read correctly and the result is clean); ``copy``: plus, on
    #: the positions whose source is padding, the partial sum itself (a shift that keeps its
    #: border). Both cost the step a second level.
    masked: bool = False
    copy: bool = False


@dataclass
class VTerm:
    """A channel pair whose weights at ``delta`` are a slot vector ``diag`` over positions (in
    the output's coordinates; zero on the padding)."""

    delta: int
    src: int            # index into the step's inputs
    c_in: int
    c_out: int
    diag: np.ndarray


@dataclass
class RTerm:
    """A token value's channel summed over positions with weights ``w`` into element
    ``r_out`` of a value without tokens."""

    src: int
    c_in: int
    r_out: int
    w: np.ndarray


@dataclass
class TStep:
    """One lowered step in tokens packing: its value's ciphertexts and, for a map, its scalar
    parts per offset, slot-vector terms and reductions."""

    kind: str                   # input, affine, mul, mul_int
    inputs: tuple[int, ...]
    width: int                  # ciphertexts of the value (channels, or elements)
    tokens: bool                # a token value (else: element r at position 0)
    clean: bool                 # zero on the padding
    parts: list[Part] = field(default_factory=list)
    vterms: list[VTerm] = field(default_factory=list)
    rterms: list[RTerm] = field(default_factory=list)
    free: bool = False          # identity maps only: sums, no level
    bias: np.ndarray | None = None   # a free step's bias (per output)
    factor: int = 1
    #: offsets of masked parts -> whether they copy the border (a masked step: two levels)
    copy_of: dict[int, bool] = field(default_factory=dict)
    # where each element of the original step's flat value lives: (ciphertext, position)
    elem_ct: np.ndarray | None = None
    elem_pos: np.ndarray | None = None
    #: the input's ciphertexts: (plane, source token of every token or -1); the client
    #: gathers them, so the maps reading the input need no rotation
    planes: list[tuple[int, np.ndarray]] = field(default_factory=list)
    plane_ids: dict[tuple[int, bytes], int] = field(default_factory=dict)

    def plane(self, q: int, pattern: np.ndarray) -> int:
        key = (int(q), pattern.astype(np.int64).tobytes())
        if key not in self.plane_ids:
            self.plane_ids[key] = len(self.planes)
            self.planes.append((int(q), pattern.astype(np.int64)))
        return self.plane_ids[key]


@dataclass
class TokenPlan:
    """A program in tokens packing (see the module docstring)."""

    grid: tuple[int, ...]
    padded: tuple[int, ...]
    slots: int
    steps: list[TStep]
    output: int
    #: per input ciphertext: position -> input element (-1: zero, :data:`ONE`: one)
    input_layout: list[np.ndarray]
    levels: list[int]
    predicted: dict[str, Any] = field(default_factory=dict)
    why: str = ""

    @property
    def period(self) -> int:
        return int(np.prod(self.padded, dtype=np.int64))

    @property
    def interleave(self) -> int:
        """Samples per group: each ciphertext holds ``interleave`` samples' tokens."""
        return self.slots // self.period

    @property
    def tok_at(self) -> np.ndarray:
        """Token at each position (-1: padding)."""
        n_tok = int(np.prod(self.grid))
        pos = np.ravel_multi_index(np.unravel_index(np.arange(n_tok), self.grid), self.padded)
        out = np.full(self.period, -1, dtype=np.int64)
        out[pos] = np.arange(n_tok)
        return out

    def part_masks(self, delta: int) -> tuple[np.ndarray, np.ndarray]:
        """A masked part's two masks over positions: tokens whose source at ``delta`` is a
        token, and tokens whose source is padding (the border)."""
        at = self.tok_at >= 0
        src = np.roll(at, -delta)
        return (at & src).astype(np.float64), (at & ~src).astype(np.float64)

    def rotation_offsets(self) -> list[int]:
        """Offsets (positions) the server rotates by."""
        out: set[int] = set()
        for st in self.steps:
            out.update(p.delta for p in st.parts if p.delta)
            out.update(v.delta for v in st.vterms if v.delta)
            if st.rterms:
                out.update(1 << b for b in range(int(math.log2(self.period))))
        return sorted(out)

    def galois_steps(self) -> list[int]:
        k = self.interleave
        return sorted({(d * k) % self.slots for d in self.rotation_offsets()} - {0})

    def op_summary(self) -> dict[str, int]:
        rot = sum(_rotations(st, self.period) for st in self.steps)
        return {"rotations": rot,
                "vector_weights": sum(len(st.vterms) + len(st.rterms) for st in self.steps),
                "scalar_weights": sum(int(m.nnz) for st in self.steps for p in st.parts
                                      for m in p.terms)}


def _signed(d: np.ndarray, p: int) -> np.ndarray:
    """Offsets modulo the period ``p`` as the nearest signed ones."""
    d = np.asarray(d) % p
    return np.where(d > p // 2, d - p, d)


def _rotations(st: TStep, period: int) -> int:
    """Rotations of one step per group, as the runtime does them: per rotated offset its
    rotated inputs (baby steps) or its rotated partial sums (giant steps, masked parts), one per
    slot-vector term off offset 0, and ``log2 p`` per reduced element."""
    n = 0
    for q in st.parts:
        if not q.delta:
            continue
        if q.masked or q.giant:
            n += len(_part_rows(q))
        else:
            n += len({(t, int(c)) for t, m in enumerate(q.terms) for c in np.unique(m.indices)})
    n += sum(1 for v in st.vterms if v.delta)
    n += len({r.r_out for r in st.rterms}) * int(math.log2(period))
    return n


def _inputs_at(st: TStep, d: int) -> set[tuple[int, int]]:
    out = {(v.src, v.c_in) for v in st.vterms if v.delta == d}
    for p in st.parts:
        if p.delta == d:
            for t, m in enumerate(p.terms):
                out.update((t, int(c)) for c in np.unique(m.indices))
    return out


def _outputs_at(st: TStep, d: int) -> set[int]:
    out = {v.c_out for v in st.vterms if v.delta == d}
    for p in st.parts:
        if p.delta == d:
            out |= _part_rows(p)
    return out


def _part_rows(q: "Part") -> set[int]:
    """Output rows a part writes."""
    out: set[int] = set()
    for m in q.terms:
        out.update(int(r) for r in np.flatnonzero(np.diff(m.tocsr().indptr)))
    return out


# --------------------------------------------------------------------------- decomposition
def _strip(shape: Sequence[int]) -> tuple[int, ...]:
    s = list(int(n) for n in shape)
    while len(s) > 1 and s[0] == 1:
        s.pop(0)
    return tuple(s)


def _grid_of(lowered: Lowered) -> tuple[tuple[int, ...], np.ndarray, np.ndarray, int]:
    """The token grid, and where each input element lives: its token and its plane."""
    patches = input_patches(lowered)
    if patches is None:
        # maps that skip part of the input (a shift that drops a border) read it by the
        # patches of those that read all of it
        full = [st for st in lowered.steps[1:] if st.kind == "affine" and 0 in st.inputs
                and np.all(np.diff(sp.csc_matrix(st.terms[st.inputs.index(0)]).indptr) > 0)]
        if full:
            patches = _input_patches(Lowered([lowered.steps[0]] + full, 0))
    if patches is None and _read_by_element(lowered):
        # patches of one element (a 1x1 patch embedding of one channel): a token per element
        shape = _strip(lowered.steps[0].shape)
        n = int(np.prod(shape))
        return shape, np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), 1
    if patches is None:
        raise TokensNotApplicable("the maps reading the input do not read it by patches (tokens "
                                  "packing needs an input the client can lay out token by token)")
    refined, layouts = patches
    # layouts: (inner axes, outer axes) and (outer axes, inner axes); the outer ones are tokens
    first, second = list(layouts[1]), list(layouts[0])
    n_out = next(i for i in range(1, len(first) + 1) if set(first[:i]) == set(second[-i:]))
    outer_axes, inner_axes = first[:n_out], first[n_out:]
    grid = tuple(int(refined[a]) for a in outer_axes)
    idx = np.indices(refined).reshape(len(refined), -1)
    token = np.ravel_multi_index(tuple(idx[a] for a in outer_axes), grid)
    if inner_axes:
        inner = tuple(int(refined[a]) for a in inner_axes)
        plane = np.ravel_multi_index(tuple(idx[a] for a in inner_axes), inner)
        planes = int(np.prod(inner))
    else:
        plane = np.zeros(token.size, dtype=np.int64)
        planes = 1
    return grid, token.astype(np.int64), plane.astype(np.int64), planes


def _read_by_element(lowered: Lowered) -> bool:
    """Whether every output of the maps reading the input reads one element of it at most, and
    one of those maps reads them all (the others may skip a border): patches of one element."""
    readers = [st.terms[st.inputs.index(0)] for st in lowered.steps[1:]
               if st.kind == "affine" and 0 in st.inputs]
    return bool(readers) and \
        all(np.all(np.diff(sp.csr_matrix(m).indptr) <= 1) for m in readers) and \
        any(np.all(np.diff(sp.csc_matrix(m).indptr) > 0) for m in readers)


def token_grid(lowered: Lowered) -> tuple[int, ...]:
    """The token grid of a program's input (raises :class:`TokensNotApplicable`)."""
    return _grid_of(lowered)[0]


def token_paddings(grid: Sequence[int]) -> list[tuple[int, ...]]:
    """Padded grids to price: each axis to the next power of two, or (where that leaves no
    padding) to the one after."""
    opts = [sorted({next_pow2(g), next_pow2(g + 1)}) for g in grid]
    return [tuple(c) for c in itertools.product(*opts)]


def build_token_plan(lowered: Lowered, slots: int, padded: Sequence[int] | None = None,
                     giant: dict[int, list[int]] | None = None) -> TokenPlan:
    """The tokens-packing plan of ``lowered`` at ``slots`` slots with the token grid padded to
    ``padded`` (default: each axis to the next power of two). ``giant``: per step, the offsets
    whose partial sums are rotated (default: where that is fewer rotations than rotating the
    inputs). Raises :class:`TokensNotApplicable` (with the reason) for programs without token
    structure."""
    steps = lowered.steps
    grid, in_token, in_plane, planes = _grid_of(lowered)
    padded = tuple(next_pow2(g) for g in grid) if padded is None else tuple(int(p) for p in padded)
    if len(padded) != len(grid) or any(p < g or p & (p - 1) for p, g in zip(padded, grid)):
        raise ValueError(f"padded grid {padded} does not hold the token grid {grid}")
    p = int(np.prod(padded))
    if p > slots:
        raise TokensNotApplicable(f"{int(np.prod(grid))} tokens padded to {p} positions do not "
                                  f"fit {slots} slots")
    n_tok = int(np.prod(grid))
    pos = np.ravel_multi_index(np.unravel_index(np.arange(n_tok), grid), padded).astype(np.int64)
    tok_at = np.full(p, -1, dtype=np.int64)
    tok_at[pos] = np.arange(n_tok)
    shapes = layout_shapes(lowered)
    tsteps: list[TStep] = []
    for si, st in enumerate(steps):
        if st.kind == "input":
            ts = TStep("input", (), planes, True, True)
            ts.elem_ct, ts.elem_pos = in_plane, pos[in_token]
            for q in range(planes):
                ts.plane(q, np.arange(int(pos.size)))
            tsteps.append(ts)
            continue
        # a token value: channels last (tokens x channels, the grid's tokens in row-major
        # order however its axes are split) or first (channels x tokens, as convolutions
        # give them); any other value holds no tokens
        sh = _strip(shapes[si])
        n, e = st.n, np.arange(st.n)
        if len(sh) >= 2 and int(np.prod(sh[:-1])) == n_tok:
            tokens, width = True, n // n_tok
            ct_of, pos_of = e % width, pos[e // width]
        elif len(sh) >= 2 and int(np.prod(sh[1:])) == n_tok:
            tokens, width = True, n // n_tok
            ct_of, pos_of = e // n_tok, pos[e % n_tok]
        else:
            tokens, width = False, n
            ct_of, pos_of = e, np.zeros(n, dtype=np.int64)
        ts = TStep(st.kind, tuple(st.inputs), width, tokens, False, factor=st.factor)
        ts.elem_ct, ts.elem_pos = ct_of, pos_of
        ins = [tsteps[j] for j in st.inputs]
        if st.kind == "mul":
            if ins[0].tokens != tokens or ins[1].tokens != tokens:
                raise TokensNotApplicable(f"step {si} multiplies values of different layouts")
            ts.clean = ins[0].clean or ins[1].clean
        elif st.kind == "mul_int":
            ts.clean = ins[0].clean
        else:
            _decompose(si, st, ts, ins, tok_at, pos, p, tokens)
        tsteps.append(ts)
    tsteps[0].width = len(tsteps[0].planes)
    for st in tsteps:
        for q in st.parts:
            for t, j in enumerate(st.inputs):
                if j == 0 and q.terms[t].shape[1] != tsteps[0].width:
                    q.terms[t].resize((st.width, tsteps[0].width))
    plan = TokenPlan(grid, padded, slots, tsteps, lowered.output,
                     _input_layout(tsteps[0], steps[0].n, pos, tok_at, p),
                     step_levels(steps, LEVEL_RULE, [int(bool(ts.copy_of)) for ts in tsteps]))
    _choose_giants(plan, giant)
    return plan


def _input_layout(ts: TStep, n: int, pos: np.ndarray, tok_at: np.ndarray, p: int
                  ) -> list[np.ndarray]:
    """Per input ciphertext, the input element at each position (plane ``q`` gathered by its
    token pattern; zero on the padding and where the pattern reads nothing); the mask plane
    last."""
    assert ts.elem_ct is not None and ts.elem_pos is not None
    n_tok = int(pos.size)
    n_planes = int(ts.elem_ct.max()) + 1
    at = np.full((n_planes, n_tok), -1, dtype=np.int64)
    at[ts.elem_ct, tok_at[ts.elem_pos]] = np.arange(n)
    out = []
    for q, pattern in ts.planes:
        idx = np.full(p, -1, dtype=np.int64)
        ok = pattern >= 0
        idx[pos[ok]] = at[q, pattern[ok]]
        out.append(idx)
    mask = np.full(p, -1, dtype=np.int64)
    mask[pos] = ONE
    return out + [mask]


def _input_terms(t: int, r: np.ndarray, c: np.ndarray, w: np.ndarray, ts: TStep, src: TStep,
                 tok_at: np.ndarray, pos: np.ndarray, p: int,
                 scalars: dict[int, list[Any]]) -> None:
    """A token map of the input: per output channel and input plane, one gathered plane and a
    scalar where the weights are one value and each output token reads at most one input token
    (a patch embedding, a shifted one, a shift that keeps its border); otherwise per offset a
    plane shifted by it, with a scalar or a slot vector."""
    assert src.elem_ct is not None and src.elem_pos is not None
    n_tok = int(pos.size)
    assert ts.elem_ct is not None and ts.elem_pos is not None
    t_o, c_o = tok_at[ts.elem_pos[r]], ts.elem_ct[r]
    q, t_i = src.elem_ct[c], tok_at[src.elem_pos[c]]
    key = c_o * (int(q.max()) + 1) + q
    order = np.argsort(key, kind="stable")
    key, t_o, c_o, q, t_i, w = (a[order] for a in (key, t_o, c_o, q, t_i, w))
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    rows, cols, vals = [], [], []
    for a, b in zip(starts, np.r_[starts[1:], key.size]):
        ws, to, ti = w[a:b], t_o[a:b], t_i[a:b]
        if _one_value(ws) and np.unique(to).size == to.size:
            pattern = np.full(n_tok, -1, dtype=np.int64)
            pattern[to] = ti
            rows.append(int(c_o[a]))
            cols.append(src.plane(int(q[a]), pattern))
            vals.append(float(np.mean(ws)))
            continue
        d = _signed(pos[ti] - pos[to], p)
        copied = _copied_border(d, to, ws, tok_at, pos, p)
        if copied is not None:
            # shifts that keep their border: one gathered plane per offset
            for dv, wv in copied.items():
                pattern = np.arange(n_tok) if dv == 0 else _copy_pattern(dv, tok_at, pos, p)
                rows.append(int(c_o[a]))
                cols.append(src.plane(int(q[a]), pattern))
                vals.append(wv)
            continue
        for dv in np.unique(d):
            sel = d == dv
            pattern = tok_at[(pos + int(dv)) % p]
            plane = src.plane(int(q[a]), pattern)
            if _one_value(ws[sel]) and sel.sum() == int((pattern >= 0).sum()):
                rows.append(int(c_o[a]))
                cols.append(plane)
                vals.append(float(np.mean(ws[sel])))
            else:
                vec = np.zeros(p)
                vec[pos[to[sel]]] = ws[sel]
                ts.vterms.append(VTerm(0, t, plane, int(c_o[a]), vec))
    if rows:
        scalars.setdefault(0, []).append((np.full(len(rows), t), np.array(rows),
                                          np.array(cols), np.array(vals)))


def _copy_pattern(dv: int, tok_at: np.ndarray, pos: np.ndarray, p: int) -> np.ndarray:
    """Source token of every token under a shift by ``dv`` positions that keeps its border."""
    src = tok_at[(pos + dv) % p]
    return np.where(src >= 0, src, np.arange(pos.size))


def _copied_border(d: np.ndarray, to: np.ndarray, ws: np.ndarray, tok_at: np.ndarray,
                   pos: np.ndarray, p: int) -> dict[int, float] | None:
    """Weights per offset where a token block is a sum of shifts that keep their border (each
    rotated offset one weight on every token whose source is a token; the unrotated weights
    those weights on the border plus one more); None otherwise."""
    n_tok = int(pos.size)
    out: dict[int, float] = {}
    resid = np.zeros(n_tok)
    size = float(np.abs(ws).max())
    for dv in np.unique(d):
        sel = d == dv
        if dv == 0:
            np.add.at(resid, to[sel], ws[sel])
            continue
        valid = tok_at[(pos + int(dv)) % p] >= 0
        if not _one_value(ws[sel]) or sel.sum() != int(valid.sum()):
            return None
        out[int(dv)] = float(np.mean(ws[sel]))
        resid -= out[int(dv)] * ~valid
    if resid.max() - resid.min() > 64 * SCALAR_RTOL * size:
        return None
    w0 = 0.5 * (resid.max() + resid.min())
    if w0 != 0:
        out[0] = w0
    return out


def _one_value(w: np.ndarray) -> bool:
    hi, lo = float(np.max(w)), float(np.min(w))
    return hi - lo <= SCALAR_RTOL * max(abs(hi), abs(lo))


def _decompose(si: int, st: Step, ts: TStep, ins: list[TStep], tok_at: np.ndarray,
               pos: np.ndarray, p: int, tokens: bool) -> None:
    """Fill an affine step's parts, vector terms and reduction terms."""
    from polynets.ir.lowering import is_identity

    n_in = len(st.terms)
    ts.free = all(is_identity(m) for m in st.terms)
    if ts.free:
        if any(ins[t].tokens != tokens or ins[t].width != ts.width for t in range(n_in)):
            raise TokensNotApplicable(f"step {si} adds values of different layouts")
        ts.bias = None if st.bias is None else np.asarray(st.bias, dtype=np.float64)
        ts.clean = all(i.clean for i in ins)
        ts.parts = [Part(0, [sp.identity(ts.width, format="csr") for _ in range(n_in)]
                         + [sp.csr_matrix((ts.width, 1))])]
        return
    scalars: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    shifted_scalar = False
    groups: list[tuple[Any, ...]] = []
    for t, m in enumerate(st.terms):
        src = ins[t]
        coo = m.tocoo()
        r, c, w = coo.row.astype(np.int64), coo.col.astype(np.int64), coo.data
        keep = w != 0
        r, c, w = r[keep], c[keep], w[keep]
        if not tokens and src.tokens:
            # a reduction over positions (token value -> elements)
            key = r * src.width + src.elem_ct[c]
            order = np.argsort(key, kind="stable")
            key, rs, cs, ws = key[order], r[order], c[order], w[order]
            starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
            for a, b in zip(starts, np.r_[starts[1:], key.size]):
                vec = np.zeros(p)
                np.add.at(vec, src.elem_pos[cs[a:b]], ws[a:b])
                ts.rterms.append(RTerm(t, int(src.elem_ct[cs[a]]), int(rs[a]), vec))
            continue
        if tokens and not src.tokens:
            raise TokensNotApplicable(f"step {si} spreads a value without tokens over tokens")
        if not tokens:
            scalars.setdefault(0, []).append((np.full(r.size, t), r, c, w))  # type: ignore
            continue
        if src.kind == "input":
            _input_terms(t, r, c, w, ts, src, tok_at, pos, p, scalars)
            continue
        t_o = tok_at[ts.elem_pos[r]]
        c_o = ts.elem_ct[r]
        c_i = src.elem_ct[c]
        d = _signed(src.elem_pos[c] - pos[t_o], p)
        key = (d + p) * (ts.width * src.width) + c_o * src.width + c_i
        order = np.argsort(key, kind="stable")
        key, t_o, c_o, c_i, d, w = (x[order] for x in (key, t_o, c_o, c_i, d, w))
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        groups.append((t, t_o, c_o, c_i, d, w, starts))
    if groups:
        shifted_scalar = _token_groups(ts, groups, ins, tok_at, pos, p, scalars)
    n_cols = [len(i.planes) if i.kind == "input" else i.width for i in ins] + [1]
    for delta in sorted(scalars):
        rows: list[list[np.ndarray]] = [[] for _ in range(n_in)]
        cols: list[list[np.ndarray]] = [[] for _ in range(n_in)]
        vals: list[list[np.ndarray]] = [[] for _ in range(n_in)]
        for tt, r, c, w in scalars[delta]:
            for k in np.unique(tt):
                sel = tt == k
                rows[int(k)].append(r[sel])
                cols[int(k)].append(c[sel])
                vals[int(k)].append(w[sel])
        mats = []
        for t in range(n_in):
            if rows[t]:
                rr, cc, vv = (np.concatenate(x) for x in (rows[t], cols[t], vals[t]))
                mats.append(sp.csr_matrix((vv, (rr, cc)), shape=(ts.width, n_cols[t])))
            else:
                mats.append(sp.csr_matrix((ts.width, n_cols[t])))
        mats.append(sp.csr_matrix((ts.width, 1)))
        ts.parts.append(Part(delta, mats, giant=delta in ts.copy_of,
                             masked=delta in ts.copy_of, copy=ts.copy_of.get(delta, False)))
    if st.bias is not None and np.any(st.bias != 0):
        # a weight on the mask plane: a scalar per channel where the bias is the same on every
        # token, else a slot vector (a shifted bias is zero where the shift brings in padding)
        b = np.asarray(st.bias, dtype=np.float64)
        col = np.zeros(ts.width)
        for c in range(ts.width):
            sel = ts.elem_ct == c
            per_token = b[sel]
            if not np.any(per_token):
                continue
            if _one_value(per_token):
                col[c] = float(np.mean(per_token))
            else:
                vec = np.zeros(p)
                vec[ts.elem_pos[sel]] = per_token
                ts.vterms.append(VTerm(0, n_in, 0, c, vec))
        if np.any(col):
            zero = next((q for q in ts.parts if q.delta == 0), None)
            if zero is None:
                zero = Part(0, [sp.csr_matrix((ts.width, w)) for w in n_cols])
                ts.parts.insert(0, zero)
            zero.terms[-1] = sp.csr_matrix(col.reshape(-1, 1))
    ts.clean = tokens and not shifted_scalar and all(
        ins[t].clean for q in ts.parts if q.delta == 0
        for t, m in enumerate(q.terms[:-1]) if m.nnz)


def _token_groups(ts: TStep, groups: list[tuple[Any, ...]], ins: list[TStep],
                  tok_at: np.ndarray, pos: np.ndarray, p: int,
                  scalars: dict[int, list[Any]]) -> bool:
    """Token-to-token terms of a step, grouped by (input, offset, output channel, input
    channel): scalars where each group is one weight on every token whose source is a token
    (rotated groups reading clean inputs only); else, where every rotated group is one weight,
    masked parts (two levels) with the border either zero or copied, whichever explains the
    unrotated weights; else slot vectors for the groups that are not scalars. Returns whether
    unmasked rotated scalars were used (the result is then dirty)."""
    n_tok = int(pos.size)
    src_ok = {}

    def valid_from(dv: int) -> np.ndarray:
        if dv not in src_ok:
            src_ok[dv] = tok_at[(pos + dv) % p] >= 0
        return src_ok[dv]

    rec = []        # per group: t, d, c_o, c_i, weight, full, same, slice
    for t, t_o, c_o, c_i, d, w, starts in groups:
        ends = np.r_[starts[1:], t_o.size]
        wmin = np.minimum.reduceat(w, starts)
        wmax = np.maximum.reduceat(w, starts)
        for g, (a, b) in enumerate(zip(starts, ends)):
            dv = int(d[a])
            full = (b - a) == int(valid_from(dv).sum())
            same = wmax[g] - wmin[g] <= SCALAR_RTOL * max(abs(wmax[g]), abs(wmin[g]))
            rec.append((t, dv, int(c_o[a]), int(c_i[a]), 0.5 * (wmin[g] + wmax[g]), full, same,
                        t_o[a:b], w[a:b]))
    plain = all(f and s_ and (dv == 0 or ins[t].clean) for t, dv, _, _, _, f, s_, _, _ in rec)
    rotated_one = all(f and s_ for _, dv, _, _, _, f, s_, _, _ in rec if dv != 0)
    if not plain and rotated_one:
        # the unrotated weights per channel pair over tokens, less each rotated weight on the
        # tokens whose source is padding where the border is copied
        pairs = sorted({(t, co, ci) for t, _, co, ci, *_ in rec})
        index = {pr: i for i, pr in enumerate(pairs)}
        zero = np.zeros((len(pairs), n_tok))
        border = np.zeros((len(pairs), n_tok))
        for t, dv, co, ci, wv, _, _, to, ws in rec:
            if dv == 0:
                zero[index[(t, co, ci)], to] += ws
            else:
                border[index[(t, co, ci)]] += wv * ~valid_from(dv)
        for copy in (True, False):
            resid = zero - border if copy else zero
            hi, lo = resid.max(axis=1), resid.min(axis=1)
            size = np.maximum(np.abs(zero).max(axis=1), np.abs(border).max(axis=1))
            if np.all(hi - lo <= 64 * SCALAR_RTOL * size):
                for (t, co, ci), v in zip(pairs, 0.5 * (hi + lo)):
                    if v != 0:
                        scalars.setdefault(0, []).append((np.array([t]), np.array([co]),
                                                          np.array([ci]), np.array([v])))
                for t, dv, co, ci, wv, *_ in rec:
                    if dv != 0:
                        scalars.setdefault(dv, []).append((np.array([t]), np.array([co]),
                                                           np.array([ci]), np.array([wv])))
                        ts.copy_of[dv] = copy
                return False
    shifted = False
    for t, dv, co, ci, wv, full, same, to, ws in rec:
        if full and same and (dv == 0 or ins[t].clean):
            scalars.setdefault(dv, []).append((np.array([t]), np.array([co]), np.array([ci]),
                                               np.array([wv])))
            shifted |= dv != 0
        else:
            vec = np.zeros(p)
            vec[pos[to]] = ws
            ts.vterms.append(VTerm(dv, t, ci, co, vec))
    return shifted


def _choose_giants(plan: TokenPlan, giant: dict[int, list[int]] | None) -> None:
    """Per step and offset, rotate the partial sums (giant) where that is fewer rotations than
    rotating the inputs (or where ``giant`` says so)."""
    for si, st in enumerate(plan.steps):
        if st.kind != "affine":
            continue
        for d in {q.delta for q in st.parts} | {v.delta for v in st.vterms}:
            if d == 0:
                continue
            if d in st.copy_of:
                g = True                        # masked parts rotate their partial sums
            elif giant is not None:
                g = d in giant.get(si, [])
            else:
                g = len(_outputs_at(st, d)) < len(_inputs_at(st, d))
            if not any(q.delta == d for q in st.parts):
                st.parts.append(Part(d, [sp.csr_matrix((st.width, plan.steps[j].width))
                                         for j in st.inputs] + [sp.csr_matrix((st.width, 1))]))
            for q in st.parts:
                if q.delta == d:
                    q.giant = g


def chosen_giants(plan: TokenPlan) -> dict[int, list[int]]:
    return {si: sorted(q.delta for q in st.parts if q.giant)
            for si, st in enumerate(plan.steps) if any(q.giant for q in st.parts)}


# --------------------------------------------------------------------------- simulation
def simulate_tokens(plan: TokenPlan, x: np.ndarray) -> np.ndarray:
    """Float64 evaluation of the plan on slot vectors (``x``: ``(B, n_input)``, at most
    ``interleave`` samples), rotations as cyclic shifts: the layout, the decomposition and the
    padding rules, without encryption. Returns ``(B, n_output)``."""
    k = plan.interleave
    b = x.shape[0]
    if b > k:
        raise ValueError(f"at most {k} samples per group")
    vecs = encode_inputs(plan, x)
    vals: list[list[np.ndarray] | None] = [None] * len(plan.steps)
    vals[0] = [v for v in vecs[:-1]]
    mask = vecs[-1]

    def rot(v: np.ndarray, d: int) -> np.ndarray:
        return np.roll(v, -d * k)

    for si, st in enumerate(plan.steps):
        if st.kind == "input":
            continue
        xs = [vals[j] for j in st.inputs]
        if st.kind == "mul":
            vals[si] = [a * b_ for a, b_ in zip(xs[0], xs[1])]
        elif st.kind == "mul_int":
            vals[si] = [st.factor * a for a in xs[0]]
        else:
            out = [np.zeros(plan.slots) for _ in range(st.width)]
            srcs = xs + [[mask]]
            for q in st.parts:
                sums: dict[int, np.ndarray] = {}
                for t, m in enumerate(q.terms):
                    m = m.tocoo()
                    for r, c, w in zip(m.row, m.col, m.data):
                        sums[int(r)] = sums.get(int(r), 0.0) + w * srcs[t][c]
                if q.masked:
                    inner, border = (np.repeat(v, k) for v in plan.part_masks(q.delta))
                    for r, v in sums.items():
                        out[r] += inner * rot(v, q.delta) + (border * v if q.copy else 0.0)
                else:
                    for r, v in sums.items():
                        out[r] += rot(v, q.delta)
            for v in st.vterms:
                out[v.c_out] += np.repeat(v.diag, k) * rot(srcs[v.src][v.c_in], v.delta)
            red: dict[int, np.ndarray] = {}
            for rt in st.rterms:
                red[rt.r_out] = red.get(rt.r_out, 0.0) + np.repeat(rt.w, k) * xs[rt.src][rt.c_in]
            for r, acc in red.items():
                for bit in range(int(math.log2(plan.period))):
                    acc = acc + rot(acc, 1 << bit)
                out[r] += acc
            if st.free and st.bias is not None:
                out = [o + bv * mask for o, bv in zip(out, _free_bias(st))]
            vals[si] = out
    return decode_outputs(plan, vals[plan.output], b)  # type: ignore[arg-type]


def _free_bias(st: TStep) -> np.ndarray:
    assert st.bias is not None and st.elem_ct is not None
    out = np.zeros(st.width)
    out[st.elem_ct] = st.bias
    return out


def encode_inputs(plan: TokenPlan, x: np.ndarray) -> list[np.ndarray]:
    """The slot vectors the client encrypts for ``x`` (``(B, n_input)``, ``B <= interleave``):
    the input planes, then the mask plane."""
    k = plan.interleave
    b = x.shape[0]
    ext = np.concatenate([x, np.zeros((b, 1)), np.ones((b, 1))], axis=1)
    out = []
    for idx in plan.input_layout:
        vec = np.zeros((idx.size, k))
        col = np.where(idx == ONE, x.shape[1] + 1, np.where(idx < 0, x.shape[1], idx))
        vec[:, :b] = ext[:, col].T
        out.append(vec.ravel())
    return out


def decode_outputs(plan: TokenPlan, outs: Sequence[np.ndarray], b: int) -> np.ndarray:
    """``(B, n_output)`` from the output ciphertexts' slot vectors."""
    st = plan.steps[plan.output]
    k = plan.interleave
    assert st.elem_ct is not None and st.elem_pos is not None
    mat = np.stack([np.asarray(o).reshape(-1, k) for o in outs])    # (width, p, k)
    return mat[st.elem_ct, st.elem_pos, :b].T


# --------------------------------------------------------------------------- counts
def _part_step(q: Part) -> Step:
    return Step("affine", (), (q.terms[0].shape[0],), terms=list(q.terms))


def token_step_counts(plan: TokenPlan, si: int, moduli: Sequence[Sequence[int]],
                      scale: float, fanin: int
                      ) -> list[tuple[int, dict[str, float]]]:
    """Primitive counts of one step per group, as ``(level, counts)`` pairs (the level whose
    primes they run on): scalar parts as :func:`he.plan.batch_step_counts` counts batch
    packing's fused rows, slot-vector weights and masks as plaintext products, rotations,
    products and one rescale per output."""
    from he.plan import batch_step_counts

    st = plan.steps[si]
    if st.kind == "input":
        return []
    top = max(plan.levels[j] for j in st.inputs)
    if st.kind == "mul":
        return [(top, {"mul_ct": st.width, "rescale": st.width})]
    if st.kind == "mul_int":
        return [(top, {"mul_plain": st.width})]
    if st.free:
        return [(top, {"add": st.width * len(st.inputs)})]
    lc = top + 1 if st.copy_of else top
    out: list[tuple[int, dict[str, float]]] = []
    main: dict[str, float] = {"rotate": 0, "mul_plain": 0, "add": 0, "rescale": st.width}
    for q in st.parts:
        at = top if q.masked else lc
        ins = [np.ones(m.shape[1], dtype=bool) for m in q.terms]
        written = np.zeros(st.width, dtype=bool)
        written[list(_part_rows(q))] = True
        c = batch_step_counts(_part_step(q), written, ins, moduli[at], scale, fanin)
        rows = int(written.sum())
        if not q.masked:
            c["rescale"] = 0
        out.append((at, c))
        if q.masked:
            main["mul_plain"] += rows * (2 if q.copy else 1)
            main["add"] += rows * (2 if q.copy else 1)
        elif q.giant and q.delta:
            main["add"] += rows
    main["rotate"] = _rotations(st, plan.period)
    main["mul_plain"] += len(st.vterms) + len(st.rterms)
    main["add"] += len(st.vterms) + len(st.rterms)
    main["add"] += len({r.r_out for r in st.rterms}) * int(math.log2(plan.period))
    out.append((lc, main))
    return out


def plaintexts_held(plan: TokenPlan) -> list[tuple[int, int]]:
    """``(count, level)`` of the slot vectors a server keeps encoded: weights, masks, biases."""
    out: list[tuple[int, int]] = []
    for si, st in enumerate(plan.steps):
        if st.kind != "affine" or (st.free and st.bias is None):
            continue
        top = max(plan.levels[j] for j in st.inputs)
        lc = top + 1 if st.copy_of else top
        n = len(st.vterms) + len(st.rterms) + sum(1 + q.copy for q in st.parts if q.masked)
        if st.free:
            n = st.width
        if n:
            out.append((n, lc))
    return out


def peak_ciphertexts(plan: TokenPlan) -> int:
    """Most ciphertexts a group holds at once: the live values, the step being computed (its
    inputs' rotated copies and its sums) and the input planes."""
    steps = plan.steps
    last = [i for i in range(len(steps))]
    for si, st in enumerate(steps):
        for j in st.inputs:
            last[j] = max(last[j], si)
    last[plan.output] = len(steps)
    peak = 0
    for si, st in enumerate(steps):
        live = sum(steps[j].width for j in range(si) if last[j] >= si)
        extra = st.width * 2
        if st.kind == "affine":
            extra += sum(steps[j].width for q in st.parts if q.delta and not q.giant
                         for j in st.inputs)
        peak = max(peak, live + extra + len(plan.input_layout))
    return peak


# --------------------------------------------------------------------------- runtime
class TokenKernels:
    """What a server keeps between groups: fused integer maps and encoded slot vectors (weights
    and masks, each encoded once at the level and scale it is used at)."""

    def __init__(self, eng: Any, plan: TokenPlan):
        self.eng = eng
        self.plan = plan
        self.fused: dict[Any, Any] = {}
        self.scalars: dict[tuple[float, int, float], Any] = {}
        self.vectors: dict[tuple[Any, int, float], Any] = {}

    def vector(self, key: Any, values: Callable[[], np.ndarray], level: int, scale: float
               ) -> Any:
        k = (key, level, scale)
        if k not in self.vectors:
            self.vectors[k] = self.eng.encode_vector(np.repeat(values(), self.plan.interleave),
                                                     level, scale)
        return self.vectors[k]

    def scalar(self, w: float, level: int, scale: float) -> Any:
        """An encoded scalar weight, kept while :data:`he.runtime.PLAIN_CACHE_BYTES` holds them
        (batch packing's rule)."""
        from he.runtime import _plain_cache_size

        k = (w, level, scale)
        if k not in self.scalars:
            if len(self.scalars) >= _plain_cache_size(self.eng, level):
                self.scalars.clear()
            self.scalars[k] = self.eng.encode_scalar(w, level, scale)
        return self.scalars[k]


def _at_level(eng: Any, e: Any, level: int) -> Any:
    """``e`` read at ``level``'s primes (a copy switched down, its scale kept)."""
    if eng.level(e) == level:
        return e
    out = eng.new_ciphertext()
    eng.evaluator.mod_switch_to(e, eng.parms_ids[level], out)
    return out


def _scalar_sums(eng: Any, uid: Any, mats: Sequence[sp.csr_matrix], srcs: list[list[Any]],
                 level: int, kern: TokenKernels, buffers: Any, fanin: int) -> list[Any]:
    """``sum_t mats[t] @ srcs[t]`` per output row at the product scale of ``level`` (not
    rescaled; None where a row has no ciphertext term): fused integer products for the rows
    :func:`he.runtime._fused_rows` takes, SEAL's plaintext products for the rest."""
    from he.runtime import _fused_rows, _is_ct

    width = mats[0].shape[0]
    st = Step("affine", (), (width,), terms=list(mats))
    rows = np.ones(width, dtype=bool)
    partial = np.zeros(width)
    out: list[Any] = [None] * width
    for r, e in _fused_rows(eng, uid, st, srcs, rows, level, fanin, kern.fused, buffers,
                            partial).items():
        out[r] = e if _is_ct(e) else None
    scale = eng.scales[level]
    # rows the fused maps did not take
    taken = {r for r, e in enumerate(out) if e is not None}
    for r in range(width):
        if r in taken:
            continue
        acc = None
        for t, m in enumerate(mats):
            lo, hi = m.indptr[r], m.indptr[r + 1]
            for c, w in zip(m.indices[lo:hi], m.data[lo:hi]):
                e = srcs[t][int(c)]
                if not _is_ct(e) or abs(w) * scale < 0.5:
                    continue
                e = _at_level(eng, e, level)
                at = scale if e.scale == scale else scale * scale / e.scale
                term = eng.mul_plain(e, kern.scalar(float(w), level, at))
                if acc is None:
                    acc = term
                else:
                    eng.add_inplace(acc, term)
        out[r] = acc
    return out

def run_tokens(eng: Any, plan: TokenPlan, kern: TokenKernels, inputs: Sequence[Any],
               fanin: int | None = None) -> list[Any]:
    """Evaluate ``plan`` on one group's input ciphertexts (the planes, then the mask plane);
    returns the output value's ciphertexts (one per channel or element; ``0.0`` for one that
    is identically zero)."""
    from he.fused import FUSED_MIN_FANIN
    from he.runtime import _Buffers, _is_ct, _mul_step

    fanin = FUSED_MIN_FANIN if fanin is None else int(fanin)
    steps = plan.steps
    if len(inputs) != len(plan.input_layout):
        raise ValueError(f"a group holds {len(inputs)} input ciphertexts, expected "
                         f"{len(plan.input_layout)}")
    buffers = _Buffers()
    mask = inputs[-1]
    remaining = [0] * len(steps)
    for st in steps:
        for j in set(st.inputs):
            remaining[j] += 1
    vals: list[list[Any] | None] = [None] * len(steps)
    vals[0] = list(inputs[:-1])
    levels = plan.levels
    for si, st in enumerate(steps):
        if st.kind == "input":
            continue
        xs = [vals[j] for j in st.inputs]
        if st.kind == "mul":
            rows = np.ones(st.width, dtype=bool)
            vals[si] = _mul_step(eng, xs[0], xs[1], rows, buffers)
        elif st.kind == "mul_int":
            vals[si] = [eng.mul_int(e, int(st.factor)) if _is_ct(e) else e * st.factor
                        for e in xs[0]]
        elif st.free:
            vals[si] = _free_step(eng, plan, kern, si, st, xs, levels)
        else:
            vals[si] = _affine_step(eng, plan, kern, si, st, xs, mask, buffers, fanin)
        for j in set(st.inputs):
            remaining[j] -= 1
            if remaining[j] == 0 and j != plan.output and j != 0:
                vals[j] = None
    out = vals[plan.output]
    assert out is not None
    return out


def _free_step(eng: Any, plan: TokenPlan, kern: TokenKernels, si: int, st: TStep,
               xs: list[Any], levels: list[int]) -> list[Any]:
    from he.runtime import _is_ct

    level = levels[si]
    out: list[Any] = []
    for c in range(st.width):
        acc = None
        for x in xs:
            e = x[c]
            if not _is_ct(e):
                continue
            e = eng.lift(e, level) if eng.level(e) != level else e
            acc = e if acc is None else eng.add(acc, e)
        out.append(acc if acc is not None else 0.0)
    if st.bias is not None:
        bias = _free_bias(st)
        valid = (plan.tok_at >= 0).astype(np.float64) if st.tokens else \
            (np.arange(plan.period) == 0).astype(np.float64)
        for c in range(st.width):
            if bias[c] != 0 and _is_ct(out[c]):
                pt = kern.vector(("bias", si, c), lambda c=c: bias[c] * valid, level,
                                 out[c].scale)
                out[c] = eng.add_plain(out[c], pt)
    return out


def _affine_step(eng: Any, plan: TokenPlan, kern: TokenKernels, si: int, st: TStep,
                 xs: list[Any], mask: Any, buffers: Any, fanin: int) -> list[Any]:
    """A weighted map: scalar parts (rotated inputs, rotated partial sums, masked partial
    sums), slot-vector terms and reductions, summed at the product scale of the step's
    computing level and rescaled once per output."""
    from he.runtime import _is_ct

    k = plan.interleave
    pmap = eng.pool.map
    srcs = [list(x) for x in xs] + [[mask]]
    top = max(plan.levels[j] for j in st.inputs)
    lc = top + 1 if st.copy_of else top          # the level the outputs are summed at
    prod = eng.scales[lc] ** 2
    acc: list[Any] = [None] * st.width

    def add(r: int, e: Any) -> None:
        if e is None:
            return
        if acc[r] is None:
            acc[r] = e
        else:
            eng.add_inplace(acc[r], e)

    for pi, q in enumerate(st.parts):
        uid = (si, pi)
        if q.delta == 0:
            for r, e in enumerate(_scalar_sums(eng, uid, q.terms, srcs, lc, kern, buffers,
                                               fanin)):
                add(r, e)
        elif q.masked:
            sums = _scalar_sums(eng, uid, q.terms, srcs, top, kern, buffers, fanin)
            inner, border = plan.part_masks(q.delta)
            pt_in = kern.vector(("inner", q.delta), lambda: inner, lc, eng.scales[lc])
            pt_b = kern.vector(("border", q.delta), lambda: border, lc, eng.scales[lc]) \
                if q.copy and border.any() else None
            rows = [r for r, e in enumerate(sums) if e is not None]
            scaled = _finish(eng, buffers, [sums[r] for r in rows], top)
            for r, s, rot in zip(rows, scaled, pmap(lambda s: eng.rotate(s, q.delta * k),
                                                     scaled)):
                add(r, eng.mul_plain(rot, pt_in))
                if pt_b is not None:
                    add(r, eng.mul_plain(s, pt_b))
        elif q.giant:
            sums = _scalar_sums(eng, uid, q.terms, srcs, lc, kern, buffers, fanin)
            rows = [r for r, e in enumerate(sums) if e is not None]
            for r, rot in zip(rows, pmap(lambda e: eng.rotate(e, q.delta * k),
                                         [sums[r] for r in rows])):
                add(r, rot)
        else:
            rotated = []
            for t, m in enumerate(q.terms):
                need = set(np.unique(m.tocoo().col).tolist())
                cols = [c for c, e in enumerate(srcs[t]) if c in need and _is_ct(e)]
                done = dict(zip(cols, pmap(
                    lambda e: eng.rotate(_at_level(eng, e, lc), q.delta * k),
                    [srcs[t][c] for c in cols])))
                rotated.append([done.get(c, 0.0) for c in range(len(srcs[t]))])
            for r, e in enumerate(_scalar_sums(eng, uid, q.terms, rotated, lc, kern, buffers,
                                               fanin)):
                add(r, e)
    switched: dict[tuple[int, int], Any] = {}

    def at_lc(t: int, c: int) -> Any:
        """Input ``c`` of source ``t`` read at the step's primes, switched down once per step
        (the slot-vector terms and the reductions read each input for many outputs)."""
        if (t, c) not in switched:
            switched[(t, c)] = _at_level(eng, srcs[t][c], lc)
        return switched[(t, c)]

    for vi, v in enumerate(st.vterms):
        if not _is_ct(srcs[v.src][v.c_in]):
            continue
        e = at_lc(v.src, v.c_in)
        if v.delta:
            e = eng.rotate(e, v.delta * k)
        pt = kern.vector(("v", si, vi), lambda v=v: v.diag, lc, prod / e.scale)
        add(v.c_out, eng.mul_plain(e, pt))
    red: dict[int, Any] = {}
    for ri, rt in enumerate(st.rterms):
        if not _is_ct(srcs[rt.src][rt.c_in]):
            continue
        e = at_lc(rt.src, rt.c_in)
        pt = kern.vector(("r", si, ri), lambda rt=rt: rt.w, lc, prod / e.scale)
        term = eng.mul_plain(e, pt)
        if rt.r_out in red:
            eng.add_inplace(red[rt.r_out], term)
        else:
            red[rt.r_out] = term
    def tree(e: Any) -> Any:
        for bit in range(int(math.log2(plan.period))):
            e = eng.add(e, eng.rotate(e, (1 << bit) * k))
        return e

    for r, e in zip(red, pmap(tree, list(red.values()))):
        add(r, e)
    rows = [r for r, a in enumerate(acc) if a is not None]
    out: list[Any] = [0.0] * st.width
    for r, res in zip(rows, _finish(eng, buffers, [acc[r] for r in rows], lc)):
        out[r] = res
    return out


def _finish(eng: Any, buffers: Any, cts: list[Any], level: int) -> list[Any]:
    """Products summed at ``level`` rescaled to the next, on the engine's threads."""
    from he.runtime import _threaded

    return _threaded(eng, buffers, cts, lambda a: (
        a, level + 1, lambda into: eng.to_level(a, level + 1, into=into)))
