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

Every back end is an :class:`Interpreter`: one loop over the nodes and one method per op, which
the back end fills in (NumPy and torch evaluation, shape checking, the CKKS lowering, degree and
noise analyses); an op it leaves out is reported by name. The NumPy interpreter
(:meth:`PolyProgram.run`) works on any dtype NumPy can multiply and add, float64 for simulation
and ``object`` arrays of sympy expressions for symbolic expansion.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import zipfile
import zlib
from struct import error as struct_error
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

# the file helpers lived here first; they stay importable from this module
from polynets._io import (ARRAY_KINDS, MAX_FILE_BYTES, MAX_JSON_BYTES, MAX_JSON_DEPTH,  # noqa: F401
                          MAX_RANK, atomic_write_bytes, dump_safetensors, is_int, load_npy_bytes,
                          loads_json_strict, read_bytes_limited, read_npy, read_safetensors)
from polynets.errors import ProgramFormatError, ShapeError, UnsupportedOpError

__all__ = ["Node", "PolyProgram", "Interpreter", "ArrayInterpreter", "OPS", "FORMAT_VERSION",
           "atomic_write_bytes", "read_bytes_limited", "loads_json_strict", "load_npy_bytes"]

OPS: tuple[str, ...] = ("input", "linear", "mul", "add", "mul_const", "add_const", "gather")
_ARITY = {"input": (0, 0), "linear": (1, 1), "mul": (2, 2), "add": (2, 2),
          "mul_const": (1, 1), "add_const": (1, 1), "gather": (1, None)}
_ARRAY_ATTRS = {"weight", "bias", "value", "index"}
#: 2: safetensors (arrays, with the JSON header in its metadata); 1: ``.npz``, still read
FORMAT_VERSION = 2
_MAGIC = "polynets-program"

MAX_ARRAY_BYTES = 1 << 31        # decompressed size of all arrays of one program (2 GiB)
MAX_NODE_ELEMENTS = 1 << 26      # elements of one value of one sample (512 MiB in float64)


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
    if arr.dtype.kind not in ARRAY_KINDS:
        raise ShapeError(f"program input must hold numbers, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _gather(values: Sequence[np.ndarray], index: np.ndarray, batch: int) -> np.ndarray:
    dtype = np.result_type(*[v.dtype for v in values])
    flat = [v.reshape(batch, -1) for v in values]
    flat.append(np.zeros((batch, 1), dtype=dtype))
    src = np.concatenate(flat, axis=1)
    idx = np.where(index < 0, src.shape[1] - 1, index)
    return src[:, idx]  # (batch, *index.shape)


class Interpreter:
    """An interpreter of the polynomial program: one loop over the nodes, one method per op.

    A back end subclasses it and defines a method named after each op it handles (``input``,
    ``linear``, ``mul``, ``add``, ``mul_const``, ``add_const``, ``gather``), called as
    ``method(i, node, *inputs)`` with node ``i`` and the values of its inputs in order, and
    returning node ``i``'s value; :meth:`finish` sees every value after its op. A node whose op
    the back end does not define raises :class:`~polynets.errors.UnsupportedOpError` naming the
    op, the node and the back end.
    """

    def run(self, program: "PolyProgram", *, release: bool = False) -> list[Any]:
        """The value of every node of ``program``, in node order.

        With ``release=True`` a value is dropped (None in the result) as soon as its last reader
        has run, unless it is the output, so only live values are held.
        """
        values: list[Any] = [None] * len(program.nodes)
        remaining = [len(u) for u in program.consumers()] if release else []
        for i, node in enumerate(program.nodes):
            values[i] = self.step(i, node, [values[j] for j in node.inputs])
            if release:
                for j in node.inputs:
                    remaining[j] -= 1
                    if remaining[j] == 0 and j != program.output:
                        values[j] = None
        return values

    def step(self, i: int, node: Node, inputs: Sequence[Any]) -> Any:
        """Node ``i``'s value from ``inputs``, the values of ``node.inputs``."""
        method = getattr(self, node.op, None) if node.op in OPS else None
        if method is None:
            handled = [op for op in OPS if getattr(self, op, None) is not None]
            where = f" in {node.path}" if node.path else ""
            raise UnsupportedOpError(
                f"{type(self).__name__} does not handle the program op {node.op!r} (node {i}"
                f"{where}); it handles {', '.join(handled) or 'no op'}")
        return self.finish(i, node, method(i, node, *inputs))

    def finish(self, i: int, node: Node, value: Any) -> Any:
        """Post-process node ``i``'s value (identity unless a back end overrides it)."""
        return value


class ArrayInterpreter(Interpreter):
    """Evaluation on arrays that hold a batch: node ``i``'s value has shape ``(B, *shape_i)``.

    The NumPy back end (float64 or ``object`` arrays); another array library subclasses it with
    its own :meth:`const` (a node's array attribute), ``contract`` (a linear map), ``select`` (a
    gather) and :meth:`expand` (broadcast to a shape). Products and sums use the arrays' own
    operators. ``xb``: the input batch, shape ``(B, *input_shape)``.
    """

    contract = staticmethod(_linear)   # (v, axis, weight, bias) -> v
    select = staticmethod(_gather)     # (values, index, batch) -> v

    def __init__(self, xb: Any):
        self.xb = xb
        self.batch = int(xb.shape[0])

    def const(self, i: int, node: Node, key: str) -> Any:
        """Node ``i``'s array attribute ``key`` (None if absent)."""
        return node.attrs.get(key)

    def expand(self, value: Any, shape: tuple[int, ...]) -> Any:
        """``value`` broadcast to ``shape``."""
        return np.broadcast_to(value, shape)

    def input(self, i: int, node: Node) -> Any:
        return self.xb

    def linear(self, i: int, node: Node, x: Any) -> Any:
        return self.contract(x, node.attrs["axis"], self.const(i, node, "weight"),
                             self.const(i, node, "bias"))

    def mul(self, i: int, node: Node, a: Any, b: Any) -> Any:
        return a * b

    def add(self, i: int, node: Node, a: Any, b: Any) -> Any:
        return a + b

    def mul_const(self, i: int, node: Node, x: Any) -> Any:
        return x * self.const(i, node, "value")

    def add_const(self, i: int, node: Node, x: Any) -> Any:
        return x + self.const(i, node, "value")

    def gather(self, i: int, node: Node, *xs: Any) -> Any:
        return self.select(xs, self.const(i, node, "index"), self.batch)

    def finish(self, i: int, node: Node, value: Any) -> Any:
        shape = (self.batch,) + tuple(node.shape)
        return value if tuple(value.shape) == shape else self.expand(value, shape)


class _MaxAbs(ArrayInterpreter):
    """NumPy evaluation that records the largest |value| of every node into ``out``."""

    def __init__(self, xb: Any, out: list[float]):
        super().__init__(xb)
        self.out = out

    def finish(self, i: int, node: Node, value: Any) -> Any:
        value = super().finish(i, node, value)
        # np.maximum keeps a NaN once seen (Python's max would drop it)
        self.out[i] = float(np.maximum(self.out[i], np.max(np.abs(value), initial=0.0)))
        return value


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
        checker = _ShapeChecker()
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
            checker.step(i, node, [self.nodes[j].shape for j in node.inputs])

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
        return self.evaluate(ArrayInterpreter(xb), keep=keep)

    def evaluate(self, interpreter: ArrayInterpreter, *, keep: bool = False) -> Any:
        """Run an array back end (NumPy, torch) on this program.

        ``interpreter`` holds the input batch, shape ``(B, *input_shape)``. Returns what
        :meth:`run` returns: the output reshaped to ``(B, *output_shape[1:])``, or with
        ``keep=True`` every node's value.
        """
        values = interpreter.run(self, release=not keep)
        if keep:
            return values
        out = values[self.output]
        if self.output_shape[:1] == (1,):
            return out.reshape((interpreter.batch,) + tuple(self.output_shape[1:]))
        return out

    def max_abs(self, x: np.ndarray, *, chunk: int = 256,
                outputs: list[np.ndarray] | None = None) -> list[float]:
        """Largest |value| of every node over the batch ``x`` (shape ``(B, *input_shape[1:])``),
        evaluated ``chunk`` samples at a time holding only live values, so the memory is that of
        one chunk's live values whatever ``B``. ``outputs``: a list that receives the output of
        every chunk (``(chunk, *node shape)``), so one pass serves both."""
        xb = self._as_batch(_numeric_input(x))
        out = [0.0] * len(self.nodes)
        for lo in range(0, max(1, int(xb.shape[0])), chunk):
            values = _MaxAbs(xb[lo:lo + chunk], out).run(self, release=True)
            if outputs is not None:
                outputs.append(values[self.output])
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
        from polynets.ir._program_torch import ProgramModule

        return ProgramModule(self, dtype=dtype)

    # ----------------------------------------------------------------------------- display
    def __repr__(self) -> str:
        lines = [f"PolyProgram({len(self.nodes)} nodes, input {self.input_shape} -> "
                 f"output {self.output_shape})"]
        details = _Describer().run(self)
        for i, (n, detail) in enumerate(zip(self.nodes, details)):
            args = ", ".join(f"%{j}" for j in n.inputs)
            body = ", ".join(s for s in (args, detail) if s)
            where = f"  # {n.path}" if n.path else ""
            mark = "  -> output" if i == self.output else ""
            lines.append(f"  %{i} = {n.op}({body}) : {tuple(n.shape)}{where}{mark}")
        return "\n".join(lines)

    # ----------------------------------------------------------------------------- files
    def to_bytes(self) -> bytes:
        """Serialise to safetensors bytes: the arrays as tensors, the JSON header (nodes, output,
        metadata) in the file's metadata; loading runs no code."""
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
        header = json.dumps({"format": _MAGIC, "version": FORMAT_VERSION, "output": self.output,
                             "meta": self.meta, "nodes": nodes})
        return dump_safetensors(arrays, {_MAGIC: header, "sha256": _digest(header, arrays)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "PolyProgram":
        """Load a program written by :meth:`to_bytes` (or the ``.npz`` files of format version
        1); malformed bytes raise ProgramFormatError.

        Nothing is allocated before its size has been checked: the safetensors header's byte
        ranges are checked against the data and :data:`MAX_ARRAY_BYTES` (an ``.npz`` member's
        ``.npy`` header against the archive's sizes); object arrays never load.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProgramFormatError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if data[:4] == b"PK\x03\x04":
            files = _read_npz(data)
            raw_header = files.pop("__header__", None)
            if raw_header is None or raw_header.dtype != np.uint8 or raw_header.ndim != 1:
                raise ProgramFormatError("not a polynets program file (no header)")
            raw, version = raw_header.tobytes(), 1
        else:
            metadata, files = read_safetensors(data, "polynets program", MAX_ARRAY_BYTES)
            if _MAGIC not in metadata:
                raise ProgramFormatError("not a polynets program file (no header)")
            if metadata.get("sha256") != _digest(metadata[_MAGIC], files):
                raise ProgramFormatError("polynets program: content does not match its digest "
                                         "(corrupted or edited)")
            raw, version = metadata[_MAGIC].encode(), FORMAT_VERSION
        header = loads_json_strict(raw, "polynets program header", ProgramFormatError)
        if not isinstance(header, dict) or header.get("format") != _MAGIC:
            raise ProgramFormatError("not a polynets program file (missing format marker)")
        if header.get("version") != version or isinstance(header.get("version"), bool):
            raise ProgramFormatError(
                f"program format version {header.get('version')!r} is not supported in this "
                f"container; this polynets writes version {FORMAT_VERSION} (safetensors) and "
                f"reads version 1 (.npz) too")
        specs = header.get("nodes")
        if not isinstance(specs, list):
            raise ProgramFormatError("malformed polynets program: 'nodes' must be a list")
        nodes = [_node_from_spec(i, spec, files) for i, spec in enumerate(specs)]
        output = header.get("output")
        if not is_int(output):
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
        """Write the program to ``path`` atomically (safetensors, no pickle)."""
        atomic_write_bytes(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PolyProgram":
        """Read a program file written by :meth:`save` (regular files only, size-limited)."""
        return cls.from_bytes(read_bytes_limited(path, "polynets program", ProgramFormatError))

    # ----------------------------------------------------------------------------- helpers
    def copy(self) -> "PolyProgram":
        return PolyProgram([Node(n.op, n.inputs, n.shape, dict(n.attrs), n.path)
                            for n in self.nodes], self.output, dict(self.meta))


def _node_from_spec(i: int, spec: Any, files: dict[str, np.ndarray]) -> Node:
    """One :class:`Node` from its JSON description; every field's type is checked."""
    where = f"malformed polynets program: node {i}"
    if not isinstance(spec, dict):
        raise ProgramFormatError(f"{where} must be an object, got {type(spec).__name__}")
    op, inputs, shape = spec.get("op"), spec.get("inputs"), spec.get("shape")
    attrs_spec, path = spec.get("attrs", {}), spec.get("path", "")
    if not isinstance(op, str) or op not in OPS:
        raise ProgramFormatError(f"{where}: unknown op {op!r}; expected one of {OPS}")
    if not isinstance(inputs, list) or not all(is_int(j) for j in inputs):
        raise ProgramFormatError(f"{where}: 'inputs' must be a list of integers")
    if not isinstance(shape, list) or len(shape) > MAX_RANK \
            or not all(is_int(d) and 0 <= d <= MAX_NODE_ELEMENTS for d in shape):
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
    if "axis" in attrs and not is_int(attrs["axis"]):
        raise ProgramFormatError(f"{where}: attribute 'axis' must be an integer")
    return Node(op=op, inputs=tuple(inputs), shape=tuple(shape), attrs=attrs, path=path)


def _digest(header: str, arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 of a program file's header and arrays (names, dtypes, shapes, bytes): safetensors
    holds no checksum, and a flipped bit in a weight must be an error, not another model."""
    h = hashlib.sha256(header.encode())
    for name in sorted(arrays):
        a = np.asarray(arrays[name], order="C")
        h.update(json.dumps([name, a.dtype.str, list(a.shape)]).encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


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
                    arr = read_npy(f, info.file_size, name[:-4])
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


class _ShapeChecker(Interpreter):
    """Checks each node's attributes against the shapes of its inputs (its values) and returns
    the node's shape; raises :class:`ProgramFormatError` naming the node."""

    def input(self, i: int, node: Node) -> tuple[int, ...]:
        return tuple(node.shape)

    def linear(self, i: int, node: Node, src: tuple[int, ...]) -> tuple[int, ...]:
        where = f"node {i} ({node.op})"
        axis, w, b = node.attrs.get("axis"), node.attrs.get("weight"), node.attrs.get("bias")
        if not isinstance(axis, int) or not 0 <= axis < len(src):
            raise ProgramFormatError(f"{where}: axis {axis!r} invalid for shape {src}")
        if not isinstance(w, np.ndarray) or w.ndim != 2 or w.shape[0] != src[axis]:
            raise ProgramFormatError(
                f"{where}: weight must be ({src[axis]}, n), got "
                f"{getattr(w, 'shape', type(w).__name__)}")
        if b is not None and (not isinstance(b, np.ndarray) or b.shape != (w.shape[1],)):
            raise ProgramFormatError(f"{where}: bias must have shape ({w.shape[1]},)")
        return self._expect(where, node, src[:axis] + (w.shape[1],) + src[axis + 1:])

    def _elementwise(self, i: int, node: Node, sa: tuple[int, ...],
                     sb: tuple[int, ...]) -> tuple[int, ...]:
        where = f"node {i} ({node.op})"
        if len(sa) != len(sb) or len(sa) != len(node.shape):
            raise ProgramFormatError(f"{where}: operands of rank {len(sa)} and {len(sb)}")
        try:
            expect = np.broadcast_shapes(sa, sb)
        except ValueError as exc:
            raise ProgramFormatError(f"{where}: shapes {sa} and {sb} do not broadcast") from exc
        return self._expect(where, node, tuple(expect))

    mul = add = _elementwise

    def _constant(self, i: int, node: Node, src: tuple[int, ...]) -> tuple[int, ...]:
        where = f"node {i} ({node.op})"
        v = node.attrs.get("value")
        if not isinstance(v, np.ndarray) or v.ndim > len(node.shape):
            raise ProgramFormatError(f"{where}: value must be an array of rank <= "
                                     f"{len(node.shape)}")
        try:
            ok = np.broadcast_shapes(src, v.shape) == tuple(node.shape)
        except ValueError:
            ok = False
        if not ok:
            raise ProgramFormatError(
                f"{where}: value of shape {v.shape} does not broadcast to {node.shape}")
        return tuple(node.shape)

    mul_const = add_const = _constant

    def gather(self, i: int, node: Node, *srcs: tuple[int, ...]) -> tuple[int, ...]:
        where = f"node {i} ({node.op})"
        idx = node.attrs.get("index")
        total = sum(math.prod(s) for s in srcs)
        if not isinstance(idx, np.ndarray) or idx.dtype.kind not in "iu" \
                or tuple(idx.shape) != tuple(node.shape):
            raise ProgramFormatError(f"{where}: index must be an integer array of the "
                                     f"node's shape {node.shape}")
        if idx.size and (idx.min() < -1 or idx.max() >= total):
            raise ProgramFormatError(f"{where}: index entries must lie in [-1, {total - 1}]")
        return tuple(node.shape)

    @staticmethod
    def _expect(where: str, node: Node, expect: tuple[int, ...]) -> tuple[int, ...]:
        if tuple(node.shape) != expect:
            raise ProgramFormatError(f"{where}: shape {node.shape}, expected {expect}")
        return expect


class _Describer(Interpreter):
    """The attributes of each node as :meth:`PolyProgram.__repr__` prints them."""

    def _bare(self, i: int, node: Node, *_: str) -> str:
        return ""

    input = mul = add = _bare

    def linear(self, i: int, node: Node, x: str) -> str:
        a = node.attrs
        return f"axis={a['axis']}, weight{tuple(a['weight'].shape)}" + \
            (", bias" if a.get("bias") is not None else "")

    def _constant(self, i: int, node: Node, x: str) -> str:
        v = node.attrs["value"]
        return f"{float(v):.6g}" if v.size == 1 else f"const{tuple(v.shape)}"

    mul_const = add_const = _constant

    def gather(self, i: int, node: Node, *xs: str) -> str:
        return "zero-fill" if bool((node.attrs["index"] < 0).any()) else ""
