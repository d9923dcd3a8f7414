"""Lower a PyTorch model to a :class:`~polynets.ir.program.PolyProgram`.

How: the model (a float64, eval-mode copy) is run once on one sample of the example input under a
``TorchDispatchMode``. Every ATen op whose operands depend on the input is lowered to the
program's seven ops; everything else (parameters, ``w.t()``, buffers, masks) is evaluated as it
runs and becomes a constant. Why a dispatch-mode recorder rather than ``torch.fx`` or
``torch.export``: it sees the ops that really execute, after every ``nn.Module``, functional and
composite op (``F.linear``, ``einsum``, ``matmul``) is decomposed to a small, stable ATen set, with
concrete shapes and values, so Python control flow and user modules need no special support; and
forward hooks give each op the qualified name of the module that issued it, for error messages.
The price is that a trace is specialised to the example's per-sample shape, which is what an
encrypted program needs anyway, and blind to what the model does across the samples of a batch:
the traced program is therefore checked against the model on a batch of two samples. A
``TorchFunctionMode`` beside the recorder lowers the few functions whose ATen decomposition
writes in place (padding by reflection, replication or wrapping around) as the selections they
are.

Ops that do not preserve polynomiality (LayerNorm, GELU, sigmoid, softmax, division by data, ...)
are recorded as *offences* with their module path and a hint; :func:`trace` raises
:class:`~polynets.errors.NonPolynomialError`, :func:`polynets.ir.certify` reports them. An op the
tracer does not know raises :class:`~polynets.errors.UnsupportedOpError` naming the op and the
module -- never a silently wrong program.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from polynets.errors import (NonPolynomialError, PolynetsError, ShapeError, TraceError,
                             UnsupportedOpError)
from polynets.ir.program import Node, PolyProgram

__all__ = ["trace", "Offence", "record"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Offence:
    """A module that makes a model non-polynomial."""

    path: str
    module_type: str
    op: str
    hint: str

    def __str__(self) -> str:
        where = self.path or "<model>"
        return f"{where} ({self.module_type}): {self.op} is not a polynomial; {self.hint}"


_HINTS: dict[str, str] = {
    "native_layer_norm": 'LayerNorm divides by a data-dependent norm; use norm="batch", which '
                         "folds into the affine map at inference",
    "native_group_norm": 'GroupNorm divides by a data-dependent norm; use norm="batch"',
    "gelu": 'use the polynomial variant (activation="linear" for PoM; Mu-Layers need none)',
    "relu": "use a polynomial block (Mu-Layer) or a square instead of the activation",
    "silu": 'use the polynomial variant (activation="linear")',
    "tanh": "use a polynomial block (Mu-Layer) instead of the activation",
    "sigmoid": 'use gate="linear" or a polynomial gate',
    "_softmax": "apply a classifier's softmax outside the model (on decrypted logits); "
                "replace attention by pn.PoM or pn.PADRe",
    "_log_softmax": "apply log-softmax outside the model (on decrypted logits)",
    "div": "division by a data-dependent value; divide by a constant instead",
    "addcdiv": "division by a data-dependent value; divide by a constant instead",
    "reciprocal": "division by a data-dependent value; divide by a constant instead",
    "_to_copy": "a cast to an integer or boolean type rounds or thresholds its values; keep "
                "them floating-point",
    "floor_divide": "division with rounding; divide by a constant without rounding instead",
    "embedding": "an encrypted input holds no indices to look rows up by; embed the tokens on "
                 "the client and encrypt the vectors, or give one-hot vectors to an nn.Linear",
    "native_batch_norm": "use BatchNorm with running statistics (track_running_stats=True), "
                         "which folds into the affine map at inference",
}
_MAX_POOL_OPS = ("max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
                 "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d",
                 "adaptive_max_pool2d", "adaptive_max_pool3d", "fractional_max_pool2d",
                 "fractional_max_pool3d")
# fused kernels of softmax attention: F.scaled_dot_product_attention, and the inference fast
# paths of nn.MultiheadAttention and nn.TransformerEncoderLayer
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_attention_math", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                  "_native_multi_head_attention", "_transformer_encoder_layer_fwd")
_HINTS.update(dict.fromkeys(_MAX_POOL_OPS, "use average pooling (nn.AvgPool2d, "
                                           "nn.AdaptiveAvgPool2d) or a strided convolution"))
_HINTS.update(dict.fromkeys(_ATTENTION_OPS, "attention's softmax is not a polynomial; replace "
                                            "attention by pn.PoM or pn.PADRe"))
_DEFAULT_HINT = "replace it by additions and multiplications (Mu-Layer, square, polynomial gate)"
#: What an offence calls a norm by its input's statistics (a batch norm that uses no running
#: statistics in eval mode, an instance norm)
_INPUT_STATISTICS = "normalisation by its input's own statistics"

_NONPOLY = {
    "native_layer_norm", "native_group_norm", "gelu", "relu", "silu", "tanh", "sigmoid",
    "_softmax", "_log_softmax", "exp", "log", "sqrt", "rsqrt", "reciprocal", "abs", "clamp",
    "clamp_min", "clamp_max", "hardtanh", "leaky_relu", "elu", "erf", "sin", "cos", "sign",
    "maximum", "minimum", "max", "min", "amax", "amin", "eq", "ne", "gt", "ge", "lt",
    "le", "softplus", "hardswish", "hardsigmoid", "mish", "log1p", "expm1", "linalg_vector_norm",
    "norm", "topk", "sort", "argmax", "argmin", "floor", "ceil", "round", "logsumexp",
    "pow_tensor", "prelu", "_prelu_kernel", "glu", "std", "std_mean",
    "native_dropout", "bernoulli", "celu", "threshold", "hardshrink", "softshrink",
    "log_sigmoid_forward", "rrelu_with_noise", "softmax", "log_softmax", "tan", "atan", "atan2",
    "asin", "acos", "sinh", "cosh", "asinh", "acosh", "atanh", "exp2", "log2", "log10", "logit",
    "trunc", "frac", "fmod", "remainder", "heaviside", "floor_divide",
} | set(_MAX_POOL_OPS) | set(_ATTENTION_OPS)

# Ops that only move, copy or select values: lowered to one gather by running them on indices.
_LAYOUT = {
    "view", "_unsafe_view", "reshape", "alias", "permute", "transpose", "t", "unsqueeze",
    "squeeze", "expand", "clone", "contiguous", "slice", "select", "narrow", "flip", "roll",
    "repeat", "detach", "lift_fresh", "lift_fresh_copy", "_to_copy", "to", "index",
    "index_select", "gather", "movedim", "unfold", "diagonal", "split", "split_with_sizes",
    "unbind", "chunk", "constant_pad_nd", "cat", "stack",
    "expand_copy", "view_copy", "permute_copy", "slice_copy", "select_copy", "transpose_copy",
    "unsqueeze_copy", "squeeze_copy", "t_copy", "alias_copy", "tile", "repeat_interleave",
    "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "im2col", "col2im", "_unsafe_index",
    "hstack", "vstack", "flatten", "unflatten", "ravel", "zero_pad2d",
}

# Ops that are affine in their (single) traced operand: lowered with a dense probe of the map.
_AFFINE_PROBE = {
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "_adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool3d",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_bilinear2d", "upsample_linear1d",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
    "trace", "diag", "tril", "triu", "fft_r2c",
    # scattered by constant indices: affine in the tensor scattered into and the values jointly
    "scatter_add", "index_add", "scatter", "index_copy", "index_put", "index_fill",
    "masked_scatter", "diag_embed",
}
_PROBE_LIMIT = 50_000_000  # entries of a dense probed matrix

# Ops whose output depends only on the operand's shape (never traced).
_SHAPE_ONLY = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
               "new_empty", "new_full", "sym_size", "sym_stride", "sym_numel", "size", "stride",
               "rand_like", "randn_like", "randint_like", "_shape_as_tensor"}

_INPLACE_ARITH = {"add_", "sub_", "mul_", "div_", "neg_", "pow_", "addcmul_", "addcdiv_",
                  "lerp_"}


def _name(func: Any) -> str:
    """The ATen name of an op overload (``aten.sub.Tensor``) or of an op packet
    (``aten.sub``, which the in-place ops are lowered by): ``"sub"``."""
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "__name__", str(func))


def _np(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", torch.float64).numpy().copy()
    return np.asarray(t, dtype=np.float64)


class _Recorder(TorchDispatchMode):
    """Records the ops that touch input-dependent tensors as program nodes."""

    def __init__(self, strict: bool):
        super().__init__()
        self.strict = strict
        self.nodes: list[Node] = []
        self.node_of: dict[int, int] = {}
        self.alive: list[torch.Tensor] = []  # keeps traced tensors alive so ids stay unique
        self.stack: list[tuple[str, str]] = [("", "model")]
        self.offences: list[Offence] = []
        self.paused = False  # while a function mode lowers a whole function itself
        # the exception leaving the model's forward, and the innermost module it left
        self.failure: tuple[BaseException, str, str] | None = None

    # ----------------------------------------------------------------------------- bookkeeping
    @property
    def path(self) -> str:
        return self.stack[-1][0]

    def add(self, op: str, inputs: Sequence[int], shape: Sequence[int], **attrs: Any) -> int:
        self.nodes.append(Node(op, tuple(int(i) for i in inputs), tuple(int(d) for d in shape),
                               attrs, self.path))
        return len(self.nodes) - 1

    def bind(self, tensor: torch.Tensor, node: int) -> None:
        self.node_of[id(tensor)] = node
        self.alive.append(tensor)

    def traced(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and id(x) in self.node_of

    def shape(self, node: int) -> tuple[int, ...]:
        return self.nodes[node].shape

    def gather(self, inputs: Sequence[int], index: np.ndarray) -> int:
        """A gather node, or the input itself when ``index`` is the identity."""
        index = np.asarray(index, dtype=np.int64)
        if len(inputs) == 1 and self.shape(inputs[0]) == index.shape and \
                np.array_equal(index.ravel(), np.arange(index.size)):
            return int(inputs[0])
        return self.add("gather", inputs, index.shape, index=index)

    def reshape(self, node: int, shape: Sequence[int]) -> int:
        return self.gather([node], np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape))

    def broadcast(self, node: int, shape: Sequence[int]) -> int:
        """Materialise numpy/torch broadcasting of ``node`` to ``shape`` as a gather."""
        src = self.shape(node)
        idx = np.arange(int(np.prod(src, dtype=np.int64))).reshape(src)
        idx = idx.reshape((1,) * (len(shape) - len(src)) + tuple(src))
        return self.gather([node], np.broadcast_to(idx, tuple(shape)).copy())

    # ----------------------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if not self.paused and _name(func) == "embedding" and self.traced(args[1]) \
                and args[1].is_floating_point():
            # the trace's float64 input cannot index the table: the lookup is refused by name
            self.offend("aten.embedding with input-dependent indices", _HINTS["embedding"])
            out = torch.zeros(tuple(args[1].shape) + (args[0].shape[-1],), dtype=args[0].dtype)
            self._opaque(out)
            return out
        out = func(*args, **kwargs)
        if self.paused:
            return out
        flat_in, _ = tree_flatten((args, kwargs))
        if not any(self.traced(a) for a in flat_in):
            return out
        name = _name(func)
        if name in _SHAPE_ONLY:
            return out
        module_type = self.stack[-1][1]
        if name.endswith("_") and name[:-1] in _NONPOLY:
            name = name[:-1]            # an in-place activation (ReLU(inplace=True)): not a
            #                             polynomial, whichever form it takes
        if name in _NONPOLY or (name in ("div", "true_divide") and self.traced(args[1])) \
                or (name == "where" and self.traced(args[0])) \
                or (name == "masked_fill" and self.traced(args[1])) \
                or (name == "addcdiv" and self.traced(args[2])) \
                or (name in ("div", "_to_copy") and self._rounds(name, kwargs)) \
                or (name == "pow" and not self._integer_pow(args)) \
                or (name in ("native_batch_norm",) and bool(args[5])):
            self.offend(*self._offence(name, args, kwargs))
            self._opaque(out)
            return out
        if any(self.traced(a) and not (a.is_floating_point() or a.is_complex())
               for a in flat_in):
            # integers or booleans an offence (a cast, a comparison) made of the input: their
            # uses (indices, masks) are no more a polynomial, and that offence is recorded
            self._opaque(out)
            return out
        if name in _INPLACE_ARITH or name.endswith("_") or name == "copy_":
            if name in _INPLACE_ARITH and self.traced(args[0]) and not args[0]._is_view():
                base = getattr(aten, name[:-1])
                self._lower(base, name[:-1], args, kwargs, args[0])
                return out
            raise UnsupportedOpError(
                f"in-place aten.{name} on an input-dependent tensor in module "
                f"'{self.path or '<model>'}' ({module_type}): write it out of place "
                f"(e.g. torch.cat of slices instead of assigning into a slice)")
        self._lower(func, name, args, kwargs, out)
        return out

    def offend(self, op: str, hint: str) -> None:
        """Record that the current module computes ``op``, which is not a polynomial (raised
        at once when tracing strictly)."""
        self.offences.append(Offence(self.path, self.stack[-1][1], op, hint))
        if self.strict:
            raise NonPolynomialError(str(self.offences[-1]))

    def enter(self, qualname: str, module: nn.Module, inputs: Sequence[Any]) -> None:
        """A module's forward begins (a forward pre-hook)."""
        self.stack.append((qualname, type(module).__name__))
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.running_mean is None \
                and any(self.traced(a) for a in tree_flatten(inputs)[0]):
            # BatchNorm without running statistics, or an instance norm: in eval mode too it
            # normalises by statistics of its input. Recorded here, since PyTorch refuses a
            # batch of one sample before any op runs; the module (of the traced copy) then
            # runs with unit statistics, an affine map, so the trace goes on to the others.
            self.offend(_INPUT_STATISTICS, _HINTS["native_batch_norm"])
            module.register_buffer("running_mean", torch.zeros(module.num_features,
                                                               dtype=torch.float64))
            module.register_buffer("running_var", torch.ones(module.num_features,
                                                             dtype=torch.float64))
            module.track_running_stats = True

    def leave(self) -> None:
        """A module's forward ends, returning or raising (a forward hook called always)."""
        failing = sys.exc_info()[1]
        if failing is not None and (self.failure is None or self.failure[0] is not failing):
            self.failure = (failing, *self.stack[-1])  # the innermost module it leaves
        self.stack.pop()

    def select(self, func: Callable, args: Sequence[Any], kwargs: dict) -> torch.Tensor:
        """Run ``func``, a selection of its first argument's elements, and lower it as one
        gather by running it on indices; its ATen ops are not recorded (PyTorch decomposes
        circular padding into in-place writes into a new tensor)."""
        x = args[0]
        self.paused = True
        try:
            out = func(*args, **kwargs)
            idx = func(torch.arange(1, x.numel() + 1, dtype=torch.float64).reshape(x.shape),
                       *args[1:], **kwargs)
        finally:
            self.paused = False
        self.bind(out, self.gather([self.node_of[id(x)]], idx.numpy().astype(np.int64) - 1))
        return out

    def _offence(self, name: str, args: Sequence[Any], kwargs: dict) -> tuple[str, str]:
        """How an offence names the ATen op ``name`` called on ``args`` and ``kwargs``, and
        its hint."""
        hint = _HINTS.get(name, _DEFAULT_HINT)
        if name == "_to_copy":
            return f"a cast to {str(kwargs['dtype']).replace('torch.', '')}", hint
        if name == "div" and kwargs.get("rounding_mode") is not None:
            return f"division with rounding_mode={kwargs['rounding_mode']!r}", \
                _HINTS["floor_divide"]
        if name == "pow":
            return ("pow with an input-dependent exponent" if self.traced(args[1])
                    else "pow with a non-integer or negative exponent"), hint
        if name == "native_batch_norm":  # the model runs in eval mode: no running statistics
            return _INPUT_STATISTICS, hint
        return f"aten.{name}", hint

    def _rounds(self, name: str, kwargs: dict) -> bool:
        """Whether the ``div`` or ``_to_copy`` called with ``kwargs`` rounds its values: a
        division with a rounding mode, a cast to an integer or boolean dtype."""
        if name == "div":
            return kwargs.get("rounding_mode") is not None
        dtype = kwargs.get("dtype")
        return isinstance(dtype, torch.dtype) and not (dtype.is_floating_point
                                                       or dtype.is_complex)

    def _integer_pow(self, args: Sequence[Any]) -> bool:
        if self.traced(args[1]) if len(args) > 1 else False:
            return False
        exponent = args[1]
        if isinstance(exponent, torch.Tensor):
            if exponent.numel() != 1:
                return False
            exponent = exponent.item()
        return float(exponent).is_integer() and exponent >= 0

    def _opaque(self, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.bind(t, self.add("input", (), tuple(t.shape)))

    # ----------------------------------------------------------------------------- lowering
    def _lower(self, func: Any, name: str, args: Sequence[Any], kwargs: dict, out: Any) -> None:
        handler: Callable | None = _HANDLERS.get(name)
        if handler is not None:
            handler(self, func, args, kwargs, out)
        elif name in _LAYOUT:
            self._layout(func, args, kwargs, out)
        elif name in _AFFINE_PROBE:
            self._probe(func, args, kwargs, out)
        else:
            raise UnsupportedOpError(
                f"aten.{name} on an input-dependent tensor in module '{self.path or '<model>'}' "
                f"({self.stack[-1][1]}) cannot be lowered to a polynomial program; supported "
                f"are affine maps, products, sums and layout ops")

    def _layout(self, func: Any, args: Sequence[Any], kwargs: dict, out: Any) -> None:
        """Run a layout op on index tensors: it tells where every output element comes from."""
        flat_args, spec = tree_flatten((args, kwargs))
        inputs: list[int] = []
        offset = 0
        index_args = []
        value_args = []
        has_const = False
        for a in flat_args:
            if self.traced(a):
                node = self.node_of[id(a)]
                inputs.append(node)
                n = a.numel()
                index_args.append(torch.arange(offset + 1, offset + n + 1, dtype=torch.float64)
                                  .reshape(a.shape))
                value_args.append(torch.zeros(a.shape, dtype=torch.float64))
                offset += n
            elif isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() > 0 \
                    and _name(func) in ("cat", "stack", "hstack", "vstack"):
                has_const = True
                index_args.append(torch.zeros(a.shape, dtype=torch.float64))
                value_args.append(a.to(torch.float64))
            else:
                index_args.append(a)
                value_args.append(a)
        iargs, ikwargs = tree_unflatten_pair(index_args, spec)
        if _name(func) == "constant_pad_nd":
            pad_value = iargs[2] if len(iargs) > 2 else ikwargs.get("value", 0.0)
            iargs = (iargs[0], iargs[1], 0.0)
        else:
            pad_value = 0.0
        if _name(func) == "_to_copy":
            ikwargs = {**ikwargs, "dtype": torch.float64}
        idx_out = func(*iargs, **ikwargs)
        outs = tree_flatten(out)[0]
        idx_outs = tree_flatten(idx_out)[0]
        const_outs = None
        if has_const:
            vargs, vkwargs = tree_unflatten_pair(value_args, spec)
            const_outs = tree_flatten(func(*vargs, **vkwargs))[0]
        for k, (o, io) in enumerate(zip(outs, idx_outs)):
            if not isinstance(o, torch.Tensor):
                continue
            index = io.detach().numpy().astype(np.int64) - 1
            node = self.gather(inputs, index)
            extra = None
            if const_outs is not None:
                extra = _np(const_outs[k])
            if pad_value != 0.0:
                extra = (index < 0) * float(pad_value)
            if extra is not None and np.any(extra != 0):
                node = self.add("add_const", [node], index.shape, value=extra)
            self.bind(o, node)

    def _probe(self, func: Any, args: Sequence[Any], kwargs: dict, out: torch.Tensor) -> None:
        """Lower an op affine in its traced operands jointly (one, or several: the tensor
        scattered into and the values scattered) by probing it with basis vectors of each."""
        flat_args, spec = tree_flatten((args, kwargs))
        traced = [i for i, a in enumerate(flat_args) if self.traced(a)]
        sizes = [flat_args[i].numel() for i in traced]
        n, m = sum(sizes), out.numel()
        if n * m > _PROBE_LIMIT:
            raise UnsupportedOpError(
                f"aten.{_name(func)} in module '{self.path or '<model>'}' maps {n} to {m} values; "
                f"too large to lower as a dense affine map (limit {_PROBE_LIMIT} entries)")
        zeros = [torch.zeros(flat_args[i].shape, dtype=torch.float64) for i in traced]

        def call(k: int = -1, v: torch.Tensor | None = None) -> torch.Tensor:
            fa = list(flat_args)
            for j, i in enumerate(traced):
                fa[i] = v if j == k else zeros[j]
            a, kw = tree_unflatten_pair(fa, spec)
            return func(*a, **kw).reshape(-1)

        zero = call()
        cols = []
        for k, i in enumerate(traced):
            basis = torch.eye(sizes[k], dtype=torch.float64).reshape(
                (sizes[k],) + tuple(flat_args[i].shape))
            cols += [call(k, basis[e]) - zero for e in range(sizes[k])]
        node = self.gather([self.node_of[id(flat_args[i])] for i in traced], np.arange(n))
        node = self.add("linear", [node], (m,), axis=0, weight=torch.stack(cols).numpy().copy(),
                        bias=zero.numpy().copy() if torch.any(zero != 0) else None)
        self.bind(out, self.reshape(node, tuple(out.shape)))

    # ----------------------------------------------------------------------------- helpers
    def linear(self, node: int, axis: int, weight: np.ndarray, bias: np.ndarray | None) -> int:
        shape = list(self.shape(node))
        axis = axis % len(shape)
        shape[axis] = weight.shape[1]
        if bias is not None and not np.any(bias):
            bias = None
        return self.add("linear", [node], shape, axis=axis, weight=weight, bias=bias)

    def scale(self, node: int, value: Any, out_shape: Sequence[int]) -> int:
        return self._const_op("mul_const", node, value, out_shape)

    def shift(self, node: int, value: Any, out_shape: Sequence[int]) -> int:
        return self._const_op("add_const", node, value, out_shape)

    def _const_op(self, op: str, node: int, value: Any, out_shape: Sequence[int]) -> int:
        v = _np(value)
        out_shape = tuple(out_shape)
        if self.shape(node) != out_shape:
            node = self.broadcast(node, out_shape)
        while v.ndim > len(out_shape):
            v = v.reshape(v.shape[1:])
        if op == "mul_const" and np.all(v == 1.0):
            return node
        if op == "add_const" and not np.any(v):
            return node
        return self.add(op, [node], out_shape, value=v)

    def binary(self, op: str, a: int, b: int, out_shape: Sequence[int]) -> int:
        out_shape = tuple(out_shape)
        a = self.broadcast(a, out_shape) if self.shape(a) != out_shape else a
        b = self.broadcast(b, out_shape) if self.shape(b) != out_shape else b
        return self.add(op, [a, b], out_shape)

    def operand(self, x: Any) -> int | None:
        return self.node_of[id(x)] if self.traced(x) else None


class _FunctionRecorder(TorchFunctionMode):
    """Lowers, above the ATen level, functions whose ATen decomposition the recorder could not
    follow: padding other than by a constant (``F.pad`` in modes ``"circular"``, ``"reflect"``
    and ``"replicate"``: convolutions' ``padding_mode``, ``nn.CircularPad2d``, ...) selects
    elements of its input, lowered as one gather."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func is F.pad and args and self.recorder.traced(args[0]):
            mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
            if mode != "constant":
                return self.recorder.select(func, args, kwargs)
        return func(*args, **kwargs)


def tree_unflatten_pair(flat: list, spec: Any) -> tuple[tuple, dict]:
    args, kwargs = tree_unflatten(flat, spec)
    return tuple(args), dict(kwargs)


# --------------------------------------------------------------------------------- handlers
def _h_add(r: _Recorder, func, args, kwargs, out) -> None:
    name = _name(func)
    a, b = args[0], args[1]
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    sign = -1.0 if name == "sub" else 1.0
    if name == "rsub":  # b - alpha * a
        a, b, sign = b, a, -1.0
        na, nb = r.operand(a), r.operand(b)
        if na is not None and nb is not None:
            nb = r.scale(nb, -float(alpha), r.shape(nb))
            r.bind(out, r.binary("add", na, nb, out.shape))
            return
        if nb is not None:  # a constant - alpha * traced
            node = r.scale(nb, -float(alpha), out.shape)
            r.bind(out, r.shift(node, a, out.shape))
            return
        r.bind(out, r.shift(na, -float(alpha) * _np(b), out.shape))
        return
    na, nb = r.operand(a), r.operand(b)
    coef = sign * float(alpha)
    if na is not None and nb is not None:
        if coef != 1.0:
            nb = r.scale(nb, coef, r.shape(nb))
        r.bind(out, r.binary("add", na, nb, out.shape))
    elif na is not None:
        r.bind(out, r.shift(na, coef * _np(b), out.shape))
    else:
        node = r.scale(nb, coef, out.shape)
        r.bind(out, r.shift(node, a, out.shape))


def _h_div(r: _Recorder, func, args, kwargs, out) -> None:
    r.bind(out, r.scale(r.operand(args[0]), 1.0 / _np(args[1]), out.shape))


def _value(r: _Recorder, x: Any) -> int | np.ndarray:
    """``x`` as an operand of :func:`_times` and :func:`_plus`: its node if input-dependent,
    else its value."""
    node = r.operand(x)
    return node if node is not None else _np(x)


def _times(r: _Recorder, a: int | np.ndarray, b: int | np.ndarray, shape: Sequence[int]
           ) -> int | np.ndarray:
    """``a * b`` with broadcasting to ``shape``: a product of nodes, a scaled node or a
    constant."""
    if isinstance(a, int) and isinstance(b, int):
        return r.binary("mul", a, b, shape)
    if isinstance(a, int):
        return r.scale(a, b, shape)
    if isinstance(b, int):
        return r.scale(b, a, shape)
    return np.broadcast_to(a * b, tuple(shape)).copy()


def _plus(r: _Recorder, a: int | np.ndarray, b: int | np.ndarray, shape: Sequence[int]
          ) -> int | np.ndarray:
    """``a + b`` with broadcasting to ``shape``: a sum of nodes, a shifted node or a constant."""
    if isinstance(a, int) and isinstance(b, int):
        return r.binary("add", a, b, shape)
    if isinstance(a, int):
        return r.shift(a, b, shape)
    if isinstance(b, int):
        return r.shift(b, a, shape)
    return np.broadcast_to(a + b, tuple(shape)).copy()


def _h_mul(r: _Recorder, func, args, kwargs, out) -> None:
    node = _times(r, _value(r, args[0]), _value(r, args[1]), out.shape)
    assert isinstance(node, int)
    r.bind(out, node)


def _h_addcmul(r: _Recorder, func, args, kwargs, out) -> None:
    """``addcmul(x, t1, t2, value)`` = ``x + value * t1 * t2`` and ``addcdiv`` = ``x + value *
    t1 / t2`` (a constant ``t2``; division by an input-dependent one is an offence), any of the
    operands input-dependent."""
    x, t1, t2 = args[:3]
    value = float(kwargs.get("value", args[3] if len(args) > 3 else 1.0))
    other = _value(r, t2) if _name(func) == "addcmul" else 1.0 / _np(t2)
    term = _times(r, _times(r, _value(r, t1), other, out.shape), np.asarray(value), out.shape)
    node = _plus(r, _value(r, x), term, out.shape)
    assert isinstance(node, int)
    r.bind(out, node)


def _h_lerp(r: _Recorder, func, args, kwargs, out) -> None:
    """``lerp(start, end, weight)`` = ``start + weight * (end - start)``, any operand
    input-dependent (an input-dependent weight makes a product)."""
    start, end, weight = (_value(r, a) for a in args[:3])
    step = _plus(r, end, _times(r, start, np.asarray(-1.0), out.shape), out.shape)
    node = _plus(r, start, _times(r, weight, step, out.shape), out.shape)
    assert isinstance(node, int)
    r.bind(out, node)


def _h_neg(r: _Recorder, func, args, kwargs, out) -> None:
    r.bind(out, r.scale(r.operand(args[0]), -1.0, out.shape))


def _h_pow(r: _Recorder, func, args, kwargs, out) -> None:
    base = r.operand(args[0])
    k = args[1].item() if isinstance(args[1], torch.Tensor) else args[1]
    k = int(k)
    if k == 0:
        zero = r.scale(base, 0.0, out.shape)
        r.bind(out, r.shift(zero, 1.0, out.shape))
        return
    result: int | None = None
    square = base
    while k:  # binary exponentiation: multiplicative depth ceil(log2 k)
        if k & 1:
            result = square if result is None else r.binary("mul", result, square, out.shape)
        k >>= 1
        if k:
            square = r.binary("mul", square, square, out.shape)
    assert result is not None
    r.bind(out, result)


def _h_square(r: _Recorder, func, args, kwargs, out) -> None:
    x = r.operand(args[0])
    r.bind(out, r.binary("mul", x, x, out.shape))


def _h_mm(r: _Recorder, func, args, kwargs, out) -> None:
    _matmul(r, args[0], args[1], None, 1.0, 1.0, out)


def _h_addmm(r: _Recorder, func, args, kwargs, out) -> None:
    beta = kwargs.get("beta", 1.0)
    alpha = kwargs.get("alpha", 1.0)
    if r.traced(args[0]):
        node = _matmul(r, args[1], args[2], None, 1.0, alpha, None)
        scaled = r.scale(r.operand(args[0]), beta, out.shape)
        r.bind(out, r.binary("add", node, scaled, out.shape))
        return
    _matmul(r, args[1], args[2], args[0], beta, alpha, out)


def _matmul(r: _Recorder, a: Any, b: Any, bias: Any, beta: float, alpha: float,
            out: torch.Tensor | None) -> int:
    """a @ b (2-D or batched 3-D) where one or both operands are input-dependent."""
    na, nb = r.operand(a), r.operand(b)
    shape = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (a.shape[-2], b.shape[-1])
    if na is not None and nb is not None:
        node = _bilinear(r, na, nb, tuple(a.shape), tuple(b.shape), shape)
        if alpha != 1.0:
            node = r.scale(node, alpha, shape)
    elif na is not None:
        w = _np(b) * alpha  # (k, n) or (G, k, n)
        node = _apply_weight(r, na, tuple(a.shape), w, axis=-1)
    else:
        w = np.swapaxes(_np(a), -1, -2) * alpha  # x^T-side: contract b's rows
        node = _apply_weight(r, nb, tuple(b.shape), w, axis=-2)
    if bias is not None:
        bvec = _np(bias) * beta
        node = r.shift(node, bvec, shape)
    if out is not None:
        r.bind(out, node)
    return node


def _apply_weight(r: _Recorder, node: int, xshape: tuple[int, ...], w: np.ndarray,
                  axis: int) -> int:
    """Contract ``axis`` of x with w (k, n), or with a per-batch-entry w (G, k, n)."""
    if w.ndim == 2 or all(np.array_equal(w[0], w[g]) for g in range(w.shape[0])):
        return r.linear(node, axis, w if w.ndim == 2 else w[0], None)
    # Batched weights differ: x (G, p, q); move G next to the contracted axis, use a
    # block-diagonal weight on the merged (G * k) axis, then move G back.
    g, k, n = w.shape
    axis = axis % 3
    other = 2 if axis == 1 else 1
    perm = (other, 0, axis)
    idx = np.arange(int(np.prod(xshape))).reshape(xshape).transpose(perm)  # (p, G, k)
    merged = r.gather([node], idx.reshape(xshape[other], g * k))
    block = np.zeros((g * k, g * n))
    for i in range(g):
        block[i * k:(i + 1) * k, i * n:(i + 1) * n] = w[i]
    lin = r.linear(merged, 1, block, None)  # (p, G * n)
    p = xshape[other]
    back = np.arange(p * g * n).reshape(p, g, n)
    back = back.transpose(1, 0, 2) if axis == 2 else back.transpose(1, 2, 0)
    return r.gather([lin], back)


def _bilinear(r: _Recorder, na: int, nb: int, sa: tuple, sb: tuple, shape: tuple) -> int:
    """a @ b with both operands input-dependent: broadcast, multiply, sum over k."""
    k = sa[-1]
    batch = shape[:-2]
    n, m = shape[-2], shape[-1]
    ia = np.arange(int(np.prod(sa))).reshape(sa)[..., :, :, None]
    ib = np.arange(int(np.prod(sb))).reshape(sb)[..., None, :, :]
    full = batch + (n, k, m)
    ea = r.gather([na], np.broadcast_to(ia, full).copy())
    eb = r.gather([nb], np.broadcast_to(ib, full).copy())
    prod = r.add("mul", [ea, eb], full)
    summed = r.linear(prod, len(full) - 2, np.ones((k, 1)), None)
    return r.reshape(summed, shape)


def _h_bmm(r: _Recorder, func, args, kwargs, out) -> None:
    _matmul(r, args[0], args[1], None, 1.0, 1.0, out)


def _h_baddbmm(r: _Recorder, func, args, kwargs, out) -> None:
    _h_addmm(r, func, args, kwargs, out)


def _reduced_dims(dims: Any, nd: int) -> list[int]:
    """The sorted, non-negative dims an ATen reduction's ``dim`` argument names (None or an
    empty list: all)."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % nd for d in dims}) if nd else []


def _sum_over(r: _Recorder, node: int, dims: list[int], factor: float,
              out_shape: Sequence[int]) -> int:
    """``factor`` times the sum of ``node`` over ``dims``, reshaped to ``out_shape``."""
    shape = r.shape(node)
    keep = [d for d in range(len(shape)) if d not in dims]
    count = int(np.prod([shape[d] for d in dims])) if dims else 1
    idx = np.arange(int(np.prod(shape))).reshape(shape).transpose(keep + dims)
    merged = r.gather([node], idx.reshape(tuple(shape[d] for d in keep) + (count,)))
    summed = r.linear(merged, len(keep), np.full((count, 1), float(factor)), None)
    return r.reshape(summed, tuple(out_shape))


def _reduce(r: _Recorder, x: torch.Tensor, dims: Any, keepdim: bool, mean: bool,
            out: torch.Tensor) -> None:
    dims = _reduced_dims(dims, x.dim())
    count = int(np.prod([x.shape[d] for d in dims])) if dims else 1
    r.bind(out, _sum_over(r, r.operand(x), dims, 1.0 / count if mean else 1.0, out.shape))


def _h_var(r: _Recorder, func, args, kwargs, out) -> None:
    """``var`` and ``var_mean``: the mean of the squared deviations from the mean, a polynomial
    of degree 2, divided by ``count - correction`` (Bessel's correction by default)."""
    x = args[0]
    dims = _reduced_dims(args[1] if len(args) > 1 else kwargs.get("dim"), x.dim())
    correction = kwargs.get("correction")
    correction = 1.0 if correction is None else float(correction)
    count = int(np.prod([x.shape[d] for d in dims])) if dims else 1
    if count <= correction:
        raise UnsupportedOpError(f"variance of {count} value(s) with correction {correction:g} "
                                 f"in module '{r.path or '<model>'}' is not defined")
    node = r.operand(x)
    kept = tuple(1 if d in dims else n for d, n in enumerate(x.shape))
    mean = _sum_over(r, node, dims, 1.0 / count, kept)
    centred = r.binary("add", node, r.scale(mean, -1.0, kept), tuple(x.shape))
    square = r.binary("mul", centred, centred, tuple(x.shape))
    var_out, mean_out = (out[0], out[1]) if isinstance(out, (tuple, list)) else (out, None)
    r.bind(var_out, _sum_over(r, square, dims, 1.0 / (count - correction), var_out.shape))
    if mean_out is not None:
        r.bind(mean_out, r.reshape(mean, tuple(mean_out.shape)))


def _h_trilinear(r: _Recorder, func, args, kwargs, out) -> None:
    """``aten._trilinear`` (``nn.Bilinear``, ``F.bilinear``): three operands, each unsqueezed
    at its ``expand`` dims to one rank, multiplied with broadcasting and summed over
    ``sumdim``; the input-dependent operands are multiplied as nodes, the others scale."""
    operands, expands = args[:3], args[3:6]
    rank = operands[0].dim() + len(expands[0])
    sumdim = sorted({int(d) % rank for d in args[6]})  # args[7], unroll_dim, tunes the kernel
    shapes = []
    for t, expand in zip(operands, expands):
        shape = list(t.shape)
        for d in sorted(expand):
            shape.insert(d, 1)
        shapes.append(tuple(shape))
    full = tuple(torch.broadcast_shapes(*shapes))
    node: int | None = None
    const = np.ones(())
    for t, shape in zip(operands, shapes):
        if r.traced(t):
            expanded = r.broadcast(r.reshape(r.operand(t), shape), full)
            node = expanded if node is None else r.binary("mul", node, expanded, full)
        else:
            const = const * _np(t).reshape(shape)
    assert node is not None
    node = r.scale(node, np.broadcast_to(const, full).copy(), full)
    r.bind(out, _sum_over(r, node, sumdim, 1.0, out.shape))


def _h_sum(r: _Recorder, func, args, kwargs, out) -> None:
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    _reduce(r, args[0], dims, keepdim, False, out)


def _h_mean(r: _Recorder, func, args, kwargs, out) -> None:
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    _reduce(r, args[0], dims, keepdim, True, out)


def _h_cumsum(r: _Recorder, func, args, kwargs, out) -> None:
    x = args[0]
    dim = args[1] % max(x.dim(), 1)
    n = x.shape[dim]
    r.bind(out, r.linear(r.operand(x), dim, np.triu(np.ones((n, n))), None))


def _h_prod(r: _Recorder, func, args, kwargs, out) -> None:
    """``prod`` over one dim or all elements: the elements multiplied pairwise, half against
    half, so a product of ``n`` has multiplicative depth ``ceil(log2 n)``."""
    x = args[0]
    node = r.operand(x)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if isinstance(dim, int) and x.dim() > 0:
        dim %= x.dim()
    else:  # prod of every element (aten.prod.default)
        node, dim = r.reshape(node, (x.numel(),)), 0
    shape = r.shape(node)
    while shape[dim] > 1:
        n, half = shape[dim], shape[dim] // 2
        idx = np.arange(int(np.prod(shape))).reshape(shape)
        first = r.gather([node], np.take(idx, np.arange(half), axis=dim))
        second = r.gather([node], np.take(idx, np.arange(half, 2 * half), axis=dim))
        pairs = r.binary("mul", first, second, r.shape(first))
        if n % 2:  # the odd one out goes on to the next round
            size = int(np.prod(r.shape(pairs)))
            kept = np.concatenate([np.arange(size).reshape(r.shape(pairs)),
                                   size + np.take(idx, [n - 1], axis=dim)], axis=dim)
            pairs = r.gather([pairs, node], kept)
        node, shape = pairs, r.shape(pairs)
    r.bind(out, r.reshape(node, tuple(out.shape)))


def _h_cumprod(r: _Recorder, func, args, kwargs, out) -> None:
    """``cumprod`` as a parallel prefix product: ``ceil(log2 n)`` rounds, each multiplying
    every element by the partial product ``2**k`` places before it (by 1 where there is none),
    so its multiplicative depth is that of one product of all ``n``."""
    x = args[0]
    dim = (args[1] if len(args) > 1 else kwargs["dim"]) % max(x.dim(), 1)
    node, shape = r.operand(x), tuple(x.shape)
    n = shape[dim] if shape else 1
    idx = np.arange(int(np.prod(shape))).reshape(shape)
    step = 1
    while step < n:
        earlier = np.take(idx, np.arange(-step, n - step), axis=dim)
        before = np.moveaxis(np.moveaxis(earlier, dim, 0).copy(), 0, dim)
        np.moveaxis(before, dim, 0)[:step] = -1  # no element that far before: times 1
        shifted = r.shift(r.gather([node], before), (before < 0).astype(np.float64), shape)
        node = r.binary("mul", node, shifted, shape)
        step *= 2
    r.bind(out, node)


def _h_batch_norm(r: _Recorder, func, args, kwargs, out) -> None:
    x, weight, bias, mean, var = args[:5]
    eps = args[-1] if _name(func) == "_native_batch_norm_legit_no_training" else args[7]
    c = x.shape[1]
    inv = 1.0 / np.sqrt(_np(var) + float(eps))
    scale = inv * (_np(weight) if weight is not None else 1.0)
    shift = (_np(bias) if bias is not None else 0.0) - _np(mean) * scale
    bshape = (c,) + (1,) * (x.dim() - 2)
    node = r.scale(r.operand(x), scale.reshape(bshape), x.shape)
    node = r.shift(node, shift.reshape(bshape), x.shape)
    r.bind(out[0], node)


def _h_convolution(r: _Recorder, func, args, kwargs, out) -> None:
    x, weight, bias, stride, padding, dilation, transposed, _, groups = args[:9]
    if r.traced(weight) or (bias is not None and r.traced(bias)):
        raise UnsupportedOpError(f"convolution with an input-dependent kernel in module "
                                 f"'{r.path or '<model>'}'")
    if transposed:
        r._probe(func, args, kwargs, out)
        return
    nsp = x.dim() - 2
    if nsp not in (1, 2):
        r._probe(func, args, kwargs, out)
        return
    node = r.operand(x)
    # im2col as a gather: (N, C, *S) -> (N, *S_out, C/g * prod(k)) per group, then one linear.
    xs = tuple(x.shape)
    n, cin = xs[0], xs[1]
    w = _np(weight)  # (O, C/g, *k)
    cout = w.shape[0]
    ksz = w.shape[2:]
    idx = torch.arange(1, int(np.prod(xs)) + 1, dtype=torch.float64).reshape(xs)
    pads = [int(p) for p in padding]
    if nsp == 1:
        idx = idx.unsqueeze(2)
        ksz = (1,) + tuple(ksz)
        stride, dilation, pads = (1, stride[0]), (1, dilation[0]), [0, pads[0]]
    padded = torch.nn.functional.pad(idx, (pads[1], pads[1], pads[0], pads[0]))
    cols = torch.nn.functional.unfold(padded, kernel_size=ksz, dilation=tuple(dilation),
                                      stride=tuple(stride))  # (N, C*kh*kw, L)
    cols = cols.transpose(1, 2)  # (N, L, C*kh*kw)
    index = cols.numpy().astype(np.int64) - 1
    patches = r.gather([node], index)
    per = cin // groups * int(np.prod(ksz))
    opg = cout // groups
    wmat = np.zeros((cin * int(np.prod(ksz)), cout))
    for g in range(groups):
        wg = w[g * opg:(g + 1) * opg].reshape(opg, per)  # (O/g, C/g * k)
        wmat[g * per:(g + 1) * per, g * opg:(g + 1) * opg] = wg.T
    lin = r.linear(patches, 2, wmat, _np(bias) if bias is not None else None)  # (N, L, O)
    oshape = tuple(out.shape)
    back = np.arange(n * int(np.prod(oshape[2:])) * cout).reshape(n, -1, cout)
    back = back.transpose(0, 2, 1).reshape(oshape)
    r.bind(out, r.gather([lin], back))


def _h_linear(r: _Recorder, func, args, kwargs, out) -> None:
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if r.traced(w):
        raise UnsupportedOpError(f"linear with an input-dependent weight in module "
                                 f"'{r.path or '<model>'}'")
    node = r.linear(r.operand(x), -1, _np(w).T, _np(bias) if bias is not None else None)
    r.bind(out, node)


def _h_dropout(r: _Recorder, func, args, kwargs, out) -> None:
    train = args[2] if len(args) > 2 else kwargs.get("train", False)
    if train:
        raise UnsupportedOpError(f"dropout in training mode in module '{r.path or '<model>'}': "
                                 f"call model.eval() first")
    r.bind(out, r.operand(args[0]))


def _h_masked_fill(r: _Recorder, func, args, kwargs, out) -> None:
    """x.masked_fill(mask, value) with a constant mask: a selection plus a constant."""
    x, mask, value = args[0], args[1], args[2]
    idx = torch.arange(1, x.numel() + 1, dtype=torch.float64).reshape(x.shape)
    index = idx.masked_fill(mask, 0).numpy().astype(np.int64) - 1
    node = r.gather([r.operand(x)], index)
    fill = torch.zeros(out.shape, dtype=torch.float64).masked_fill(mask, _np(value).item())
    r.bind(out, r.shift(node, fill, out.shape))


def _h_where(r: _Recorder, func, args, kwargs, out) -> None:
    """torch.where(mask, a, b) with a constant mask: a selection from a and b plus a constant."""
    cond, operands = args[0], args[1:3]
    inputs: list[int] = []
    index_parts, const_parts = [], []
    offset = 0
    for v in operands:
        if r.traced(v):
            inputs.append(r.operand(v))
            index_parts.append(torch.arange(offset + 1, offset + v.numel() + 1,
                                            dtype=torch.float64).reshape(v.shape))
            const_parts.append(torch.zeros(v.shape, dtype=torch.float64))
            offset += v.numel()
        else:
            index_parts.append(torch.zeros((), dtype=torch.float64))
            const_parts.append(torch.as_tensor(v, dtype=torch.float64))
    index = torch.where(cond, *index_parts).expand(out.shape)
    node = r.gather(inputs, index.numpy().astype(np.int64) - 1)
    const = torch.where(cond, *const_parts).expand(out.shape)
    r.bind(out, r.shift(node, const.numpy(), out.shape))


_HANDLERS: dict[str, Callable] = {
    "add": _h_add, "sub": _h_add, "rsub": _h_add, "mul": _h_mul, "div": _h_div,
    "true_divide": _h_div, "neg": _h_neg, "pow": _h_pow, "square": _h_square, "mm": _h_mm,
    "addmm": _h_addmm, "bmm": _h_bmm, "baddbmm": _h_baddbmm, "sum": _h_sum, "mean": _h_mean,
    "var": _h_var, "var_mean": _h_var, "_trilinear": _h_trilinear,
    "cumsum": _h_cumsum, "_native_batch_norm_legit_no_training": _h_batch_norm,
    "native_batch_norm": _h_batch_norm, "convolution": _h_convolution, "linear": _h_linear,
    "dropout": _h_dropout, "masked_fill": _h_masked_fill, "where": _h_where,
    "addcmul": _h_addcmul, "addcdiv": _h_addcmul, "lerp": _h_lerp, "prod": _h_prod,
    "cumprod": _h_cumprod,
}


# --------------------------------------------------------------------------------- entry points
#: what to do with a model of several inputs or outputs
_ONE_TENSOR = "an encrypted program has one input tensor and one output tensor"


def _check_one_input(model: nn.Module, example_input: Any) -> None:
    """Raise :class:`TraceError` where the model takes several inputs or the example is
    several tensors, saying how to make one."""
    arrays = [t for t in example_input if isinstance(t, (torch.Tensor, np.ndarray))] \
        if isinstance(example_input, (tuple, list)) else []
    # a tuple of tensors is how PyTorch passes several inputs; rows of different shapes are no
    # batch either (a list of equal rows is one)
    if arrays and ((isinstance(example_input, tuple) and isinstance(arrays[0], torch.Tensor))
                   or len({tuple(t.shape) for t in arrays}) > 1):
        raise TraceError(
            f"example_input must be one tensor (B, *sample), got a {type(example_input).__name__}"
            f" of {len(example_input)}: {_ONE_TENSOR}; concatenate the model's inputs into one "
            f"tensor and split them inside forward")
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a TorchScript or builtin forward: not inspectable
        return
    required = [p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 1:
        raise TraceError(
            f"{type(model).__name__}.forward takes {len(required)} inputs "
            f"({', '.join(required)}): {_ONE_TENSOR}; concatenate the inputs into one tensor and "
            f"split them inside forward (or give the others defaults)")


def _prepare(model: nn.Module, example_input: Any) -> tuple[nn.Module, torch.Tensor]:
    if not isinstance(model, nn.Module):
        raise TraceError(f"expected an nn.Module to trace, got {type(model).__name__}")
    as_polynomial = getattr(model, "as_polynomial", None)
    if callable(as_polynomial):  # vector fields f(t, x) expose their one-input polynomial
        model = as_polynomial()
    _check_one_input(model, example_input)
    if not isinstance(example_input, torch.Tensor):
        example_input = torch.as_tensor(np.asarray(example_input))
    if example_input.dim() < 1 or example_input.shape[0] < 1:
        raise ShapeError(f"example_input must have a leading batch dimension of size >= 1, got "
                         f"shape {tuple(example_input.shape)}")
    if not torch.all(torch.isfinite(example_input.float())):
        raise ShapeError("example_input contains NaN or infinite values")
    # tensors a forward pre-hook computes from parameters (pruning's weight_orig * weight_mask,
    # torch.nn.utils.weight_norm's g * v / |v|) are not leaves, which deepcopy refuses: the
    # copy holds them detached, and its hooks compute them again on every forward
    computed = {id(t): t.detach().clone() for module in model.modules()
                for t in vars(module).values() if isinstance(t, torch.Tensor) and not t.is_leaf}
    clone = copy.deepcopy(model, computed).to("cpu").double().eval()
    for module in clone.modules():  # .double() converts parameters and buffers only
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                setattr(module, name, value.detach().to("cpu", torch.float64))
    x = example_input[:1].detach().to("cpu", torch.float64).clone()
    return clone, x


class _Float64Casts(TorchDispatchMode):
    """Keeps a cast of a floating tensor to another floating dtype (``x.float()``,
    ``x.half()``, ``w.to(torch.float32)``) at float64: a change of precision is the identity
    of the polynomial, which the encrypted program computes at CKKS precision whatever the
    model's dtype."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        dtype = kwargs.get("dtype")
        if _name(func) == "_to_copy" and isinstance(dtype, torch.dtype) \
                and dtype.is_floating_point and dtype != torch.float64 \
                and args[0].is_floating_point():
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _float64() -> Iterator[None]:
    """Run the traced float64 copy of a model with float64 as the default dtype, so that the
    constants its forward creates (``torch.ones(4, 2)``, ``torch.tensor([0.5])``) are float64
    too, as its parameters are, and with its casts to other floating dtypes kept at float64
    (:class:`_Float64Casts`), when traced and when checked alike."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64Casts():
            yield
    finally:
        torch.set_default_dtype(previous)


def _second_sample(example_input: Any, x: torch.Tensor) -> torch.Tensor:
    """A sample to pair with the traced one ``x``: the example's second, or else a fixed
    pseudo-random one of ``x``'s shape and root-mean-square size."""
    if isinstance(example_input, torch.Tensor) and example_input.shape[0] > 1:
        return example_input[1:2].detach().to("cpu", torch.float64)
    g = torch.Generator().manual_seed(0)
    size = float(x.pow(2).mean().sqrt()) or 1.0
    return size * torch.randn(x.shape, generator=g, dtype=torch.float64)


def _separate_alone(model: nn.Module, pair: torch.Tensor, ref: np.ndarray, tol: float) -> bool:
    """Whether ``model`` run on each sample of ``pair`` alone gives ``ref``, its outputs on the
    pair, within ``tol`` (it keeps the samples separate, and is deterministic)."""
    try:
        with torch.no_grad(), _float64():
            alone = [model(pair[i:i + 1]) for i in range(pair.shape[0])]
        out = torch.cat(alone).detach().to("cpu", torch.float64).numpy()
    except Exception:  # noqa: BLE001 -- outputs that do not stack: not separate
        return False
    return out.shape == ref.shape and float(np.max(np.abs(out - ref), initial=0.0)) <= tol


def check_samples_separate(model: nn.Module, program: PolyProgram, pair: torch.Tensor) -> None:
    """Raise :class:`TraceError` unless ``model`` on the batch ``pair`` (two samples) returns
    what ``program``, traced from one sample, gives for each sample separately.

    A program never mixes samples: a model that does (a mean, sum, reshape or normalisation
    over the batch axis, an output without it) is traced into one that computes something
    else on a batch. A model that cannot run on two samples at all is not judged.
    """
    try:
        with torch.no_grad(), _float64():
            ref = model(pair)
    except Exception:  # noqa: BLE001 -- a model written for one sample at a time
        return
    if not isinstance(ref, torch.Tensor):
        return
    ref_np = ref.detach().to("cpu", torch.float64).numpy()
    if not np.all(np.isfinite(ref_np)):
        # NaN or inf compares unequal to everything: no verdict on the batch axis is possible
        raise TraceError(
            "the model's output is not finite (NaN or inf) on a batch of two samples shaped as "
            "the example input: check its weights and the example input, or bring values "
            "down that overflow (a product of large values, a high power)")
    got = program.run(pair.numpy())
    assert isinstance(got, np.ndarray)
    if got.shape == ref_np.shape:
        tol = 1e-6 * max(1.0, float(np.max(np.abs(ref_np), initial=0.0)))
        diff = float(np.max(np.abs(got - ref_np), initial=0.0))
        if diff <= tol:
            return
        if _separate_alone(model, pair, ref_np, tol):
            raise TraceError(
                f"the program traced from the model differs from the model by up to {diff:.3g} "
                f"on a batch of two samples, which the model computes separately: an op on an "
                f"input-dependent value was traced as something it does not compute; please "
                f"report the model (and write that op otherwise meanwhile)")
        found = f"its outputs differ by up to {diff:.3g} from those of each sample run alone"
    else:
        found = f"it returns shape {tuple(ref_np.shape)} where each sample run alone gives " \
                f"{tuple(got.shape)}"
    raise TraceError(
        f"the model mixes the samples of a batch: on a batch of two samples {found}; an "
        f"encrypted program evaluates every sample separately, so the model must keep the batch "
        f"axis (dim 0) first and not reduce, reshape or normalise across it (or the model is not "
        f"deterministic)")


#: modules whose training mode computes something else than their eval mode
_MODE_DEPENDENT = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd,
                   nn.AlphaDropout, nn.FeatureAlphaDropout)


def _warn_training(model: nn.Module) -> None:
    """Warn where ``model`` is in training mode with modules that compute otherwise in eval
    mode: the program is traced in eval mode, so it differs from ``model(x)`` as it stands."""
    if not isinstance(model, nn.Module):
        return
    found = [f"'{name or '<model>'}' ({type(m).__name__})" for name, m in model.named_modules()
             if m.training and isinstance(m, _MODE_DEPENDENT)]
    if found:
        # point at the user's call, past the library's frames (trace, certify, he.compile)
        level, frame = 2, sys._getframe(1)
        while frame is not None and \
                str(frame.f_globals.get("__name__", "")).split(".")[0] in ("polynets", "he"):
            level, frame = level + 1, frame.f_back
        warnings.warn(
            f"the model is in training mode: it is traced in eval mode (BatchNorm by its running "
            f"statistics, no dropout), so the program computes what model.eval() does, not what "
            f"the model computes now ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''});"
            f" call model.eval() first", UserWarning, stacklevel=level)


def record(model: nn.Module, example_input: Any, *, strict: bool) -> tuple[
        list[Node], int | None, list[Offence], dict[str, Any]]:
    """Run the recorder; returns (nodes, output node or None, offences, meta)."""
    _warn_training(model)
    clone, x = _prepare(model, example_input)
    rec = _Recorder(strict=strict)
    handles = []
    for qualname, module in clone.named_modules():
        if module is clone or isinstance(module, torch.jit.ScriptModule):
            continue  # TorchScript runs its submodules without hooks: its ops count as its own

        def pre(mod, inputs, _q=qualname):  # noqa: ANN001
            rec.enter(_q, mod, inputs)

        def post(mod, inputs, output):  # noqa: ANN001
            rec.leave()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    rec.stack = [("", type(clone).__name__)]
    rec.bind(x, rec.add("input", (), tuple(x.shape)))
    try:
        with torch.no_grad(), _float64(), rec, _FunctionRecorder(rec):
            y = clone(x)
    except PolynetsError:
        raise
    except Exception as exc:  # the model's own code failed on one sample
        failing = rec.failure if rec.failure is not None and rec.failure[0] is exc else None
        path, kind = failing[1:] if failing is not None else ("", type(clone).__name__)
        raise TraceError(f"the model raised {type(exc).__name__} in module '{path or '<model>'}' "
                         f"({kind}) when run on one sample of shape {tuple(x.shape)}: "
                         f"{exc}") from exc
    finally:
        for h in handles:
            h.remove()
    if not isinstance(y, torch.Tensor):
        size = f" of {len(y)}" if isinstance(y, (tuple, list, dict)) else ""
        raise TraceError(f"the model must return one tensor to be traced, got "
                         f"{type(y).__name__}{size}: {_ONE_TENSOR}; return the output to "
                         f"encrypt (the logits, say), or wrap the model in a module that does")
    meta = {"model": type(model).__name__, "input_shape": list(x.shape),
            "output_shape": list(y.shape)}
    out = rec.node_of.get(id(y))
    if out is not None and not rec.offences:
        check_samples_separate(clone, PolyProgram(rec.nodes, out),
                               torch.cat([x, _second_sample(example_input, x)]))
    return rec.nodes, out, rec.offences, meta


def trace(model: nn.Module, example_input: Any, *, optimize: bool = True) -> PolyProgram:
    """Lower ``model`` (run in eval mode, float64) to a :class:`PolyProgram`.

    ``example_input``: a tensor ``(B, ...)``; only its first sample is used, and the program
    accepts any batch of that per-sample shape. Models whose forward is not one-input (a
    Poly-NODE's ``f(t, x)``) are traced through their ``as_polynomial()`` module. With
    ``optimize`` (default) BatchNorm and other affine chains are folded into adjacent linear
    maps, linear chains fused, layout ops composed.

    Raises :class:`NonPolynomialError` naming every offending module, and
    :class:`UnsupportedOpError` for ops the tracer does not know.
    """
    nodes, out, offences, meta = record(model, example_input, strict=False)
    if offences:
        raise NonPolynomialError(
            "the model is not a polynomial of its input:\n" +
            "\n".join(f"  - {o}" for o in offences))
    if out is None:
        raise TraceError("the model's output does not depend on its input; nothing to trace")
    program = PolyProgram(nodes, out, meta=meta)
    if optimize:
        from polynets.ir.passes import optimize as _optimize

        program = _optimize(program)
    return program

