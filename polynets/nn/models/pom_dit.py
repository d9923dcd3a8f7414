"""A small class-conditional PoM diffusion transformer trained by flow matching (PoM-video §4).

DiT-style blocks (PoM-video Fig. 3a, Listing 6) with the Polynomial Mixer in place of attention:

``x <- x + (1 + g_1) * PoM(N(x) * (1 + s_1) + b_1)``,
``x <- x + (1 + g_2) * FF(N(x) * (1 + s_2) + b_2)``,

where ``(s_1, b_1, g_1, s_2, b_2, g_2)`` are predicted from the condition ``c = E[y] + T(t)``
(class embedding plus time embedding) only. The paper normalises with a LayerNorm and uses a
GELU MLP; here ``N`` is a BatchNorm without affine parameters (an affine map of ``x`` at
inference) and ``FF`` is a Mu-Layer, so for a fixed (class, time) every block is a polynomial of
its input ``x`` (degree ``(degree + 1) * 2`` with the linear PoM): :meth:`PoMDiTBlock.conditioned`
gives that one-input map for :func:`polynets.ir.certify`. The condition path (sinusoidal time
features, SiLU) is not a polynomial, and need not be: it never sees ``x``.

The velocity model ``v(x_t, t, y)`` is trained by conditional flow matching on the straight path
``x_t = (1 - t) x_0 + t x_1`` (``x_0`` Gaussian noise, ``x_1`` data, target ``x_1 - x_0``),
with the class dropped at rate ``class_dropout`` for classifier-free guidance, and sampled with
Euler steps from ``t = 0`` to ``1``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polynets.errors import ConfigError, ShapeError, check_int
from polynets.nn.layers import ChannelsLastBatchNorm, MuLayer, check_shape, to_2tuple
from polynets.nn.pom import PoM

__all__ = ["PoMDiTBlock", "PoMDiT", "flow_matching_loss", "sample"]


def _modulate(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``x * (1 + scale) + shift`` with per-sample (B, C) scale and shift over tokens (B, N, C)."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class PoMDiTBlock(nn.Module):
    """DiT block with PoM for attention and BatchNorm for LayerNorm (see the module docstring).

    Args:
        dim: token width; cond_dim: width of the condition ``c``.
        degree, expand, gate: the :class:`~polynets.nn.pom.PoM`'s (linear PoM, polynomial).
        mlp_ratio: hidden width of the Mu-Layer feed-forward, as a multiple of ``dim``.

    Call: ``block(x, c)`` with ``x`` (B, N, dim), ``c`` (B, cond_dim) -> (B, N, dim).
    """

    def __init__(self, dim: int, cond_dim: int, *, degree: int = 2, expand: float = 2,
                 gate: str = "linear", mlp_ratio: float = 2) -> None:
        super().__init__()
        self.dim = check_int(dim, "PoMDiTBlock dim")
        self.cond_dim = check_int(cond_dim, "PoMDiTBlock cond_dim")
        if not isinstance(mlp_ratio, (int, float)) or mlp_ratio <= 0:
            raise ConfigError(f"PoMDiTBlock mlp_ratio must be a positive number, got "
                              f"{mlp_ratio!r}")
        self.norm1 = ChannelsLastBatchNorm(dim, affine=False)
        self.pom = PoM(dim, degree=degree, expand=expand, gate=gate)
        self.norm2 = ChannelsLastBatchNorm(dim, affine=False)
        self.ff = MuLayer(dim, dim, hidden=max(1, int(round(mlp_ratio * dim))))
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(cond_dim, 6 * dim))
        nn.init.zeros_(self.modulation[1].weight)
        nn.init.zeros_(self.modulation[1].bias)

    @property
    def polynomial_degree(self) -> int | None:
        """Degree in ``x`` for a fixed condition: ``PoM degree * 2`` (the Mu-Layer squares)."""
        pom = self.pom.polynomial_degree
        return None if pom is None else 2 * pom

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        check_shape("PoMDiTBlock", x, ("B", "N", self.dim))
        check_shape("PoMDiTBlock condition", c, (x.shape[0], self.cond_dim))
        s1, b1, g1, s2, b2, g2 = self.modulation(c).chunk(6, dim=-1)
        x = x + (1 + g1.unsqueeze(1)) * self.pom(_modulate(self.norm1(x), s1, b1))
        return x + (1 + g2.unsqueeze(1)) * self.ff(_modulate(self.norm2(x), s2, b2))

    def conditioned(self, c: Tensor) -> nn.Module:
        """The block for one fixed condition ``c`` (cond_dim,) or (1, cond_dim): a one-input
        module ``x -> block(x, c)`` that traces to a polynomial of ``x``."""
        return _FixedCondition(self, c.reshape(1, -1))


class _FixedCondition(nn.Module):
    """``x -> module(x, c)`` with ``c`` a constant (1, C) buffer broadcast over the batch."""

    def __init__(self, module: nn.Module, c: Tensor) -> None:
        super().__init__()
        self.module = module
        self.register_buffer("c", c.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x, self.c.to(x.dtype).expand(x.shape[0], -1))


class _TimeEmbedding(nn.Module):
    """``t -> MLP([cos(t w_k), sin(t w_k)])``, log-spaced frequencies (DiT's timestep embedder)."""

    def __init__(self, dim: int, frequencies: int = 32) -> None:
        super().__init__()
        self.register_buffer(
            "freqs", torch.exp(-math.log(1000.0) * torch.arange(frequencies) / frequencies) * 1000,
            persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2 * frequencies, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        angles = t[:, None] * self.freqs.to(t.dtype)
        return self.mlp(torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1))


class PoMDiT(nn.Module):
    """Class-conditional PoM diffusion transformer: ``v = Unpatch(Final(Blocks(Patch(x) + p, c)))``.

    ``c = E[y] + T(t)``; ``y = num_classes`` is the null class of classifier-free guidance.

    Args:
        img_size: image side (or (H, W)), default 8; in_chans: channels (default 1);
        patch_size: side of the square patches (default 2: 16 tokens at 8x8);
        dim: token width (default 64); depth: blocks (default 4);
        num_classes: classes (default 10); degree, expand, mlp_ratio: the blocks'.

    Call: ``model(x, t, y)`` with ``x`` (B, in_chans, H, W), ``t`` (B,) in [0, 1], ``y`` (B,)
    class indices (``num_classes`` for none) -> velocity (B, in_chans, H, W).
    """

    def __init__(self, img_size: int | tuple[int, int] = 8, in_chans: int = 1,
                 patch_size: int = 2, dim: int = 64, depth: int = 4, num_classes: int = 10, *,
                 degree: int = 2, expand: float = 2, mlp_ratio: float = 2) -> None:
        super().__init__()
        self.img_size = to_2tuple(img_size, "img_size")
        self.in_chans = check_int(in_chans, "PoMDiT in_chans")
        self.patch_size = check_int(patch_size, "PoMDiT patch_size")
        self.dim = check_int(dim, "PoMDiT dim")
        self.num_classes = check_int(num_classes, "PoMDiT num_classes")
        check_int(depth, "PoMDiT depth")
        if any(s % patch_size for s in self.img_size):
            raise ConfigError(f"PoMDiT img_size {self.img_size} must be divisible by "
                              f"patch_size={patch_size}")
        self.grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        tokens = self.grid[0] * self.grid[1]
        self.patch = nn.Conv2d(in_chans, dim, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, dim))
        self.class_embed = nn.Embedding(num_classes + 1, dim)
        self.time_embed = _TimeEmbedding(dim)
        self.blocks = nn.ModuleList(
            PoMDiTBlock(dim, dim, degree=degree, expand=expand, mlp_ratio=mlp_ratio)
            for _ in range(depth))
        self.final_norm = ChannelsLastBatchNorm(dim, affine=False)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.head = nn.Linear(dim, patch_size * patch_size * in_chans)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.class_embed.weight, std=0.02)
        for layer in (self.final_modulation[1], self.head):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def condition(self, t: Tensor, y: Tensor) -> Tensor:
        """``c = E[y] + T(t)``: (B,), (B,) -> (B, dim)."""
        if t.dim() != 1 or y.dim() != 1 or t.shape != y.shape:
            raise ShapeError(f"PoMDiT expected t and y of shape (B,), got {tuple(t.shape)} and "
                             f"{tuple(y.shape)}")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) > self.num_classes):
            raise ConfigError(f"PoMDiT class labels must lie in [0, {self.num_classes}] "
                              f"({self.num_classes} is the null class)")
        return self.class_embed(y) + self.time_embed(t)

    def velocity(self, x: Tensor, c: Tensor) -> Tensor:
        """The network for a given condition ``c`` (B, dim): images -> velocity, same shape."""
        check_shape("PoMDiT", x, ("B", self.in_chans, *self.img_size))
        b, p = x.shape[0], self.patch_size
        h = self.patch(x).flatten(2).transpose(1, 2) + self.pos_embed  # (B, N, dim)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_modulation(c).chunk(2, dim=-1)
        out = self.head(_modulate(self.final_norm(h), scale, shift))  # (B, N, p * p * C)
        out = out.reshape(b, *self.grid, p, p, self.in_chans)
        return out.permute(0, 5, 1, 3, 2, 4).reshape(b, self.in_chans, *self.img_size)

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[0] != t.shape[0]:
            raise ShapeError(f"PoMDiT expected x of shape (B, {self.in_chans}, "
                             f"{self.img_size[0]}, {self.img_size[1]}) and t, y of shape (B,), "
                             f"got {tuple(x.shape)} and {tuple(t.shape)}")
        return self.velocity(x, self.condition(t, y))

    def conditioned(self, t: float, y: int) -> nn.Module:
        """The whole velocity network for one fixed (time, class): ``x -> v(x, t, y)``, a
        polynomial of ``x``."""
        with torch.no_grad():
            ref = self.pos_embed
            c = self.condition(torch.tensor([float(t)], dtype=ref.dtype, device=ref.device),
                               torch.tensor([int(y)], device=ref.device))
        return _FixedCondition(_Velocity(self), c)


class _Velocity(nn.Module):
    def __init__(self, model: PoMDiT) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        return self.model.velocity(x, c)


def flow_matching_loss(model: PoMDiT, x1: Tensor, y: Tensor, *, class_dropout: float = 0.1,
                       generator: torch.Generator | None = None) -> Tensor:
    """Conditional flow-matching loss ``|v(x_t, t, y) - (x_1 - x_0)|^2`` on the straight path
    ``x_t = (1 - t) x_0 + t x_1``, ``x_0 ~ N(0, I)``, ``t ~ U(0, 1)``; labels replaced by the
    null class with probability ``class_dropout``."""
    if not 0.0 <= class_dropout < 1.0:
        raise ConfigError(f"class_dropout must lie in [0, 1), got {class_dropout!r}")
    b = x1.shape[0]
    device = x1.device
    x0 = torch.randn(x1.shape, generator=generator, device=device, dtype=x1.dtype)
    t = torch.rand(b, generator=generator, device=device, dtype=x1.dtype)
    drop = torch.rand(b, generator=generator, device=device) < class_dropout
    y = torch.where(drop, torch.full_like(y, model.num_classes), y)
    tt = t[:, None, None, None]
    xt = (1 - tt) * x0 + tt * x1
    return F.mse_loss(model(xt, t, y), x1 - x0)


@torch.no_grad()
def sample(model: PoMDiT, y: Tensor, *, steps: int = 50, guidance: float = 1.0,
           clip: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Images of classes ``y`` (B,) by Euler integration of ``v`` from noise at ``t = 0`` to
    ``t = 1``, with classifier-free guidance ``v_null + guidance * (v_y - v_null)`` (1: none).

    ``clip``: clamp the predicted end point ``x_1 = x_t + (1 - t) v`` to ``[-clip, clip]``
    before each step (data known to lie in that range; keeps a high-degree polynomial network
    from running away on a rare sample). Returns (B, in_chans, H, W)."""
    steps = check_int(steps, "sample steps")
    if clip is not None and not clip > 0:
        raise ConfigError(f"sample clip must be a positive number or None, got {clip!r}")
    ref = model.pos_embed
    x = torch.randn(y.shape[0], model.in_chans, *model.img_size, generator=generator,
                    dtype=ref.dtype, device=ref.device)
    null = torch.full_like(y, model.num_classes)
    for k in range(steps):
        t = torch.full((y.shape[0],), k / steps, dtype=ref.dtype, device=ref.device)
        v = model(x, t, y)
        if guidance != 1.0:
            v_null = model(x, t, null)
            v = v_null + guidance * (v - v_null)
        if clip is not None:
            remaining = 1.0 - k / steps
            v = ((x + remaining * v).clamp(-clip, clip) - x) / remaining
        x = x + v / steps
    return x
