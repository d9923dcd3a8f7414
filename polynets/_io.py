"""Safe reading and atomic writing of files and bytes, shared by every package.

Untrusted input is bounded before it is parsed (file size, JSON size and nesting, ``.npy`` and
safetensors headers checked against the data before anything is allocated; no pickle), and files
are written so that a reader sees the old content or the new one, never half of it.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import tempfile
import time
from typing import Any, Callable

import numpy as np

from polynets.errors import PolynetsError, ProgramFormatError, WriteError

__all__ = ["atomic_write_bytes", "read_bytes_limited", "loads_json_strict", "load_npy_bytes",
           "read_npy", "dump_safetensors", "read_safetensors", "is_int", "MAX_FILE_BYTES", "MAX_RANK", "MAX_JSON_BYTES",
           "MAX_JSON_DEPTH", "ARRAY_KINDS"]

MAX_FILE_BYTES = 1 << 32         # the largest file a loader reads (4 GiB)
MAX_RANK = 32                    # the largest rank of an array that loads
MAX_JSON_BYTES = 1 << 26         # a JSON header (64 MiB)
MAX_JSON_DEPTH = 64
ARRAY_KINDS = "biuf"             # bool, signed / unsigned integers, floats: nothing else loads


def is_int(v: Any) -> bool:
    """Whether ``v`` is a Python int (``bool`` excluded)."""
    return isinstance(v, int) and not isinstance(v, bool)


def read_npy(f: Any, size: int, name: str,
             error: Callable[[str], Exception] = ProgramFormatError,
             what: str = "program array") -> np.ndarray:
    """Read one ``.npy`` stream of ``size`` bytes after checking its header's dtype and shape
    against ``size`` (so a header claiming a huge shape fails before anything is allocated)."""
    label = f"{what} {name!r}" if name else what
    try:
        major, _ = np.lib.format.read_magic(f)
        if major == 1:
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, max_header_size=1 << 16)
        elif major in (2, 3):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f, max_header_size=1 << 16)
        else:
            raise error(f"{label}: unknown .npy version {major}")
    except PolynetsError:
        raise
    except Exception as exc:  # noqa: BLE001 - numpy's header parser raises many kinds on garbage
        raise error(f"{label}: not a .npy array ({type(exc).__name__}: {exc})") from exc
    if dtype.hasobject or dtype.kind not in ARRAY_KINDS or dtype.subdtype is not None \
            or dtype.names is not None:
        raise error(f"{label} has dtype {dtype}; only numbers load")
    if len(shape) > MAX_RANK or not all(is_int(d) and d >= 0 for d in shape):
        raise error(f"{label}: invalid shape {shape}")
    nbytes = math.prod(shape) * dtype.itemsize
    header_size = f.tell()
    if header_size + nbytes != size:
        raise error(f"{label}: its header says shape {shape} ({nbytes} bytes of {dtype}) but "
                    f"{max(size - header_size, 0)} bytes follow it")
    raw = f.read(nbytes)
    if len(raw) != nbytes:
        raise error(f"{label} is truncated")
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return arr.copy(order="K")


#: safetensors dtype names of the numbers that load (little-endian, as the format stores them)
_SAFETENSORS_DTYPES = {"BOOL": "|b1", "U8": "|u1", "I8": "|i1", "U16": "<u2", "I16": "<i2",
                       "U32": "<u4", "I32": "<i4", "U64": "<u8", "I64": "<i8", "F16": "<f2",
                       "F32": "<f4", "F64": "<f8"}


def dump_safetensors(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """``arrays`` (numbers) and a string map as safetensors bytes: a little-endian 8-byte header
    length, the JSON header (``__metadata__`` and each array's dtype, shape and byte range),
    padded with spaces to 8 bytes, then the arrays' bytes. Keys are sorted and arrays laid out
    in name order, so the same content always gives the same bytes."""
    names = {dt: name for name, dt in _SAFETENSORS_DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    chunks, at = [], 0
    for name in sorted(arrays):
        a = np.asarray(arrays[name], order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d
        a = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
        dt = names.get(a.dtype.str)
        if dt is None:
            raise TypeError(f"array {name!r} has dtype {a.dtype}; safetensors stores numbers")
        raw = a.tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [at, at + len(raw)]}
        chunks.append(raw)
        at += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def read_safetensors(data: bytes, what: str, max_array_bytes: int,
                     error: Callable[[str], Exception] = ProgramFormatError
                     ) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """The metadata and arrays of safetensors bytes. The header's length, JSON (size, nesting),
    dtypes, shapes and byte ranges are checked first, against the data and ``max_array_bytes``,
    so that nothing is allocated for a header that lies; the ranges must tile the data buffer
    exactly (no gap, overlap or trailing bytes). Anything else raises ``error(message)``."""
    data = bytes(data)
    if len(data) < 8:
        raise error(f"{what}: {len(data)} bytes, too short for a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > min(MAX_JSON_BYTES, len(data) - 8):
        raise error(f"{what}: header of {size} bytes in {len(data)} bytes of data (truncated or "
                    f"not safetensors)")
    header = loads_json_strict(data[8:8 + size], f"{what} header", error)
    if not isinstance(header, dict):
        raise error(f"{what}: the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise error(f"{what}: __metadata__ must map names to strings")
    buffer = memoryview(data)[8 + size:]
    spans: list[tuple[int, int, str, np.dtype, tuple[int, ...]]] = []
    for name, spec in header.items():
        try:
            dtype = np.dtype(_SAFETENSORS_DTYPES[spec["dtype"]])
            shape = tuple(spec["shape"])
            begin, end = spec["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise error(f"{what}: array {name!r} is malformed ({type(exc).__name__}: "
                        f"{exc})") from exc
        if len(shape) > MAX_RANK or not all(is_int(d) and d >= 0 for d in shape) or \
                not (is_int(begin) and is_int(end)):
            raise error(f"{what}: array {name!r}: invalid shape {shape} or offsets")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise error(f"{what}: array {name!r}: shape {shape} of {spec['dtype']} needs "
                        f"{math.prod(shape) * dtype.itemsize} bytes, its range holds "
                        f"{end - begin}")
        spans.append((begin, end, name, dtype, shape))
    spans.sort()
    at = 0
    for begin, end, name, _, _ in spans:
        if begin != at:
            raise error(f"{what}: array {name!r} starts at byte {begin}, expected {at} (gap "
                        f"or overlap)")
        at = end
    if at != len(buffer):
        raise error(f"{what}: arrays cover {at} bytes of a {len(buffer)}-byte buffer "
                    f"(truncated or trailing bytes)")
    if at > max_array_bytes:
        raise error(f"{what}: {at} bytes of arrays, more than the {max_array_bytes} allowed")
    arrays = {name: np.frombuffer(buffer[begin:end], dtype=dtype).reshape(shape).copy()
              for begin, end, name, dtype, shape in spans}
    return metadata, arrays


def load_npy_bytes(data: bytes, what: str,
                   error: Callable[[str], Exception] = ProgramFormatError) -> np.ndarray:
    """The array in ``.npy`` bytes (numbers only, no pickle), its header checked against the
    data before anything is allocated; anything else raises ``error(message)``."""
    return read_npy(io.BytesIO(data), len(data), "", error, what)


def read_bytes_limited(path: str | os.PathLike, what: str,
                       error: Callable[[str], Exception] = ProgramFormatError,
                       limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``), or ``error(message)``.

    Directories, FIFOs, devices and sockets are refused before they are read (so ``/dev/zero``
    or a pipe never hangs or fills memory), and so is a missing file or a path under a file.
    """
    try:
        name = os.fspath(path)
    except TypeError as exc:
        raise error(f"{what}: expected a file path, got {type(path).__name__}") from exc
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError as exc:
        raise error(f"{what} {name!r} does not exist") from exc
    except NotADirectoryError as exc:
        raise error(f"{what} {name!r}: a directory in this path is a file") from exc
    except OSError as exc:
        raise error(f"cannot read {what} {name!r}: {exc.strerror}") from exc
    except ValueError as exc:       # a NUL in the path: the file's bytes given for its path?
        raise error(f"{what}: expected a file path, got {type(path).__name__} holding a NUL "
                    f"byte ({len(name)} long)") from exc
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{what} {name!r} is a directory; expected a file")
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what} {name!r} is not a regular file (a pipe, device or socket); "
                        f"expected a file")
        if info.st_size > limit:
            raise error(f"{what} {name!r} is {info.st_size} bytes, more than the {limit} "
                        f"bytes allowed")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 24, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise error(f"{what} {name!r} grew past the {limit} bytes allowed while reading")
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"cannot read {what} {name!r}: {exc.strerror}") from exc
    finally:
        os.close(fd)


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def loads_json_strict(raw: bytes | str, what: str,
                      error: Callable[[str], Exception] = ProgramFormatError, *,
                      max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON: size and nesting bounded, no NaN / Infinity, no duplicate keys.

    Raises ``error(message)`` for anything else than strict JSON within the limits.
    """
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > max_bytes:
        raise error(f"{what}: {len(raw)} bytes of JSON, more than the {max_bytes} allowed")
    bare = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    step = (np.isin(bare, (0x5B, 0x7B)).astype(np.int64)
            - np.isin(bare, (0x5D, 0x7D)).astype(np.int64))
    if step.size and int(np.cumsum(step).max()) > max_depth:
        raise error(f"{what}: JSON nested more than {max_depth} levels deep")

    def constant(name: str) -> Any:
        raise ValueError(f"non-finite number {name}")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"number {text} is out of range")
        return value

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            raise ValueError("duplicate key in an object")
        return out

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=constant, parse_float=finite,
                          object_pairs_hook=unique)
    except (UnicodeDecodeError, ValueError, RecursionError, TypeError) as exc:
        raise error(f"{what}: malformed JSON ({exc})") from exc


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


_TMP_PREFIX = ".tmp-"
_STALE_SECONDS = 60.0


def _remove_stale_temporaries(directory: str, base: str) -> None:
    """Remove temporary files of ``base`` left by writers that died (their process is gone)."""
    prefix = f"{_TMP_PREFIX}{base}."
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return
    now = time.time()
    for name in names:
        pid = name[len(prefix):].split(".", 1)[0]
        if not pid.isdigit():
            continue
        full = os.path.join(directory, name)
        try:
            if now - os.lstat(full).st_mtime < _STALE_SECONDS:
                continue
            if int(pid) != os.getpid():
                try:
                    os.kill(int(pid), 0)
                    continue
                except ProcessLookupError:
                    pass
                except PermissionError:
                    continue
            os.unlink(full)
        except OSError:
            continue


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, private: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half.

    The file is readable per the umask (``0o666 & ~umask``, typically 0644) or, with
    ``private=True`` (secret keys), by its owner only (0600). On any failure the temporary file
    is removed and :class:`~polynets.errors.WriteError` says why; temporary files left by killed
    writers are removed by the next write of the same path.
    """
    try:
        path = os.fspath(path)
    except TypeError as exc:
        raise WriteError(f"cannot write to {path!r}: expected a file path") from exc
    if not path or path.endswith(os.sep):
        raise WriteError(f"cannot write {path!r}: expected a file name, not a directory")
    if os.path.isdir(path):
        raise WriteError(f"cannot write {path!r}: it is a directory; name a file in it")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise WriteError(f"cannot write {path!r}: a parent of it is a file, not a directory") \
            from exc
    except OSError as exc:
        raise WriteError(f"cannot create the directory {directory!r}: {exc.strerror}") from exc
    base = os.path.basename(path)
    _remove_stale_temporaries(directory, base)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{base}.{os.getpid()}.", dir=directory)
    except OSError as exc:
        raise WriteError(f"cannot write {path!r}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600 if private else 0o666 & ~_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise WriteError(f"cannot write {path!r}: {exc.strerror or exc}") from exc
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
