"""Hoisted rotations: the baby steps of a map from one decomposition of its input, their
products with the diagonals summed before one division by the special prime.

A rotation by ``s`` is ``(sigma(c0), 0) + KeySwitch(sigma(c1))``, the automorphism ``sigma`` of
the step applied to both polynomials. SEAL's key switching first brings ``sigma(c1)`` back to
coefficients (an inverse NTT per prime), reduces every prime's digit modulo every other prime
and the special prime ``p`` and takes them to NTT form again: ``L (L + 1)`` transforms for
``L`` primes, most of a rotation's time; then it multiplies the digits by the step's Galois key,
divides by ``p`` with rounding and adds ``sigma(c0)``. The digits of ``sigma(c1)`` are the digits
of ``c1`` with ``sigma`` applied (in NTT form, ``sigma`` only permutes each digit's words), so the
baby steps of a map, which rotate one ciphertext by many steps, decompose it once
(:meth:`Hoister.decompose`) and each step only multiplies the digits by its key
(:meth:`Hoister.rotate_ext`; the key kept permuted by ``sigma^-1``, so the products read every
array in order and only their sums are permuted). A baby step stays multiplied by ``p``
(:class:`Extended`, in the level's primes and ``p``): the products of a giant step's baby steps
with its diagonals (plaintexts in the same primes, :meth:`Hoister.extend_plain`) are summed there
(:meth:`Hoister.product_sum`) and the sum divided once (:meth:`Hoister.mod_down`). A rotation
that runs alone shares each stage among a pool's threads (:meth:`Hoister.rotate_shared`).

The arithmetic is SEAL's: 128-bit lazy accumulation of digit-key products and one Barrett
reduction per word (compiled by numba), the special prime's rounding added before the
division, SEAL's own NTTs (its exported lazy transforms, called through :mod:`ctypes` without
the GIL, on tables SEAL builds). A hoisted rotation differs from SEAL's in the digits'
representatives where ``sigma`` negates a coefficient (``-d mod q_i`` rather than ``(q_j - d)
mod q_i``, the same size), so its key-switching noise is of the same size but its words are not
SEAL's. Where the second polynomial is a constant, the digits are the same whatever ``sigma``,
and so is every word: :meth:`Hoister.validated` checks that against SEAL's rotation (no secret
key needed); anything else leaves no hoister, and the runtime rotates with SEAL.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import tenseal.sealapi as seal

from he._kernels import pointer_intrinsic
from he.fused import _DYN_DATA, _DYN_SIZE, _cxx_address, raw_access
from he.native import _ASSIGN

__all__ = ["Hoister", "Decomposed", "Extended", "kernels", "expected", "refused",
           "galois_permutation",
           "plain_words", "ENV_NO_HOISTING"]

#: Set (to anything but ``0``) to compile vector programs without hoisted rotations (benchmarks
#: measure both in one run with it); :data:`polynets._compiled.ENV_DISABLE` turns them off too.
ENV_NO_HOISTING = "POLYNETS_NO_HOISTING"

_NTT = "_ZN4seal4util26ntt_negacyclic_harvey_lazyENS0_7PtrIterIPmEERKNS0_9NTTTablesE"
_INTT = ("_ZN4seal4util34inverse_ntt_negacyclic_harvey_lazyENS0_7PtrIterIPmEERKNS0_9"
         "NTTTablesE")
#: words per block of the compiled products' loops: their 128-bit sums (4 arrays of the block,
#: 128 KiB) stay in a second-level cache while every term's (or digit's) words of the block
#: pass, each term's read as a run of 32 KiB. Blocks of 512 words (sums in a first-level
#: cache, a term's words read 4 KiB at a time) took 1.3-1.8x as long per extended product
#: in sums of 16-64 terms and 1.1-1.3x per hoisted rotation of 6 digits (N=8192 and 16384,
#: 3-8 primes, on a 2-core x86-64 machine); 8192 words ran as 4096, 16384 slower
#: (``benchmarks/he_hoist_kernels.py`` times each size)
PRODUCT_BLOCK = 4096
#: digits up to which the compiled products keep each word's sums in registers over the digits
#: (faster with few digits; with many, the blocked loop: 1.2-1.8 against 1.8-2.9 ns per product
#: at 3 digits, 2.6-3.0 against 1.9 at 6, N=8192 and 16384 on a 2-core x86-64 machine)
_FEW_DIGITS = 4
_KERNELS: dict[str, Any] = {}
_FOUND: dict[str, bool] = {}
_LOCK = threading.Lock()


def expected() -> bool:
    """Whether a vector program compiled now plans hoisted baby steps: numba installed, SEAL
    callable natively here (:func:`he.native.native_platform`), neither
    :data:`ENV_NO_HOISTING` nor :data:`polynets._compiled.ENV_DISABLE` set. A server still
    validates its :class:`Hoister` before use and rotates with SEAL where that fails."""
    from he.native import native_platform
    if refused() or not native_platform():
        return False
    if "numba" not in _FOUND:
        _FOUND["numba"] = importlib.util.find_spec("numba") is not None
    return _FOUND["numba"]


def refused() -> str:
    """Why hoisting is turned off by the environment (:data:`ENV_NO_HOISTING`,
    :data:`polynets._compiled.ENV_DISABLE`), '' where it is not."""
    from polynets._compiled import ENV_DISABLE, disabled
    if os.environ.get(ENV_NO_HOISTING, "0") not in ("", "0"):
        return f"{ENV_NO_HOISTING} is set"
    return f"{ENV_DISABLE} is set" if disabled() else ""


def kernels() -> dict[str, Callable[..., Any]]:
    """The compiled loops (numba, cached on disk): ``reduce_rows``, ``canonical``, ``mac``,
    ``product_sum``, ``round_special``, ``divide``. Raises ImportError where numba is
    missing."""
    with _LOCK:
        if not _KERNELS:
            _KERNELS.update(_build())
    return _KERNELS


def _build() -> dict[str, Callable[..., Any]]:
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def mulhi(typingctx: Any, a: Any, b: Any) -> Any:
        """The high word of the 128-bit product of two uint64."""
        if a != types.uint64 or b != types.uint64:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            wide = ir.IntType(128)
            p = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
            return builder.trunc(builder.lshr(p, ir.Constant(wide, 64)), ir.IntType(64))

        return types.uint64(types.uint64, types.uint64), codegen

    @intrinsic
    def mac128(typingctx: Any, hi: Any, lo: Any, a: Any, b: Any) -> Any:
        """``(hi, lo) + a b`` as a 128-bit sum, returned as its (high, low) words."""
        if any(x != types.uint64 for x in (hi, lo, a, b)):
            return None
        pair = types.UniTuple(types.uint64, 2)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            wide, word = ir.IntType(128), ir.IntType(64)
            h, lw, x, y = (builder.zext(v, wide) for v in args)
            acc = builder.or_(builder.shl(h, ir.Constant(wide, 64)), lw)
            acc = builder.add(acc, builder.mul(x, y))
            top = builder.trunc(builder.lshr(acc, ir.Constant(wide, 64)), word)
            return context.make_tuple(builder, pair, [top, builder.trunc(acc, word)])

        return pair(types.uint64, types.uint64, types.uint64, types.uint64), codegen

    one = np.uint64(1)

    @numba.njit(inline="always")
    def barrett64(x: Any, q: Any, r: Any) -> Any:
        """``x mod q`` for any uint64 ``x``, ``r = floor(2^64 / q)``."""
        t = x - mulhi(x, r) * q
        return t - q if t >= q else t

    @numba.njit(inline="always")
    def barrett128(hi: Any, lo: Any, q: Any, r0: Any, r1: Any) -> Any:
        """``(hi 2^64 + lo) mod q``, ``r1 2^64 + r0 = floor(2^128 / q)`` (SEAL's estimate of the
        quotient from the three high partial products, one correction)."""
        carry = mulhi(lo, r0)
        t2lo = lo * r1
        t1 = t2lo + carry
        t3 = mulhi(lo, r1) + (one if t1 < t2lo else np.uint64(0))
        t2lo = hi * r0
        s = t1 + t2lo
        carry = mulhi(hi, r0) + (one if s < t1 else np.uint64(0))
        t1 = hi * r1 + t3 + carry
        t = lo - t1 * q
        return t - q if t >= q else t

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def reduce_rows(src: Any, moduli: Any, ratios: Any, rows: Any, out: Any) -> None:
        """``out[i, j] = src[j] mod moduli[i]`` for the rows ``i`` in ``rows`` (``src[j]``
        below ``moduli[j]``)."""
        for i in rows:
            q, r = moduli[i], ratios[i]
            for j in range(out.shape[1]):
                if i != j:
                    row, dst = src[j], out[i, j]
                    for w in range(row.shape[0]):
                        dst[w] = barrett64(row[w], q, r)

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def canonical(src: Any, moduli: Any) -> None:
        """``src[j] <- src[j] mod moduli[j]`` for ``src[j]`` below ``2 moduli[j]`` (a lazy
        inverse NTT's output)."""
        for j in range(src.shape[0]):
            qj, row = moduli[j], src[j]
            for w in range(row.shape[0]):
                row[w] = row[w] - qj if row[w] >= qj else row[w]

    word_pointer = pointer_intrinsic("uint64")

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def mac(digits: Any, keys: Any, key_rows: Any, moduli: Any, r0s: Any, r1s: Any, perm: Any,
            c0: Any, lift: Any, lift_shoup: Any, rows: Any, out: Any, block: int) -> None:
        """The extended rotation, in the primes ``rows`` (indices among the level's and the
        special one): ``u[c, i] = sum_j digits[i, j] keys[j, c, key_rows[i]] mod
        moduli[i]``, then ``out[c, i, w] = u[c, i, perm[w]]`` plus, for ``c = 0`` and the
        level's primes, ``lift[i] c0[i, perm[w]]`` (``lift[i] = p mod q_i``; nothing in the
        special prime, where ``p c0`` is zero). Digits below ``2^62``, keys below ``2^61``:
        128-bit sums of at most 16 products, one Barrett reduction each. The products run
        digit by digit over contiguous words with the sums in memory (a loop over the digits
        inside the words' loop runs several times slower)."""
        _, n_dig, n = digits.shape
        limbs = c0.shape[0]
        h0 = np.empty(block, dtype=np.uint64)
        l0 = np.empty(block, dtype=np.uint64)
        h1 = np.empty(block, dtype=np.uint64)
        l1 = np.empty(block, dtype=np.uint64)
        u0 = np.empty(n, dtype=np.uint64)
        u1 = np.empty(n, dtype=np.uint64)
        for i in rows:
            q, r0, r1, kr = moduli[i], r0s[i], r1s[i], key_rows[i]
            f = lift[i] if i < limbs else np.uint64(0)
            fs = lift_shoup[i] if i < limbs else np.uint64(0)
            if n_dig <= _FEW_DIGITS:
                # few digits: each word's sums in registers over the digits
                for w in range(n):
                    s0 = np.uint64(0)
                    t0 = np.uint64(0)
                    s1 = np.uint64(0)
                    t1 = np.uint64(0)
                    for j in range(n_dig):
                        a = digits[i, j, w]
                        s0, t0 = mac128(s0, t0, a, keys[j, 0, kr, w])
                        s1, t1 = mac128(s1, t1, a, keys[j, 1, kr, w])
                    m = barrett128(s0, t0, q, r0, r1)
                    if i < limbs:
                        x = c0[i, w]
                        v = x * f - mulhi(x, fs) * q
                        m += v - q if v >= q else v
                        m = m - q if m >= q else m
                    u0[w] = m
                    u1[w] = barrett128(s1, t1, q, r0, r1)
                n_blocks = 0
            else:
                n_blocks = n
            # many: a block of words at a time (PRODUCT_BLOCK), its 128-bit sums in a cache
            # while every digit's words pass, then reduced in order (sums of whole rows would go out
            # to memory per digit)
            for start in range(0, n_blocks, block):
                size = min(block, n - start)
                h0[:] = 0
                l0[:] = 0
                h1[:] = 0
                l1[:] = 0
                for j in range(n_dig):
                    dj = digits[i, j, start:start + size]
                    k0, k1 = keys[j, 0, kr, start:start + size], keys[j, 1, kr, start:start + size]
                    for w in range(size):
                        a = dj[w]
                        h0[w], l0[w] = mac128(h0[w], l0[w], a, k0[w])
                        h1[w], l1[w] = mac128(h1[w], l1[w], a, k1[w])
                for w in range(size):
                    m = barrett128(h0[w], l0[w], q, r0, r1)
                    if i < limbs:
                        x = c0[i, start + w]
                        v = x * f - mulhi(x, fs) * q
                        m += v - q if v >= q else v
                        m = m - q if m >= q else m
                    u0[start + w] = m
                    u1[start + w] = barrett128(h1[w], l1[w], q, r0, r1)
            # the automorphism: one gather from each reduced row (a row stays in the cache,
            # where gathers from the four words of the sums would not)
            d0, d1 = out[0, i], out[1, i]
            for w in range(n):
                d0[w] = u0[perm[w]]
                d1[w] = u1[perm[w]]

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def product_sum(plains: Any, cts: Any, moduli: Any, r0s: Any, r1s: Any, rows_of: Any,
                    out: Any, block: int) -> None:
        """``out[c, i] = sum_t plain_t[i] ct_t[c, i] mod moduli[i]``: ``plains`` and ``cts``
        the addresses of ``(rows, n)`` and ``(2, rows, n)`` words (canonical), at most 256
        terms (128-bit sums), for the rows ``i`` in ``rows_of``."""
        _, rows, n = out.shape
        terms = plains.shape[0]
        h0 = np.empty(block, dtype=np.uint64)
        l0 = np.empty(block, dtype=np.uint64)
        h1 = np.empty(block, dtype=np.uint64)
        l1 = np.empty(block, dtype=np.uint64)
        for i in rows_of:
            q, r0, r1, d0, d1 = moduli[i], r0s[i], r1s[i], out[0, i], out[1, i]
            for start in range(0, n, block):
                size = min(block, n - start)
                h0[:] = 0
                l0[:] = 0
                h1[:] = 0
                l1[:] = 0
                for t in range(terms):
                    # each term's block through a pointer to it, indexed by the loop's own
                    # counter: plain loads (an offset added inside the loop made the compiler
                    # read the words by gathers, 1.5-3x slower)
                    pt = numba.carray(word_pointer(plains[t] + 8 * (i * n + start)), (size,))
                    c0 = numba.carray(word_pointer(cts[t] + 8 * (i * n + start)), (size,))
                    c1 = numba.carray(word_pointer(cts[t] + 8 * ((rows + i) * n + start)),
                                      (size,))
                    for w in range(size):
                        a = pt[w]
                        h0[w], l0[w] = mac128(h0[w], l0[w], a, c0[w])
                        h1[w], l1[w] = mac128(h1[w], l1[w], a, c1[w])
                for w in range(size):
                    d0[start + w] = barrett128(h0[w], l0[w], q, r0, r1)
                    d1[start + w] = barrett128(h1[w], l1[w], q, r0, r1)

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def round_special(last: Any, half: Any, moduli: Any, ratios: Any, fixes: Any,
                      out: Any) -> None:
        """``out[j] = ((last + half) mod p) mod q_j + fix_j`` in ``[0, q_j)`` for ``last``
        below ``2p`` (``p`` the last modulus; ``fix_j = q_j - (half mod q_j)``): the special
        prime's part, rounded, in every other prime."""
        p = moduli[moduli.shape[0] - 1]
        for j in range(out.shape[0]):
            q, r, fix = moduli[j], ratios[j], fixes[j]
            dst = out[j]
            for w in range(last.shape[0]):
                x = last[w] + half
                x = x - p if x >= p else x
                x = x - p if x >= p else x
                t = barrett64(x, q, r) + fix
                dst[w] = t - q if t >= q else t

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def divide(acc: Any, t: Any, moduli: Any, inv: Any, inv_shoup: Any, out: Any) -> None:
        """``out[j] = (acc[j] - t[j]) p^-1 mod q_j`` for ``acc`` below ``q_j`` and ``t`` below
        ``4 q_j`` (``inv_shoup = floor(inv 2^64 / q_j)``)."""
        for j in range(out.shape[0]):
            q, f, fs = moduli[j], inv[j], inv_shoup[j]
            q4 = q << np.uint64(2)
            a, b, dst = acc[j], t[j], out[j]
            for w in range(dst.shape[0]):
                m = a[w] + q4 - b[w]
                m = m * f - mulhi(m, fs) * q
                dst[w] = m - q if m >= q else m

    return {"reduce_rows": reduce_rows, "canonical": canonical, "mac": mac,
            "product_sum": product_sum,
            "round_special": round_special, "divide": divide}


@dataclass
class Decomposed:
    """A ciphertext's first polynomial and its second's digits in every prime of its level and
    the special prime, NTT form (:meth:`Hoister.decompose`)."""
    source: Any               # the ciphertext (kept alive; its level, scale and form)
    c0: np.ndarray            # (L, N)
    digits: np.ndarray        # (L + 1, L, N): modulus, digit, word


@dataclass
class Extended:
    """A ciphertext times the special prime ``p``, in the primes of its level and ``p`` (NTT
    form, canonical words): a hoisted rotation before its division by ``p``, or a sum of
    plaintext products of such rotations (:meth:`Hoister.product_sum`). ``source``: a
    ciphertext at the same level (the template :meth:`Hoister.mod_down` writes into)."""
    source: Any
    words: np.ndarray         # (2, L + 1, N)


class _Prime:
    def __init__(self, value: int, log_n: int):
        self.value = int(value)
        self.modulus = seal.Modulus(self.value)
        self.tables = sys.modules[seal.Ciphertext.__module__].util.NTTTables(
            log_n, self.modulus)
        self.address = _cxx_address(self.tables)
        self.ratio = (1 << 64) // self.value
        r = (1 << 128) // self.value
        self.r0, self.r1 = r & ((1 << 64) - 1), r >> 64


class Hoister:
    """Hoisted rotations for ciphertexts of ``context`` with ``galois_keys`` (see the module
    docstring)."""

    def __init__(self, context: Any, galois_keys: Any):
        from he.native import _library
        self._context = context
        self._keys = galois_keys
        data = context.key_context_data()
        parms = data.parms()
        self.ring = int(parms.poly_modulus_degree())
        log_n = self.ring.bit_length() - 1
        self._primes = [_Prime(m.value(), log_n) for m in parms.coeff_modulus()]
        self._key_parms_id = context.key_parms_id()
        self._steps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._levels: dict[int, _Level] = {}
        self._has_key: dict[int, bool] = {}
        self._lock = threading.Lock()
        lib = _library()
        self._ntt, self._intt = getattr(lib, _NTT), getattr(lib, _INTT)
        self._assign = getattr(lib, _ASSIGN)
        for fn in (self._ntt, self._intt, self._assign):
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._k = kernels()
        #: words per block of the products' loops (:data:`PRODUCT_BLOCK`; a benchmark may set
        #: another size to compare, the results are the same)
        self.block = PRODUCT_BLOCK

    @classmethod
    def validated(cls, context: Any, galois_keys: Any, evaluator: Any, encoder: Any, probe: Any,
                  step: int) -> tuple["Hoister | None", str]:
        """A hoister checked on ``probe`` (a ciphertext in NTT form at the top level) and
        rotation ``step`` (a step with a Galois key), or None and why not.

        A ciphertext whose second polynomial is a constant has the same digits whatever the
        automorphism, so SEAL's rotation of it and a hoisted one do the same arithmetic: the
        check asks for the same words, at the top level and the next, which covers the
        layouts read, the keys' rows, the permutation and the division by the special prime.
        The products' sums are checked against exact integers, and extended plaintexts
        against SEAL's encoding at the level."""
        try:
            hoister = cls(context, galois_keys)
            hoister._validate(evaluator, encoder, probe, int(step))
        except Exception as exc:            # noqa: BLE001 -- any failure: SEAL rotates
            return None, f"hoisted rotations unavailable: {type(exc).__name__}: {exc}"
        return hoister, ""

    def _validate(self, evaluator: Any, encoder: Any, probe: Any, step: int) -> None:
        from he.native import galois_element
        if probe.size() != 2 or not probe.is_ntt_form():
            raise ValueError("the probe is not a two-polynomial ciphertext in NTT form")
        ct = seal.Ciphertext()
        self._assign(_cxx_address(ct), _cxx_address(probe))
        rng = np.random.default_rng(7)
        for depth in range(2):
            limbs = ct.coeff_modulus_size()
            lv = self._level(limbs)
            words = raw_access(ct).view(ct)
            constant = int(rng.integers(1, 1 << 20))
            words[limbs:2 * limbs] = (np.uint64(constant) % lv.moduli[:limbs])[:, None]
            for s in (step, -step):
                if not self._keys.has_key(galois_element(s, self.ring)):
                    if s == step:
                        raise ValueError(f"no Galois key for the probe step {step}")
                    continue
                expect = seal.Ciphertext()
                evaluator.rotate_vector(ct, s, self._keys, expect)
                got = self.rotate(self.decompose(ct), s)
                if not np.array_equal(raw_access(got).view(got), raw_access(expect).view(expect)) \
                        or got.scale != expect.scale or got.parms_id() != expect.parms_id():
                    raise ValueError(f"a hoisted rotation by {s} differs from SEAL's")
            values = rng.uniform(-1.0, 1.0, self.ring // 2).tolist()
            ext = self.extend_plain(encoder, values, 2.0 ** 20, limbs)
            pt = seal.Plaintext()
            encoder.encode(values, ct.parms_id(), 2.0 ** 20, pt)
            if not np.array_equal(ext[:limbs].ravel(), plain_words(pt)):
                raise ValueError("an extended plaintext differs from SEAL's encoding")
            self._check_sums(lv)
            if depth == 0:
                nxt = self._context.get_context_data(ct.parms_id()).next_context_data()
                if nxt is None:
                    break
                evaluator.mod_switch_to_next_inplace(ct)

    def _check_sums(self, lv: "_Level") -> None:
        """:meth:`product_sum`'s loop on random words of the level's primes against Python's
        integers."""
        rng = np.random.default_rng(3)
        rows, n, terms = lv.moduli.size, 8, 5
        top = lv.moduli[:, None]
        plains = [(rng.integers(0, 1 << 62, (rows, n), dtype=np.uint64) % top) for _ in
                  range(terms)]
        cts = [(rng.integers(0, 1 << 62, (2, rows, n), dtype=np.uint64) % top) for _ in
               range(terms)]
        out = np.empty((2, rows, n), dtype=np.uint64)
        self._k["product_sum"](np.array([p.ctypes.data for p in plains], dtype=np.int64),
                               np.array([c.ctypes.data for c in cts], dtype=np.int64),
                               lv.moduli, lv.r0, lv.r1, np.arange(rows), out, self.block)
        for c in range(2):
            for i in range(rows):
                q = int(lv.moduli[i])
                for w in range(n):
                    want = sum(int(p[i, w]) * int(x[c, i, w]) for p, x in zip(plains, cts)) % q
                    if int(out[c, i, w]) != want:
                        raise ValueError("the compiled product sums differ from exact integers")

    def _level(self, limbs: int) -> "_Level":
        level = self._levels.get(limbs)
        if level is None:
            level = self._levels[limbs] = _Level(self._primes, limbs)
        return level

    def decompose(self, ct: Any, pool: Any = None) -> Decomposed:
        """``ct``'s digits for :meth:`rotate_ext`: its second polynomial in coefficients (lazy
        inverse NTTs), each prime's digit reduced modulo every other prime and the special
        prime and taken to NTT form (lazy: words below four times the prime); the digit of a
        prime in itself is the ciphertext's own words. ``pool`` (a :class:`he.native.Pool`):
        the primes' rows are shared among its threads."""
        limbs = ct.coeff_modulus_size()
        lv = self._level(limbs)
        words = raw_access(ct).view(ct)
        c0 = np.array(words[:limbs])
        coeff = np.array(words[limbs:2 * limbs])
        digits = np.empty((limbs + 1, limbs, self.ring), dtype=np.uint64)
        threads = 1 if pool is None else min(pool.threads, limbs + 1)
        chunks = [np.arange(t, limbs + 1, threads) for t in range(threads)]

        def inverse(t: int) -> None:
            for j in range(t, limbs, threads):
                self._intt(coeff[j].ctypes.data, lv.primes[j].address)
            self._k["canonical"](coeff[t::threads], lv.moduli[:limbs][t::threads])

        def rows(t: int) -> None:
            self._k["reduce_rows"](coeff, lv.moduli, lv.ratios, chunks[t], digits)
            for i in chunks[t]:
                address = lv.primes[i].address
                for j in range(limbs):
                    if i == j:
                        digits[i, j] = words[limbs + j]
                    else:
                        self._ntt(digits[i, j].ctypes.data, address)

        if threads == 1:
            inverse(0)
            rows(0)
        else:
            pool.map(inverse, range(threads))
            pool.map(rows, range(threads))
        return Decomposed(ct, c0, digits)

    def _step(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's permutation of NTT words and its Galois key's words permuted by the
        inverse (``sum_j sigma(d_j) k_j = sigma(sum_j d_j sigma^-1(k_j))``: the products then
        read every array in order, and only their sums are permuted), made once per step."""
        from he.native import galois_element
        elt = galois_element(step, self.ring)
        got = self._steps.get(elt)
        if got is None:
            with self._lock:
                got = self._steps.get(elt)
                if got is None:
                    perm = galois_permutation(elt, self.ring)
                    inverse = np.argsort(perm)
                    k = len(self._primes)
                    keys = np.empty((len(self._keys.key(elt)), 2, k, self.ring),
                                    dtype=np.uint64)
                    for j, pk in enumerate(self._keys.key(elt)):
                        keys[j] = raw_access(pk.data()).view(pk.data()).reshape(
                            2, k, self.ring)[:, :, inverse]
                    got = self._steps[elt] = (perm, keys)
        return got

    def rotate_ext(self, dec: Decomposed, step: int, pool: Any = None) -> Extended:
        """The decomposed ciphertext rotated left by ``step`` slots, times the special prime
        (before :meth:`mod_down`): ``sigma(p c0 + sum_j d_j k_j')``, ``sigma(sum_j d_j
        k_j'')`` for the step's key ``k``. ``pool``: the primes' rows are shared among its
        threads."""
        perm, keys = self._step(step)
        limbs = dec.c0.shape[0]
        lv = self._level(limbs)
        out = np.empty((2, limbs + 1, self.ring), dtype=np.uint64)
        threads = 1 if pool is None else min(pool.threads, limbs + 1)

        def rows(t: int) -> None:
            self._k["mac"](dec.digits, keys, lv.key_rows, lv.moduli, lv.r0, lv.r1, perm,
                           dec.c0, lv.lift, lv.lift_shoup, np.arange(t, limbs + 1, threads), out,
                           self.block)

        if threads == 1:
            rows(0)
        else:
            pool.map(rows, range(threads))
        return Extended(dec.source, out)

    def product_sum(self, terms: Sequence[tuple[np.ndarray, Extended]],
                    pool: Any = None) -> Extended:
        """``sum_t plain_t * ext_t`` (plaintexts from :meth:`extend_plain` at the terms'
        level); ``pool``: the primes' rows are shared among its threads."""
        ext0 = terms[0][1]
        limbs = ext0.words.shape[1] - 1
        lv = self._level(limbs)
        for pt, ext in terms:
            if pt.shape != ext0.words.shape[1:] or ext.words.shape != ext0.words.shape:
                raise ValueError("plaintext and extended ciphertexts of different levels")
        plains = np.array([pt.ctypes.data for pt, _ in terms], dtype=np.int64)
        cts = np.array([ext.words.ctypes.data for _, ext in terms], dtype=np.int64)
        out = np.empty_like(ext0.words)
        threads = 1 if pool is None else min(pool.threads, limbs + 1)

        def rows(t: int) -> None:
            self._k["product_sum"](plains, cts, lv.moduli, lv.r0, lv.r1,
                                   np.arange(t, limbs + 1, threads), out, self.block)

        if threads == 1:
            rows(0)
        else:
            pool.map(rows, range(threads))
        return Extended(ext0.source, out)

    def add_ext(self, exts: Sequence[Extended]) -> Extended:
        """The sum of extended ciphertexts of one level (the first one's words overwritten):
        words below their primes (under 2^61) summed two at a time never pass 2^64."""
        acc = exts[0].words
        q = self._level(acc.shape[1] - 1).moduli.reshape(1, -1, 1)
        less = np.empty_like(acc)
        for ext in exts[1:]:
            if ext.words.shape != acc.shape:
                raise ValueError("extended ciphertexts of different levels")
            np.add(acc, ext.words, out=acc)
            # reduced: the smaller of the sum and the sum less the prime (which wraps around
            # to above the sum where the sum is below the prime)
            np.subtract(acc, q, out=less)
            np.minimum(acc, less, out=acc)
        return Extended(exts[0].source, acc)

    def mod_down(self, ext: Extended, scale: float, pool: Any = None) -> Any:
        """``ext`` divided by the special prime with rounding: a SEAL ciphertext at its level,
        of scale ``scale`` (``ext``'s words are overwritten). ``pool``: the two polynomials on
        two of its threads."""
        limbs = ext.words.shape[1] - 1
        lv = self._level(limbs)
        out = seal.Ciphertext()
        self._assign(_cxx_address(out), _cxx_address(ext.source))
        out.scale = float(scale)
        words = raw_access(out).view(out)
        special = lv.primes[-1]

        def divide(c: int) -> None:
            t = np.empty((limbs, self.ring), dtype=np.uint64)
            last = ext.words[c, limbs]
            self._intt(last.ctypes.data, special.address)
            self._k["round_special"](last, lv.half, lv.moduli, lv.ratios, lv.fixes, t)
            for j in range(limbs):
                self._ntt(t[j].ctypes.data, lv.primes[j].address)
            self._k["divide"](ext.words[c, :limbs], t, lv.moduli[:limbs], lv.inv, lv.inv_shoup,
                              words[c * limbs:(c + 1) * limbs])

        if pool is None or pool.threads < 2:
            divide(0)
            divide(1)
        else:
            pool.map(divide, range(2))
        return out

    def rotate(self, dec: Decomposed, step: int) -> Any:
        """The decomposed ciphertext rotated left by ``step`` slots (a SEAL ciphertext)."""
        return self.mod_down(self.rotate_ext(dec, step), dec.source.scale)

    def accepts(self, ct: Any, step: int) -> bool:
        """Whether ``ct`` can be rotated by ``step`` here: two polynomials in NTT form at a
        level of this context, not transparent, and a Galois key for the step."""
        from he.native import galois_element
        step %= self.ring // 2
        if not step or ct.size() != 2 or not ct.is_ntt_form() or ct.is_transparent() \
                or self._context.get_context_data(ct.parms_id()) is None:
            return False
        if step not in self._has_key:
            self._has_key[step] = bool(self._keys.has_key(galois_element(step, self.ring)))
        return self._has_key[step]

    def rotate_shared(self, ct: Any, step: int, pool: Any) -> Any:
        """``ct`` rotated left by ``step`` slots with every stage's work shared among the
        threads of ``pool`` (:meth:`decompose`, :meth:`rotate_ext`, :meth:`mod_down`): for a
        rotation nothing else runs beside, which SEAL would take on one thread (``pool`` None:
        on this one, the same words). Called from outside ``pool``'s threads."""
        return self.mod_down(self.rotate_ext(self.decompose(ct, pool), step, pool), ct.scale,
                             pool)

    def extend_plain(self, encoder: Any, values: Any, scale: float, limbs: int) -> np.ndarray:
        """``values`` encoded at ``scale`` in the first ``limbs`` primes and the special prime
        (the rows a product with an extended ciphertext of ``limbs`` primes reads): encoded
        in every prime of the key level, the rows of the other primes dropped."""
        pt = seal.Plaintext()
        encoder.encode(values, self._key_parms_id, float(scale), pt)
        words = plain_words(pt).reshape(len(self._primes), self.ring)
        return np.concatenate([words[:limbs], words[-1:]])


def plain_words(pt: Any) -> np.ndarray:
    """A copy of a plaintext's words (its coefficient array, read at the address its
    ``DynArray`` holds; sizes and sampled words checked against SEAL's accessors)."""
    arr = pt.dyn_array()
    base = _cxx_address(arr)
    count = int(ctypes.c_uint64.from_address(base + _DYN_SIZE).value)
    addr = int(ctypes.c_uint64.from_address(base + _DYN_DATA).value)
    if count != int(pt.coeff_count()) or count != arr.size() or not addr:
        raise RuntimeError("a plaintext's coefficient array is not where it was expected")
    words = np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(addr)).copy()
    for i in (0, count // 3, count - 1):
        if int(words[i]) != int(arr.at(i)):
            raise RuntimeError("a plaintext's words differ from SEAL's accessor")
    return words


class _Level:
    """A level's primes (``limbs`` of the chain, then the special prime) and the constants of
    :class:`Hoister` there."""

    def __init__(self, primes: Sequence[_Prime], limbs: int):
        self.primes = list(primes[:limbs]) + [primes[-1]]
        u64 = np.uint64
        self.moduli = np.array([p.value for p in self.primes], dtype=u64)
        self.ratios = np.array([p.ratio for p in self.primes], dtype=u64)
        self.r0 = np.array([p.r0 for p in self.primes], dtype=u64)
        self.r1 = np.array([p.r1 for p in self.primes], dtype=u64)
        self.key_rows = np.array(list(range(limbs)) + [len(primes) - 1], dtype=np.int64)
        special = self.primes[-1].value
        data = self.primes[:-1]
        self.half = u64(special >> 1)
        self.fixes = np.array([(p.value - (special >> 1) % p.value) % p.value for p in data],
                              dtype=u64)
        inv = [pow(special, -1, p.value) for p in data]
        self.inv = np.array(inv, dtype=u64)
        self.inv_shoup = np.array([(v << 64) // p.value for v, p in zip(inv, data)], dtype=u64)
        lift = [special % p.value for p in data]
        self.lift = np.array(lift, dtype=u64)
        self.lift_shoup = np.array([(v << 64) // p.value for v, p in zip(lift, data)], dtype=u64)


def _reverse_bits(x: np.ndarray, bits: int) -> np.ndarray:
    out = np.zeros_like(x)
    for b in range(bits):
        out |= ((x >> b) & 1) << (bits - 1 - b)
    return out


def galois_permutation(elt: int, ring: int) -> np.ndarray:
    """The permutation of NTT-form words that applies the automorphism ``X -> X^elt``:
    ``sigma(a)[w] = a[perm[w]]`` in SEAL's bit-reversed NTT order (its
    ``GaloisTool::generate_table_ntt``)."""
    log_n = ring.bit_length() - 1
    i = np.arange(ring, 2 * ring, dtype=np.int64)
    raw = ((int(elt) * _reverse_bits(i, log_n + 1)) >> 1) & (ring - 1)
    return _reverse_bits(raw, log_n)
