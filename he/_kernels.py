"""Compiled loops of the fused batch maps (:mod:`he.fused`): the digit split of the inputs' words
and the modular recombination of the digit products, each in one pass over memory.

NumPy spends a pass over the data per operation (shift, mask, convert; scale, add, divide,
round, multiply, subtract, clamp, convert, copy): on a batch-packed program that is most of the
time of a fused map, several times its matrix products. These loops do the same arithmetic per
word while it is in registers, read the inputs straight from SEAL's coefficient arrays and write
the outputs into them (the addresses :class:`he.fused.RawAccess` validated), so the gather and
scatter copies go too. The float64 matrix products stay NumPy's (BLAS).

The loops are compiled by numba on first use and cached on disk. :func:`kernels` returns them
after checking them against the NumPy reference on random words; where numba is missing or the
check fails it returns ``None`` and says why in :func:`reason`, and :mod:`he.fused` keeps its
NumPy path (bit-identical results, only slower).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import numpy as np

from polynets._compiled import ENV_DISABLE, disabled, numpy_loops

__all__ = ["kernels", "expected", "reason", "disabled", "numpy_loops", "ENV_DISABLE"]

_STATE: dict[str, Any] = {}
#: 1.5 * 2^52: ``(x + _ROUND) - _ROUND`` is ``x`` rounded to the nearest integer for |x| < 2^51
_ROUND = 6755399441055744.0


def reason() -> str:
    """Why the compiled loops are not used ('' when they are, or not yet tried)."""
    if disabled():
        return f"{ENV_DISABLE} is set"
    return str(_STATE.get("reason", ""))


def expected() -> bool:
    """Whether :func:`kernels` is expected to return the compiled loops (numba installed, not
    disabled, no failed attempt), without compiling them: what the cost model prices."""
    if disabled() or _STATE.get("kernels", True) is None:
        return False
    if "numba_found" not in _STATE:
        _STATE["numba_found"] = importlib.util.find_spec("numba") is not None
    return bool(_STATE["numba_found"])


def kernels() -> tuple[Callable[..., None], Callable[..., None]] | None:
    """``(gather_digits, reduce_scatter)`` compiled and checked, or ``None``."""
    if disabled():
        return None
    if "kernels" not in _STATE:
        try:
            pair = _build()
            _check(*pair)
            _STATE["kernels"] = pair
        except Exception as exc:            # noqa: BLE001 -- any failure means: use NumPy
            _STATE["kernels"] = None
            _STATE["reason"] = f"{type(exc).__name__}: {exc}"
    return _STATE["kernels"]


def pointer_intrinsic(element: str) -> Any:
    """A numba intrinsic that reads an integer address as a pointer to ``element`` words (a
    numba type name: ``"int64"``, ``"uint64"``), for loops that read SEAL's arrays in place."""
    from numba.core import types
    from numba.extending import intrinsic

    kind = getattr(types, element)

    @intrinsic
    def word_pointer(typingctx: Any, address: Any) -> Any:
        """An integer address as a pointer to the words."""
        if not isinstance(address, types.Integer):
            return None
        ptr = types.CPointer(kind)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(address), codegen

    return word_pointer


def _build() -> tuple[Callable[..., None], Callable[..., None]]:
    import numba

    # the storage of a SEAL ciphertext as int64 words: its words are below 2^62, so signed
    # loads and conversions, single instructions, serve
    word_pointer = pointer_intrinsic("int64")

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def gather_digits(addr: Any, count: Any, offsets: Any, lo: int, t: int, shifts: Any,
                      mask: Any, out: Any) -> None:
        """``out[d, i, r*t + e] = (word >> shifts[d]) & mask`` for the word at
        ``offsets[i, r] + lo + e`` of input ``i``'s array."""
        k, rows = offsets.shape
        n_digits = shifts.shape[0]
        for i in range(k):
            src = numba.carray(word_pointer(addr[i]), (count[i],))
            for r in range(rows):
                words = src[offsets[i, r] + lo:offsets[i, r] + lo + t]
                base = r * t
                for d in range(n_digits):
                    dig = out[d, i, base:base + t]
                    s = shifts[d]
                    for e in range(t):
                        dig[e] = np.float64((words[e] >> s) & mask)

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def reduce_scatter(parts: Any, q: Any, qinv: Any, radix: float, const: Any, addr: Any,
                       count: Any, offsets: Any, lo: int, t: int) -> None:
        """Horner's rule over the digit products ``parts[d]`` (highest digit last) with a
        centred reduction after each step, plus ``const[j, r]``, written to output ``j``'s word
        at ``offsets[r] + lo + e`` in ``[0, q[r])``."""
        n_digits, r_out, _ = parts.shape
        rows = offsets.shape[0]
        acc = np.empty(t)
        for j in range(r_out):
            dst = numba.carray(word_pointer(addr[j]), (count[j],))
            for r in range(rows):
                qq = q[r]
                qi = qinv[r]
                base = r * t
                # rounding to nearest by the float64 magic constant (|a qi| < 2^51)
                src = parts[n_digits - 1, j, base:base + t]
                for e in range(t):
                    a = src[e]
                    acc[e] = a - ((a * qi + _ROUND) - _ROUND) * qq
                for d in range(n_digits - 2, -1, -1):
                    src = parts[d, j, base:base + t]
                    for e in range(t):
                        a = acc[e] * radix + src[e]
                        acc[e] = a - ((a * qi + _ROUND) - _ROUND) * qq
                c = const[j, r]
                out = dst[offsets[r] + lo:offsets[r] + lo + t]
                for e in range(t):
                    a = acc[e] + c
                    a += qq if a < 0.0 else 0.0
                    a -= qq if a >= qq else 0.0
                    out[e] = np.int64(a)

    return gather_digits, reduce_scatter


def _check(gather_digits: Callable[..., None], reduce_scatter: Callable[..., None]) -> None:
    """Both loops against plain NumPy on random words of a 30-bit prime, two digits."""
    rng = np.random.default_rng(1)
    q, bits, k, r_out, t = 1073479681, 16, 5, 3, 16
    words = rng.integers(0, q, size=(k, 2 * t), dtype=np.uint64)
    addr = np.array([w.ctypes.data for w in words], dtype=np.int64)
    count = np.full(k, 2 * t, dtype=np.int64)
    offsets = np.tile(np.array([0, t], dtype=np.int64), (k, 1))
    shifts = np.array([0, bits], dtype=np.int64)
    mask = np.int64((1 << bits) - 1)
    digits = np.empty((2, k, 2 * t))
    gather_digits(addr, count, offsets, 0, t, shifts, mask, digits)
    if not (np.array_equal(digits[0], (words & np.uint64(mask)).astype(np.float64))
            and np.array_equal(digits[1], (words >> np.uint64(bits)).astype(np.float64))):
        raise RuntimeError("compiled digit split differs from NumPy")
    w = rng.integers(-(1 << 20), 1 << 20, size=(r_out, k)).astype(np.float64)
    parts = np.stack([w @ digits[0], w @ digits[1]])
    const = rng.integers(0, q, size=(r_out, 2)).astype(np.float64)
    outs = np.zeros((r_out, 2 * t), dtype=np.uint64)
    reduce_scatter(parts, np.full(2, float(q)), np.full(2, 1.0 / q), float(1 << bits), const,
                   np.array([o.ctypes.data for o in outs], dtype=np.int64),
                   np.full(r_out, 2 * t, dtype=np.int64), np.array([0, t], dtype=np.int64),
                   0, t)
    wi = [[int(v) for v in row] for row in w.astype(np.int64)]
    for j in range(r_out):
        for c in range(2 * t):
            want = (sum(wi[j][i] * int(words[i, c]) for i in range(k))
                    + int(const[j, c // t])) % q
            if int(outs[j, c]) != want:
                raise RuntimeError("compiled recombination differs from exact integers")
