"""Thin layer over SEAL (``tenseal.sealapi``): contexts, level/scale bookkeeping, byte I/O.

Scale discipline: a ciphertext at level ``l`` (after ``l`` rescales) always carries the canonical
scale ``S[l]``, with ``S[0] = 2^scale_bits`` and ``S[l+1] = S[l]^2 / q_l`` (``q_l`` the prime
dropped by the ``l``-th rescale). A ciphertext-ciphertext product of two level-``l`` values lands
exactly on ``S[l+1]``; a plaintext product encodes its plaintext at scale ``S[l]`` and lands there
too; a value at a lower level is lifted by a multiplication with an encoded 1 chosen so that it
arrives on the canonical scale. Additions therefore never meet mismatched scales.

A wide chain (``params.pending`` 0 or 1, see :class:`~he.params.CKKSParams`) keeps two levels
per prime: a pending level carries ``2^(2 scale_bits)`` and a product from it rescales by a prime
of twice the scale back to ``2^scale_bits``, its plaintext encoded at ``plain_scales[l] =
S[l+1] q / S[l]``; a product from the other levels rescales nothing. Ciphertext products happen
only from non-pending levels.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Callable, Mapping

import numpy as np
import tenseal.sealapi as seal

from he.errors import ParameterError, SerializationError
from he.native import NativeEvaluator, Pool, default_threads, galois_element
from he.params import CKKSParams, seal_security_level
from he.plan import rotation_path

__all__ = ["Engine", "build_context", "save_object", "load_object", "galois_elements",
           "SEAL_MAGIC"]

#: The first two bytes of everything SEAL serialises (``seal::Serialization::seal_magic``,
#: 0xA15E little-endian)
SEAL_MAGIC = 0xA15E


def build_context(params: CKKSParams) -> Any:
    """A SEAL CKKS context for ``params`` with its security level enforced by SEAL itself."""
    params.check()
    enc = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    enc.set_poly_modulus_degree(params.poly_modulus_degree)
    try:
        enc.set_coeff_modulus(seal.CoeffModulus.Create(params.poly_modulus_degree,
                                                       list(params.coeff_mod_bit_sizes)))
    except (ValueError, RuntimeError) as exc:
        raise ParameterError(f"SEAL cannot build the modulus chain {params.coeff_mod_bit_sizes} "
                             f"for N={params.poly_modulus_degree}: {exc}") from exc
    ctx = seal.SEALContext(enc, True, seal_security_level(params.security_bits))
    if not ctx.parameters_set():
        raise ParameterError(f"SEAL rejected the parameters: {ctx.parameters_error_message()}")
    return ctx


def galois_elements(steps: list[int], ring_degree: int) -> list[int]:
    """SEAL Galois elements for left rotations by ``steps`` slots (``3^step mod 2N``)."""
    half = ring_degree // 2
    return sorted({galois_element(s, ring_degree) for s in steps if int(s) % half})


# SEAL reads and writes files only; a memory-backed directory, where there is one, saves the disk
_TMPDIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
#: objects larger than this go through the default (disk) temporary directory instead: a
#: memory-backed file would hold one more copy of them (Galois keys of deep programs reach GBs)
#: that memory pressure cannot reclaim, as it can a disk file's page cache
_SHM_MAX_BYTES = 64 << 20


def _tmpdir(large: bool) -> str | None:
    """Where a SEAL object passes through on its way to or from bytes."""
    return None if large else _TMPDIR


def save_object(obj: Any, large: bool | None = None) -> bytes:
    """Serialise a SEAL object (ciphertext, key, ...) to bytes (SEAL's own zstd format).
    ``large``: it may pass :data:`_SHM_MAX_BYTES` (default: Galois keys, the objects that grow
    large; SEAL does not say how large before saving), so it goes through the disk."""
    large = isinstance(obj, seal.GaloisKeys) if large is None else bool(large)
    fd, path = tempfile.mkstemp(prefix="polynets-he-", dir=_tmpdir(large))
    os.close(fd)
    try:
        obj.save(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def load_object(factory: Callable[[], Any], context: Any, data: Any, what: str) -> Any:
    """Load bytes written by :func:`save_object` into a fresh ``factory()`` object. ``data``:
    the bytes, or a list of buffers that are those bytes one after the other.

    SEAL validates the header, sizes and that every coefficient is reduced for ``context``; any
    failure becomes a :class:`SerializationError`.
    """
    parts = data if isinstance(data, list) else [data]
    head = bytes(parts[0][:16]) if parts else b""
    if len(head) < 16 or int.from_bytes(head[:2], "little") != SEAL_MAGIC:
        raise SerializationError(f"{what}: not SEAL data (bad magic bytes or truncated)")
    size = sum(memoryview(p).nbytes for p in parts)
    fd, path = tempfile.mkstemp(prefix="polynets-he-", dir=_tmpdir(size > _SHM_MAX_BYTES))
    try:
        with os.fdopen(fd, "wb") as f:
            for p in parts:
                f.write(p)
        obj = factory()
        try:
            obj.load(context, path)
        except (ValueError, RuntimeError, TypeError, IndexError, MemoryError) as exc:
            raise SerializationError(f"{what}: malformed, truncated or for other parameters "
                                     f"({exc})") from exc
        if not seal.is_valid_for(obj, context):
            raise SerializationError(f"{what}: does not belong to this parameter set")
        return obj
    finally:
        os.unlink(path)


class Engine:
    """Encoder, evaluator and the level/scale bookkeeping for one parameter set."""

    def __init__(self, params: CKKSParams, context: Any | None = None):
        self.params = params
        self.context = context if context is not None else build_context(params)
        self.encoder = seal.CKKSEncoder(self.context)
        self.evaluator = seal.Evaluator(self.context)
        self.slots = self.encoder.slot_count()
        chain_ids: list[Any] = []
        primes: list[int] = []
        data = self.context.first_context_data()
        while data is not None:
            chain_ids.append(data.parms_id())
            primes.append(data.parms().coeff_modulus()[-1].value())
            data = data.next_context_data()
        self.top_chain = self.context.first_context_data().chain_index()
        #: the encoded ones a lift multiplies by, per (from, to) level (:meth:`lift`)
        self._ones: dict[tuple[int, int], Any] = {}
        self._chain_ids = chain_ids
        #: parms id of every level (a wide chain has two levels per prime)
        self.parms_ids = [chain_ids[params.chain_index(lv)] for lv in range(params.levels + 1)]
        #: the levels each number of dropped primes holds (two per prime on a wide chain)
        self._levels_of_chain: dict[int, list[int]] = {}
        for lv in range(params.levels + 1):
            self._levels_of_chain.setdefault(params.chain_index(lv), []).append(lv)
        sb = params.scale_bits
        if params.pending < 0:
            # S[l+1] = S[l]^2 / q_l doubles any offset of log2 S from the scale at every level,
            # so S[0] is chosen where the offsets of the primes cancel: log2 S[l] then stays
            # within the primes' own offsets of scale_bits however long the chain (2^scale_bits
            # exactly would drift by a factor (q/2^scale_bits)^(2^l) and leave SEAL's bounds on
            # deep chains)
            offset = sum((math.log2(float(primes[k])) - sb) / 2.0 ** (k + 1)
                         for k in range(params.levels))
            self.scales = [2.0 ** (sb + offset)]
            for level in range(params.levels):
                s = self.scales[-1]
                self.scales.append(s * s / float(primes[level]))
            #: scale of a plaintext multiplied into a level-l value: the product, rescaled by
            #: the prime the level drops, lands on S[l+1]
            self.plain_scales = self.scales[:-1]
        else:
            # wide: pending levels carry exactly 2^(2 sb), the others 2^sb; a product from a
            # pending level divides by its prime q, so its plaintext carries S[l+1] q / S[l]
            self.scales = [2.0 ** params.scale_bits_at(lv) for lv in range(params.levels + 1)]
            self.plain_scales = [
                self.scales[lv + 1] * (float(primes[params.chain_index(lv)])
                                       if params.drops(lv) else 1.0) / self.scales[lv]
                for lv in range(params.levels)]
        self.relin_keys: Any = None
        self.galois_keys: Any = None
        #: rotation steps the Galois keys cover when they are a key basis; None: every step
        self.key_steps: frozenset[int] | None = None
        #: rotations and plaintext products without the GIL (:mod:`he.native`), once
        #: :meth:`use_threads` validated them
        self.native: NativeEvaluator | None = None
        #: threads that rotate one ciphertext group's values at once
        self.pool = Pool(1)
        #: hoisted baby steps (:mod:`he.hoist`), once :meth:`use_hoisting` validated them
        self.hoister: Any = None
        #: a rotation that runs alone has its key switching's stages shared among the threads
        #: (:meth:`rotate_alone`; a plan's :attr:`he.plan.VectorPlan.shares_rotations`)
        self.share_rotations = False

    def use_hoisting(self, probe: Any, probe_step: int) -> str:
        """Rotate the baby steps of a plan that asks for it (:attr:`he.plan.VectorPlan.hoisted`)
        from one decomposition of each input (:class:`he.hoist.Hoister`, validated on
        ``probe``, a top-level ciphertext, and ``probe_step``, a step with a Galois key);
        returns why not where it cannot or the environment says not (:func:`he.hoist.refused`;
        SEAL then rotates them one by one), else ``""``."""
        from he.hoist import Hoister, refused
        self.hoister, why = None, refused()
        if not why:
            self.hoister, why = Hoister.validated(self.context, self.galois_keys,
                                                  self.evaluator, self.encoder, probe, probe_step)
        return why

    def use_threads(self, threads: int | None, probe: Any, probe_step: int | None) -> str:
        """Rotate, multiply and rescale on ``threads`` threads (None: every core this process
        may use) where SEAL can be called without the GIL (:mod:`he.native`, validated on
        ``probe``, a top-level ciphertext, rotated by ``probe_step`` where there are Galois
        keys); returns why not where it cannot, else ``""``."""
        n = default_threads() if threads is None else int(threads)
        if n < 1:
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        if n == 1 or (self.galois_keys is None and self.relin_keys is None):
            self.native, self.pool = None, Pool(1)
            return ""
        # a plaintext at the scale products take at the top level (a program without levels
        # multiplies by none: the canonical one)
        scale = self.plain_scales[0] if self.plain_scales else self.scales[0]
        plain = self.encode_vector(np.linspace(-1.0, 1.0, self.slots), 0, scale)
        native = NativeEvaluator(self.context, self.evaluator, self.galois_keys, probe,
                                 probe_step, plain, self.relin_keys)
        if not native.ok:
            self.native, self.pool = None, Pool(1)
            return native.reason
        self.native, self.pool = native, Pool(n)
        return ""

    # --------------------------------------------------------------------- bookkeeping
    def chain(self, ct: Any) -> int:
        """Primes dropped from ``ct``'s chain."""
        return self.top_chain - self.context.get_context_data(ct.parms_id()).chain_index()

    def level(self, ct: Any) -> int:
        chain = self.chain(ct)
        if self.params.pending < 0:
            return chain
        # a wide chain's prime holds a pending and a canonical level: the scale tells them apart
        return min(self._levels_of_chain[chain],
                   key=lambda lv: abs(math.log2(ct.scale / self.scales[lv])))

    def encode_vector(self, values: np.ndarray, level: int, scale: float) -> Any:
        pt = seal.Plaintext()
        self.encoder.encode(np.asarray(values, dtype=np.float64).tolist(),
                            self.parms_ids[level], scale, pt)
        return pt

    def encode_scalar(self, value: float, level: int, scale: float) -> Any:
        pt = seal.Plaintext()
        self.encoder.encode(float(value), self.parms_ids[level], scale, pt)
        return pt

    def _canon(self, ct: Any, level: int | None = None) -> Any:
        ct.scale = self.scales[self.level(ct) if level is None else level]
        return ct

    # --------------------------------------------------------------------- arithmetic
    def lift(self, ct: Any, level: int, out: Any = None) -> Any:
        """Return ``ct`` at ``level`` (>= its own) on the canonical scale, value unchanged: ``ct``
        itself where it is there already, else a new ciphertext (``out`` where given, a buffer
        whose storage is reused)."""
        cur = self.level(ct)
        if cur == level:
            return ct
        if cur > level:
            raise ParameterError(f"cannot lower a level-{cur} ciphertext to level {level}")
        target = self.params.chain_index(level)
        res = seal.Ciphertext() if out is None else out
        out = ct
        one = self._ones.get((cur, level))
        if not self.params.lift_rescales(cur, level):
            # a wide chain's canonical level to its pending one: a product with 1, no rescale
            if one is None:
                one = self._ones[(cur, level)] = self.encode_scalar(
                    1.0, level, self.scales[level] / self.scales[cur])
            self.evaluator.multiply_plain(out, one, res)
            return self._canon(res, level)
        # down to the chain just above the target, then a product with 1 at scale p and a
        # rescale by that chain's last prime q: p = S[level] * q / S[cur] (encoded once)
        prev = self._chain_ids[target - 1]
        if self.chain(ct) < target - 1:
            out = seal.Ciphertext()
            self.evaluator.mod_switch_to(ct, prev, out)
        if one is None:
            q = float(self.context.get_context_data(prev).parms().coeff_modulus()[-1].value())
            one = self._ones[(cur, level)] = seal.Plaintext()
            self.encoder.encode(1.0, prev, self.scales[level] * q / self.scales[cur], one)
        self.evaluator.multiply_plain(out, one, res)
        self.rescale_into(res, res)
        return self._canon(res, level)

    def drop_to(self, ct: Any, level: int, inplace: bool = False) -> Any:
        """``ct`` on the primes of ``level`` (at or below its own), its value and scale
        unchanged: a modulus switch, no rescale (:func:`he.params.returned_level` says where
        the value still fits). ``ct`` itself where it is on them already, or where
        ``inplace`` (switched in its own storage)."""
        target = self.params.chain_index(level)
        if self.chain(ct) >= target:
            return ct
        if inplace:
            self.evaluator.mod_switch_to_inplace(ct, self._chain_ids[target])
            return ct
        out = seal.Ciphertext()
        self.evaluator.mod_switch_to(ct, self._chain_ids[target], out)
        return out

    def rescale_into(self, ct: Any, dst: Any) -> None:
        """``dst <- ct`` rescaled by its last prime (``dst`` may be ``ct``): natively where
        :mod:`he.native` accepts it, else through ``tenseal.sealapi`` (same words)."""
        if self.native is not None and self.native.accepts_rescale(ct):
            self.native.rescale(ct, dst)
        else:
            self.evaluator.rescale_to_next(ct, dst)

    def rescale(self, ct: Any) -> Any:
        self.rescale_into(ct, ct)
        return self._canon(ct)

    def to_level(self, ct: Any, level: int, into: Any = None) -> Any:
        """Finish a product (plaintext products at :attr:`plain_scales`, or two ciphertexts'
        of a non-pending level) that reaches ``level``: rescale where the level drops a prime,
        then the canonical scale. ``into``: a buffer a rescale writes to, leaving ``ct`` (a
        scratch ciphertext) unchanged -- the result is ``into`` where the level rescales, else
        ``ct``; in place, the result keeps ``ct``'s storage, a prime (and a relinearised
        product's polynomial) larger than it needs."""
        if self.chain(ct) < self.params.chain_index(level):
            dst = ct if into is None else into
            self.rescale_into(ct, dst)
            return self._canon(dst, level)
        return self._canon(ct, level)

    def mul_plain(self, ct: Any, pt: Any) -> Any:
        """``ct * pt`` without rescale (plaintext encoded at scale S[level(ct)])."""
        native = self.native
        if native is not None and native.accepts_product(ct, pt):
            return native.multiply_plain(ct, pt)
        out = seal.Ciphertext()
        self.evaluator.multiply_plain(ct, pt, out)
        return out

    def mul_plain_into(self, ct: Any, pt: Any, out: Any) -> None:
        """``out <- ct * pt`` without rescale, reusing ``out``'s memory."""
        self.evaluator.multiply_plain(ct, pt, out)

    def copy_into(self, ct: Any, out: Any) -> None:
        """``out <- ct`` (level, scale, words), in ``out``'s storage where it holds them: SEAL's
        assignment, natively where :mod:`he.native` is validated, else a negation into ``out``
        undone in place (SEAL's negation assigns first)."""
        if self.native is not None:
            self.native.assign(out, ct)
        else:
            self.evaluator.negate(ct, out)
            self.evaluator.negate_inplace(out)

    @staticmethod
    def new_ciphertext() -> Any:
        """An empty SEAL ciphertext (a buffer for :meth:`mul_plain_into`)."""
        return seal.Ciphertext()

    def prefault(self, buffers: Mapping[float, int], like: Any) -> list[Any]:
        """Ciphertexts whose storage is allocated and written (``buffers``: bytes of one
        ciphertext's storage -> how many, :func:`he.tiling.allocations`; sizes that are no
        ciphertext of these parameters are skipped), for results to be written into
        (:func:`he.runtime.run_batch`'s ``spare``): their first writes find pages the kernel has
        already mapped and zeroed. ``like``: a ciphertext of this context in NTT form (an
        encryption of zero), whose form each buffer takes (a copy of it switched to the
        buffer's level, the rest of its storage zero), so that results written word by word
        (:mod:`he.fused`) need no copy first to give the buffer its form."""
        n = self.params.poly_modulus_degree
        level_of = {self.params.limbs(level): level for level in range(self.params.levels + 1)}
        held = []
        forms: dict[int, Any] = {}
        for nbytes, count in buffers.items():
            words = int(round(float(nbytes) / 8))
            shape = next(((size, words // (size * n)) for size in (2, 3)
                          if words % (size * n) == 0 and words // (size * n) in level_of), None)
            if shape is None or count <= 0:
                continue
            size, limbs = shape
            level = level_of[limbs]
            pid = self.parms_ids[level]
            if level not in forms:
                forms[level] = seal.Ciphertext()
                self.evaluator.mod_switch_to(like, pid, forms[level])
            for _ in range(int(count)):
                ct = seal.Ciphertext(self.context, pid, size)     # storage reserved ...
                self.evaluator.negate(forms[level], ct)           # ... written in its form
                ct.resize(self.context, pid, size)                # ... the rest zeros
                held.append(ct)
        return held

    def mul_scalar(self, ct: Any, value: float) -> Any:
        """``ct * value`` without rescale."""
        return self.mul_plain(ct, self.encode_scalar(value, self.level(ct),
                                                     self.plain_scales[self.level(ct)]))

    def mul_int(self, ct: Any, value: int) -> Any:
        """``ct * value`` for an integer: exact, keeps the level and the scale."""
        if value == 1:
            return ct
        if value == -1:
            out = seal.Ciphertext()
            self.evaluator.negate(ct, out)
            return out
        out = self.mul_plain(ct, self.encode_scalar(float(value), self.level(ct), 1.0))
        return self._canon(out)

    def multiply(self, a: Any, b: Any, out: Any = None, into: Any = None) -> Any:
        """``a * b`` (relinearised and rescaled), both lifted to a common level first. ``out``:
        a scratch ciphertext to compute in; ``into``: where its rescale writes the result
        (see :meth:`to_level`)."""
        level = max(self.level(a), self.level(b))
        a, b = self.lift(a, level), self.lift(b, level)
        if self.params.is_pending(level):
            raise ParameterError(f"a ciphertext product from pending level {level}")
        out = seal.Ciphertext() if out is None else out
        if self.native is not None and self.native.accepts_ct_product(a, b):
            self.native.product(a, b, out)
        else:
            if a is b:
                self.evaluator.square(a, out)
            else:
                self.evaluator.multiply(a, b, out)
            self.evaluator.relinearize_inplace(out, self.relin_keys)
        return self.to_level(out, level + 1, into=into)

    def multiply_lazy(self, a: Any, b: Any, out: Any) -> Any:
        """``out <- a * b`` neither relinearised nor rescaled: three polynomials at the inputs'
        common level, carrying the product of their scales (``out``: a buffer of three
        polynomials at that level, whose storage is reused)."""
        level = max(self.level(a), self.level(b))
        a, b = self.lift(a, level), self.lift(b, level)
        if self.params.is_pending(level):
            raise ParameterError(f"a ciphertext product from pending level {level}")
        if self.native is not None and self.native.accepts_ct_product(a, b):
            return self.native.product(a, b, out, relinearize=False)
        if a is b:
            self.evaluator.square(a, out)
        else:
            self.evaluator.multiply(a, b, out)
        return out

    def add(self, a: Any, b: Any, out: Any = None) -> Any:
        """``a + b``, both lifted to a common level first, in a new ciphertext (``out`` where
        given, a buffer whose storage is reused)."""
        level = max(self.level(a), self.level(b))
        a, b = self.lift(a, level), self.lift(b, level)
        out = seal.Ciphertext() if out is None else out
        self.evaluator.add(a, b, out)
        return out

    def add_inplace(self, acc: Any, b: Any) -> None:
        self.evaluator.add_inplace(acc, b)

    def add_plain(self, ct: Any, pt: Any) -> Any:
        """``ct + pt`` for a plaintext encoded at ct's level and canonical scale."""
        out = seal.Ciphertext()
        self.evaluator.add_plain(ct, pt, out)
        return out

    def add_scalar_inplace(self, ct: Any, value: float) -> None:
        """``ct += value`` (encoded at ``ct``'s level and scale), in ``ct``'s storage."""
        self.evaluator.add_plain_inplace(ct, self.encode_scalar(value, self.level(ct),
                                                                ct.scale))

    def add_plain_scalar(self, ct: Any, value: float) -> Any:
        level = self.level(ct)
        out = seal.Ciphertext()
        self.evaluator.add_plain(ct, self.encode_scalar(value, level, self.scales[level]), out)
        return out

    def shared_pool(self) -> Any:
        """The threads that share the work of one rotation or decomposition that runs alone
        (:attr:`share_rotations`); None: this thread does it."""
        return self.pool if self.share_rotations and self.pool.threads > 1 else None

    def rotate_alone(self, ct: Any, step: int) -> Any:
        """``ct`` rotated left by ``step`` slots where nothing else runs beside (a fold, from
        outside the engine's threads): where a hoister was validated and the plan shares
        rotations, each key switching's stages shared among the threads
        (:meth:`he.hoist.Hoister.rotate_shared`, the same words on one thread as on several),
        else :meth:`rotate`."""
        hoister, pool = self.hoister, self.shared_pool()
        if hoister is None or not self.share_rotations:
            return self.rotate(ct, step)
        for s in rotation_path(step, self.slots, self.key_steps):
            ct = hoister.rotate_shared(ct, s, pool) if hoister.accepts(ct, s) \
                else self.rotate(ct, s)
        return ct

    def rotate(self, ct: Any, step: int) -> Any:
        """``ct`` rotated left by ``step`` slots: one key switching, or where the keys are a
        power-of-two basis (:attr:`key_steps`), the composition :func:`he.plan.rotation_path`
        gives."""
        native = self.native
        for s in rotation_path(step, self.slots, self.key_steps):
            if native is not None and native.accepts_rotation(ct, s):
                ct = native.rotate(ct, s)
                continue
            out = seal.Ciphertext()
            self.evaluator.rotate_vector(ct, s, self.galois_keys, out)
            ct = out
        return ct
