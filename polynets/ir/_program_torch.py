"""Execute a :class:`~polynets.ir.program.PolyProgram` with PyTorch ops (CPU or GPU)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from polynets.errors import ConfigError, ShapeError
from polynets.ir.program import ArrayInterpreter, Node, PolyProgram


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


class _TorchInterpreter(ArrayInterpreter):
    """The array interpreter on tensors; a node's arrays are the module's buffers."""

    contract = staticmethod(_linear)
    select = staticmethod(_gather)

    def __init__(self, xb: torch.Tensor, module: "ProgramModule"):
        super().__init__(xb)
        self.module = module

    def const(self, i: int, node: Node, key: str) -> torch.Tensor | None:
        name = self.module._names[i].get(key)
        return None if name is None else getattr(self.module, name)

    def expand(self, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return value.expand(shape)


class ProgramModule(nn.Module):
    """``nn.Module`` running a polynomial program; input/output shapes are those of the model."""

    def __init__(self, program: PolyProgram, dtype: Any = None):
        super().__init__()
        self.program = program
        self.dtype = dtype or torch.float64
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(f"to_torch(dtype=...) needs a real floating-point dtype such as "
                              f"torch.float64, got {dtype!r}")
        # the program's constants are buffers: they move with .to(device) and are saved in the
        # state dict, but are not parameters an optimiser would train
        self._names: list[dict[str, str]] = []
        for i, node in enumerate(program.nodes):
            names: dict[str, str] = {}
            for key, value in node.attrs.items():
                if key in ("weight", "bias", "value", "index") and value is not None:
                    names[key] = f"n{i}_{key}"
                    kind = torch.long if key == "index" else self.dtype
                    self.register_buffer(names[key], torch.as_tensor(value, dtype=kind))
            self._names.append(names)

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
        return self.program.evaluate(_TorchInterpreter(xb, self))
