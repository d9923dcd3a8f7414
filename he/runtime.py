"""The two CKKS interpreters of a polynomial program.

* :func:`run_batch`: batch packing. A value of sample shape ``S`` is a flat list of ``prod(S)``
  elements, each a SEAL ciphertext (one sample per slot) or a Python float (a value known in the
  clear, e.g. a zero from padding or a constant). Linear maps are sums of plaintext-scalar
  products rescaled once per output; zero weights are skipped; gathers are reindexing.
* :func:`run_vector`: vector packing over a :class:`~he.plan.VectorPlan` with plaintexts encoded
  once by :class:`VectorKernels`.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
from tqdm.auto import tqdm

from he.backend import Engine
from he.plan import MatVec, VectorPlan
from polynets.program import PolyProgram

__all__ = ["live_inputs", "run_batch", "VectorKernels", "run_vector"]

Elem = Any  # a seal.Ciphertext or a float


def _is_ct(e: Elem) -> bool:
    return not isinstance(e, float)


def _scale_elem(eng: Engine, e: Elem, v: float) -> Elem:
    if not _is_ct(e):
        return e * v
    if v == 0.0:
        return 0.0
    if v == round(v) and abs(v) < 2 ** 20:
        return eng.mul_int(e, int(v))
    return eng.rescale(eng.mul_scalar(e, v))


def _add_elem(eng: Engine, a: Elem, b: Elem) -> Elem:
    if _is_ct(a) and _is_ct(b):
        return eng.add(a, b)
    if _is_ct(a):
        return eng.add_plain_scalar(a, b) if b != 0.0 else a
    if _is_ct(b):
        return eng.add_plain_scalar(b, a) if a != 0.0 else b
    return a + b


def _mul_elem(eng: Engine, a: Elem, b: Elem) -> Elem:
    if _is_ct(a) and _is_ct(b):
        return eng.multiply(a, b)
    if _is_ct(a):
        return _scale_elem(eng, a, b)
    return _scale_elem(eng, b, a)


def _linear_batch(eng: Engine, x: list[Elem], shape: tuple[int, ...], axis: int,
                  weight: np.ndarray, bias: np.ndarray | None) -> list[Elem]:
    pre = int(np.prod(shape[:axis], dtype=np.int64))
    k = shape[axis]
    post = int(np.prod(shape[axis + 1:], dtype=np.int64))
    n = weight.shape[1]
    cts = [e for e in x if _is_ct(e)]
    level = max((eng.level(c) for c in cts), default=0)
    xs = np.empty(len(x), dtype=object)
    xs[:] = [eng.lift(e, level) if _is_ct(e) else e for e in x]
    xs = xs.reshape(pre, k, post)
    scale = eng.scales[level]
    out = np.empty((pre, n, post), dtype=object)
    term = eng.new_ciphertext()
    for j in range(n):
        nz = np.nonzero(weight[:, j])[0]
        # each weight of this output column encoded once, reused at every (pre, post) position
        plain = {int(i): eng.encode_scalar(float(weight[i, j]), level, scale) for i in nz
                 if any(_is_ct(e) for e in xs[:, i, :].ravel())}
        b0 = float(bias[j]) if bias is not None else 0.0
        for a in range(pre):
            for c in range(post):
                acc = None
                const = b0
                for i in nz:
                    e = xs[a, i, c]
                    if not _is_ct(e):
                        const += float(weight[i, j]) * e
                    elif acc is None:
                        acc = eng.mul_plain(e, plain[i])
                    else:
                        eng.mul_plain_into(e, plain[i], term)
                        eng.add_inplace(acc, term)
                if acc is None:
                    out[a, j, c] = const
                else:
                    res = eng.rescale(acc)
                    out[a, j, c] = eng.add_plain_scalar(res, const) if const != 0.0 else res
    return list(out.ravel())


def _broadcast(elems: list[Elem], src: tuple[int, ...], dst: tuple[int, ...]) -> list[Elem]:
    if tuple(src) == tuple(dst):
        return elems
    idx = np.broadcast_to(np.arange(len(elems)).reshape(src), dst).ravel()
    return [elems[i] for i in idx]


def _unbroadcast(live: np.ndarray, src: tuple[int, ...]) -> np.ndarray:
    """Liveness of an operand of shape ``src`` broadcast to ``live``'s shape (any over copies)."""
    pad = (1,) * (live.ndim - len(src)) + tuple(src)
    axes = tuple(d for d, (s, t) in enumerate(zip(pad, live.shape)) if s == 1 and t != 1)
    return live.any(axis=axes, keepdims=True).reshape(src)


def live_inputs(program: PolyProgram) -> np.ndarray:
    """Mask over the flat input elements that can reach the output (bool, ``prod(input shape)``).

    An element is dead when every path from it meets a zero weight or a gather that drops it
    (e.g. pixels a strided convolution never covers); batch packing neither encrypts nor sends it.
    Which elements are dead depends on the public program only, never on the data.
    """
    nodes = program.nodes
    live: list[np.ndarray | None] = [None] * len(nodes)
    live[program.output] = np.ones(nodes[program.output].shape, dtype=bool)
    for i in range(len(nodes) - 1, -1, -1):
        node, out = nodes[i], live[i]
        if out is None or node.op == "input":
            continue
        shapes = [tuple(nodes[j].shape) for j in node.inputs]
        if node.op == "linear":
            w = np.asarray(node.attrs["weight"]) != 0
            axis = node.attrs["axis"]
            moved = np.moveaxis(out, axis, -1).astype(np.int64)
            grads = [np.moveaxis((moved @ w.T.astype(np.int64)) > 0, -1, axis)]
        elif node.op == "gather":
            flat = np.zeros(sum(int(np.prod(s, dtype=np.int64)) for s in shapes), dtype=bool)
            idx = np.asarray(node.attrs["index"]).ravel()
            np.logical_or.at(flat, idx[idx >= 0], out.ravel()[idx >= 0])
            bounds = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for s in shapes])
            grads = [flat[lo:hi].reshape(s) for lo, hi, s in zip(bounds[:-1], bounds[1:], shapes)]
        else:
            grads = [_unbroadcast(out, s) for s in shapes]
        for j, g in zip(node.inputs, grads):
            live[j] = g if live[j] is None else live[j] | g
    mask = live[program.input_id]
    size = int(np.prod(nodes[program.input_id].shape, dtype=np.int64))
    return np.zeros(size, dtype=bool) if mask is None else mask.ravel()


def run_batch(eng: Engine, program: PolyProgram, inputs: list[Any],
              progress: bool = False) -> list[Elem]:
    """Evaluate ``program`` on one group of batch-packed input ciphertexts (flat input order;
    dead inputs, see :func:`live_inputs`, may be given as ``0.0``)."""
    users = program.consumers()
    remaining = [len(u) for u in users]
    vals: list[list[Elem] | None] = [None] * len(program.nodes)
    nodes = program.nodes
    # no bar object at all without progress: this also runs in forked workers
    steps = tqdm(nodes, desc="batch nodes", leave=False) if progress else nodes
    for i, node in enumerate(steps):
        a = node.attrs
        shape = tuple(node.shape)
        ins = [vals[j] for j in node.inputs]
        if node.op == "input":
            out = list(inputs)
        elif node.op == "linear":
            src = tuple(nodes[node.inputs[0]].shape)
            out = _linear_batch(eng, ins[0], src, a["axis"], np.asarray(a["weight"], np.float64),
                                None if a.get("bias") is None else np.asarray(a["bias"], float))
        elif node.op in ("mul", "add"):
            xa = _broadcast(ins[0], tuple(nodes[node.inputs[0]].shape), shape)
            xb = _broadcast(ins[1], tuple(nodes[node.inputs[1]].shape), shape)
            fn = _mul_elem if node.op == "mul" else _add_elem
            out = [fn(eng, p, q) for p, q in zip(xa, xb)]
        elif node.op in ("mul_const", "add_const"):
            v = np.broadcast_to(np.asarray(a["value"], dtype=np.float64), shape).ravel()
            xa = _broadcast(ins[0], tuple(nodes[node.inputs[0]].shape), shape)
            fn = _scale_elem if node.op == "mul_const" else _add_elem
            out = [fn(eng, p, float(c)) for p, c in zip(xa, v)]
        else:
            flat = [e for x in ins for e in x]
            out = [flat[j] if j >= 0 else 0.0 for j in np.asarray(a["index"]).ravel()]
        vals[i] = out
        for j in node.inputs:
            remaining[j] -= 1
            if remaining[j] == 0 and j != program.output:
                vals[j] = None
    result = vals[program.output]
    assert result is not None
    return result


class VectorKernels:
    """Plaintexts of a vector plan, encoded once for an engine (diagonals, planes, biases)."""

    def __init__(self, eng: Engine, plan: VectorPlan):
        self.diag: dict[tuple[int, int, int, int], Any] = {}
        self.planes: dict[tuple[int, int], Any] = {}
        self.bias: dict[int, Any] = {}
        for si, st in enumerate(plan.steps):
            if st.kind == "affine":
                lin = max(plan.steps[s].level for s in st.inputs)
                for ti, mv in enumerate(st.matvecs):
                    if mv is None:
                        continue
                    for gi, group in enumerate(mv.groups):
                        for b, vec in group.items():
                            self.diag[si, ti, gi, b] = eng.encode_vector(vec, lin, eng.scales[lin])
            elif st.kind == "planes":
                for j, w in enumerate(st.planes):
                    self.planes[si, j] = eng.encode_vector(w, 0, eng.scales[0])
            if st.bias is not None and np.any(st.bias):
                p = st.period
                vec = np.zeros(p)
                vec[:st.n] = st.bias
                self.bias[si] = eng.encode_vector(np.tile(vec, eng.slots // p), st.level,
                                                  eng.scales[st.level])


def _accumulate(eng: Engine, terms: Iterable[Any]) -> Any:
    """Sum ciphertexts in place into the first one."""
    acc = None
    for term in terms:
        if acc is None:
            acc = term
        else:
            eng.add_inplace(acc, term)
    return acc


def _fold(eng: Engine, ct: Any, steps: Sequence[int]) -> Any:
    """Add rotated copies of ``ct`` onto itself (sums across slot blocks)."""
    for f in steps:
        ct = eng.add(ct, eng.rotate(ct, f))
    return ct


def _matvec(eng: Engine, kern: VectorKernels, key: tuple[int, int], mv: MatVec, x: Any) -> Any:
    rots = {b: eng.rotate(x, b) for b in mv.babies}
    acc = _accumulate(eng, (
        eng.rotate(_accumulate(eng, (eng.mul_plain(rots[b], kern.diag[key + (gi, b)])
                                     for b in group)), giant)
        for gi, (giant, group) in enumerate(zip(mv.giants, mv.groups))))
    return _fold(eng, eng.rescale(acc), mv.folds)


def run_vector(eng: Engine, plan: VectorPlan, kern: VectorKernels, inputs: Sequence[Any]) -> Any:
    """Evaluate a vector plan on one sample's input ciphertexts; returns the output ciphertext."""
    vals: list[Any] = [None] * len(plan.steps)
    for si, st in enumerate(plan.steps):
        if st.kind == "input":
            vals[si] = inputs[0]
            continue
        if st.kind == "planes":
            acc = _accumulate(eng, (eng.mul_plain(ct, kern.planes[si, j])
                                    for j, ct in enumerate(inputs)))
            out = _fold(eng, eng.rescale(acc), st.plane_folds)
        elif st.kind == "affine":
            lin = max(plan.steps[s].level for s in st.inputs)
            out = None
            for ti, (src, mv) in enumerate(zip(st.inputs, st.matvecs)):
                x = eng.lift(vals[src], lin)
                term = x if mv is None else _matvec(eng, kern, (si, ti), mv, x)
                out = term if out is None else eng.add(out, term)
        elif st.kind == "mul":
            out = eng.multiply(vals[st.inputs[0]], vals[st.inputs[1]])
        else:
            out = eng.mul_int(vals[st.inputs[0]], st.factor)
        if si in kern.bias:
            out = eng.add_plain(out, kern.bias[si])
        vals[si] = out
    return vals[plan.output]
