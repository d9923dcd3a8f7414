"""Ciphertexts as bytes: each RNS word in as many bytes as its prime needs, no compression pass.

SEAL's own serialisation (:func:`he.backend.save_object`) compresses every ciphertext with zstd
while holding Python's global interpreter lock: at N=16384 that is 1.4-4.7 ms per ciphertext,
as long as the encryption itself, and a client's threads take turns at it. The words of a CKKS
ciphertext are uniformly random below their prime, so what zstd saves is the unused high bytes
of each 64-bit word; writing each word of a limb in the bytes its largest word needs saves the
same (within a few percent) with one NumPy copy.

:func:`dumps` writes that form (``PNCT``), read through the ciphertext's words in place
(:class:`he.fused.RawAccess`; SEAL's form where that layout was not confirmed).
:func:`loads` takes either form. Every field of the compact form, its seed record and its
length are checked before anything is allocated. Its words are then written straight into a
SEAL ciphertext (one the caller reuses, where given), a seeded ciphertext's random half is
regenerated from its seed by SEAL without the GIL, and SEAL checks the result against the
context (metadata, scale bounds, every word reduced modulo its prime): :class:`DirectLoad`,
compared word for word with SEAL's own load before first use. Where that is unavailable, the
compact form is turned back into SEAL's uncompressed serialisation and SEAL loads it, with the
same checks. :func:`check` raises what :func:`loads` would, without regenerating the seed.

Layout (version 1, little-endian)::

    b"PNCT" | version (1) | flags (1: bit 0 seeded, bit 1 NTT form) | polynomials stored (1)
           | limbs (1) | parms id (4 x u64) | ring degree (u64) | size (u64) | scale (f64)
           | correction factor (u64) | bytes per word, one per limb (limbs x u8)
           | seeded only: SEAL's saved seed record (81 bytes)
           | words: per stored polynomial, per byte k (least significant first), byte k of
             the N words of each limb wider than k bytes, limb after limb

A seeded ciphertext (the client's secret-key encryptions) stores its first polynomial and the
seed of the second, as SEAL's own seeded form does.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Sequence

import numpy as np
import tenseal.sealapi as seal

from he.backend import SEAL_MAGIC, load_object, save_object
from he.errors import SerializationError
from he.native import SEED_PRNG_TYPES
from he.params import MAX_MODULUS_BITS

__all__ = ["dumps", "loads", "check", "encrypt_bytes", "ciphertext_bytes", "DirectLoad",
           "seal_loads"]

_MAGIC = b"PNCT"
_VERSION = 1
_SEEDED, _NTT = 1, 2
_FIXED = struct.Struct("<4sBBBB4QQQdQ")
# SEAL's serialisation header: magic, header size, version major and minor, compression
# mode, reserved, total size (seal::Serialization::SEALHeader)
_SEAL_HEADER = struct.Struct("<HBBBBHQ")
# a seeded ciphertext's second polynomial starts with this word, then SEAL's saved seed record
# (its header, the generator type and the 64-byte seed)
_SEED_MARKER = np.uint64(0xFFFFFFFFFFFFFFFF)
_SEED_BYTES = _SEAL_HEADER.size + 1 + 64
_MAX_LIMBS = 64
_MAX_SIZE = 16          # SEAL_CIPHERTEXT_SIZE_MAX


@lru_cache(maxsize=1)
def _seal_version() -> tuple[int, int]:
    """The version SEAL writes in its headers (and so accepts back)."""
    head = save_object(seal.Ciphertext())
    magic, _, major, minor, *_ = _SEAL_HEADER.unpack_from(head)
    if magic != SEAL_MAGIC:
        raise RuntimeError("SEAL's serialisation header is not what this module reads")
    return major, minor


def _seal_header(total: int) -> bytes:
    major, minor = _seal_version()
    return _SEAL_HEADER.pack(SEAL_MAGIC, _SEAL_HEADER.size, major, minor, 0, 0, total)


def _raw(ct: Any) -> Any:
    from he.fused import raw_access
    if not isinstance(ct, seal.Ciphertext) or sys.byteorder != "little" \
            or not ct.is_ntt_form() or ct.size() < 2:
        return None
    raw = raw_access(ct)
    return raw if raw.ok else None


def dumps(ct: Any) -> bytes:
    """``ct`` (a SEAL ciphertext) as bytes in the compact form; SEAL's own where its words
    cannot be read in place (or for SEAL's ``Serializable`` wrapper, which hides them)."""
    raw = _raw(ct)
    if raw is None:
        return save_object(ct)
    rows = raw.view(ct)
    n, limbs, size = ct.poly_modulus_degree(), ct.coeff_modulus_size(), ct.size()
    seeded = size == 2 and rows[limbs, 0] == _SEED_MARKER
    stored = 1 if seeded else size
    words = rows[:stored * limbs].reshape(stored, limbs, n)
    seed = rows[limbs, 1:1 + math.ceil(_SEED_BYTES / 8)].tobytes()[:_SEED_BYTES] \
        if seeded else b""
    return _compact([int(p) for p in ct.parms_id()], size, float(ct.scale), words, seed)


def _compact(parms_id: Sequence[int], size: int, scale: float, words: np.ndarray,
             seed: bytes) -> bytes:
    """The compact form of a ciphertext of ``size`` polynomials at ``parms_id``: ``words``
    (polynomials stored x limbs x N, uint64), ``seed`` SEAL's seed record of the second
    polynomial where only the first is stored (else empty)."""
    stored, limbs, n = words.shape
    widths = [max(1, (int(words[:, l].max()).bit_length() + 7) // 8) for l in range(limbs)]
    # CKKS keeps the correction factor (a BGV notion) at 1
    head = _FIXED.pack(_MAGIC, _VERSION, (_SEEDED if seed else 0) | _NTT, stored, limbs,
                       *parms_id, n, size, float(scale), 1)
    parts = [head, bytes(widths), bytes(seed)]
    planes = _byte_planes(widths)
    for p in range(stored):
        for k, limbs_k in enumerate(planes):
            # byte k of every word of the limbs that wide (contiguous copies, a strided
            # one is ten times slower)
            parts.append((words[p, limbs_k] >> np.uint64(8 * k)).astype(np.uint8).tobytes())
    return b"".join(parts)


def _byte_planes(widths: list[int]) -> list[slice | list[int]]:
    """Per byte k (least significant first), the limbs whose words are wider than k bytes."""
    out: list[slice | list[int]] = []
    for k in range(max(widths)):
        limbs = [l for l, w in enumerate(widths) if w > k]
        out.append(slice(None) if len(limbs) == len(widths) else limbs)
    return out


def ciphertext_bytes(ring: int, prime_bits: Sequence[int], polys: int) -> int:
    """Bytes :func:`dumps` writes for a ciphertext of ring degree ``ring`` whose limbs' primes
    have ``prime_bits`` bits, storing ``polys`` polynomials: 1 for a client's seeded encryption
    (the other is its seed), 2 for a server's result. A limb of a ``b``-bit prime takes
    ``ceil(b / 8)`` bytes per word: SEAL's ``b``-bit primes lie just below ``2^b``, so each
    word reaches the top bit with probability about 1/2, and the largest of ``N`` falls short
    of it with probability about ``2^-N``."""
    words = sum((int(b) + 7) // 8 for b in prime_bits)
    seed = _SEED_BYTES if polys == 1 else 0
    return _FIXED.size + len(prime_bits) + seed + int(polys) * int(ring) * words


def _field_error(what: str, why: str) -> SerializationError:
    return SerializationError(f"{what}: malformed ciphertext bytes ({why})")


_WORKSPACE = threading.local()


def _words_buffer(count: int) -> np.ndarray:
    """A zeroed ``(count, 8)`` byte array, reused by this thread: a fresh one of a ciphertext's
    size is first-touched page by page, which costs more than the rest of the load."""
    buf = getattr(_WORKSPACE, "buf", None)
    if buf is None or buf.shape[0] < count:
        buf = _WORKSPACE.buf = np.zeros((count, 8), dtype=np.uint8)
    out = buf[:count]
    out.fill(0)
    return out


@dataclass(frozen=True)
class _Head:
    """The fields of a compact-form ciphertext (:func:`_parse`)."""
    parms_id: tuple[int, int, int, int]
    n: int
    limbs: int
    size: int
    stored: int
    scale: float
    widths: list[int]
    seed: bytes          # SEAL's seed record of the second polynomial (seeded only)
    words_at: int        # where the byte planes start

    @property
    def seeded(self) -> bool:
        return bool(self.seed)


def _parse(data: Any, what: str) -> _Head:
    """The header of the compact form ``data``, every field, the seed record and the length
    checked against what the header describes before anything is allocated."""
    if len(data) < _FIXED.size:
        raise _field_error(what, "truncated header")
    (magic, version, flags, stored, limbs, p0, p1, p2, p3, n, size, scale,
     correction) = _FIXED.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise _field_error(what, f"unknown format version {version}")
    if flags & ~(_SEEDED | _NTT) or not flags & _NTT:
        raise _field_error(what, f"unknown flags {flags:#x}")
    seeded = bool(flags & _SEEDED)
    if n not in MAX_MODULUS_BITS or not 1 <= limbs <= _MAX_LIMBS or not 2 <= size <= _MAX_SIZE \
            or stored != (1 if seeded else size) or (seeded and size != 2):
        raise _field_error(what, f"ring degree {n}, {limbs} limbs, size {size}, {stored} "
                                 f"polynomials stored")
    if not (math.isfinite(scale) and scale > 0.0) or correction != 1:
        raise _field_error(what, "scale or correction factor")
    pos = _FIXED.size
    if len(data) < pos + limbs:
        raise _field_error(what, "truncated word widths")
    widths = list(data[pos:pos + limbs])
    pos += limbs
    if any(not 1 <= w <= 8 for w in widths):
        raise _field_error(what, f"word widths {widths}")
    seed = b""
    if seeded:
        seed = bytes(data[pos:pos + _SEED_BYTES])
        pos += _SEED_BYTES
        if len(seed) == _SEED_BYTES:
            head = _SEAL_HEADER.unpack_from(seed)
            # SEAL's record of a seed (seal::UniformRandomGeneratorInfo): its header, the
            # generator (one SEAL knows) and 64 bytes
            if head[:2] != (SEAL_MAGIC, _SEAL_HEADER.size) or head[2:4] != _seal_version() \
                    or head[4] != 0 or head[6] != _SEED_BYTES \
                    or seed[_SEAL_HEADER.size] not in SEED_PRNG_TYPES:
                raise _field_error(what, "seed record")
    if len(data) != pos + stored * n * sum(widths):
        raise _field_error(what, f"{len(data)} bytes where the header describes "
                                 f"{pos + stored * n * sum(widths)}")
    return _Head((p0, p1, p2, p3), n, limbs, size, stored, scale, widths, seed, pos)


def _scatter(data: Any, head: _Head, words: np.ndarray) -> None:
    """The byte planes of ``data`` written into ``words`` (stored polynomials x limbs x N x 8
    bytes, zero), each word's bytes from least significant."""
    pos = head.words_at
    n, limbs = head.n, head.limbs
    for p in range(head.stored):
        for k, limbs_k in enumerate(_byte_planes(head.widths)):
            count_k = limbs if isinstance(limbs_k, slice) else len(limbs_k)
            words[p, limbs_k, :, k] = np.frombuffer(data, np.uint8, count_k * n,
                                                    pos).reshape(count_k, n)
            pos += count_k * n


def _to_seal(data: Any, head: _Head) -> list[Any]:
    """SEAL's uncompressed serialisation of the compact form ``data`` (header ``head``,
    checked), as buffers to write one after the other."""
    count = head.stored * head.limbs * head.n
    words = _words_buffer(count).reshape(head.stored, head.limbs, head.n, 8)
    _scatter(data, head, words)
    members = (struct.pack("<4Q", *head.parms_id) + b"\x01"
               + struct.pack("<QQQdQ", head.size, head.n, head.limbs, head.scale, 1))
    dyn_size = _SEAL_HEADER.size + 8 + count * 8
    total = _SEAL_HEADER.size + len(members) + dyn_size + len(head.seed)
    return [_seal_header(total) + members + _seal_header(dyn_size) + struct.pack("<Q", count),
            memoryview(words.reshape(-1)), head.seed]


class DirectLoad:
    """Compact-form ciphertexts of one context loaded straight into a SEAL ciphertext's words,
    without SEAL's stream: the words written in place (:class:`he.fused.RawAccess`), a seeded
    ciphertext's random half regenerated by SEAL without the GIL
    (:class:`he.native.SeedExpander`), then SEAL's own check that the result is valid for the
    context (metadata, scale bounds, every word reduced). A server's threads load a request's
    ciphertexts at once, each into a buffer it reuses.

    Before first use, a seeded and an unseeded probe (random words, a random seed) are loaded
    both ways and must agree word for word with SEAL's load; anything else leaves :attr:`ok`
    false with :attr:`reason`, and :func:`loads` keeps SEAL's."""

    def __init__(self, context: Any):
        from he.native import SeedExpander
        self.ok = False
        self.reason = ""
        self.context = context
        self._expander = SeedExpander(context)
        if not self._expander.ok:
            self.reason = self._expander.reason
            return
        try:
            self._validate()
            self.ok = True
        except (_Mismatch, SerializationError) as exc:
            self.reason = str(exc)

    def _validate(self) -> None:
        from he.fused import raw_access
        ctx = self.context
        data = ctx.first_context_data()
        moduli = [int(q.value()) for q in data.parms().coeff_modulus()]
        n = int(data.parms().poly_modulus_degree())
        pid = [int(w) for w in data.parms_id()]
        rng = np.random.default_rng()
        words = np.stack([np.stack([rng.integers(0, q, n, dtype=np.uint64) for q in moduli])
                          for _ in range(2)])
        scale = 2.0 ** min(20, sum(q.bit_length() for q in moduli) - 2)
        major, minor = _seal_version()
        seed = (_SEAL_HEADER.pack(SEAL_MAGIC, _SEAL_HEADER.size, major, minor, 0, 0, _SEED_BYTES)
                + bytes([SEED_PRNG_TYPES[0]]) + rng.bytes(64))
        for blob in (_compact(pid, 2, scale, words[:1], seed), _compact(pid, 2, scale, words, b"")):
            head = _parse(blob, "probe")
            try:
                want = load_object(seal.Ciphertext, ctx, _to_seal(blob, head), "probe")
            except SerializationError as exc:
                raise _Mismatch(f"SEAL does not load the probe: {exc}") from None
            raw = raw_access(want)
            if not raw.ok:
                raise _Mismatch(f"the binding's ciphertext layout: {raw.reason}")
            got = self.load(head, blob, "probe")
            if [int(w) for w in got.parms_id()] != pid or got.size() != 2 \
                    or not got.is_ntt_form() or float(got.scale) != scale \
                    or not np.array_equal(raw.view(got), raw.view(want)):
                raise _Mismatch("a direct load differs from SEAL's")

    def load(self, head: _Head, data: Any, what: str, into: Any = None,
             expand: bool = True) -> Any:
        """The ciphertext of ``data`` (header ``head``, :func:`_parse`) in ``into`` (resized; a
        new ciphertext where None). ``expand=False`` leaves a seeded ciphertext's second
        polynomial zero (:func:`check`: the seed record was checked, its expansion cannot
        fail)."""
        from he.fused import raw_access
        ct = seal.Ciphertext() if into is None else into
        try:
            ct.resize(self.context, list(head.parms_id), head.size)
        except (ValueError, RuntimeError, TypeError) as exc:
            raise SerializationError(f"{what}: malformed, truncated or for other parameters "
                                     f"({exc})") from exc
        if ct.poly_modulus_degree() != head.n or ct.coeff_modulus_size() != head.limbs:
            raise _field_error(what, f"ring degree {head.n} or {head.limbs} limbs are not its "
                                     f"parameters'")
        raw = raw_access(ct)
        raw.mark_ntt_form(ct)
        ct.scale = head.scale
        rows = raw.view(ct)
        stored = rows[:head.stored * head.limbs]
        stored.fill(0)
        _scatter(data, head, stored.view(np.uint8).reshape(head.stored, head.limbs, head.n, 8))
        if head.seeded:
            if expand:
                at = _SEAL_HEADER.size
                self._expander.expand(ct, head.seed[at], head.seed[at + 1:], _seal_version())
            else:
                rows[head.limbs:].fill(0)
        if not seal.is_valid_for(ct, self.context):
            raise SerializationError(f"{what}: malformed, truncated or for other parameters "
                                     f"(SEAL finds it not valid for them: a word not reduced, "
                                     f"or a scale out of bounds)")
        return ct


class _Mismatch(Exception):
    pass


#: the direct loads of the last few contexts (each validated once), with the contexts
_DIRECT: "OrderedDict[int, DirectLoad]" = OrderedDict()
_DIRECT_LOCK = threading.Lock()


_SEAL_ONLY = [False]


@contextmanager
def seal_loads() -> Iterator[None]:
    """Within it, :func:`loads` and :func:`check` of this process go through SEAL's own stream
    (one ciphertext at a time, under the GIL): the baseline the direct loads are measured
    against, with the same bytes and results."""
    before = _SEAL_ONLY[0]
    _SEAL_ONLY[0] = True
    try:
        yield
    finally:
        _SEAL_ONLY[0] = before


def _direct(context: Any) -> DirectLoad | None:
    """``context``'s validated :class:`DirectLoad`, None where it is unavailable."""
    if _SEAL_ONLY[0]:
        return None
    with _DIRECT_LOCK:
        d = _DIRECT.get(id(context))
        if d is None or d.context is not context:
            d = _DIRECT[id(context)] = DirectLoad(context)
            while len(_DIRECT) > 4:
                _DIRECT.popitem(last=False)
        else:
            _DIRECT.move_to_end(id(context))
    return d if d.ok else None


def loads(context: Any, data: Any, what: str, into: Any = None) -> Any:
    """A SEAL ciphertext of ``context`` from :func:`dumps`' bytes (either form), validated by
    SEAL; anything malformed, truncated or of other parameters is a
    :class:`~he.errors.SerializationError`. ``into``: a ciphertext whose storage the result
    may take (it is the result where it was used)."""
    if data[:4] == _MAGIC:
        head = _parse(data, what)
        direct = _direct(context)
        if direct is not None:
            return direct.load(head, data, what, into)
        return load_object(seal.Ciphertext, context, _to_seal(data, head), what)
    return load_object(seal.Ciphertext, context, data, what)


def check(context: Any, data: Any, what: str) -> None:
    """Raise what :func:`loads` would raise on ``data``, at less cost where the direct load is
    available (into this thread's scratch ciphertext, a seed's expansion skipped: the seed
    record was checked, and its expansion cannot fail)."""
    if data[:4] == _MAGIC:
        head = _parse(data, what)
        direct = _direct(context)
        if direct is not None:
            scratch = getattr(_WORKSPACE, "ct", None)
            if scratch is None:
                scratch = _WORKSPACE.ct = seal.Ciphertext()
            direct.load(head, data, what, scratch, expand=False)
            return
    loads(context, data, what)


def encrypt_bytes(plain: Any, encryptor: Any, native: Any = None) -> bytes:
    """``plain`` encrypted with the secret key, as bytes: through ``native`` (a validated
    :class:`he.native.NativeEncryptor`, without the GIL) in the compact form where it is
    usable, else SEAL's encryptor and its own seeded form. What a client sends per input
    ciphertext, and what the cost model times as ``encrypt``."""
    if native is not None and native.ok:
        return dumps(native.encrypt(plain))
    return save_object(encryptor.encrypt_symmetric(plain))
