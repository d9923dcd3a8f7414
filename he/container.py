"""A small, code-free byte container: magic, digest, JSON header, named binary blobs.

Layout (version 2)::

    b"PNHE" | version (1 byte) | header digest (32 bytes) | header length (4 bytes, big-endian)
           | UTF-8 JSON header | blobs back to back

    header digest = BLAKE2b-256(magic + version + header length + header)

The header holds ``kind``, the caller's fields and ``blobs``: for each blob name a list of
``[length, BLAKE2b-256 hex digest]``, one per blob. Reading checks, in this order and before any
blob is sliced or any byte reaches SEAL, NumPy or torch: the magic and version, the header's
digest, the JSON (size, nesting depth, no NaN/Infinity, no duplicate keys), the blob table against
the kind's schema (:data:`BLOB_SCHEMAS`: which names, how many of each), the lengths against the
bytes present, then every blob's digest. So a flipped bit, a truncation or two swapped blobs is a
:class:`~he.errors.SerializationError` naming what is damaged, and a blob the kind does not define
(a secret key under another name, a second public key) is refused before anyone loads it.

The digests protect against corruption in storage and transport and against mixed-up files; they
carry no key, so they do not stop someone who rewrites a file on purpose (CKKS ciphertexts are
malleable: integrity against the server is out of scope).

The ``*_field`` helpers read typed, bounded header fields and raise SerializationError.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from he.errors import SerializationError
from polynets._io import loads_json_strict

__all__ = ["BLOB_SCHEMAS", "MAX_BLOBS", "digest", "pack", "unpack", "int_field", "float_field",
           "str_field", "list_field", "dict_field", "bool_field"]

_MAGIC = b"PNHE"
_VERSION = 2
_DIGEST = 32
_PREFIX = len(_MAGIC) + 1 + _DIGEST + 4
_MAX_HEADER = 1 << 24
_MAX_DEPTH = 32
MAX_BLOBS = 1 << 20
"""The most blobs one container may hold (all names together)."""

_Counts = tuple[int, int]
_Schema = dict[str, _Counts]

_PUBLIC_KEYS: _Schema = {"public_key": (1, 1), "relin_keys": (1, 1), "galois_keys": (0, 1)}
BLOB_SCHEMAS: dict[str, _Schema | tuple[str, _Counts]] = {
    "public-context": _PUBLIC_KEYS,
    "secret-context": {**_PUBLIC_KEYS, "secret_key": (1, 1)},
    "compiled-program": {"program": (1, 1)},
    # g0, g1, ... g(n-1): one group of SEAL ciphertexts per batch block or sample
    "ciphertext": ("g", (0, MAX_BLOBS)),
}
"""Per kind, the blob names it may hold and how many blobs (min, max) under each: a dict for fixed
names (a name with min 0 may be absent), or ``(prefix, (min, max))`` for the indexed names
``prefix0 .. prefix{n-1}`` (at least one, none skipped). Anything else is refused."""


def digest(data: bytes | bytearray | memoryview) -> str:
    """BLAKE2b-256 of ``data`` as hex (the digest used for blobs and headers)."""
    return hashlib.blake2b(data, digest_size=_DIGEST).hexdigest()


#: Blobs of more bytes than this in all are digested on every core (hashlib hashes without the
#: GIL): a batch request's hundreds of MB take a second on one, a vector request's few MB a
#: few milliseconds, as long as encrypting one of its ciphertexts
_PARALLEL_DIGEST_BYTES = 1 << 20


def _digests(items: list[Any]) -> list[str]:
    """:func:`digest` of each item, in order, on every core where they are large together."""
    if sum(memoryview(b).nbytes for b in items) < _PARALLEL_DIGEST_BYTES or len(items) < 2:
        return [digest(b) for b in items]
    from he.native import default_threads
    with ThreadPoolExecutor(min(default_threads(), len(items))) as pool:
        return list(pool.map(digest, items))


def _schema_error(kind: str, message: str) -> SerializationError:
    return SerializationError(f"{kind}: {message}")


def _check_names(kind: str, counts: dict[str, int], what: str) -> None:
    """Refuse blob names or counts that ``kind``'s schema does not allow."""
    schema = BLOB_SCHEMAS.get(kind)
    if schema is None:
        raise _schema_error(what, f"unknown record kind {kind!r}")
    if isinstance(schema, tuple):
        prefix, (lo, hi) = schema
        expected = {f"{prefix}{i}" for i in range(len(counts))}
        if set(counts) != expected or not counts:
            shown = ", ".join(sorted(counts)[:4]) or "none"
            raise _schema_error(what, f"blob names must be {prefix}0 .. {prefix}<n-1> with none "
                                      f"skipped, found {shown}")
        bounds = {name: (lo, hi) for name in counts}
    else:
        unknown = sorted(set(counts) - set(schema))
        if unknown:
            raise _schema_error(what, f"unexpected blob {unknown[0]!r} in a {kind} record "
                                      f"(it may hold only {', '.join(sorted(schema))}); "
                                      f"refusing it")
        bounds = schema
    for name, (lo, hi) in bounds.items():
        n = counts.get(name, 0)
        if not lo <= n <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise _schema_error(what, f"{n} {name!r} blobs in a {kind} record, expected {want}")


def pack(kind: str, header: dict[str, Any], blobs: dict[str, list[bytes]]) -> bytes:
    """Serialise ``header`` (JSON-able, finite numbers) and lists of blobs under ``kind``.

    ``blobs`` must fit ``kind``'s schema in :data:`BLOB_SCHEMAS` (names and counts), checked
    here as on reading; ``header`` may not use the keys ``kind`` and ``blobs``.
    """
    if "kind" in header or "blobs" in header:
        raise SerializationError("pack: 'kind' and 'blobs' are reserved header keys")
    _check_names(kind, {name: len(items) for name, items in blobs.items()}, kind)
    items_in_order = [bytes(b) for name in sorted(blobs) for b in blobs[name]]
    digests = iter(_digests(items_in_order))
    head = dict(header)
    head["kind"] = kind
    head["blobs"] = {name: [[len(b), next(digests)] for b in blobs[name]]
                     for name in sorted(blobs)}
    try:
        raw = json.dumps(head, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"pack: the {kind} header is not finite JSON ({exc})") from exc
    if len(raw) > _MAX_HEADER:
        raise SerializationError(f"pack: the {kind} header is {len(raw)} bytes, more than "
                                 f"{_MAX_HEADER}")
    lead = _MAGIC + bytes([_VERSION])
    length = struct.pack(">I", len(raw))
    check = hashlib.blake2b(lead + length + raw, digest_size=_DIGEST).digest()
    return b"".join([lead, check, length, raw, *items_in_order])


def unpack(data: Any, kind: str | tuple[str, ...], what: str, views: bool = False
           ) -> tuple[dict[str, Any], dict[str, list[bytes]]]:
    """Parse and verify bytes written by :func:`pack` holding a ``kind`` record (or one of).

    Returns the header (with ``kind``) and the blobs; every name the kind's schema allows is
    present (an empty list when it has none). Raises SerializationError, before any blob is
    handed out, for bad magic or version, a damaged header or blob, a header that is not strict
    bounded JSON, blob names or counts outside the kind's schema, and truncated or extra bytes.
    ``views``: where ``data`` is ``bytes`` (immutable: what was verified stays what is read),
    the blobs are read-only views of it rather than copies (a public context's Galois keys are
    hundreds of MB, a copy of which a server held while loading them).
    """
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    view, head, hlen = _verified_header(data, what)
    size = len(view)
    found = head.get("kind")
    if found not in kinds:
        raise SerializationError(f"{what}: holds a {found!r} record, expected "
                                 f"{' or '.join(repr(k) for k in kinds)}")
    table = _blob_table(head.get("blobs"), what)
    _check_names(found, {name: len(items) for name, items in table.items()}, what)
    total = sum(n for items in table.values() for n, _ in items)
    pos = _PREFIX + hlen
    if pos + total != size:
        state = "truncated" if pos + total > size else f"{size - pos - total} unexpected " \
                                                         f"trailing bytes"
        raise SerializationError(f"{what}: {state} (the header lists {total} bytes of blobs, "
                                 f"{size - pos} are present)")
    blobs: dict[str, list[bytes]] = {}
    share = views and isinstance(data, bytes)
    for name in sorted(table):
        items = []
        for n, _ in table[name]:
            items.append(view[pos:pos + n] if share else bytes(view[pos:pos + n]))
            pos += n
        for k, (got, (_, want)) in enumerate(zip(_digests(items), table[name])):
            if not hmac.compare_digest(got, want):
                raise SerializationError(f"{what}: blob {name!r} #{k} is damaged (its BLAKE2b "
                                         f"digest does not match); the data was corrupted in "
                                         f"storage or transport, or blobs were moved")
        blobs[name] = items
    schema = BLOB_SCHEMAS[found]
    if isinstance(schema, dict):
        for name in schema:
            blobs.setdefault(name, [])
    return head, blobs


def _verified_header(data: Any, what: str) -> tuple[memoryview, dict[str, Any], int]:
    """The bytes as a view, the header (magic, version, length and BLAKE2b digest checked,
    strict bounded JSON object) and its length."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SerializationError(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"{what}: expected contiguous bytes ({exc})") from exc
    size = len(view)
    if size < _PREFIX or bytes(view[:4]) != _MAGIC:
        raise SerializationError(f"{what}: not polynets encrypted-inference data (bad magic or "
                                 f"truncated, {size} bytes)")
    if view[4] != _VERSION:
        raise SerializationError(f"{what}: format version {view[4]} is not supported "
                                 f"(this polynets reads {_VERSION})")
    (hlen,) = struct.unpack(">I", view[_PREFIX - 4:_PREFIX])
    if hlen > _MAX_HEADER or _PREFIX + hlen > size:
        raise SerializationError(f"{what}: truncated or damaged header ({size} bytes, header "
                                 f"length says {hlen})")
    raw = bytes(view[_PREFIX:_PREFIX + hlen])
    check = hashlib.blake2b(bytes(view[:5]) + bytes(view[_PREFIX - 4:_PREFIX]) + raw,
                            digest_size=_DIGEST).digest()
    if not hmac.compare_digest(check, bytes(view[5:5 + _DIGEST])):
        raise SerializationError(f"{what}: the header is damaged (its BLAKE2b digest does not "
                                 f"match); the data was corrupted in storage or transport")
    head = loads_json_strict(raw, f"{what}: header", SerializationError,
                             max_bytes=_MAX_HEADER, max_depth=_MAX_DEPTH)
    if not isinstance(head, dict):
        raise SerializationError(f"{what}: malformed header (not a JSON object)")
    return view, head, hlen


_HEX = re.compile(r"[0-9a-f]{64}")


def _blob_table(table: Any, what: str) -> dict[str, list[tuple[int, str]]]:
    if not isinstance(table, dict):
        raise SerializationError(f"{what}: malformed header (no blob table)")
    out: dict[str, list[tuple[int, str]]] = {}
    count = 0
    for name, items in table.items():
        if not isinstance(items, list):
            raise SerializationError(f"{what}: malformed blob table entry {name[:40]!r}")
        count += len(items)
        if count > MAX_BLOBS:
            raise SerializationError(f"{what}: more than {MAX_BLOBS} blobs")
        entries = []
        for item in items:
            if not (isinstance(item, list) and len(item) == 2 and _is_int(item[0])
                    and 0 <= item[0] < 1 << 62 and isinstance(item[1], str)
                    and _HEX.fullmatch(item[1])):
                raise SerializationError(f"{what}: malformed blob table entry {name[:40]!r} "
                                         f"(expected [length, digest])")
            entries.append((item[0], item[1]))
        out[name] = entries
    return out


# ---------------------------------------------------------------------------- header fields
_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(head: dict[str, Any], name: str, what: str, default: Any) -> Any:
    if not isinstance(head, dict):
        raise SerializationError(f"{what}: malformed header (not an object)")
    if name not in head:
        if default is _MISSING:
            raise SerializationError(f"{what}: malformed header (no field {name!r})")
        return default
    return head[name]


def int_field(head: dict[str, Any], name: str, what: str, *, lo: int = 0,
              hi: int = (1 << 31) - 1, default: Any = _MISSING) -> int:
    """Header field ``name`` as an integer in ``[lo, hi]`` (booleans and floats refused)."""
    value = _get(head, name, what, default)
    if not _is_int(value) or not lo <= value <= hi:
        raise SerializationError(f"{what}: header field {name!r} must be an integer in "
                                 f"[{lo}, {hi}], got {_show(value)}")
    return value


def float_field(head: dict[str, Any], name: str, what: str, *, lo: float = -math.inf,
                hi: float = math.inf, default: Any = _MISSING) -> float:
    """Header field ``name`` as a finite number in ``[lo, hi]``."""
    value = _get(head, name, what, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(float(value)) or not lo <= float(value) <= hi:
        raise SerializationError(f"{what}: header field {name!r} must be a finite number in "
                                 f"[{lo}, {hi}], got {_show(value)}")
    return float(value)


def str_field(head: dict[str, Any], name: str, what: str, *, choices: Any = None,
              pattern: str | None = None, max_len: int = 4096,
              default: Any = _MISSING) -> str:
    """Header field ``name`` as a string (one of ``choices``, matching ``pattern``)."""
    value = _get(head, name, what, default)
    ok = isinstance(value, str) and len(value) <= max_len
    if ok and choices is not None:
        ok = value in choices
    if ok and pattern is not None:
        ok = re.fullmatch(pattern, value) is not None
    if not ok:
        want = f"one of {sorted(choices)}" if choices is not None else \
            f"a string matching {pattern}" if pattern else f"a string of at most {max_len} chars"
        raise SerializationError(f"{what}: header field {name!r} must be {want}, got "
                                 f"{_show(value)}")
    return value


def bool_field(head: dict[str, Any], name: str, what: str, *, default: Any = _MISSING) -> bool:
    value = _get(head, name, what, default)
    if not isinstance(value, bool):
        raise SerializationError(f"{what}: header field {name!r} must be true or false, got "
                                 f"{_show(value)}")
    return value


def list_field(head: dict[str, Any], name: str, what: str, *, max_len: int = MAX_BLOBS,
               default: Any = _MISSING) -> list[Any]:
    value = _get(head, name, what, default)
    if not isinstance(value, list) or len(value) > max_len:
        raise SerializationError(f"{what}: header field {name!r} must be a list of at most "
                                 f"{max_len} items, got {_show(value)}")
    return value


def dict_field(head: dict[str, Any], name: str, what: str, *,
               default: Any = _MISSING) -> dict[str, Any]:
    value = _get(head, name, what, default)
    if not isinstance(value, dict):
        raise SerializationError(f"{what}: header field {name!r} must be an object, got "
                                 f"{_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
