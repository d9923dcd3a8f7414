"""Models built only from the public API, on inputs of several shapes (colour images, sequences,
tabular rows), compiled with the compiler's defaults and run end to end under real CKKS:
decrypt(server.run(encrypt(x))) agrees with the program's simulation within the promised error,
and the simulation with the PyTorch model.

Each model is small; together they cover the lowering paths a user's model can take (stacked
pairs in either order, client planes, spatial shifts, pyramid merges, token and channel mixers
of every polynomial family, maps without a shortcut).
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

import polynets as pn

pytestmark = pytest.mark.slow


class _Tokens(nn.Module):
    """Patch embedding, residual Mu-Layers, mean-pooled linear head."""

    def __init__(self, img: int, ch: int, patch: int, dim: int, depth: int, **mu) -> None:
        super().__init__()
        self.embed = pn.PatchEmbed(img, patch, ch, dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim, **mu) for _ in range(depth))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.mean((1, 2)))


class _Sequence(nn.Module):
    """A linear input map, one residual token mixer, a mean-pooled head."""

    def __init__(self, mixer: nn.Module, features: int = 8, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.mix = mixer
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.inp(x)
        return self.head((t + self.mix(t)).mean(1))


class _Image(nn.Module):
    """Patch embedding, one residual mixer on the token grid, a mean-pooled head."""

    def __init__(self, mixer: nn.Module, dim: int = 16) -> None:
        super().__init__()
        self.embed = pn.PatchEmbed(16, 4, 1, dim)
        self.mix = mixer
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        return self.head((t + self.mix(t)).mean((1, 2)))


#: name -> (constructor, input shape of one sample)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "colour_tokens_rank": (lambda: _Tokens(16, 3, 4, 16, 2, rank=8, bias=False), (3, 16, 16)),
    "colour_tokens_shift": (lambda: _Tokens(16, 3, 4, 16, 1, spatial_shift=True,
                                            norm="batch"), (3, 16, 16)),
    "monet_colour": (lambda: pn.MONet(img_size=16, in_chans=3, num_classes=10, patch_size=4,
                                      embed_dim=16, depth=1, merges=0), (3, 16, 16)),
    "monet_pyramid": (lambda: pn.MONet(img_size=16, in_chans=1, num_classes=10, patch_size=2,
                                       embed_dim=(8, 16), depth=(1, 1), merges=1), (1, 16, 16)),
    "tabular_mu": (lambda: nn.Sequential(pn.MuLayer(12, 8, shortcut=False),
                                         pn.MuLayer(8, 2, shortcut=False)), (12,)),
    "polymorpher": (lambda: pn.PolymorpherClassifier(8, 8, 10, dim=16, depth=1), (8, 8)),
    "sequence_pom": (lambda: _Sequence(pn.PoM(16)), (8, 8)),
    "sequence_hyena": (lambda: _Sequence(pn.Hyena(16, max_len=8)), (8, 8)),
    "image_padre": (lambda: _Image(pn.PADRe(16, kernel_size=3)), (1, 16, 16)),
    "image_conv2former": (lambda: _Image(pn.Conv2Former(16, kernel_size=3)), (1, 16, 16)),
}


def _trained_stats(model: nn.Module, x: torch.Tensor) -> nn.Module:
    model.train()
    with torch.no_grad():
        model(x)           # BatchNorm running statistics from the data
    return model.eval()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_public_models_decrypt_to_their_simulation_and_the_model(name: str,
                                                                 encrypted_roundtrip) -> None:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    x = torch.rand(64, *shape)
    encrypted_roundtrip(_trained_stats(make(), x), x)
