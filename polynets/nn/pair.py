"""One-input view of a two-input module, so that two-input mixers trace and certify.

The tracer (:func:`polynets.ir.trace`) lowers models of one input tensor. A module of two inputs,
such as Cross-PoM ``pom(x_q, x_c)`` or the multimodal PADRe ``padre(x, context)``, is traced
through :class:`PairInput`: its one input is the per-sample concatenation
``z = [flatten(a), flatten(b)]`` and it calls ``module(a, b, **call_kwargs)``. The program then
computes the same polynomial of the pair ``(a, b)``, and its certificate gives the degree in the
pair (the total degree in all entries of ``a`` and ``b``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from polynets.errors import ConfigError
from polynets.nn.layers import check_shape

__all__ = ["PairInput"]


def _sample_shape(value: object, name: str) -> tuple[int, ...]:
    shape = (value,) if isinstance(value, int) else tuple(value)  # type: ignore[arg-type]
    if not shape or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                            for v in shape):
        raise ConfigError(f"PairInput {name} must be a per-sample shape of positive ints "
                          f"(without the batch dim), got {value!r}")
    return shape


class PairInput(nn.Module):
    """``z -> module(a, b, **call_kwargs)`` with ``z = [flatten(a), flatten(b)]`` per sample.

    Args:
        module: a module called as ``module(a, b, **call_kwargs)``.
        first_shape: per-sample shape of ``a`` (without the batch dim), e.g. ``(N, d)``.
        second_shape: per-sample shape of ``b``, e.g. ``(M, d)``.
        **call_kwargs: constant keyword arguments of every call (e.g. a Cross-PoM ``mask``);
            they do not depend on the input, so the tracer records them as constants.

    Shapes: ``(B, prod(first_shape) + prod(second_shape)) -> module(a, b).shape``.
    """

    def __init__(self, module: nn.Module, first_shape: int | Sequence[int],
                 second_shape: int | Sequence[int], **call_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"PairInput wraps an nn.Module, got {type(module).__name__}")
        self.module = module
        self.first_shape = _sample_shape(first_shape, "first_shape")
        self.second_shape = _sample_shape(second_shape, "second_shape")
        self.call_kwargs = dict(call_kwargs)
        self.split = (math.prod(self.first_shape), math.prod(self.second_shape))

    @staticmethod
    def pack(a: Tensor, b: Tensor) -> Tensor:
        """The one input of the pair: ``(B, *first) , (B, *second) -> (B, F1 + F2)``."""
        if a.dim() < 1 or b.dim() < 1 or a.shape[0] != b.shape[0]:
            raise ConfigError(f"PairInput.pack needs two tensors with the same leading batch "
                              f"dim, got {tuple(a.shape)} and {tuple(b.shape)}")
        return torch.cat([a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)], dim=1)

    def unpack(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Inverse of :meth:`pack`: ``(B, F1 + F2) -> (B, *first_shape), (B, *second_shape)``."""
        check_shape("PairInput", z, ("B", sum(self.split)))
        a, b = z.split(self.split, dim=1)
        return a.reshape(-1, *self.first_shape), b.reshape(-1, *self.second_shape)

    def extra_repr(self) -> str:
        return f"first_shape={self.first_shape}, second_shape={self.second_shape}"

    def forward(self, z: Tensor) -> Tensor:
        a, b = self.unpack(z)
        return self.module(a, b, **self.call_kwargs)

