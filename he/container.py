"""A small, code-free byte container: magic, JSON header, named binary blobs.

Layout: ``b"PNHE"`` + 1-byte version + 4-byte big-endian header length + UTF-8 JSON header (with
``kind`` and the list of blob names and lengths) + the blobs back to back. Every length is checked
against the data before anything is sliced, so truncated or garbage bytes fail with a
:class:`~he.errors.SerializationError` before any of it reaches SEAL.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from he.errors import SerializationError

__all__ = ["pack", "unpack"]

_MAGIC = b"PNHE"
_VERSION = 1
_MAX_HEADER = 1 << 26


def pack(kind: str, header: dict[str, Any], blobs: dict[str, list[bytes]]) -> bytes:
    """Serialise ``header`` (JSON-able) and lists of blobs under ``kind``."""
    head = dict(header)
    head["kind"] = kind
    head["blobs"] = {name: [len(b) for b in items] for name, items in blobs.items()}
    raw = json.dumps(head, sort_keys=True).encode()
    parts = [_MAGIC, bytes([_VERSION]), struct.pack(">I", len(raw)), raw]
    for name in sorted(head["blobs"]):
        parts.extend(blobs[name])
    return b"".join(parts)


def unpack(data: Any, kind: str | tuple[str, ...], what: str) -> tuple[dict[str, Any],
                                                                       dict[str, list[bytes]]]:
    """Parse bytes written by :func:`pack` and check they hold a ``kind`` record (or one of)."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SerializationError(f"{what}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < 9 or data[:4] != _MAGIC:
        raise SerializationError(f"{what}: not polynets encrypted-inference data (bad magic or "
                                 f"truncated, {len(data)} bytes)")
    if data[4] != _VERSION:
        raise SerializationError(f"{what}: format version {data[4]} is not supported "
                                 f"(this polynets reads {_VERSION})")
    (hlen,) = struct.unpack(">I", data[5:9])
    if hlen > _MAX_HEADER or 9 + hlen > len(data):
        raise SerializationError(f"{what}: truncated header ({len(data)} bytes, header says "
                                 f"{hlen})")
    try:
        head = json.loads(data[9:9 + hlen].decode())
        sizes = head["blobs"]
        if not isinstance(head, dict) or not isinstance(sizes, dict):
            raise TypeError("header is not an object")
        if head.get("kind") not in kinds:
            raise SerializationError(f"{what}: holds a {head.get('kind')!r} record, expected "
                                     f"{' or '.join(repr(k) for k in kinds)}")
        pos = 9 + hlen
        blobs: dict[str, list[bytes]] = {}
        for name, lens in sorted(sizes.items()):
            items = []
            for n in lens:
                n = int(n)
                if n < 0 or pos + n > len(data):
                    raise SerializationError(f"{what}: truncated (blob {name!r} runs past the "
                                             f"end of the data)")
                items.append(data[pos:pos + n])
                pos += n
            blobs[str(name)] = items
    except SerializationError:
        raise
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SerializationError(f"{what}: malformed header ({exc!r})") from exc
    if pos != len(data):
        raise SerializationError(f"{what}: {len(data) - pos} unexpected trailing bytes")
    return head, blobs
