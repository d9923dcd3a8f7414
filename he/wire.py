"""Ciphertexts as bytes: each RNS word in as many bytes as its prime needs, no compression pass.

SEAL's own serialisation (:func:`he.backend.save_object`) compresses every ciphertext with zstd
while holding Python's global interpreter lock: at N=16384 that is 1.4-4.7 ms per ciphertext,
as long as the encryption itself, and a client's threads take turns at it. The words of a CKKS
ciphertext are uniformly random below their prime, so what zstd saves is the unused high bytes
of each 64-bit word; writing each word of a limb in the bytes its largest word needs saves the
same (within a few percent) with one NumPy copy.

:func:`dumps` writes that form (``PNCT``), read through the ciphertext's words in place
(:class:`he.fused.RawAccess`; SEAL's form where that layout was not confirmed).
:func:`loads` takes either form. The compact form is turned back into SEAL's uncompressed
serialisation, after every field and the length have been checked, and SEAL loads it: SEAL
checks the metadata against the context, expands a seeded ciphertext's random half from its
seed, and refuses any word not reduced modulo its prime, as for its own bytes.

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
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import tenseal.sealapi as seal

from he.backend import SEAL_MAGIC, load_object, save_object
from he.errors import SerializationError
from he.params import MAX_MODULUS_BITS

__all__ = ["dumps", "loads", "encrypt_bytes", "ciphertext_bytes"]

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
    widths = [max(1, (int(words[:, l].max()).bit_length() + 7) // 8) for l in range(limbs)]
    parms = [int(p) for p in ct.parms_id()]
    # CKKS keeps the correction factor (a BGV notion) at 1
    head = _FIXED.pack(_MAGIC, _VERSION, (_SEEDED if seeded else 0) | _NTT, stored, limbs,
                       *parms, n, size, float(ct.scale), 1)
    parts = [head, bytes(widths)]
    if seeded:
        parts.append(rows[limbs, 1:1 + math.ceil(_SEED_BYTES / 8)].tobytes()[:_SEED_BYTES])
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


def _to_seal(data: bytes, what: str) -> list[Any]:
    """SEAL's uncompressed serialisation of the compact form ``data``, as buffers to write one
    after the other, every field and the length checked before anything is allocated."""
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
        seed = data[pos:pos + _SEED_BYTES]
        pos += _SEED_BYTES
    if len(data) != pos + stored * n * sum(widths):
        raise _field_error(what, f"{len(data)} bytes where the header describes "
                                 f"{pos + stored * n * sum(widths)}")
    count = stored * limbs * n
    words = _words_buffer(count).reshape(stored, limbs, n, 8)
    planes = _byte_planes(widths)
    for p in range(stored):
        for k, limbs_k in enumerate(planes):
            count_k = limbs if isinstance(limbs_k, slice) else len(limbs_k)
            words[p, limbs_k, :, k] = np.frombuffer(data, np.uint8, count_k * n,
                                                    pos).reshape(count_k, n)
            pos += count_k * n
    members = (struct.pack("<4Q", p0, p1, p2, p3) + b"\x01"
               + struct.pack("<QQQdQ", size, n, limbs, scale, correction))
    dyn_size = _SEAL_HEADER.size + 8 + count * 8
    total = _SEAL_HEADER.size + len(members) + dyn_size + len(seed)
    return [_seal_header(total) + members + _seal_header(dyn_size) + struct.pack("<Q", count),
            memoryview(words.reshape(-1)), seed]


def loads(context: Any, data: bytes, what: str) -> Any:
    """A SEAL ciphertext of ``context`` from :func:`dumps`' bytes (either form), validated by
    SEAL; anything malformed, truncated or of other parameters is a
    :class:`~he.errors.SerializationError`."""
    if data[:4] == _MAGIC:
        return load_object(seal.Ciphertext, context, _to_seal(data, what), what)
    return load_object(seal.Ciphertext, context, data, what)


def encrypt_bytes(plain: Any, encryptor: Any, native: Any = None) -> bytes:
    """``plain`` encrypted with the secret key, as bytes: through ``native`` (a validated
    :class:`he.native.NativeEncryptor`, without the GIL) in the compact form where it is
    usable, else SEAL's encryptor and its own seeded form. What a client sends per input
    ciphertext, and what the cost model times as ``encrypt``."""
    if native is not None and native.ok:
        return dumps(native.encrypt(plain))
    return save_object(encryptor.encrypt_symmetric(plain))
