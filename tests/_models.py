"""Small modules that several test files build their models from."""

from __future__ import annotations

import torch
from torch import nn


class Square(nn.Module):
    """``x * x``, elementwise: the activation of the polynomial networks under test."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x
