"""Execute a :class:`~polynets.program.PolyProgram` with PyTorch ops (CPU or GPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from polynets.program import PolyProgram


class ProgramModule(nn.Module):
    """``nn.Module`` running a polynomial program; input/output shapes are those of the model."""

    def __init__(self, program: "PolyProgram", dtype: Any = None):
        super().__init__()
        self.program = program
        dtype = dtype or torch.float64
        self._consts = nn.ParameterList()
        self._slots: list[dict[str, int]] = []
        for node in program.nodes:
            slots: dict[str, int] = {}
            for key, value in node.attrs.items():
                if key in ("weight", "bias", "value") and value is not None:
                    slots[key] = len(self._consts)
                    self._consts.append(nn.Parameter(torch.as_tensor(value, dtype=dtype),
                                                     requires_grad=False))
                elif key == "index":
                    slots[key] = len(self._consts)
                    self._consts.append(nn.Parameter(torch.as_tensor(value, dtype=torch.long),
                                                     requires_grad=False))
            self._slots.append(slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prog = self.program
        sample = prog.input_shape
        batch = x.shape[0]
        values: list[torch.Tensor] = []
        for node, slots in zip(prog.nodes, self._slots):
            c = {k: self._consts[i] for k, i in slots.items()}
            ins = [values[j] for j in node.inputs]
            if node.op == "input":
                out = x.reshape((batch,) + tuple(sample)).to(self._dtype())
            elif node.op == "linear":
                axis = node.attrs["axis"] + 1
                out = torch.movedim(torch.tensordot(ins[0], c["weight"], dims=([axis], [0])),
                                    -1, axis)
                if "bias" in c:
                    shape = [1] * out.ndim
                    shape[axis] = -1
                    out = out + c["bias"].reshape(shape)
            elif node.op == "mul":
                out = ins[0] * ins[1]
            elif node.op == "add":
                out = ins[0] + ins[1]
            elif node.op == "mul_const":
                out = ins[0] * c["value"]
            elif node.op == "add_const":
                out = ins[0] + c["value"]
            else:
                flat = [v.reshape(batch, -1) for v in ins]
                flat.append(flat[0].new_zeros(batch, 1))
                src = torch.cat(flat, dim=1)
                idx = c["index"].reshape(-1)
                idx = torch.where(idx < 0, src.shape[1] - 1, idx)
                out = src[:, idx].reshape((batch,) + tuple(node.shape))
            if tuple(out.shape[1:]) != tuple(node.shape):
                out = out.expand((batch,) + tuple(node.shape))
            values.append(out)
        out = values[prog.output]
        if prog.output_shape[:1] == (1,):
            out = out.reshape((batch,) + tuple(prog.output_shape[1:]))
        return out

    def _dtype(self) -> torch.dtype:
        for p in self._consts:
            if p.dtype.is_floating_point:
                return p.dtype
        return torch.float64
