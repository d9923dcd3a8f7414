"""Fused plaintext-weight linear maps over batch-packed ciphertexts, computed with BLAS.

In batch packing every element of a value is its own ciphertext, and a linear map
``y_r = sum_c W[r, c] x_c`` multiplies ciphertexts by *scalars*. A scalar encoded by SEAL's CKKS
encoder at scale ``S`` is the constant polynomial ``round(w S)``, whose NTT form is that integer
in every slot, so ``multiply_plain`` by it multiplies every RNS word of the ciphertext by
``round(w S) mod q``. A whole map is therefore one integer matrix product per RNS limb,

    Y[r, :] = sum_c Wint[r, c] * X[c, :]  (mod q_l),

which this module computes with float64 BLAS: the inputs are split into digits small enough
that every partial sum is an exact integer below 2^53, each digit is one matrix product, and the
digits are recombined modulo ``q_l``. The result is bit-identical to SEAL's ``multiply_plain`` +
``add`` chain (a test checks it), at the cost of one matrix product instead of ``nnz``
ciphertext operations.

The ciphertexts' words are read and written in place. ``tenseal.sealapi`` exposes no buffer, so
:class:`RawAccess` locates SEAL's coefficient array through the binding's object layout and
validates the location once per process against SEAL's own accessors (parameters id, sizes,
scale, the first word of every polynomial, sampled words, and a write read back); any mismatch
disables the fast path and the interpreters keep using SEAL's operations.
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp
from threadpoolctl import threadpool_limits

from he import _kernels

__all__ = ["RawAccess", "raw_access", "add_constant", "FusedMap", "fuse_map", "FUSED_MIN_FANIN"]

#: Rows whose fan-in (ciphertext inputs) is below this keep SEAL's multiply/add chain: a matrix
#: product pays a gather of its inputs, which a one- or two-term sum does not repay.
FUSED_MIN_FANIN = 3

# CPython object header (reference count + type pointer); pybind11 stores the wrapped C++
# pointer right after it for a simple (single-holder) instance.
_PY_HEADER = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)
# seal::Ciphertext: parms_id (4 words), is_ntt_form, size, poly_modulus_degree,
# coeff_modulus_size, scale, correction_factor, then the DynArray data_.
_CT_WORDS = 10
_DYN_OFFSET = _CT_WORDS * 8
# DynArray<T>: MemoryPoolHandle (2 words), capacity, size, Pointer<T> (data pointer first).
_DYN_CAPACITY, _DYN_SIZE, _DYN_DATA = 16, 24, 32


def _cxx_address(obj: Any) -> int:
    return int(ctypes.c_void_p.from_address(id(obj) + _PY_HEADER).value or 0)


def _words(address: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(address)).copy()


class RawAccess:
    """In-place NumPy views of SEAL ciphertext words, after a one-off validation.

    ``ok`` says whether the layout was confirmed; ``reason`` why not. Views are valid while the
    ciphertext object lives and is not resized; callers keep the ciphertext referenced.
    """

    def __init__(self, probe_ct: Any, parms_id: Sequence[int]):
        self.ok = False
        self.reason = ""
        try:
            self._validate(probe_ct, list(parms_id))
            self.ok = True
        except _LayoutMismatch as exc:
            self.reason = str(exc)

    def _data_address(self, ct: Any) -> tuple[int, int]:
        base = _cxx_address(ct)
        dyn = base + _DYN_OFFSET
        count = int(ctypes.c_uint64.from_address(dyn + _DYN_SIZE).value)
        addr = int(ctypes.c_uint64.from_address(dyn + _DYN_DATA).value)
        return addr, count

    def _validate(self, ct: Any, parms_id: list[int]) -> None:
        base = _cxx_address(ct)
        if base == 0 or base % 8:
            raise _LayoutMismatch("no C++ object address in the binding")
        words = _words(base, _CT_WORDS + 6)
        size, n, limbs = ct.size(), ct.poly_modulus_degree(), ct.coeff_modulus_size()
        if [int(w) for w in words[:4]] != [int(p) for p in parms_id]:
            raise _LayoutMismatch("parameters id not where expected")
        if (int(words[5]), int(words[6]), int(words[7])) != (size, n, limbs):
            raise _LayoutMismatch("size fields not where expected")
        if words[8:9].view(np.float64)[0] != ct.scale:
            raise _LayoutMismatch("scale not where expected")
        if _cxx_address(ct.dyn_array()) != base + _DYN_OFFSET:
            raise _LayoutMismatch("coefficient array is not a member at the expected offset")
        dyn = words[_CT_WORDS:]
        capacity, count, addr = int(dyn[2]), int(dyn[3]), int(dyn[4])
        if count != size * n * limbs or capacity < count or addr == 0 or addr % 8:
            raise _LayoutMismatch("coefficient array header does not match the ciphertext")
        view = np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(addr))
        arr = ct.dyn_array()
        rng = np.random.default_rng(0)
        probes = [0, count - 1] + [int(i) for i in rng.integers(0, count, 30)]
        if any(int(view[i]) != int(arr.at(i)) for i in probes):
            raise _LayoutMismatch("words differ from SEAL's accessor")
        if any(int(view[p * n * limbs]) != int(ct.data(p)) for p in range(size)):
            raise _LayoutMismatch("polynomial starts differ from SEAL's accessor")
        old = int(view[1])
        view[1] = old ^ 1
        seen = int(arr.at(1))
        view[1] = old
        if seen != old ^ 1:
            raise _LayoutMismatch("a write is not seen by SEAL")

    def address(self, ct: Any) -> tuple[int, int]:
        """The address of the ciphertext's words and their number (``size * limbs * N``)."""
        addr, count = self._data_address(ct)
        if count != ct.size() * ct.coeff_modulus_size() * ct.poly_modulus_degree():
            raise RuntimeError("ciphertext storage does not match its sizes")
        return addr, count

    def mark_ntt_form(self, ct: Any) -> None:
        """Flag ``ct`` as in NTT form (the boolean between its parameters id and its size), as
        SEAL's results are, for words written into it directly; checked through SEAL's
        accessor, restored and refused where that does not see it."""
        if ct.is_ntt_form():
            return
        flag = ctypes.c_bool.from_address(_cxx_address(ct) + 4 * 8)
        flag.value = True
        if not ct.is_ntt_form():
            flag.value = False
            raise RuntimeError("the NTT-form flag is not where expected")

    def view(self, ct: Any) -> np.ndarray:
        """The ciphertext's words as a writable ``(size * limbs, N)`` uint64 array."""
        addr, count = self._data_address(ct)
        n = ct.poly_modulus_degree()
        rows = ct.size() * ct.coeff_modulus_size()
        if count != rows * n:
            raise RuntimeError("ciphertext storage does not match its sizes")
        return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(addr)).reshape(rows, n)


class _LayoutMismatch(Exception):
    pass


_RAW: list[RawAccess] = []


def raw_access(ct: Any) -> RawAccess:
    """The process's :class:`RawAccess`, validated once on ``ct`` (any NTT-form ciphertext; its
    words are read and one is rewritten and restored)."""
    if not _RAW:
        _RAW.append(RawAccess(ct, list(ct.parms_id())))
    return _RAW[0]


def add_constant(raw: RawAccess, ct: Any, value: int, moduli: Sequence[int]) -> None:
    """``ct <- ct + value`` for an integer ``value`` (a constant already at the ciphertext's
    scale): the constant polynomial is ``value`` in every NTT slot of the first polynomial."""
    v = raw.view(ct)
    for limb, q in enumerate(moduli):
        row = v[limb]
        row += np.uint64(int(value) % int(q))
        row -= np.where(row >= np.uint64(q), np.uint64(q), np.uint64(0))


@dataclass
class _Block:
    rows: np.ndarray          # output rows (indices into the map's covered rows)
    cols: np.ndarray          # input columns (indices into the ciphertext inputs)
    weights: np.ndarray       # float64 (len(rows), len(cols)) integer-valued weights
    l1: float                 # largest row sum of |weights|


def _digit_plan(l1: float, q: int) -> tuple[int, int]:
    """``(digit_bits, n_digits)`` for one prime: words ``x < q`` are split into unsigned digits
    so that a digit's product sum (``< l1 2^bits``) plus a centred partial result shifted by one
    digit (``<= (q/2 + 1) 2^bits``) stays an exact float64 integer (below 2^52). One digit when
    the whole product sum ``l1 q`` already is."""
    pb = int(q).bit_length()
    if l1 * q < 2.0 ** 52:
        return pb, 1
    bits = 52 - int(math.ceil(math.log2(q / 2.0 + l1 + 1.0)))
    return bits, -(-pb // bits) if bits >= 4 else 0


def _row_plans(l1: float, moduli: Sequence[int], size: int
               ) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """The ``(polynomial, limb)`` rows of a ciphertext of ``size`` polynomials over ``moduli``
    grouped by their :func:`_digit_plan` (polynomial-major, limb-minor)."""
    plans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for p in range(size):
        for limb, q in enumerate(moduli):
            plans.setdefault(_digit_plan(l1, q), []).append((p, limb))
    return plans


@dataclass
class FusedMap:
    """A plaintext-weight map over ciphertext inputs, grouped into dense blocks.

    Block weights are the integers ``round(w * s_c)`` (exact float64), ``s_c`` the scale that
    takes column ``c``'s ciphertext to the common product scale.
    """

    n_rows: int
    blocks: list[_Block]
    macs: int                 # multiply-accumulates per word (sum of block sizes)

    def work(self, moduli: Sequence[int], size: int = 2) -> dict[str, float]:
        """Work of one application to ciphertexts of ``size`` polynomials over ``moduli``, per
        ring coefficient, as :class:`~he.costmodel.CostModel` prices it: ``fused_mac``
        (multiply-accumulates x digits), ``fused_in`` (input words gathered x digits) and
        ``fused_out`` (output words reduced x digits)."""
        mac = w_in = w_out = 0.0
        for blk in self.blocks:
            for q in moduli:
                digits = _digit_plan(blk.l1, q)[1]
                mac += size * digits * blk.rows.size * blk.cols.size
                w_in += size * digits * blk.cols.size
                w_out += size * digits * blk.rows.size
        return {"fused_mac": mac, "fused_in": w_in, "fused_out": w_out}

    def apply(self, raw: RawAccess, inputs: Sequence[Any], outputs: Sequence[Any],
              moduli: Sequence[int], constants: Sequence[int] | None = None,
              pool: Any = None) -> None:
        """``outputs[r] <- sum_c W[r, c] inputs[c] + constants[r]`` word by word, modulo each
        limb's prime (``constants``: integers already at the outputs' scale, added to the
        first polynomial, where a constant's NTT form lies).

        ``outputs`` are ciphertexts at the level of the ``moduli`` (their words are overwritten);
        ``inputs`` at that level or below it (more limbs): switching a ciphertext down a level
        without rescaling drops its last limbs, so only the first ``len(moduli)`` are read.
        ``pool``: a :class:`he.native.Pool` whose threads share the compiled loops' work (each
        block, digit plan and range of coefficients writes words of its own, and the loops and
        the products release the GIL); the words are the same whatever the threads.
        """
        # one BLAS thread (batch servers run a process per core): with two, the products inside
        # a server took up to 60x as long as alone on a loaded 2-core machine (10 x 4704 by
        # 4704 x 222: 104 ms against 1.6 ms), a whole batch run 5.9x
        with threadpool_limits(limits=1, user_api="blas"):
            compiled = _kernels.kernels()
            if compiled is None:
                self._apply_numpy(raw, inputs, outputs, moduli)
                for out, v in zip(outputs, constants if constants is not None else ()):
                    if v:
                        add_constant(raw, out, int(v), moduli)
            else:
                self._apply_compiled(compiled, raw, inputs, outputs, moduli, constants, pool)

    def _apply_compiled(self, compiled: tuple[Any, Any], raw: RawAccess, inputs: Sequence[Any],
                        outputs: Sequence[Any], moduli: Sequence[int],
                        constants: Sequence[int] | None, pool: Any = None) -> None:
        """:meth:`apply` with the compiled loops of :mod:`he._kernels`: every block and digit
        plan in tiles of coefficients, the tiles spread over ``pool``'s threads."""
        limbs = len(moduli)
        in_mem = [raw.address(c) for c in inputs]
        out_mem = [raw.address(c) for c in outputs]
        n = outputs[0].poly_modulus_degree()
        size = out_mem[0][1] // (n * limbs)
        consts = [int(v) for v in constants] if constants is not None else [0] * self.n_rows
        gather_digits, reduce_scatter = compiled
        threads = 1 if pool is None else pool.threads
        layouts = list(self._layouts(moduli, size, n, in_mem, out_mem, consts))
        tasks = []
        for item in layouts:
            blk, (plan, pl) = item[0], item[1][:2]
            k, r_out, rows, n_digits = blk.cols.size, blk.rows.size, len(pl), plan[1]
            # wide tiles (few calls), the buffers within 32 MB; at least one per thread where
            # the blocks are fewer than the threads
            tile = max(64, min(n, (1 << 22) // max(1, (k + r_out) * rows * n_digits)))
            if threads > 1 and len(layouts) < threads:
                tile = max(64, min(tile, -(-n // threads)))
            tasks += [(item, lo, min(n, lo + tile) - lo) for lo in range(0, n, tile)]

        def run(task: tuple[Any, int, int]) -> None:
            (blk, (plan, pl, q, in_off, out_off, in_addr, in_count, out_addr, out_count,
                   const)), lo, t = task
            bits, n_digits = plan
            ws = _workspace()
            digits = ws.get("digits", (n_digits, blk.cols.size, len(pl) * t), np.float64)
            parts = ws.get("parts", (n_digits, blk.rows.size, len(pl) * t), np.float64)
            gather_digits(in_addr, in_count, in_off, lo, t,
                          np.arange(n_digits, dtype=np.int64) * bits,
                          np.int64((1 << bits) - 1), digits)
            for d in range(n_digits):
                np.matmul(blk.weights, digits[d], out=parts[d])
            reduce_scatter(parts, q, 1.0 / q, float(1 << bits), const, out_addr, out_count,
                           out_off, lo, t)

        if pool is None:
            for task in tasks:
                run(task)
        else:
            pool.map(run, tasks)

    def _layouts(self, moduli: Sequence[int], size: int, n: int, in_mem: list[tuple[int, int]],
                 out_mem: list[tuple[int, int]], consts: list[int]) -> Any:
        """Per block and digit plan: the word offsets, addresses and constants the compiled
        loops read (every offset is checked against its array's length here)."""
        limbs = len(moduli)
        for blk in self.blocks:
            plans = _row_plans(blk.l1, moduli, size)
            in_addr = np.array([in_mem[c][0] for c in blk.cols], dtype=np.int64)
            in_count = np.array([in_mem[c][1] for c in blk.cols], dtype=np.int64)
            out_addr = np.array([out_mem[r][0] for r in blk.rows], dtype=np.int64)
            out_count = np.array([out_mem[r][1] for r in blk.rows], dtype=np.int64)
            for plan, pl in plans.items():
                q = np.asarray([moduli[limb] for _, limb in pl], dtype=np.float64)
                out_off = np.asarray([(p * limbs + limb) * n for p, limb in pl], dtype=np.int64)
                width = in_count // (size * n)
                in_off = (np.asarray([p for p, _ in pl])[None, :] * width[:, None]
                          + np.asarray([limb for _, limb in pl])[None, :]) * n
                if (in_off + n > in_count[:, None]).any() or out_off.max() + n > out_count.min():
                    raise RuntimeError("ciphertext storage smaller than the map reads or writes")
                const = np.asarray([[int(consts[r]) % moduli[limb] if p == 0 else 0
                                     for p, limb in pl] for r in blk.rows], dtype=np.float64)
                yield blk, (plan, pl, q, in_off.astype(np.int64), out_off, in_addr, in_count,
                            out_addr, out_count, const)

    def _apply_numpy(self, raw: RawAccess, inputs: Sequence[Any], outputs: Sequence[Any],
                     moduli: Sequence[int]) -> None:
        """:meth:`apply` without constants, with NumPy operations (the reference path)."""
        limbs = len(moduli)
        ys = [raw.view(c) for c in outputs]
        n_rows, n = ys[0].shape
        size = n_rows // limbs
        xs = [raw.view(c) for c in inputs]
        ws = _workspace()
        for blk in self.blocks:
            plans = _row_plans(blk.l1, moduli, size)
            k, r_out = blk.cols.size, blk.rows.size
            for (bits, n_digits), pl in plans.items():
                q = np.asarray([moduli[limb] for _, limb in pl], dtype=np.float64)
                out_rows = np.asarray([p * limbs + limb for p, limb in pl])
                in_rows = {}
                for c in blk.cols:
                    width = xs[c].shape[0] // size
                    if width not in in_rows:
                        in_rows[width] = np.asarray([p * width + limb for p, limb in pl])
                rows = len(pl)
                # a tile's buffers stay within a few tens of MB
                tile = max(256, min(n, (1 << 21) // max(1, max(k, r_out) * rows)))
                for lo in range(0, n, tile):
                    hi = min(n, lo + tile)
                    t = hi - lo
                    x = ws.get("x", (k, rows, t), np.uint64)
                    for i, c in enumerate(blk.cols):
                        v = xs[c]
                        np.take(v[:, lo:hi], in_rows[v.shape[0] // size], axis=0, out=x[i])
                    res = _modular_product(blk.weights, x, q, bits, n_digits, ws)
                    for j, r in enumerate(blk.rows):
                        d = ys[r]
                        if rows == n_rows:
                            np.copyto(d[:, lo:hi], res[j], casting="unsafe")
                        else:
                            d[out_rows, lo:hi] = res[j]


class _Workspace:
    """Scratch arrays reused across calls: fresh large temporaries are page-faulted in on every
    use, which costs more than the arithmetic on them."""

    def __init__(self) -> None:
        self.bufs: dict[tuple[str, Any], np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        need = int(np.prod(shape))
        buf = self.bufs.get((name, dtype))
        if buf is None or buf.size < need:
            buf = np.empty(need, dtype=dtype)
            self.bufs[(name, dtype)] = buf
        return buf[:need].reshape(shape)


_LOCAL = threading.local()


def _workspace() -> _Workspace:
    """This thread's scratch arrays (threads that share a map's work each write their own)."""
    ws = getattr(_LOCAL, "workspace", None)
    if ws is None:
        ws = _LOCAL.workspace = _Workspace()
    return ws


def _modular_product(w: np.ndarray, x: np.ndarray, q: np.ndarray, bits: int,
                     n_digits: int, ws: _Workspace) -> np.ndarray:
    """``(w @ x) mod q`` as float64 in ``[0, q)``, for uint64 ``x`` (k, rows, t) whose row ``i``
    is reduced modulo ``q[i]``: unsigned ``bits``-bit digits of ``x``, one exact float64 product
    each, recombined by Horner's rule with centred reductions. Returns a workspace array."""
    k, rows, t = x.shape
    r_out = w.shape[0]
    flat = x.reshape(k, rows * t)
    qb = q[None, :, None]
    qinv = 1.0 / qb
    mask = np.uint64((1 << bits) - 1)
    digit = ws.get("digit", (k, rows * t), np.uint64)
    digit_f = ws.get("digit_f", (k, rows * t), np.float64)
    acc = ws.get("acc", (r_out, rows * t), np.float64)
    part = ws.get("part", (r_out, rows * t), np.float64)
    tmp = ws.get("tmp", (r_out, rows, t), np.float64)
    acc3 = acc.reshape(r_out, rows, t)
    for i in reversed(range(n_digits)):
        if i:
            np.right_shift(flat, np.uint64(i * bits), out=digit)
            src = digit
        else:
            src = flat
        if i < n_digits - 1:
            np.bitwise_and(src, mask, out=digit)
            src = digit
        np.copyto(digit_f, src, casting="unsafe")
        if i == n_digits - 1:
            np.matmul(w, digit_f, out=acc)
        else:
            np.matmul(w, digit_f, out=part)
            acc *= float(1 << bits)
            acc += part
        np.multiply(acc3, qinv, out=tmp)                  # centred: |acc| <= q/2 + 1 after
        np.rint(tmp, out=tmp)
        tmp *= qb
        acc3 -= tmp
    np.add(acc3, qb, out=acc3, where=acc3 < 0)
    return acc3


def fuse_map(mats: Sequence[sp.csr_matrix], ct_cols: Sequence[np.ndarray],
             col_scales: Sequence[np.ndarray], rows: np.ndarray, moduli: Sequence[int],
             min_fanin: int = FUSED_MIN_FANIN) -> tuple[FusedMap | None, np.ndarray]:
    """Group a step's ciphertext weights into dense integer blocks.

    Args:
        mats: the step's terms (CSR), one per input value.
        ct_cols: per term, a bool mask of the input elements that are ciphertexts.
        col_scales: per term, the encoding scale of each column's weights (read where
            ``ct_cols``).
        rows: output rows to compute.
        moduli: the primes of the inputs' level.
        min_fanin: rows with fewer ciphertext terms are left to SEAL.

    Returns:
        The fused map over the concatenated ciphertext inputs (``None`` when no row qualifies) and
        the rows it covers.
    """
    parts = []
    for m, cols, sc in zip(mats, ct_cols, col_scales):
        idx = np.flatnonzero(cols)
        parts.append(m[:, idx] @ sp.diags(np.asarray(sc, dtype=np.float64)[idx]))
    none = (None, np.zeros(0, dtype=np.int64))
    if not parts:
        return none
    wint = sp.hstack(parts, format="csr")[rows]
    wint.data = np.round(wint.data)
    wint.eliminate_zeros()
    chosen = np.flatnonzero(np.diff(wint.indptr) >= min_fanin)
    if chosen.size == 0:
        return none
    wint = wint[chosen]
    blocks = _dense_blocks(wint)
    if any(_digit_plan(b.l1, q)[1] == 0 for b in blocks for q in moduli):
        return none
    macs = sum(b.rows.size * b.cols.size for b in blocks)
    return FusedMap(n_rows=chosen.size, blocks=blocks, macs=macs), np.asarray(rows)[chosen]


def _dense_blocks(w: sp.csr_matrix, min_density: float = 0.5) -> list[_Block]:
    """Rows grouped by support: identical supports share a block; consecutive groups merge while
    the merged block stays at least ``min_density`` full."""
    groups: dict[bytes, list[int]] = {}
    supports: dict[bytes, np.ndarray] = {}
    for r in range(w.shape[0]):
        cols = np.sort(w.indices[w.indptr[r]:w.indptr[r + 1]])
        key = cols.tobytes()
        groups.setdefault(key, []).append(r)
        supports[key] = cols
    merged: list[tuple[list[int], np.ndarray, int]] = []
    for key in sorted(groups, key=lambda k: (supports[k][0], len(supports[k]))):
        rows, cols = groups[key], supports[key]
        nnz = len(rows) * cols.size
        if merged:
            prow, pcols, pnnz = merged[-1]
            ucols = np.union1d(pcols, cols)
            if (pnnz + nnz) >= min_density * (len(prow) + len(rows)) * ucols.size:
                merged[-1] = (prow + rows, ucols, pnnz + nnz)
                continue
        merged.append((list(rows), cols, nnz))
    out = []
    for rows, cols, _ in merged:
        r = np.asarray(rows)
        dense = w[r][:, cols].toarray()
        out.append(_Block(rows=r, cols=cols, weights=dense,
                          l1=float(np.abs(dense).sum(axis=1).max())))
    return out
