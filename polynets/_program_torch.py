"""Execute a :class:`~polynets.program.PolyProgram` with PyTorch ops (CPU or GPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from polynets.errors import ConfigError, ShapeError

if TYPE_CHECKING:
    from polynets.program import PolyProgram


def _linear(v: torch.Tensor, axis: int, weight: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    # v: (B, *sample); contract sample axis `axis` (tensor dim axis + 1) with weight (k, n)
    out = torch.movedim(torch.tensordot(v, weight, dims=([axis + 1], [0])), -1, axis + 1)
    if bias is not None:
        shape = [1] * out.ndim
        shape[axis + 1] = -1
        out = out + bias.reshape(shape)
    return out


def _gather(values: Sequence[torch.Tensor], index: torch.Tensor, batch: int) -> torch.Tensor:
    flat = [v.reshape(batch, -1) for v in values]
    flat.append(flat[0].new_zeros(batch, 1))
    src = torch.cat(flat, dim=1)
    idx = torch.where(index < 0, src.shape[1] - 1, index)
    return src[:, idx]  # (batch, *index.shape)


class ProgramModule(nn.Module):
    """``nn.Module`` running a polynomial program; input/output shapes are those of the model."""

    def __init__(self, program: "PolyProgram", dtype: Any = None):
        super().__init__()
        self.program = program
        self.dtype = dtype or torch.float64
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(f"to_torch(dtype=...) needs a real floating-point dtype such as "
                              f"torch.float64, got {dtype!r}")
        self._consts = nn.ParameterList()
        self._slots: list[dict[str, int]] = []
        for node in program.nodes:
            slots: dict[str, int] = {}
            for key, value in node.attrs.items():
                if key in ("weight", "bias", "value", "index") and value is not None:
                    slots[key] = len(self._consts)
                    kind = torch.long if key == "index" else self.dtype
                    self._consts.append(nn.Parameter(torch.as_tensor(value, dtype=kind),
                                                     requires_grad=False))
            self._slots.append(slots)

    def _attr(self, i: int, key: str) -> torch.Tensor | None:
        slot = self._slots[i].get(key)
        return None if slot is None else self._consts[slot]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, *input_shape[1:])`` (what the traced model took); any other rank or size
        raises :class:`~polynets.errors.ShapeError`. Integer and bool inputs are cast to
        ``self.dtype``; complex ones are refused."""
        if not isinstance(x, torch.Tensor):
            raise ShapeError(f"the program module takes a torch.Tensor, got {type(x).__name__}")
        if x.is_complex():
            raise ShapeError("program input is complex; a polynomial program evaluates real "
                             "numbers")
        xb = x.reshape(self.program.batch_shape(x.shape)).to(self.dtype)
        return self.program.evaluate(xb, attr=self._attr, linear=_linear, gather=_gather,
                                     expand=lambda v, shape: v.expand(shape))
