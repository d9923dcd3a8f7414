"""SEAL's rotations, plaintext and ciphertext products, relinearisations and rescales called
without Python's global interpreter lock, so one sample's maps (vector packing) or one group's
products and rescales (batch packing) use every core.

``tenseal.sealapi`` holds the GIL through every call, so threads that rotate take as long as one.
The extension module that defines ``tenseal.sealapi``'s classes also exports SEAL's own C++
symbols, and a :mod:`ctypes` call releases the GIL. :class:`NativeEvaluator` rotates by calling
``seal::Evaluator::rotate_internal``, and multiplies by a plaintext with
``seal::Evaluator::multiply_plain_inplace``, on a copy made by ``seal::Ciphertext::operator=``;
ciphertext products are ``multiply_inplace`` / ``square_inplace`` then ``relinearize_internal``,
rescales ``rescale_to_next``,
on the very objects ``tenseal.sealapi`` created (their C++ addresses follow the binding's object layout,
as in :mod:`he.fused`). SEAL takes its memory pool handle by value, which the Itanium C++ ABI
passes by address: the handle of a fresh, empty ciphertext is lent, and SEAL takes it over (or
copies it), so the pool's reference count stays balanced either way.

A C++ exception cannot cross :mod:`ctypes`, so every call first checks what SEAL would refuse
(:meth:`NativeEvaluator.accepts_rotation`, :meth:`NativeEvaluator.accepts_product`,
:meth:`NativeEvaluator.accepts_ct_product`, :meth:`NativeEvaluator.accepts_rescale`) and leaves
anything else to ``tenseal.sealapi``, whose errors are Python exceptions. Before the first use,
rotations, products and rescales of a probe ciphertext are compared byte for byte with
``tenseal.sealapi``'s; a missing symbol, another platform or any mismatch leaves
:attr:`NativeEvaluator.ok` false with the reason, and the runtime keeps ``tenseal.sealapi``
(one core).

A client's secret-key encryptions go the same way (:class:`NativeEncryptor`, through
``seal::Encryptor::encrypt_internal``), so its threads encrypt a request's ciphertexts at once.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, TypeVar

import numpy as np
import tenseal.sealapi as seal

from he.fused import _DYN_OFFSET, _cxx_address, raw_access

__all__ = ["NativeEvaluator", "NativeEncryptor", "SeedExpander", "Pool", "default_threads",
           "native_platform", "galois_element", "NATIVE_PLATFORMS"]

#: (system, machine) pairs where SEAL's symbols are called natively: the Itanium C++ ABI
#: (non-trivial arguments passed by address) and the binding's layout as validated here
NATIVE_PLATFORMS = (("Linux", "x86_64"), ("Linux", "aarch64"))

_ROTATE = ("_ZNK4seal9Evaluator15rotate_internalERNS_10CiphertextEiRKNS_10GaloisKeysENS_16"
           "MemoryPoolHandleE")
_ASSIGN = "_ZN4seal10CiphertextaSERKS0_"
_MUL_PLAIN = ("_ZNK4seal9Evaluator22multiply_plain_inplaceERNS_10CiphertextERKNS_9PlaintextENS_16"
              "MemoryPoolHandleE")
_MUL = "_ZNK4seal9Evaluator16multiply_inplaceERNS_10CiphertextERKS1_NS_16MemoryPoolHandleE"
_SQUARE = "_ZNK4seal9Evaluator14square_inplaceERNS_10CiphertextENS_16MemoryPoolHandleE"
_RELIN = ("_ZNK4seal9Evaluator20relinearize_internalERNS_10CiphertextERKNS_9RelinKeysEmNS_16"
          "MemoryPoolHandleE")
_RESCALE = "_ZNK4seal9Evaluator15rescale_to_nextERKNS_10CiphertextERS1_NS_16MemoryPoolHandleE"
_ENCRYPT = ("_ZNK4seal9Encryptor16encrypt_internalERKNS_9PlaintextEbbRNS_10CiphertextENS_16"
            "MemoryPoolHandleE")
_EXPAND_SEED = ("_ZN4seal10Ciphertext11expand_seedERKNS_11SEALContextERKNS_26UniformRandomGenerator"
                "InfoENS_11SEALVersionE")
#: the generators a seed may name (``seal::prng_type``: blake2xb, shake256); SEAL refuses any
#: other by an exception, which a native call could not carry
SEED_PRNG_TYPES = (1, 2)
T = TypeVar("T")


def galois_element(step: int, ring: int) -> int:
    """SEAL's Galois element for a left rotation by ``step`` slots in ring ``ring``
    (``3^(step mod N/2) mod 2N``; 1, the identity, for a multiple of ``N/2``)."""
    return pow(3, int(step) % (ring // 2), 2 * ring)


def default_threads() -> int:
    """Cores this process may run on (its CPU affinity where the platform reports one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class NativeEvaluator:
    """Rotations and plaintext products of SEAL ciphertexts that release the GIL (see the module
    docstring).

    ``rotate(ct, step)`` returns a new ciphertext, ``ct`` rotated left by ``step`` slots with the
    Galois key of that step; ``multiply_plain(ct, pt)`` a new ciphertext ``ct * pt``. ``ok``
    says whether the native path was validated, ``reason`` why not. ``probe_plain``: a nonzero
    plaintext at the probe's level and scale, for the product's validation.
    """

    def __init__(self, context: Any, evaluator: Any, galois_keys: Any, probe: Any,
                 probe_step: int | None, probe_plain: Any, relin_keys: Any = None):
        self.ok = False
        self.reason = ""
        self._context = context
        self._evaluator = evaluator
        self._keys = galois_keys
        self._relin = relin_keys
        self._ring = int(context.first_context_data().parms().poly_modulus_degree())
        #: bits of the modulus at every level (SEAL's bound on a product's scale)
        self._parms: dict[tuple[int, ...], int] = {}
        #: per level with a next one: that level's modulus bits and the prime a rescale drops
        self._next: dict[tuple[int, ...], tuple[int, float]] = {}
        data = context.first_context_data()
        while data is not None:
            self._parms[tuple(data.parms_id())] = int(data.total_coeff_modulus_bit_count())
            nxt = data.next_context_data()
            if nxt is not None:
                self._next[tuple(data.parms_id())] = (
                    int(nxt.total_coeff_modulus_bit_count()),
                    float(data.parms().coeff_modulus()[-1].value()))
            data = nxt
        self._has_key: dict[int, bool] = {}
        try:
            self._bind()
            self._validate(probe, probe_step, probe_plain)
            self.ok = True
        except _Unavailable as exc:
            self.reason = str(exc)

    def _bind(self) -> None:
        lib = _library()
        try:
            rotate = getattr(lib, _ROTATE)
            assign = getattr(lib, _ASSIGN)
            mul_plain = getattr(lib, _MUL_PLAIN)
            mul, square = getattr(lib, _MUL), getattr(lib, _SQUARE)
            relin, rescale = getattr(lib, _RELIN), getattr(lib, _RESCALE)
        except (OSError, AttributeError) as exc:
            raise _Unavailable(f"SEAL's symbols are not exported: {exc}") from None
        ptr = ctypes.c_void_p
        rotate.restype = None
        rotate.argtypes = [ptr, ptr, ctypes.c_int, ptr, ptr]
        assign.restype = ptr
        assign.argtypes = [ptr, ptr]
        for fn in (mul_plain, mul, rescale):        # (this, ct, other, pool)
            fn.restype = None
            fn.argtypes = [ptr, ptr, ptr, ptr]
        square.restype = None
        square.argtypes = [ptr, ptr, ptr]
        relin.restype = None
        relin.argtypes = [ptr, ptr, ptr, ctypes.c_size_t, ptr]
        self._rotate_fn, self._assign_fn, self._mul_plain_fn = rotate, assign, mul_plain
        self._mul_fn, self._square_fn, self._relin_fn, self._rescale_fn = \
            mul, square, relin, rescale
        self._ev = _cxx_address(self._evaluator)
        self._gk = _cxx_address(self._keys) if self._keys is not None else 0
        self._rk = _cxx_address(self._relin) if self._relin is not None else 0
        if not self._ev or (self._keys is not None and not self._gk) \
                or (self._relin is not None and not self._rk):
            raise _Unavailable("the binding's object layout is not the expected one")

    def _validate(self, probe: Any, step: int, plain: Any) -> None:
        from he.backend import save_object
        _check_layout(probe)
        holders = (seal.Ciphertext(), seal.Ciphertext())
        words = [(ctypes.c_uint64 * 2).from_address(_cxx_address(h) + _DYN_OFFSET)
                 for h in holders]
        if not words[0][0] or not words[0][1] or words[0][0] != words[1][0]:
            raise _Unavailable("a ciphertext's memory pool handle is not where it was expected")
        if (self._keys is not None and not self.accepts_rotation(probe, step)) \
                or not self.accepts_product(probe, plain):
            raise _Unavailable("the probe ciphertext, plaintext or Galois key is not usable")
        for s in ((step, -step) if self._keys is not None else ()):
            if not self._key(s):
                continue
            expect = seal.Ciphertext()
            self._evaluator.rotate_vector(probe, s, self._keys, expect)
            if save_object(self.rotate(probe, s)) != save_object(expect):
                raise _Unavailable("a native rotation differs from tenseal.sealapi's")
        expect = seal.Ciphertext()
        self._evaluator.multiply_plain(probe, plain, expect)
        if save_object(self.multiply_plain(probe, plain)) != save_object(expect):
            raise _Unavailable("a native plaintext product differs from tenseal.sealapi's")
        if self._relin is not None:
            self._validate_products(probe)

    def _validate_products(self, probe: Any) -> None:
        from he.backend import save_object
        other = self._copy(probe)
        for b in (probe, other):                    # a square, then a product of two
            if not self.accepts_ct_product(probe, b):
                raise _Unavailable("the probe ciphertext cannot be multiplied here")
            expect = seal.Ciphertext()
            if b is probe:
                self._evaluator.square(probe, expect)
            else:
                self._evaluator.multiply(probe, b, expect)
            self._evaluator.relinearize_inplace(expect, self._relin)
            got = self.product(probe, b, seal.Ciphertext())
            if save_object(got) != save_object(expect):
                raise _Unavailable("a native ciphertext product differs from tenseal.sealapi's")
            if not self.accepts_rescale(expect):
                raise _Unavailable("the probe product cannot be rescaled here")
            into = seal.Ciphertext()
            self._evaluator.rescale_to_next(expect, into)
            if save_object(self.rescale(got, seal.Ciphertext())) != save_object(into):
                raise _Unavailable("a native rescale differs from tenseal.sealapi's")

    def _key(self, step: int) -> bool:
        half = self._ring // 2
        s = int(step) % half
        if s not in self._has_key:
            self._has_key[s] = bool(s) and bool(
                self._keys.has_key(galois_element(s, self._ring)))
        return self._has_key[s]

    def accepts_rotation(self, ct: Any, step: int) -> bool:
        """True when SEAL would rotate ``ct`` by ``step`` without raising: two polynomials in
        NTT form at a level of this context, not transparent, and a Galois key for the step."""
        return ct.size() == 2 and ct.is_ntt_form() and tuple(ct.parms_id()) in self._parms \
            and not ct.is_transparent() and self._key(step)

    def accepts_product(self, ct: Any, pt: Any) -> bool:
        """True when SEAL would multiply ``ct`` by ``pt`` without raising: both in NTT form at
        the same level of this context, the product's scale within that level's modulus, and
        neither transparent nor zero (a transparent result)."""
        bits = self._parms.get(tuple(ct.parms_id()))
        if bits is None or not ct.is_ntt_form() or not pt.is_ntt_form() \
                or list(pt.parms_id()) != list(ct.parms_id()):
            return False
        scale = float(ct.scale) * float(pt.scale)
        return 0.0 < scale and math.log2(scale) < bits - 1 and not ct.is_transparent() \
            and not pt.is_zero()

    def accepts_ct_product(self, a: Any, b: Any) -> bool:
        """True when SEAL would multiply ``a`` by ``b`` and relinearise without raising: relin
        keys given, two polynomials each in NTT form at the same level, neither transparent,
        the product's scale within that level's modulus."""
        if self._relin is None:
            return False
        bits = self._parms.get(tuple(a.parms_id()))
        if bits is None or a.size() != 2 or b.size() != 2 or not a.is_ntt_form() \
                or not b.is_ntt_form() or list(a.parms_id()) != list(b.parms_id()) \
                or a.is_transparent() or b.is_transparent():
            return False
        scale = float(a.scale) * float(b.scale)
        return 0.0 < scale and math.log2(scale) < bits - 1

    def accepts_rescale(self, ct: Any) -> bool:
        """True when SEAL would rescale ``ct`` to the next level without raising: in NTT form,
        not at the chain's end, the divided scale within the next level's modulus."""
        nxt = self._next.get(tuple(ct.parms_id()))
        if nxt is None or not ct.is_ntt_form() or ct.is_transparent():
            return False
        scale = float(ct.scale) / nxt[1]
        return 1.0 <= scale and math.log2(scale) < nxt[0] - 1

    def _call(self, fn: Any, *args: Any) -> None:
        """``fn(evaluator, *args, pool)``: one of SEAL's ``Evaluator`` members, called without
        the GIL (:func:`_lend_pool`)."""
        _lend_pool(fn, self._ev, *args)

    def product(self, a: Any, b: Any, out: Any, relinearize: bool = True) -> Any:
        """``out <- a * b`` relinearised to two polynomials (three polynomials where not
        ``relinearize``), without the GIL (``out``'s storage reused); the caller has checked
        :meth:`accepts_ct_product`."""
        self._assign_fn(_cxx_address(out), _cxx_address(a))
        if a is b:
            self._call(self._square_fn, _cxx_address(out))
        else:
            self._call(self._mul_fn, _cxx_address(out), _cxx_address(b))
        if relinearize:
            self._call(self._relin_fn, _cxx_address(out), self._rk, 2)
        return out

    def rescale(self, ct: Any, into: Any) -> Any:
        """``into <- ct`` rescaled by its last prime, without the GIL (``into`` may be ``ct``);
        the caller has checked :meth:`accepts_rescale`."""
        self._call(self._rescale_fn, _cxx_address(ct), _cxx_address(into))
        return into

    def assign(self, out: Any, ct: Any) -> Any:
        """``out <- ct`` by SEAL's assignment (``out``'s storage reused where it holds ``ct``'s
        words)."""
        self._assign_fn(_cxx_address(out), _cxx_address(ct))
        return out

    def _copy(self, ct: Any) -> Any:
        return self.assign(seal.Ciphertext(), ct)

    def rotate(self, ct: Any, step: int) -> Any:
        """``ct`` rotated left by ``step`` slots (one key switching), without the GIL; the
        caller has checked :meth:`accepts_rotation`."""
        out = self._copy(ct)
        self._call(self._rotate_fn, _cxx_address(out), int(step), self._gk)
        return out

    def multiply_plain(self, ct: Any, pt: Any) -> Any:
        """``ct * pt`` without rescale, without the GIL; the caller has checked
        :meth:`accepts_product`."""
        out = self._copy(ct)
        self._call(self._mul_plain_fn, _cxx_address(out), _cxx_address(pt))
        return out


class _Unavailable(Exception):
    pass


def native_platform() -> bool:
    """Whether SEAL's symbols may be called natively here (:data:`NATIVE_PLATFORMS`, little
    endian); :class:`NativeEvaluator` and :class:`NativeEncryptor` still validate before use."""
    return sys.byteorder == "little" and \
        (platform.system(), platform.machine()) in NATIVE_PLATFORMS


def _library() -> ctypes.CDLL:
    """The extension module that defines ``tenseal.sealapi``'s classes, opened by
    :mod:`ctypes` (whose calls release the GIL)."""
    if not native_platform():
        raise _Unavailable(f"no native SEAL calls on {platform.system()} {platform.machine()}")
    module = sys.modules.get(seal.Ciphertext.__module__)
    path = getattr(module, "__file__", None)
    if not path:
        raise _Unavailable("the SEAL extension module's file is unknown")
    try:
        return ctypes.CDLL(path)
    except OSError as exc:
        raise _Unavailable(f"the SEAL extension module cannot be opened: {exc}") from None


def _check_layout(ct: Any) -> None:
    """The binding's object layout, checked on ``ct`` against SEAL's own accessors
    (:func:`he.fused.raw_access`) before any address is handed to SEAL."""
    raw = raw_access(ct)
    if not raw.ok:
        raise _Unavailable(f"the binding's ciphertext layout is not the expected one: "
                           f"{raw.reason}")


def _lend_pool(fn: Any, *args: Any) -> None:
    """``fn(*args, pool)`` without the GIL, the pool handle of a fresh, empty ciphertext lent
    as its last argument (see the module docstring)."""
    holder = seal.Ciphertext()
    fn(*args, _cxx_address(holder) + _DYN_OFFSET)


class NativeEncryptor:
    """Secret-key encryption of CKKS plaintexts without the GIL, so a client's threads encrypt
    a request's ciphertexts at once (encoding and serialising, in ``tenseal.sealapi``, hold the
    GIL and take turns).

    ``encrypt(pt)`` calls ``seal::Encryptor::encrypt_internal`` (symmetric, seed saved: the
    ciphertext serialises in SEAL's seeded form, as ``encrypt_symmetric``'s does) on
    ``encryptor``, which must hold the secret key. Encryption is randomised, so it cannot be
    compared byte for byte: before the first use a probe plaintext (``probe_plain``, nonzero)
    is encrypted natively, checked for its level, scale and form, serialised, loaded back
    through SEAL's validation and decrypted with ``decryptor``; its error must stay within 16
    times that of ``tenseal.sealapi``'s own encryption of the same plaintext (and ``2^10`` over
    its scale). Anything else leaves :attr:`ok` false with :attr:`reason`, and callers keep
    ``tenseal.sealapi``.
    """

    def __init__(self, context: Any, encryptor: Any, decryptor: Any, encoder: Any,
                 probe_plain: Any):
        self.ok = False
        self.reason = ""
        self._encryptor = encryptor
        #: per level of the context, the words of a plaintext there (what SEAL checks)
        self._words: dict[tuple[int, ...], int] = {}
        data = context.first_context_data()
        while data is not None:
            parms = data.parms()
            self._words[tuple(data.parms_id())] = \
                int(parms.poly_modulus_degree()) * len(parms.coeff_modulus())
            data = data.next_context_data()
        try:
            try:
                fn = getattr(_library(), _ENCRYPT)
            except AttributeError as exc:
                raise _Unavailable(f"SEAL's symbols are not exported: {exc}") from None
            ptr = ctypes.c_void_p
            fn.restype = None
            fn.argtypes = [ptr, ptr, ctypes.c_bool, ctypes.c_bool, ptr, ptr]
            self._fn = fn
            self._enc = _cxx_address(encryptor)
            if not self._enc:
                raise _Unavailable("the binding's object layout is not the expected one")
            self._validate(context, decryptor, encoder, probe_plain)
            self.ok = True
        except _Unavailable as exc:
            self.reason = str(exc)

    def accepts(self, pt: Any) -> bool:
        """True when SEAL would encrypt ``pt`` without raising: in NTT form at a level of this
        context, with that level's number of words."""
        return pt.is_ntt_form() and \
            self._words.get(tuple(pt.parms_id())) == int(pt.coeff_count())

    def encrypt(self, pt: Any) -> Any:
        """A fresh ciphertext of ``pt`` (NTT form, at ``pt``'s level and scale), encrypted with
        the secret key, its random half kept as a seed; called without the GIL. A plaintext
        SEAL would refuse (:meth:`accepts`) raises ValueError."""
        if not self.accepts(pt):
            raise ValueError("the plaintext is not in NTT form at a level of this context")
        out = seal.Ciphertext()
        _lend_pool(self._fn, self._enc, _cxx_address(pt), False, True, _cxx_address(out))
        return out

    def _validate(self, context: Any, decryptor: Any, encoder: Any, pt: Any) -> None:
        from he.backend import load_object, save_object
        if not self.accepts(pt) or pt.is_zero():
            raise _Unavailable("the probe plaintext is not usable")
        # SEAL's own encryption first: an encryptor without the secret key raises here, as a
        # Python exception, before any native call could
        try:
            expect = save_object(self._encryptor.encrypt_symmetric(pt))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _Unavailable(f"the encryptor cannot encrypt with a secret key: {exc}") from None

        def error(ct: Any) -> float:
            out = seal.Plaintext()
            decryptor.decrypt(ct, out)
            got = np.asarray(encoder.decode_double(out))
            return float(np.max(np.abs(got - want)))

        want = np.asarray(encoder.decode_double(pt))
        try:
            reference = load_object(seal.Ciphertext, context, expect, "encryption")
        except Exception as exc:                   # noqa: BLE001 - any failure disables it
            raise _Unavailable(f"SEAL's own encryption does not load back: {exc}") from None
        _check_layout(reference)
        ct = self.encrypt(pt)
        if ct.size() != 2 or not ct.is_ntt_form() or list(ct.parms_id()) != list(pt.parms_id()) \
                or float(ct.scale) != float(pt.scale):
            raise _Unavailable("a native encryption's level, scale or form is not the plaintext's")
        blob = save_object(ct)
        if abs(len(blob) - len(expect)) > len(expect) // 8:
            raise _Unavailable("a native encryption does not serialise in the seeded form")
        try:
            loaded = load_object(seal.Ciphertext, context, blob, "native encryption")
        except Exception as exc:                   # noqa: BLE001 - any failure disables it
            raise _Unavailable(f"a native encryption does not load back: {exc}") from None
        bound = max(16.0 * error(reference), 2.0 ** 10 / float(pt.scale))
        if not error(loaded) <= bound:
            raise _Unavailable("a native encryption does not decrypt to its plaintext")


class SeedExpander:
    """The random half of a seeded ciphertext regenerated from its seed without the GIL
    (``seal::Ciphertext::expand_seed``), so that a server's threads load a request's ciphertexts
    at once (:func:`he.wire.loads`).

    ``context``'s C++ address is checked first: its key, first and last parameters ids must be
    where SEAL's ``SEALContext`` keeps them (after its memory pool handle). :attr:`ok` says
    whether the symbol and the layout were found, :attr:`reason` why not; the words it
    generates are compared with SEAL's own load by the caller before use
    (:class:`he.wire.DirectLoad`)."""

    def __init__(self, context: Any):
        self.ok = False
        self.reason = ""
        self._context = context
        try:
            try:
                fn = getattr(_library(), _EXPAND_SEED)
            except AttributeError as exc:
                raise _Unavailable(f"SEAL's symbols are not exported: {exc}") from None
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
            addr = _cxx_address(context)
            if not addr or addr % 8:
                raise _Unavailable("no C++ object address for the context")
            words = list((ctypes.c_uint64 * 14).from_address(addr))[2:]
            ids = [int(w) for pid in (context.key_parms_id(), context.first_parms_id(),
                                      context.last_parms_id()) for w in pid]
            if [int(w) for w in words] != ids:
                raise _Unavailable("the context's parameters ids are not where expected")
            self._fn, self._addr = fn, addr
            self.ok = True
        except _Unavailable as exc:
            self.reason = str(exc)

    def expand(self, ct: Any, prng_type: int, seed: bytes, version: tuple[int, int]) -> None:
        """Write the second polynomial of ``ct`` from ``seed`` (64 bytes) with generator
        ``prng_type`` as SEAL of ``version`` (major, minor) would. ``ct`` holds two or more
        polynomials at a parameters id of the context (its ``resize`` with the context checked
        that); anything SEAL would refuse raises ValueError first."""
        if not self.ok:
            raise ValueError(f"no native seed expansion: {self.reason}")
        if int(prng_type) not in SEED_PRNG_TYPES or len(seed) != 64 or ct.size() < 2 \
                or self._context.get_context_data(ct.parms_id()) is None:
            raise ValueError("a seed SEAL would not expand")
        # seal::UniformRandomGeneratorInfo: the generator type (one byte), the seed at 8
        info = ctypes.create_string_buffer(72)
        info[0] = int(prng_type)
        info[8:72] = bytes(seed)
        major, minor = version
        self._fn(_cxx_address(ct), self._addr, ctypes.addressof(info),
                 (int(major) & 0xFF) | (int(minor) & 0xFF) << 8)


class Pool:
    """A thread pool of ``threads`` workers (one: everything runs in the caller's thread).

    A process forked from one whose pool had started its threads inherits none of them, so a
    pool used in another process than its creator's starts a pool of its own there.
    """

    def __init__(self, threads: int):
        self.threads = max(1, int(threads))
        self._ex: ThreadPoolExecutor | None = None
        self._pid = -1

    def map(self, fn: Callable[..., T], items: Iterable[Any]) -> list[T]:
        items = list(items)
        if self.threads == 1 or len(items) < 2:
            return [fn(x) for x in items]
        if self._ex is None or self._pid != os.getpid():
            self._ex, self._pid = ThreadPoolExecutor(self.threads), os.getpid()
        return list(self._ex.map(fn, items))
