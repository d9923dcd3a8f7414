"""The polynomial program: a small typed IR of what a polynomial model computes.

A :class:`PolyProgram` is a list of :class:`Node` s in topological order (SSA form: node ``i`` only
reads nodes ``< i``). Every value has a *sample shape*: the shape the traced tensor had when the
model was run on a batch of one sample (so the leading ``1`` of the batch axis is usually part of
it). Interpreters evaluate a batch of ``B`` samples at once by holding arrays of shape
``(B, *sample_shape)``; no op ever mixes samples.

Seven ops, every one of them affine or a Hadamard product:

============  ==========  ===================================================================
op            inputs      semantics (per sample)
============  ==========  ===================================================================
``input``     --          the model input
``linear``    x           contract axis ``axis`` of x (length k) with ``weight`` (k, n), put the
                          new axis of length n at the same position, add ``bias`` (n,) or None
``mul``       a, b        element-wise product, broadcasting size-1 dims (same rank)
``add``       a, b        element-wise sum, broadcasting size-1 dims (same rank)
``mul_const`` x           x * ``value`` (a float64 array broadcastable to x's trailing dims)
``add_const`` x           x + ``value``
``gather``    x0, x1 ...  out.flat[j] = concat(x0.flat, x1.flat, ...)[``index``.flat[j]], or 0
                          where the index is -1. Every layout op (reshape, permute, slice,
                          concat, shift, zero-pad, im2col of a convolution) is one gather.
============  ==========  ===================================================================

The NumPy interpreter (:meth:`PolyProgram.run`) works on any dtype NumPy can multiply and add,
float64 for simulation and ``object`` arrays of sympy expressions for symbolic expansion.
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
import zipfile
import zlib
from struct import error as struct_error
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from polynets.errors import PolynetsError, ProgramFormatError, ShapeError, WriteError

__all__ = ["Node", "PolyProgram", "OPS", "FORMAT_VERSION", "atomic_write_bytes",
           "read_bytes_limited", "loads_json_strict", "load_npy_bytes"]

OPS: tuple[str, ...] = ("input", "linear", "mul", "add", "mul_const", "add_const", "gather")
_ARITY = {"input": (0, 0), "linear": (1, 1), "mul": (2, 2), "add": (2, 2),
          "mul_const": (1, 1), "add_const": (1, 1), "gather": (1, None)}
_ARRAY_ATTRS = {"weight", "bias", "value", "index"}
FORMAT_VERSION = 1
_MAGIC = "polynets-program"

MAX_FILE_BYTES = 1 << 32         # the largest file a loader reads (4 GiB)
MAX_ARRAY_BYTES = 1 << 31        # decompressed size of all arrays of one program (2 GiB)
MAX_NODE_ELEMENTS = 1 << 26      # elements of one value of one sample (512 MiB in float64)
MAX_RANK = 32
MAX_JSON_BYTES = 1 << 26         # a JSON header (64 MiB)
MAX_JSON_DEPTH = 64
_ARRAY_KINDS = "biuf"            # bool, signed / unsigned integers, floats: nothing else loads


@dataclass
class Node:
    """One operation of a :class:`PolyProgram`.

    ``shape`` is the sample shape of the value the node produces; ``attrs`` holds the op's
    parameters (NumPy arrays and plain ints); ``path`` names the module that produced it.
    """

    op: str
    inputs: tuple[int, ...]
    shape: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _linear(v: np.ndarray, axis: int, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    # v: (B, *sample); contract sample axis `axis` (array axis axis + 1) with weight (k, n).
    if v.dtype == object or weight.dtype == object:
        out = np.tensordot(v, weight, axes=([axis + 1], [0]))
    else:
        out = np.tensordot(v, weight.astype(v.dtype, copy=False), axes=([axis + 1], [0]))
    out = np.moveaxis(out, -1, axis + 1)
    if bias is not None:
        shape = [1] * out.ndim
        shape[axis + 1] = bias.shape[0]
        out = out + bias.reshape(shape)
    return out


def _numeric_input(x: Any) -> np.ndarray:
    """``x`` as an array the interpreter evaluates: float64, or ``object`` for expressions."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        x = x.numpy() if x.is_complex() else x.double().numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"program input must be a numeric array, got {type(x).__name__} "
                         f"({exc})") from exc
    if arr.dtype == object:
        return arr
    if arr.dtype.kind == "c":
        raise ShapeError("program input is complex; a polynomial program evaluates real numbers "
                         "(pass the real part, or the real and imaginary parts as channels)")
    if arr.dtype.kind not in _ARRAY_KINDS:
        raise ShapeError(f"program input must hold numbers, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _gather(values: Sequence[np.ndarray], index: np.ndarray, batch: int) -> np.ndarray:
    dtype = np.result_type(*[v.dtype for v in values])
    flat = [v.reshape(batch, -1) for v in values]
    flat.append(np.zeros((batch, 1), dtype=dtype))
    src = np.concatenate(flat, axis=1)
    idx = np.where(index < 0, src.shape[1] - 1, index)
    return src[:, idx]  # (batch, *index.shape)


class PolyProgram:
    """A polynomial program: nodes in topological order, one input, one output.

    Args:
        nodes: the operations; ``nodes[i].inputs`` only refer to indices ``< i``.
        output: index of the node whose value is the program's result.
        meta: free-form JSON-serialisable description (model name, source, passes applied).
    """

    def __init__(self, nodes: Sequence[Node], output: int, meta: dict[str, Any] | None = None):
        self.nodes: list[Node] = list(nodes)
        self.output = int(output)
        self.meta: dict[str, Any] = dict(meta or {})
        self.validate()

    # ----------------------------------------------------------------------------- structure
    @property
    def input_id(self) -> int:
        return next(i for i, n in enumerate(self.nodes) if n.op == "input")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Sample shape of the input (leading 1 = the batch axis of the traced example)."""
        return self.nodes[self.input_id].shape

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.nodes[self.output].shape

    def consumers(self) -> list[list[int]]:
        """For each node, the indices of the nodes that read it."""
        users: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for j in node.inputs:
                users[j].append(i)
        return users

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self.nodes)

    def validate(self) -> None:
        """Check the program is well formed; raise :class:`ProgramFormatError` if not."""
        if not self.nodes:
            raise ProgramFormatError("a polynomial program needs at least an input node")
        inputs = [i for i, n in enumerate(self.nodes) if n.op == "input"]
        if len(inputs) != 1:
            raise ProgramFormatError(f"expected exactly one input node, found {len(inputs)}")
        if not 0 <= self.output < len(self.nodes):
            raise ProgramFormatError(
                f"output index {self.output} is outside the program's {len(self.nodes)} nodes")
        for i, node in enumerate(self.nodes):
            where = f"node {i} ({node.op})"
            if node.op not in OPS:
                raise ProgramFormatError(f"{where}: unknown op; expected one of {OPS}")
            lo, hi = _ARITY[node.op]
            if len(node.inputs) < lo or (hi is not None and len(node.inputs) > hi):
                raise ProgramFormatError(f"{where}: has {len(node.inputs)} inputs")
            if any(not 0 <= j < i for j in node.inputs):
                raise ProgramFormatError(f"{where}: reads a node that does not precede it")
            if any(int(d) < 0 for d in node.shape):
                raise ProgramFormatError(f"{where}: negative dimension in shape {node.shape}")
            ins = [self.nodes[j] for j in node.inputs]
            a = node.attrs
            if node.op == "linear":
                axis, w, b = a.get("axis"), a.get("weight"), a.get("bias")
                src = ins[0].shape
                if not isinstance(axis, int) or not 0 <= axis < len(src):
                    raise ProgramFormatError(f"{where}: axis {axis!r} invalid for shape {src}")
                if not isinstance(w, np.ndarray) or w.ndim != 2 or w.shape[0] != src[axis]:
                    raise ProgramFormatError(
                        f"{where}: weight must be ({src[axis]}, n), got "
                        f"{getattr(w, 'shape', type(w).__name__)}")
                if b is not None and (not isinstance(b, np.ndarray) or b.shape != (w.shape[1],)):
                    raise ProgramFormatError(f"{where}: bias must have shape ({w.shape[1]},)")
                expect = src[:axis] + (w.shape[1],) + src[axis + 1:]
                if tuple(node.shape) != expect:
                    raise ProgramFormatError(f"{where}: shape {node.shape}, expected {expect}")
            elif node.op in ("mul", "add"):
                sa, sb = ins[0].shape, ins[1].shape
                if len(sa) != len(sb) or len(sa) != len(node.shape):
                    raise ProgramFormatError(f"{where}: operands of rank {len(sa)} and {len(sb)}")
                try:
                    expect = np.broadcast_shapes(sa, sb)
                except ValueError as exc:
                    raise ProgramFormatError(f"{where}: shapes {sa} and {sb} do not broadcast") \
                        from exc
                if tuple(node.shape) != tuple(expect):
                    raise ProgramFormatError(f"{where}: shape {node.shape}, expected {expect}")
            elif node.op in ("mul_const", "add_const"):
                v = a.get("value")
                if not isinstance(v, np.ndarray) or v.ndim > len(node.shape):
                    raise ProgramFormatError(f"{where}: value must be an array of rank <= "
                                             f"{len(node.shape)}")
                try:
                    ok = np.broadcast_shapes(ins[0].shape, v.shape) == tuple(node.shape)
                except ValueError:
                    ok = False
                if not ok:
                    raise ProgramFormatError(
                        f"{where}: value of shape {v.shape} does not broadcast to {node.shape}")
            elif node.op == "gather":
                idx = a.get("index")
                total = sum(n.numel for n in ins)
                if not isinstance(idx, np.ndarray) or idx.dtype.kind not in "iu" \
                        or tuple(idx.shape) != tuple(node.shape):
                    raise ProgramFormatError(f"{where}: index must be an integer array of the "
                                             f"node's shape {node.shape}")
                if idx.size and (idx.min() < -1 or idx.max() >= total):
                    raise ProgramFormatError(
                        f"{where}: index entries must lie in [-1, {total - 1}]")

    # ----------------------------------------------------------------------------- interpreter
    def batch_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The ``(B, *input_shape)`` an input of ``shape`` is evaluated as, or ShapeError.

        Accepted: ``(B, *input_shape[1:])`` (a batch, as the model takes it) or ``input_shape``
        itself; any other rank or size is refused, never reinterpreted.
        """
        shape = tuple(shape)
        sample = tuple(self.input_shape)
        if len(shape) == len(sample) and shape[1:] == sample[1:] and sample[:1] == (1,):
            return (shape[0],) + sample
        if shape == sample:
            return (1,) + sample
        expected = ("B",) + sample[1:]
        raise ShapeError(f"program input must have shape {expected}, got {shape}")

    def _as_batch(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.batch_shape(x.shape))

    def run(self, x: np.ndarray, *, keep: bool = False) -> np.ndarray | list[np.ndarray]:
        """Evaluate the program on a batch ``x`` of shape ``(B, *input_shape[1:])``.

        Numeric input is computed in float64 whatever its dtype (integers and booleans are cast,
        the weights never are); ``object`` arrays (sympy expressions) are evaluated as they are.
        Complex input is refused. Returns the output, shape ``(B, *output_shape[1:])`` -- the
        shape ``model(x)`` has -- or, with ``keep=True``, the list of every node's value with
        shape ``(B, *node.shape)``.
        """
        xb = self._as_batch(_numeric_input(x))
        return self.evaluate(xb, attr=lambda i, key: self.nodes[i].attrs.get(key),
                             linear=_linear, gather=_gather,
                             expand=lambda v, shape: np.broadcast_to(v, shape), keep=keep)

    def evaluate(self, xb: Any, *, attr: Any, linear: Any, gather: Any, expand: Any,
                 keep: bool = False) -> Any:
        """The interpreter loop shared by the NumPy and torch back ends.

        ``xb``: the input batch, shape ``(B, *input_shape)``. The back end supplies ``attr(i,
        key)`` (node ``i``'s attribute as one of its arrays, or None), ``linear(v, axis, weight,
        bias)``, ``gather(values, index, batch)`` and ``expand(v, shape)``; products and sums use
        the arrays' own operators. Returns what :meth:`run` returns.
        """
        batch = xb.shape[0]
        values: list[Any] = [None] * len(self.nodes)
        remaining = [len(u) for u in self.consumers()]
        for i, node in enumerate(self.nodes):
            ins = [values[j] for j in node.inputs]
            if node.op == "input":
                out = xb
            elif node.op == "linear":
                out = linear(ins[0], node.attrs["axis"], attr(i, "weight"), attr(i, "bias"))
            elif node.op == "mul":
                out = ins[0] * ins[1]
            elif node.op == "add":
                out = ins[0] + ins[1]
            elif node.op == "mul_const":
                out = ins[0] * attr(i, "value")
            elif node.op == "add_const":
                out = ins[0] + attr(i, "value")
            else:
                out = gather(ins, attr(i, "index"), batch)
            shape = (batch,) + tuple(node.shape)
            values[i] = out if tuple(out.shape) == shape else expand(out, shape)
            if not keep:
                for j in node.inputs:
                    remaining[j] -= 1
                    if remaining[j] == 0 and j != self.output:
                        values[j] = None
        if keep:
            return values
        out = values[self.output]
        if self.output_shape[:1] == (1,):
            return out.reshape((batch,) + tuple(self.output_shape[1:]))
        return out

    def simulate(self, x: Any) -> np.ndarray:
        """Run the program in float64 NumPy: the reference of the exact arithmetic.

        ``x``: array-like or tensor of shape ``(B, *input_shape[1:])``; returns the shape of
        ``model(x)``.
        """
        arr = _numeric_input(x)
        if arr.dtype == object:
            try:
                arr = arr.astype(np.float64)
            except (TypeError, ValueError) as exc:
                raise ShapeError(f"simulate needs real numbers, got objects ({exc})") from exc
        return self.run(arr)  # type: ignore[return-value]

    def __call__(self, x: Any) -> np.ndarray:
        return self.simulate(x)

    def to_torch(self, dtype: Any = None) -> "Any":
        """A ``torch.nn.Module`` that executes this program (float64 by default)."""
        from polynets._program_torch import ProgramModule

        return ProgramModule(self, dtype=dtype)

    # ----------------------------------------------------------------------------- display
    def __repr__(self) -> str:
        lines = [f"PolyProgram({len(self.nodes)} nodes, input {self.input_shape} -> "
                 f"output {self.output_shape})"]
        for i, n in enumerate(self.nodes):
            args = ", ".join(f"%{j}" for j in n.inputs)
            a = n.attrs
            if n.op == "linear":
                detail = f"axis={a['axis']}, weight{tuple(a['weight'].shape)}" + \
                    (", bias" if a.get("bias") is not None else "")
            elif n.op in ("mul_const", "add_const"):
                v = a["value"]
                detail = f"{float(v):.6g}" if v.size == 1 else f"const{tuple(v.shape)}"
            elif n.op == "gather":
                detail = "zero-fill" if bool((a["index"] < 0).any()) else ""
            else:
                detail = ""
            body = ", ".join(s for s in (args, detail) if s)
            where = f"  # {n.path}" if n.path else ""
            mark = "  -> output" if i == self.output else ""
            lines.append(f"  %{i} = {n.op}({body}) : {tuple(n.shape)}{where}{mark}")
        return "\n".join(lines)

    # ----------------------------------------------------------------------------- files
    def to_bytes(self) -> bytes:
        """Serialise to an ``.npz`` archive (JSON header + arrays); loading runs no code."""
        arrays: dict[str, np.ndarray] = {}
        nodes = []
        for i, n in enumerate(self.nodes):
            attrs: dict[str, Any] = {}
            for k, v in n.attrs.items():
                if isinstance(v, np.ndarray):
                    key = f"n{i}_{k}"
                    arrays[key] = v
                    attrs[k] = {"array": key}
                else:
                    attrs[k] = v
            nodes.append({"op": n.op, "inputs": list(n.inputs), "shape": list(n.shape),
                          "attrs": attrs, "path": n.path})
        header = {"format": _MAGIC, "version": FORMAT_VERSION, "output": self.output,
                  "meta": self.meta, "nodes": nodes}
        arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "PolyProgram":
        """Load a program written by :meth:`to_bytes`; malformed bytes raise ProgramFormatError.

        Nothing is decompressed or allocated before its size has been checked: every array's
        ``.npy`` header is read first and its shape and dtype checked against the archive's
        sizes and :data:`MAX_ARRAY_BYTES`; object arrays never load.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProgramFormatError(f"expected bytes, got {type(data).__name__}")
        files = _read_npz(bytes(data))
        raw_header = files.pop("__header__", None)
        if raw_header is None or raw_header.dtype != np.uint8 or raw_header.ndim != 1:
            raise ProgramFormatError("not a polynets program file (no header)")
        header = loads_json_strict(raw_header.tobytes(), "polynets program header",
                                   ProgramFormatError)
        if not isinstance(header, dict) or header.get("format") != _MAGIC:
            raise ProgramFormatError("not a polynets program file (missing format marker)")
        if header.get("version") != FORMAT_VERSION or isinstance(header.get("version"), bool):
            raise ProgramFormatError(
                f"program format version {header.get('version')!r} is not supported; this "
                f"polynets reads version {FORMAT_VERSION}")
        specs = header.get("nodes")
        if not isinstance(specs, list):
            raise ProgramFormatError("malformed polynets program: 'nodes' must be a list")
        nodes = [_node_from_spec(i, spec, files) for i, spec in enumerate(specs)]
        output = header.get("output")
        if not _is_int(output):
            raise ProgramFormatError(f"malformed polynets program: 'output' must be an integer, "
                                     f"got {output!r}")
        meta = header.get("meta") or {}
        if not isinstance(meta, dict):
            raise ProgramFormatError("malformed polynets program: 'meta' must be an object")
        try:
            return cls(nodes, output, meta=meta)
        except ProgramFormatError:
            raise
        except (TypeError, ValueError, IndexError, KeyError, OverflowError) as exc:
            raise ProgramFormatError(f"malformed polynets program: {exc!r}") from exc

    def save(self, path: str | os.PathLike) -> None:
        """Write the program to ``path`` atomically (``.npz`` archive, no pickle)."""
        atomic_write_bytes(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PolyProgram":
        """Read a program file written by :meth:`save` (regular files only, size-limited)."""
        return cls.from_bytes(read_bytes_limited(path, "polynets program", ProgramFormatError))

    # ----------------------------------------------------------------------------- helpers
    def copy(self) -> "PolyProgram":
        return PolyProgram([Node(n.op, n.inputs, n.shape, dict(n.attrs), n.path)
                            for n in self.nodes], self.output, dict(self.meta))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _node_from_spec(i: int, spec: Any, files: dict[str, np.ndarray]) -> Node:
    """One :class:`Node` from its JSON description; every field's type is checked."""
    where = f"malformed polynets program: node {i}"
    if not isinstance(spec, dict):
        raise ProgramFormatError(f"{where} must be an object, got {type(spec).__name__}")
    op, inputs, shape = spec.get("op"), spec.get("inputs"), spec.get("shape")
    attrs_spec, path = spec.get("attrs", {}), spec.get("path", "")
    if not isinstance(op, str) or op not in OPS:
        raise ProgramFormatError(f"{where}: unknown op {op!r}; expected one of {OPS}")
    if not isinstance(inputs, list) or not all(_is_int(j) for j in inputs):
        raise ProgramFormatError(f"{where}: 'inputs' must be a list of integers")
    if not isinstance(shape, list) or len(shape) > MAX_RANK \
            or not all(_is_int(d) and 0 <= d <= MAX_NODE_ELEMENTS for d in shape):
        raise ProgramFormatError(f"{where}: 'shape' must be a list of at most {MAX_RANK} "
                                 f"non-negative integers")
    if math.prod(shape) > MAX_NODE_ELEMENTS:
        raise ProgramFormatError(f"{where}: shape {tuple(shape)} has {math.prod(shape)} elements "
                                 f"per sample, more than the {MAX_NODE_ELEMENTS} a program may "
                                 f"hold")
    if not isinstance(attrs_spec, dict):
        raise ProgramFormatError(f"{where}: 'attrs' must be an object, got "
                                 f"{type(attrs_spec).__name__}")
    if not isinstance(path, str):
        raise ProgramFormatError(f"{where}: 'path' must be a string")
    attrs: dict[str, Any] = {}
    for key, value in attrs_spec.items():
        if isinstance(value, dict):
            name = value.get("array")
            if key not in _ARRAY_ATTRS or set(value) != {"array"} or not isinstance(name, str):
                raise ProgramFormatError(f"{where}: unexpected array attribute {key!r}")
            if name not in files:
                raise ProgramFormatError(f"{where}: array {name!r} of attribute {key!r} is "
                                         f"missing from the file")
            array = files[name]
            if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
                raise ProgramFormatError(f"{where}: attribute {key!r} holds NaN or infinite values")
            attrs[key] = array
        elif key in _ARRAY_ATTRS and value is not None:
            raise ProgramFormatError(f"{where}: attribute {key!r} must name an array")
        elif value is None or isinstance(value, (int, float, str, bool)):
            attrs[key] = value
        else:
            raise ProgramFormatError(f"{where}: attribute {key!r} has unsupported type "
                                     f"{type(value).__name__}")
    if "axis" in attrs and not _is_int(attrs["axis"]):
        raise ProgramFormatError(f"{where}: attribute 'axis' must be an integer")
    return Node(op=op, inputs=tuple(inputs), shape=tuple(shape), attrs=attrs, path=path)


def _read_npz(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` archive, each checked before it is decompressed."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError,
            IndexError, struct_error, NotImplementedError) as exc:
        raise ProgramFormatError(f"not a polynets program file (corrupted or truncated: "
                                 f"{exc})") from exc
    if len(members) > 1 << 20:
        raise ProgramFormatError(f"not a polynets program file ({len(members)} members)")
    budget = MAX_ARRAY_BYTES
    out: dict[str, np.ndarray] = {}
    with archive:
        for info in members:
            name = info.filename
            if not name.endswith(".npy") or name[:-4] in out:
                raise ProgramFormatError(f"not a polynets program file (unexpected or repeated "
                                         f"member {name!r})")
            if info.file_size > budget:
                raise ProgramFormatError(
                    f"program array {name[:-4]!r} claims {info.file_size} bytes, more than the "
                    f"{MAX_ARRAY_BYTES} bytes a program may hold")
            try:
                with archive.open(info) as f:
                    arr = _read_npy(f, info.file_size, name[:-4])
                    if f.read(1):
                        raise ProgramFormatError(f"program array {name[:-4]!r}: trailing bytes")
            except ProgramFormatError:
                raise
            except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, KeyError,
                    TypeError, SyntaxError, OverflowError, NotImplementedError, struct_error,
                    RuntimeError) as exc:
                raise ProgramFormatError(f"program array {name[:-4]!r} is corrupted or "
                                         f"truncated ({type(exc).__name__}: {exc})") from exc
            budget -= info.file_size
            out[name[:-4]] = arr
    return out


def _read_npy(f: Any, size: int, name: str,
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
    if dtype.hasobject or dtype.kind not in _ARRAY_KINDS or dtype.subdtype is not None \
            or dtype.names is not None:
        raise error(f"{label} has dtype {dtype}; only numbers load")
    if len(shape) > MAX_RANK or not all(_is_int(d) and d >= 0 for d in shape):
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


def load_npy_bytes(data: bytes, what: str,
                   error: Callable[[str], Exception] = ProgramFormatError) -> np.ndarray:
    """The array in ``.npy`` bytes (numbers only, no pickle), its header checked against the
    data before anything is allocated; anything else raises ``error(message)``."""
    return _read_npy(io.BytesIO(data), len(data), "", error, what)


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


def iter_ops(program: PolyProgram, ops: Iterable[str]) -> list[int]:
    """Indices of the nodes whose op is in ``ops``."""
    wanted = set(ops)
    return [i for i, n in enumerate(program.nodes) if n.op in wanted]
