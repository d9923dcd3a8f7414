"""Lowering a polynomial program to the steps of the two CKKS packings.

**Batch packing** evaluates the program's nodes directly (one sample per slot); this module only
counts its levels (:func:`batch_levels`).

**Vector packing** keeps one sample per ciphertext: a value with ``n`` elements sits in slots
``[0, n)``, zero-padded to its *period* ``p = next_pow2(n)`` and repeated across all slots, so a
cyclic rotation of the whole ciphertext is a cyclic rotation of the value modulo ``p``. Every
affine node (linear, gather, non-integer constant scale, constant shift, and sums of those) is
composed into a pending sparse affine map ``y = sum_k A_k x_k + b`` and only materialised when a
ciphertext product, the output or a shared value needs it, so gather/linear/gather chains cost
one level. A materialised map is evaluated by the diagonal method with baby-step/giant-step
rotations (:class:`MatVec`); a map with more outputs than inputs, or fewer, works in the larger of
the two periods and folds the result with ``log2(p_in / p_out)`` rotations. When the first map
reads only the input and each output uses few inputs (convolutions, patch embeddings), the client
encrypts the input as *planes* (plane ``t`` holds, for every output, its ``t``-th input), so the
server needs no rotation for it at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

from polynets.program import PolyProgram

__all__ = ["batch_levels", "int_scalar", "MatVec", "VStep", "VectorPlan", "plan_vector",
           "next_pow2"]


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def int_scalar(value: np.ndarray) -> int | None:
    """The integer ``k`` if ``value`` is one integer repeated (a level-free multiplication)."""
    v = np.asarray(value, dtype=np.float64).ravel()
    if v.size == 0 or not np.all(v == v[0]):
        return None
    k = float(v[0])
    return int(k) if k == round(k) and abs(k) < 2 ** 20 else None


def batch_levels(program: PolyProgram) -> list[int]:
    """Levels (rescales) of every node in batch packing."""
    levels: list[int] = []
    for node in program.nodes:
        ins = [levels[j] for j in node.inputs]
        if node.op == "input":
            lv = 0
        elif node.op == "linear":
            lv = ins[0] + 1
        elif node.op == "mul":
            lv = max(ins) + 1
        elif node.op == "mul_const":
            v = np.asarray(node.attrs["value"], dtype=np.float64)
            lv = ins[0] + (0 if np.all(v == np.round(v)) else 1)
        else:
            lv = max(ins)
        levels.append(lv)
    return levels


# ----------------------------------------------------------------------------- diagonal method
@dataclass
class MatVec:
    """``y = A x`` on periodic slot vectors by the BSGS diagonal method.

    ``groups[g]`` maps a baby step ``b`` to a diagonal (already rotated by ``-giant[g]`` and
    tiled to the slot count); the result is ``sum_g rot(sum_b diag * rot(x, b), giant[g])``,
    then folded by the rotations in ``folds``.
    """

    p_in: int
    p_out: int
    giants: list[int]
    groups: list[dict[int, np.ndarray]]
    folds: list[int]

    @property
    def babies(self) -> list[int]:
        return sorted({b for g in self.groups for b in g})

    def rotations(self, include_babies: bool = True) -> set[int]:
        steps = set(self.giants) | set(self.folds)
        if include_babies:
            steps |= set(self.babies)
        return {s for s in steps if s}

    @property
    def n_diagonals(self) -> int:
        return sum(len(g) for g in self.groups)


def _diagonals(a: sp.csr_matrix, p_in: int, p_out: int) -> tuple[dict[int, np.ndarray], int]:
    """Diagonals ``d -> vector of length P`` of ``a`` (p_out x p_in padded) and P."""
    coo = a.tocoo()
    r, c, v = coo.row.astype(np.int64), coo.col.astype(np.int64), coo.data
    if p_out >= p_in:
        big = p_out
        rows = r
        d = (c - r) % p_in
    else:
        big = p_in
        t = ((c - r) % p_in) // p_out
        rows = r + t * p_out
        d = (c - rows) % p_in
    diags: dict[int, np.ndarray] = {}
    for dd in np.unique(d):
        sel = d == dd
        vec = np.zeros(big)
        np.add.at(vec, rows[sel], v[sel])
        if np.any(vec):
            diags[int(dd)] = vec
    return diags, big


def make_matvec(a: sp.csr_matrix, p_in: int, p_out: int, slots: int) -> MatVec:
    """Plan ``a`` (shape (n_out, n_in)) for inputs of period ``p_in`` and outputs of ``p_out``.

    The baby-step size ``n1`` (a power of two, in units of the gcd of the diagonal offsets)
    minimises the number of distinct rotations, baby plus giant.
    """
    diags, big = _diagonals(a, p_in, p_out)
    keys = sorted(diags)
    step = 0
    for d in keys:
        step = math.gcd(step, d)
    step = step or 1
    span = (max(keys) // step + 1) if keys else 1
    best: tuple[int, int] | None = None
    for n1 in [1 << k for k in range(0, max(1, span).bit_length() + 1)]:
        babies = {(d // step) % n1 for d in keys}
        giants = {(d // step) // n1 for d in keys}
        cost = len(babies - {0}) + len(giants - {0})
        if best is None or cost < best[0]:
            best = (cost, n1)
    n1 = best[1] if best else 1
    reps = slots // big
    by_giant: dict[int, dict[int, np.ndarray]] = {}
    for d in keys:
        g, b = divmod(d // step, n1)
        shift = g * n1 * step
        by_giant.setdefault(shift, {})[b * step] = np.tile(np.roll(diags[d], shift), reps)
    giants = sorted(by_giant)
    folds = []
    if p_out < p_in:
        s = p_out
        while s < p_in:
            folds.append(s)
            s *= 2
    return MatVec(p_in, p_out, giants, [by_giant[g] for g in giants], folds)


# ----------------------------------------------------------------------------- vector plan
@dataclass
class VStep:
    """One vector-packing step; ``kind`` in input, affine, planes, mul, mul_int."""

    kind: str
    inputs: tuple[int, ...]
    n: int
    level: int = 0
    matvecs: list[MatVec | None] = field(default_factory=list)   # None: identity term
    matrices: list[sp.csr_matrix] = field(default_factory=list)
    bias: np.ndarray | None = None
    factor: int = 1
    planes: list[np.ndarray] = field(default_factory=list)   # plaintext weights per input ct
    plane_folds: list[int] = field(default_factory=list)

    @property
    def period(self) -> int:
        return next_pow2(self.n)


@dataclass
class VectorPlan:
    """Steps of a vector-packed program, the client's input layout and the rotations used."""

    steps: list[VStep]
    output: int
    input_layout: list[np.ndarray]      # per input ciphertext: slot -> flat input index or -1
    output_shape: tuple[int, ...]

    @property
    def levels(self) -> int:
        return max(s.level for s in self.steps)

    def rotations(self) -> list[int]:
        steps: set[int] = set()
        for s in self.steps:
            for mv in s.matvecs:
                if mv is not None:
                    steps |= mv.rotations()
            steps |= set(s.plane_folds)
        return sorted(steps)

    @property
    def widest(self) -> int:
        return max(s.period for s in self.steps)

    def cost(self) -> dict[str, int]:
        mvs = [mv for s in self.steps for mv in s.matvecs if mv is not None]
        rot = sum(len(mv.rotations()) for mv in mvs) + sum(len(s.plane_folds) for s in self.steps)
        mults = sum(mv.n_diagonals for mv in mvs) + \
            sum(len(s.planes) for s in self.steps)
        return {"rotations": rot, "plain_mults": mults,
                "ct_mults": sum(s.kind == "mul" for s in self.steps),
                "input_ciphertexts": len(self.input_layout)}


@dataclass
class _Aff:
    terms: dict[int, sp.csr_matrix]
    bias: np.ndarray | None
    n: int


def _eye(n: int) -> sp.csr_matrix:
    return sp.identity(n, format="csr", dtype=np.float64)


def _is_identity(a: sp.csr_matrix) -> bool:
    return a.shape[0] == a.shape[1] and (a - _eye(a.shape[0])).count_nonzero() == 0


def _linear_matrix(shape: tuple[int, ...], axis: int, weight: np.ndarray) -> sp.csr_matrix:
    pre = int(np.prod(shape[:axis], dtype=np.int64))
    post = int(np.prod(shape[axis + 1:], dtype=np.int64))
    w = sp.csr_matrix(np.asarray(weight, dtype=np.float64).T)
    return sp.kron(sp.kron(_eye(pre), w), _eye(post), format="csr")


def _broadcast_matrix(src: tuple[int, ...], dst: tuple[int, ...]) -> sp.csr_matrix:
    n_src = int(np.prod(src, dtype=np.int64))
    idx = np.broadcast_to(np.arange(n_src).reshape(src), dst).ravel()
    n = idx.size
    return sp.csr_matrix((np.ones(n), (np.arange(n), idx)), shape=(n, n_src))


def _bias_along(shape: tuple[int, ...], axis: int, bias: np.ndarray) -> np.ndarray:
    view = [1] * len(shape)
    view[axis] = bias.shape[0]
    return np.broadcast_to(bias.reshape(view), shape).ravel().astype(np.float64)


def _compose(a: sp.csr_matrix, x: _Aff) -> _Aff:
    terms = {k: (a @ m).tocsr() for k, m in x.terms.items()}
    bias = None if x.bias is None else a @ x.bias
    return _Aff(terms, bias, a.shape[0])


def _sum(*affs: _Aff) -> _Aff:
    terms: dict[int, sp.csr_matrix] = {}
    bias = None
    for f in affs:
        for k, m in f.terms.items():
            terms[k] = (terms[k] + m).tocsr() if k in terms else m
        if f.bias is not None:
            bias = f.bias.copy() if bias is None else bias + f.bias
    return _Aff(terms, bias, affs[0].n)


def plan_vector(program: PolyProgram, slots: int, *, max_planes: int = 64,
                max_input_ciphertexts: int = 8) -> VectorPlan:
    """Lower ``program`` to vector-packing steps for ciphertexts of ``slots`` slots."""
    steps: list[VStep] = []
    users = program.consumers()

    def add_step(step: VStep) -> int:
        steps.append(step)
        return len(steps) - 1

    def materialise(f: _Aff) -> int:
        if len(f.terms) == 1:
            (src, m), = f.terms.items()
            if _is_identity(m) and (f.bias is None or not np.any(f.bias)):
                return src
        mvs = []
        srcs = []
        p_out = next_pow2(f.n)
        only_identity = True
        for src, m in f.terms.items():
            srcs.append(src)
            if _is_identity(m) and m.shape[0] == f.n:
                mvs.append(None)
            else:
                only_identity = False
                mvs.append(make_matvec(m, steps[src].period, p_out, slots))
        level = max(steps[s].level for s in srcs) + (0 if only_identity else 1)
        return add_step(VStep("affine", tuple(srcs), f.n, level, matvecs=mvs,
                              matrices=list(f.terms.values()), bias=f.bias))

    def ident(i: int) -> _Aff:
        return _Aff({i: _eye(steps[i].n)}, None, steps[i].n)

    vals: list[_Aff | None] = [None] * len(program.nodes)
    for i, node in enumerate(program.nodes):
        a = node.attrs
        ins = [vals[j] for j in node.inputs]
        shape = tuple(node.shape)
        if node.op == "input":
            val = ident(add_step(VStep("input", (), node.numel, 0)))
        elif node.op == "linear":
            src_shape = tuple(program.nodes[node.inputs[0]].shape)
            val = _compose(_linear_matrix(src_shape, a["axis"], a["weight"]), ins[0])
            if a.get("bias") is not None:
                b = _bias_along(shape, a["axis"], np.asarray(a["bias"], dtype=np.float64))
                val.bias = b if val.bias is None else val.bias + b
        elif node.op == "gather":
            index = np.asarray(a["index"]).ravel()
            sizes = [program.nodes[j].numel for j in node.inputs]
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            parts = []
            for k, f in enumerate(ins):
                sel = (index >= offsets[k]) & (index < offsets[k + 1])
                rows = np.nonzero(sel)[0]
                m = sp.csr_matrix((np.ones(rows.size), (rows, index[sel] - offsets[k])),
                                  shape=(index.size, sizes[k]))
                parts.append(_compose(m, f))
            val = _sum(*parts)
        elif node.op == "add_const":
            val = _Aff(dict(ins[0].terms), ins[0].bias, ins[0].n)
            b = np.broadcast_to(np.asarray(a["value"], dtype=np.float64), shape).ravel()
            val.bias = b.copy() if val.bias is None else val.bias + b
        elif node.op == "mul_const":
            k = int_scalar(a["value"])
            if k is not None:
                val = ident(add_step(VStep("mul_int", (materialise(ins[0]),), node.numel,
                                           0, factor=k)))
                steps[-1].level = steps[steps[-1].inputs[0]].level
            else:
                v = np.broadcast_to(np.asarray(a["value"], dtype=np.float64), shape).ravel()
                val = _compose(sp.diags(v, format="csr"), ins[0])
        elif node.op in ("add", "mul"):
            sa, sb = (tuple(program.nodes[j].shape) for j in node.inputs)
            fa = ins[0] if sa == shape else _compose(_broadcast_matrix(sa, shape), ins[0])
            fb = ins[1] if sb == shape else _compose(_broadcast_matrix(sb, shape), ins[1])
            if node.op == "add":
                val = _sum(fa, fb)
            else:
                same = node.inputs[0] == node.inputs[1]
                xa = materialise(fa)
                xb = xa if same else materialise(fb)
                lv = max(steps[xa].level, steps[xb].level) + 1
                val = ident(add_step(VStep("mul", (xa, xb), node.numel, lv)))
        else:
            raise ValueError(f"unknown op {node.op}")
        if len(users[i]) > 1:
            val = ident(materialise(val))
        vals[i] = val
    out = materialise(vals[program.output])
    plan = VectorPlan(steps, out, [], tuple(program.output_shape))
    _input_layout(plan, slots, max_planes, max_input_ciphertexts)
    return plan


def _input_layout(plan: VectorPlan, slots: int, max_planes: int, max_cts: int) -> None:
    """Client-side layout of the input; turns the input's only map into a planes step."""
    steps = plan.steps
    n_in = steps[0].n
    p = steps[0].period
    base = np.full(p, -1, dtype=np.int64)
    base[:n_in] = np.arange(n_in)
    plan.input_layout = [np.tile(base, slots // p)]
    readers = [i for i, s in enumerate(steps) if 0 in s.inputs]
    if len(readers) != 1 or plan.output == 0:
        return
    st = steps[readers[0]]
    if st.kind != "affine" or len(st.inputs) != 1 or st.matvecs[0] is None:
        return
    m = st.matrices[0].tocsr()
    m.sort_indices()
    nnz = np.diff(m.indptr)
    k = int(nnz.max()) if nnz.size else 0
    p_out = st.period
    if k == 0 or k > max_planes or p_out > slots:
        return
    per_ct = min(next_pow2(math.ceil(k / max_cts)), slots // p_out)
    n_cts = math.ceil(k / per_ct)
    if n_cts > max_cts:
        return
    layouts, weights = [], []
    for j in range(n_cts):
        idx = np.full(per_ct * p_out, -1, dtype=np.int64)
        w = np.zeros(per_ct * p_out)
        for t in range(per_ct):
            plane = j * per_ct + t
            rows = np.nonzero(nnz > plane)[0]
            cols = m.indices[m.indptr[rows] + plane]
            idx[t * p_out + rows] = cols
            w[t * p_out + rows] = m.data[m.indptr[rows] + plane]
        reps = slots // (per_ct * p_out)
        layouts.append(np.tile(idx, reps))
        weights.append(np.tile(w, reps))
    folds = []
    s = p_out
    while s < per_ct * p_out:
        folds.append(s)
        s *= 2
    st.kind = "planes"
    st.planes = weights
    st.plane_folds = folds
    st.matvecs = []
    plan.input_layout = layouts


def plan_summary(plan: VectorPlan) -> dict[str, Any]:
    return {"steps": len(plan.steps), **plan.cost(), "rotation_keys": len(plan.rotations()),
            "levels": plan.levels}
