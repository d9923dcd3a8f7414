"""Polynomial layers of MONet: Mu-Layer, Poly-Block, spatial shift and patch embeddings.

Every forward pass uses only affine maps (linear layers, convolutions, BatchNorm in eval mode),
Hadamard products, sums and layout ops (slicing, concatenation, permutes), so a network built from
these layers computes a polynomial of its input. The one exception is ``norm="layer"``
(LayerNorm, the paper's training setup), which divides by a data-dependent standard deviation;
``norm="batch"`` is the encryptable choice: in eval mode it is an affine map per channel.

Token tensors are channels-last: ``(B, H, W, C)``, or any ``(..., C)`` where no spatial mixing is
needed. Images enter patch embeddings channels-first: ``(B, C, H, W)``.

Shape checks run on Python ints (``tensor.shape``) only, never on tensor values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from polynets.errors import ConfigError, ShapeError, check_int

__all__ = [
    "ChannelsLastBatchNorm",
    "LowRankLinear",
    "MuLayer",
    "PatchEmbed",
    "PolyBlock",
    "PyramidPatchEmbed",
    "SpatialShift",
    "check_shape",
    "make_norm",
    "to_2tuple",
]

NORMS = ("none", "batch", "layer")


def check_shape(owner: str, x: Tensor, expected: Sequence[int | str], *,
                any_leading: bool = False) -> None:
    """Raise :class:`ShapeError` unless ``x.shape`` matches ``expected``.

    ``expected`` holds ints (sizes that must match) and strings (free sizes, named in the
    message, e.g. ``"B"``). With ``any_leading`` the pattern applies to the trailing dims and any
    number (>= 0) of leading dims is allowed, written ``...`` in the message.
    """
    shape = tuple(x.shape)
    if any_leading:
        ok = len(shape) >= len(expected)
        tail = shape[len(shape) - len(expected):] if ok else ()
        pattern = ("...", *expected)
    else:
        ok = len(shape) == len(expected)
        tail = shape
        pattern = tuple(expected)
    ok = ok and all(isinstance(e, str) or int(s) == e for s, e in zip(tail, expected))
    if not ok:
        want = "(" + ", ".join(str(e) for e in pattern) + ")"
        got = "(" + ", ".join(str(int(s)) for s in shape) + ")"
        raise ShapeError(f"{owner} expected input of shape {want}, got {got}")


def to_2tuple(value: int | Sequence[int], name: str) -> tuple[int, int]:
    """Return ``(value, value)`` for an int, or the pair itself; ConfigError for anything else."""
    pair = (value, value) if isinstance(value, int) else value
    if not (isinstance(pair, Sequence) and len(pair) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair)):
        raise ConfigError(f"{name} must be a positive int or a pair of positive ints, "
                          f"got {value!r}")
    return int(pair[0]), int(pair[1])


class ChannelsLastBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the last (channel) dim of a tensor of any rank.

    ``y = (x - mean_c) / sqrt(var_c + eps) * gamma_c + beta_c``; statistics over all other dims.
    In eval mode this is an affine map per channel. Shape: ``(..., C) -> (..., C)``.
    """

    def forward(self, x: Tensor) -> Tensor:
        check_shape("ChannelsLastBatchNorm", x, (self.num_features,), any_leading=True)
        return super().forward(x.reshape(-1, self.num_features)).reshape(x.shape)


def make_norm(norm: str, dim: int) -> nn.Module:
    """Normalisation over the last dim: ``"none"`` (identity), ``"batch"`` or ``"layer"``."""
    if norm == "none":
        return nn.Identity()
    if norm == "batch":
        return ChannelsLastBatchNorm(dim)
    if norm == "layer":
        return nn.LayerNorm(dim, eps=1e-6)
    raise ConfigError(f"norm must be one of {NORMS}, got {norm!r}")


def _shift_along(x: Tensor, dim: int, step: int) -> Tensor:
    """Shift ``x`` by ``step`` positions along ``dim``; the vacated border keeps its values."""
    size = x.shape[dim]
    n = min(abs(step), size)
    if n == 0:
        return x
    if step > 0:
        return torch.cat([x.narrow(dim, 0, n), x.narrow(dim, 0, size - n)], dim=dim)
    return torch.cat([x.narrow(dim, n, size - n), x.narrow(dim, size - n, n)], dim=dim)


class SpatialShift(nn.Module):
    """S2-MLP spatial shift of channel groups on channels-last tokens, out-of-place.

    The channels are split into ``groups`` contiguous groups (sizes ``C // groups``, the last
    group takes the remainder). With 4 groups, group 0 moves ``shift`` positions down along H
    (``y[:, h] = x[:, h - shift]``), group 1 up along H, group 2 right along W, group 3 left along
    W; with 8 groups the next four move along the diagonals (down-right, down-left, up-right,
    up-left). Rows or columns left empty by a shift keep their input values, as the in-place
    S2-MLP shift does. Shape: ``(B, H, W, C) -> (B, H, W, C)``.
    """

    DIRECTIONS = ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (1, -1), (-1, 1), (-1, -1))

    def __init__(self, groups: int = 4, shift: int = 1) -> None:
        super().__init__()
        if groups not in (4, 8):
            raise ConfigError(f"SpatialShift groups must be 4 or 8, got {groups!r}")
        self.groups = groups
        self.shift = check_int(shift, "SpatialShift shift")

    def extra_repr(self) -> str:
        return f"groups={self.groups}, shift={self.shift}"

    def forward(self, x: Tensor) -> Tensor:
        check_shape("SpatialShift", x, ("B", "H", "W", "C"))
        channels = x.shape[-1]
        width = channels // self.groups
        sizes = [width] * (self.groups - 1) + [channels - width * (self.groups - 1)]
        parts = torch.split(x, sizes, dim=-1)
        moved = []
        for part, (dh, dw) in zip(parts, self.DIRECTIONS[: self.groups]):
            part = _shift_along(part, 1, dh * self.shift)
            moved.append(_shift_along(part, 2, dw * self.shift))
        return torch.cat(moved, dim=-1)


class LowRankLinear(nn.Module):
    """Rank-``r`` linear map ``Y = R Q X``: ``Q: (r, d)`` without bias, then ``R: (m, r)`` with
    the bias. Shape: ``(..., d) -> (..., m)``."""

    def __init__(self, in_features: int, out_features: int, rank: int, *,
                 bias: bool = True) -> None:
        super().__init__()
        self.Q = nn.Linear(in_features, rank, bias=False)
        self.R = nn.Linear(rank, out_features, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.R(self.Q(x))


class MuLayer(nn.Module):
    """Mu-Layer of MONet: ``Y = C[(AX) * (BDX) + AX]`` on the last (channel) dim.

    ``A: (m, d)``, ``D: (l, d)``, ``B: (m, l)``, ``C: (o, m)``, with hidden size ``m`` (default
    ``d``), rank ``l`` (default ``m // shrinkage``) and output size ``o`` (default ``d``). The
    ``+ AX`` term is the shortcut (first-degree part). With ``spatial_shift`` the shift is applied
    to both branches, after ``A`` and after ``D`` (input must be ``(B, H, W, d)``). ``norm``
    normalises each branch after its projection, before the product, as in the paper's layer:
    ``Y = C[N_a(AX) * N_b(BDX) + N_a(AX)]``. With ``a_rank=r`` the first branch is factorised
    too, ``A = RQ`` with ``Q: (r, d)``, ``R: (m, r)`` (Appendix N):
    ``Y = C[(RQX) * (BDX) + RQX]``. Shape: ``(..., d) -> (..., o)``.
    """

    def __init__(self, in_features: int, out_features: int | None = None, *,
                 hidden: int | None = None, rank: int | None = None, shrinkage: int = 4,
                 shortcut: bool = True, spatial_shift: bool = False, norm: str = "none",
                 bias: bool = True, a_rank: int | None = None) -> None:
        super().__init__()
        d = check_int(in_features, "MuLayer in_features")
        o = check_int(out_features if out_features is not None else d, "MuLayer out_features")
        m = check_int(hidden if hidden is not None else d, "MuLayer hidden")
        shrinkage = check_int(shrinkage, "MuLayer shrinkage")
        l = check_int(rank if rank is not None else max(1, m // shrinkage), "MuLayer rank")
        self.in_features, self.out_features, self.hidden, self.rank = d, o, m, l
        self.shortcut = bool(shortcut)
        self.spatial_shift = bool(spatial_shift)
        self.a_rank = None if a_rank is None else check_int(a_rank, "MuLayer a_rank")
        self.A = nn.Linear(d, m, bias=bias) if a_rank is None else \
            LowRankLinear(d, m, self.a_rank, bias=bias)
        self.D = nn.Linear(d, l, bias=bias)
        self.B = nn.Linear(l, m, bias=bias)
        self.C = nn.Linear(m, o, bias=bias)
        self.shift = SpatialShift() if self.spatial_shift else nn.Identity()
        self.norm_a = make_norm(norm, m)
        self.norm_b = make_norm(norm, m)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, hidden={self.hidden}, rank={self.rank}, "
                f"a_rank={self.a_rank}, out_features={self.out_features}, "
                f"shortcut={self.shortcut}, spatial_shift={self.spatial_shift}")

    def forward(self, x: Tensor) -> Tensor:
        if self.spatial_shift:
            check_shape("MuLayer", x, ("B", "H", "W", self.in_features))
        else:
            check_shape("MuLayer", x, (self.in_features,), any_leading=True)
        a = self.norm_a(self.shift(self.A(x)))
        b = self.norm_b(self.B(self.shift(self.D(x))))
        h = a * b + a if self.shortcut else a * b
        return self.C(h)


class PolyBlock(nn.Module):
    """Poly-Block of MONet: two Mu-Layers, a norm between, a shortcut over the first.

    ``Z = X + Mu_1(X)``, ``Y = Z + Mu_2(N(Z))`` where ``Mu_1`` has hidden size ``dim`` and the
    spatial shift, ``Mu_2`` has hidden size ``dim * expansion``; both have rank
    ``hidden // shrinkage``. The paper's text describes only the shortcut over ``Mu_1``
    (``Y = Mu_2(N(Z))``, ``second_shortcut=False``); the default also keeps the shortcut over
    ``Mu_2``, as the authors' implementation does, because without it the gradient grows by
    about 10^12 through a 32-block MONet at initialisation. With ``norm="none"`` and no biases
    ``Y`` is a polynomial of degree 4 in ``X`` with terms of degrees 1 to 4 either way.
    Shape: ``(B, H, W, dim) -> (B, H, W, dim)`` (``(..., dim)`` when ``spatial_shift=False``).
    """

    def __init__(self, dim: int, *, expansion: int = 3, shrinkage: int = 4, norm: str = "batch",
                 spatial_shift: bool = True, second_shortcut: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        self.dim = check_int(dim, "PolyBlock dim")
        self.second_shortcut = bool(second_shortcut)
        expansion = check_int(expansion, "PolyBlock expansion")
        self.spatial_shift = bool(spatial_shift)
        self.mu1 = MuLayer(dim, dim, hidden=dim, shrinkage=shrinkage,
                           spatial_shift=spatial_shift, norm=norm, bias=bias)
        self.norm = make_norm(norm, dim)
        self.mu2 = MuLayer(dim, dim, hidden=dim * expansion, shrinkage=shrinkage, norm=norm,
                           bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.spatial_shift:
            check_shape("PolyBlock", x, ("B", "H", "W", self.dim))
        else:
            check_shape("PolyBlock", x, (self.dim,), any_leading=True)
        z = x + self.mu1(x)
        y = self.mu2(self.norm(z))
        return z + y if self.second_shortcut else y


class PatchEmbed(nn.Module):
    """Non-overlapping patch embedding: a ``p x p`` convolution with stride ``p``.

    ``T = Conv_p(I)``, returned channels-last. Shape:
    ``(B, in_chans, H, W) -> (B, H / p, W / p, embed_dim)``.
    """

    def __init__(self, img_size: int | Sequence[int] = 224, patch_size: int = 16,
                 in_chans: int = 3, embed_dim: int = 768, *, bias: bool = True) -> None:
        super().__init__()
        self.img_size = to_2tuple(img_size, "img_size")
        self.patch_size = to_2tuple(patch_size, "patch_size")
        self.in_chans = check_int(in_chans, "in_chans")
        self.embed_dim = check_int(embed_dim, "embed_dim")
        self.grid_size = _grid(self.img_size, self.patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.reduction = self.patch_size[0]
        self.proj = nn.Conv2d(in_chans, embed_dim, self.patch_size, stride=self.patch_size,
                              bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        check_shape(type(self).__name__, x, ("B", self.in_chans, *self.img_size))
        return self.proj(x).permute(0, 2, 3, 1)


class PyramidPatchEmbed(PatchEmbed):
    """Pyramid patch embedding (MONet, Appendix D): small patches, then 2x2 stride-2 merges.

    ``T_0 = Conv_p(I)``, ``T_k = Merge_k(T_{k-1}) + Conv_{p 2^k}(I)`` for ``k = 1..merges``; the
    direct coarser-level embedding ``Conv_{p 2^k}(I)`` is added only with ``fuse_levels``. The
    output stride is ``p * 2**merges``. Shape:
    ``(B, in_chans, H, W) -> (B, H / (p 2^merges), W / (p 2^merges), embed_dim)``.
    """

    def __init__(self, img_size: int | Sequence[int] = 224, patch_size: int = 7,
                 in_chans: int = 3, embed_dim: int = 192, *, merges: int = 1,
                 fuse_levels: bool = True, bias: bool = True) -> None:
        check_int(merges, "merges", minimum=0)
        super().__init__(img_size, patch_size, in_chans, embed_dim, bias=bias)
        self.merges = merges
        self.fuse_levels = bool(fuse_levels)
        stride = (self.patch_size[0] << merges, self.patch_size[1] << merges)
        self.grid_size = _grid(self.img_size, stride)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.reduction = stride[0]
        self.merge = nn.ModuleList(
            nn.Conv2d(embed_dim, embed_dim, 2, stride=2, bias=bias) for _ in range(merges))
        self.levels = nn.ModuleList(
            nn.Conv2d(in_chans, embed_dim, (self.patch_size[0] << k, self.patch_size[1] << k),
                      stride=(self.patch_size[0] << k, self.patch_size[1] << k), bias=bias)
            for k in range(1, merges + 1) if self.fuse_levels)

    def forward(self, x: Tensor) -> Tensor:
        check_shape(type(self).__name__, x, ("B", self.in_chans, *self.img_size))
        t = self.proj(x)
        for k, merge in enumerate(self.merge):
            t = merge(t)
            if self.fuse_levels:
                t = t + self.levels[k](x)
        return t.permute(0, 2, 3, 1)


def _grid(img_size: tuple[int, int], stride: tuple[int, int]) -> tuple[int, int]:
    if img_size[0] % stride[0] or img_size[1] % stride[1]:
        raise ConfigError(f"img_size {img_size} must be divisible by the embedding stride "
                          f"{stride}")
    return img_size[0] // stride[0], img_size[1] // stride[1]

