"""Small modules that several test files build their models from."""

from __future__ import annotations

import torch
from torch import nn


class Square(nn.Module):
    """``x * x``, elementwise: the activation of the polynomial networks under test."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def compile_candidates(program, calib, kind: str, rings: tuple[int, ...]) -> list:
    """Every lowering ``he.compile`` prices for ``program`` in packing ``kind``
    (``he.compiler._candidate_lowerings``), each compiled as it would (its kept values in the
    options, one server thread, the default cost model, 16 bits): what a test of the choice
    between them compares."""
    from he.compiler import _candidate_lowerings, _compile_packing
    from he.costmodel import default_model

    maxabs = program.max_abs(calib)
    options = {"precision_bits": 16, "max_input_ciphertexts": 8, "objective": "latency",
               "batch_size": None, "security": 128, "server_threads": 1}
    tried = []
    for keep, low, msq in _candidate_lowerings(program, calib, kind=kind):
        opts = {**options, "kept_apart": list(keep)} if keep else options
        tried.append(_compile_packing(program, low, kind, "", maxabs, msq, opts, rings,
                                      default_model(), 16, None, None))
    return tried
