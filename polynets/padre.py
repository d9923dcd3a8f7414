"""PADRe: polynomial attention drop-in replacement (Letourneau et al., PADRe, Eq. 1-8).

``Y_i = A_i X B_i`` (``A_i`` mixes tokens, ``B_i`` mixes channels), ``Z_1 = Y_1``,
``Z_{i+1} = (C_i Z_i D_i) * Y_{i+1}`` (Hadamard product), ``P = sum_i w_i * Z_i`` and
``O = P V + b``. Every entry of ``Z_i`` is a homogeneous polynomial of degree ``i`` in ``X``
(Lemma 1), so the output is a polynomial of degree ``d`` built from linear maps and products only:
it traces to a polynomial program, certifies with degree ``d`` and encrypts unchanged.

The structured maps are the paper's instance (Section 4.1): token mixing by depthwise
convolutions over the token grid (``k x k``, 2-D) or the sequence (``k`` taps, 1-D), channel
mixing by pointwise (``1 x 1``) convolutions, one head.

Appendix B's polynomial instances of the framework are here too, each in the polynomial form
the appendix analyses: :class:`Conv2Former` (degree 2), :class:`CastlingAttention` (Castling-ViT
at inference, degree 3) and :class:`Hyena` (order ``N``, degree ``N + 1``). SimA, Mamba and
softmax attention are not polynomials (norms, softplus and exp of the data); ``pn.certify``
rejects them by the offending op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polynets.errors import ConfigError
from polynets.layers import check_shape, make_norm

__all__ = ["PADRe", "Conv2Former", "CastlingAttention", "Hyena", "TOKEN_MIXINGS", "WEIGHTS"]

TOKEN_MIXINGS = ("depthwise", "shared")
"""``"depthwise"``: one ``k x k`` kernel per channel (the default; Table 2's parameter counts
rule out dense ``k x k`` convolutions); ``"shared"``: one kernel for all channels of a map."""

WEIGHTS = ("channel", "position")
"""``"channel"``: one weight per channel and degree, broadcast over tokens (the default; any
number of tokens); ``"position"``: Eq. 6's per-token, per-channel weights (fixes the tokens)."""


def _positive_int(value: object, name: str, owner: str = "PADRe") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner} {name} must be a positive int, got {value!r}")
    return value


def _token_shape(value: int | Sequence[int] | None, spatial_dims: int) -> tuple[int, ...]:
    if value is None:
        raise ConfigError('PADRe weights="position" needs token_shape: (H, W) for 2-D tokens, '
                          "N for 1-D tokens")
    shape = (value,) if isinstance(value, int) else tuple(value)
    if len(shape) != spatial_dims or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape):
        want = "(H, W)" if spatial_dims == 2 else "N"
        raise ConfigError(f"PADRe token_shape must be {want} of positive ints for "
                          f"spatial_dims={spatial_dims}, got {value!r}")
    return shape


class _TokenConv(nn.Module):
    """Token mixing ``A`` of ``channels`` maps at once: a depthwise convolution over tokens.

    ``kernel_size`` taps per spatial dim, zero padding that keeps the token count (centred, or
    all on the left with ``causal``). ``shared`` ties the kernel across the channels of each of
    the ``groups`` maps. Shape: ``(B, channels, *S) -> (B, channels, *S)``.
    """

    def __init__(self, channels: int, groups: int, kernel_size: int, spatial_dims: int, *,
                 shared: bool, causal: bool, bias: bool) -> None:
        super().__init__()
        self.channels, self.groups, self.kernel_size = channels, groups, kernel_size
        self.spatial_dims, self.shared, self.causal = spatial_dims, shared, causal
        kernels = groups if shared else channels
        self.weight = nn.Parameter(torch.empty(kernels, 1, *(kernel_size,) * spatial_dims))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        left = kernel_size - 1 if causal else (kernel_size - 1) // 2
        right = kernel_size - 1 - left
        self.pad = (left, right) * spatial_dims  # F.pad order: last dim first; equal per dim
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Unit-gain random kernels: entries ``N(0, 1 / taps)``."""
        nn.init.normal_(self.weight, std=self.kernel_size ** (-self.spatial_dims / 2))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, kernel_size={self.kernel_size}, "
                f"spatial_dims={self.spatial_dims}, shared={self.shared}, causal={self.causal}")

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if self.shared:
            per_map = self.channels // self.groups
            weight = weight.repeat_interleave(per_map, dim=0)
        conv = F.conv2d if self.spatial_dims == 2 else F.conv1d
        left, right = self.pad[:2]
        if left == right:
            return conv(x, weight, self.bias, padding=left, groups=self.channels)
        return conv(F.pad(x, self.pad), weight, self.bias, groups=self.channels)


class PADRe(nn.Module):
    """PADRe mixer: ``O = [sum_i w_i * Z_i (+ L)] V + b``, ``Z_1 = A_1 X B_1``,
    ``Z_{i+1} = (C_i Z_i D_i) * (A_{i+1} X B_{i+1})``.

    Args:
        dim: channels ``D`` of the tokens.
        degree: ``d``, the degree of the output in ``X`` (PADRe-2, -3, -4 ...).
        kernel_size: taps of the token convolutions ``A_i``, ``C_i`` per spatial dim (default 11,
            the paper's 11 x 11 on grids and 11 on sequences).
        spatial_dims: 2 (default): tokens on a grid, input ``(B, H, W, dim)``; 1: a sequence,
            input ``(B, N, dim)``.
        token_mixing: ``"depthwise"`` (default, one kernel per channel) or ``"shared"`` (one
            kernel per map, shared by all channels).
        z_mixing: apply ``C_i`` (token convolution) and ``D_i`` (pointwise) to ``Z_i`` before the
            product (default True, as in the paper's Fig. 1); False sets them to the identity.
        first_order: include ``w_1 * Z_1`` in the sum (default False: the block's shortcut
            supplies the degree-1 term, Section 4.1). Needed for ``degree=1``.
        weights: ``"channel"`` (default): ``w_i`` is one weight per channel broadcast over
            tokens; ``"position"``: Eq. 6's per-token weights ``W[m, n, i]``, which fix the token
            shape to ``token_shape``.
        token_shape: ``(H, W)`` (2-D) or ``N`` (1-D), only with ``weights="position"``.
        constant: add Eq. 6's degree-0 term ``L`` to ``P``, shaped like one ``w_i`` (per
            channel, or per token and channel with ``weights="position"``). Default False:
            the output projection's bias gives the constant (Section 4.1).
        causal: 1-D only: pad on the left so token ``t`` reads tokens ``t - k + 1 .. t``
            (default False: centred padding).
        out_features: ``G``, the width of the output projection ``V`` (default ``dim``).
        proj: apply the output projection ``V`` with bias ``b`` (default True; the paper's final
            pointwise layer, which also gives the constant term). With False, ``out_features``
            must equal ``dim`` and the output is ``P``.
        norm: ``"none"`` (default) or ``"batch"``: normalise the ``Y_i`` (Section 3.3's
            optional normalisation; batch norm folds into the maps at inference).
        bias: biases in ``A_i, B_i, C_i, D_i`` (default False, so ``Z_i`` is homogeneous of
            degree ``i`` as in Lemma 1).

    Shapes: ``(B, H, W, dim) -> (B, H, W, out_features)`` (2-D) or
    ``(B, N, dim) -> (B, N, out_features)`` (1-D).
    """

    def __init__(self, dim: int, *, degree: int = 2, kernel_size: int = 11,
                 spatial_dims: int = 2, token_mixing: str = "depthwise", z_mixing: bool = True,
                 first_order: bool = False, weights: str = "channel",
                 token_shape: int | Sequence[int] | None = None, constant: bool = False,
                 causal: bool = False,
                 out_features: int | None = None, proj: bool = True, norm: str = "none",
                 bias: bool = False) -> None:
        super().__init__()
        self.dim = _positive_int(dim, "dim")
        self.degree = _positive_int(degree, "degree")
        self.kernel_size = _positive_int(kernel_size, "kernel_size")
        if spatial_dims not in (1, 2):
            raise ConfigError(f"PADRe spatial_dims must be 1 (sequence) or 2 (grid), "
                              f"got {spatial_dims!r}")
        if token_mixing not in TOKEN_MIXINGS:
            raise ConfigError(f"PADRe token_mixing must be one of {TOKEN_MIXINGS}, "
                              f"got {token_mixing!r}")
        if weights not in WEIGHTS:
            raise ConfigError(f"PADRe weights must be one of {WEIGHTS}, got {weights!r}")
        if causal and spatial_dims != 1:
            raise ConfigError("PADRe causal=True needs spatial_dims=1 (a sequence)")
        if degree == 1 and not first_order:
            raise ConfigError("PADRe degree=1 has only the first-order term; pass "
                              "first_order=True")
        self.out_features = _positive_int(out_features if out_features is not None else dim,
                                          "out_features")
        if not proj and self.out_features != dim:
            raise ConfigError(f"PADRe proj=False keeps the width; out_features must equal dim "
                              f"({dim}), got {out_features!r}")
        self.spatial_dims, self.token_mixing, self.weights = spatial_dims, token_mixing, weights
        self.z_mixing, self.first_order, self.causal = bool(z_mixing), bool(first_order), causal
        self.token_shape = _token_shape(token_shape, spatial_dims) if weights == "position" \
            else None
        if weights == "channel" and token_shape is not None:
            raise ConfigError('PADRe token_shape is only used with weights="position"')
        d, c = self.degree, self.dim
        conv = nn.Conv2d if spatial_dims == 2 else nn.Conv1d
        shared = token_mixing == "shared"
        # Y_i for all i at once: B_1..B_d as one pointwise map to d * dim channels, then A_i.
        self.channel_mix = conv(c, d * c, 1, bias=bias)
        self.token_mix = _TokenConv(d * c, d, kernel_size, spatial_dims, shared=shared,
                                    causal=causal, bias=bias)
        if norm not in ("none", "batch"):
            raise ConfigError(f"PADRe norm must be 'none' or 'batch', got {norm!r}")
        self.norm = make_norm(norm, d * c) if norm == "batch" else None
        steps = d - 1 if self.z_mixing else 0
        self.z_channel = nn.ModuleList(conv(c, c, 1, bias=bias) for _ in range(steps))
        self.z_token = nn.ModuleList(
            _TokenConv(c, 1, kernel_size, spatial_dims, shared=shared, causal=causal, bias=bias)
            for _ in range(steps))
        self.terms = tuple(range(0 if self.first_order else 1, d))  # 0-based degrees - 1
        wshape = (len(self.terms), c) + (self.token_shape or (1,) * spatial_dims)
        self.w = nn.Parameter(torch.ones(wshape))
        self.constant = nn.Parameter(torch.zeros(wshape[1:])) if constant else None
        self.proj = nn.Linear(c, self.out_features) if proj else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Unit-gain maps: pointwise weights ``N(0, 1 / dim)``, kernels ``N(0, 1 / taps)``,
        ``w_i = 1``, the output projection as ``nn.Linear``; biases zero."""
        for m in (self.channel_mix, *self.z_channel):
            nn.init.normal_(m.weight, std=self.dim ** -0.5)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        for m in (self.token_mix, *self.z_token):
            m.reset_parameters()
        nn.init.ones_(self.w)
        if self.constant is not None:
            nn.init.zeros_(self.constant)
        if isinstance(self.proj, nn.Linear):
            self.proj.reset_parameters()

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, degree={self.degree}, kernel_size={self.kernel_size}, "
                f"spatial_dims={self.spatial_dims}, token_mixing={self.token_mixing!r}, "
                f"weights={self.weights!r}, first_order={self.first_order}, "
                f"causal={self.causal}, out_features={self.out_features}")

    def _check_input(self, x: Tensor) -> None:
        tokens: tuple[int | str, ...] = ("H", "W") if self.spatial_dims == 2 else ("N",)
        if self.token_shape is not None:
            tokens = self.token_shape
        check_shape("PADRe", x, ("B", *tokens, self.dim))

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        t = x.movedim(-1, 1)  # (B, dim, *S): convolutions run channels-first
        y = self.token_mix(self.channel_mix(t))
        if self.norm is not None:
            y = self.norm(y.movedim(1, -1)).movedim(-1, 1)
        ys = y.chunk(self.degree, dim=1)  # Y_1 .. Y_d, each (B, dim, *S)
        z = ys[0]
        out = self.w[0] * z if self.first_order else None
        for i in range(1, self.degree):
            if self.z_mixing:
                z = self.z_token[i - 1](self.z_channel[i - 1](z))
            z = z * ys[i]
            term = self.w[self.terms.index(i)] * z
            out = term if out is None else out + term
        if self.constant is not None:
            out = out + self.constant
        return self.proj(out.movedim(1, -1))


# ------------------------------------------------------------------ PADRe Appendix B instances
def _check_spatial_dims(owner: str, spatial_dims: object) -> int:
    if spatial_dims not in (1, 2):
        raise ConfigError(f"{owner} spatial_dims must be 1 (sequence) or 2 (grid), "
                          f"got {spatial_dims!r}")
    return int(spatial_dims)  # type: ignore[call-overload]


def _check_tokens(owner: str, x: Tensor, spatial_dims: int, dim: int) -> None:
    tokens = ("H", "W") if spatial_dims == 2 else ("N",)
    check_shape(owner, x, ("B", *tokens, dim))


class Conv2Former(nn.Module):
    """Conv2Former's convolutional modulation in polynomial form (PADRe App. B.2), degree 2:
    ``O = [DConv_k(X W_1) * (X W_2)] W_3 + b``.

    ``DConv_k`` is a depthwise ``k x k`` (2-D) or ``k``-tap (1-D) convolution over tokens,
    ``W_1``, ``W_2`` pointwise maps, ``W_3`` the output projection. Conv2Former's code applies a
    GELU after ``W_1``; App. B.2's analysis (and this module) leaves it out, which makes the
    block a homogeneous degree-2 polynomial before the projection.

    Args:
        dim: channels; kernel_size: taps per side (default 11, Conv2Former's);
        spatial_dims: 2 (``(B, H, W, dim)``, default) or 1 (``(B, N, dim)``);
        bias: biases of ``W_1``, ``W_2`` and the convolution (default False).

    Shapes: ``(B, H, W, dim) -> (B, H, W, dim)`` or ``(B, N, dim) -> (B, N, dim)``.
    """

    def __init__(self, dim: int, *, kernel_size: int = 11, spatial_dims: int = 2,
                 bias: bool = False) -> None:
        super().__init__()
        self.dim = _positive_int(dim, "dim", "Conv2Former")
        self.kernel_size = _positive_int(kernel_size, "kernel_size", "Conv2Former")
        self.spatial_dims = _check_spatial_dims("Conv2Former", spatial_dims)
        self.a = nn.Linear(dim, dim, bias=bias)
        self.v = nn.Linear(dim, dim, bias=bias)
        self.dconv = _TokenConv(dim, 1, kernel_size, self.spatial_dims, shared=False,
                                causal=False, bias=bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        _check_tokens("Conv2Former", x, self.spatial_dims, self.dim)
        a = self.dconv(self.a(x).movedim(-1, 1)).movedim(1, -1)
        return self.proj(a * self.v(x))


class CastlingAttention(nn.Module):
    """Castling-ViT's inference-time attention in polynomial form (PADRe App. B.5), degree 3:
    ``O = [(1/pi) Q (K^T V) / N + (I/2 + M_DW) V] W_o + b`` with ``Q, K, V = X W_{q,k,v}``.

    ``K^T V`` (per head, ``(d_h, d_h)``) is formed first, so the cost is linear in the number of
    tokens ``N``; it is averaged over the tokens (a constant ``1/N``) so its size does not grow
    with ``N``. ``M_DW`` is a depthwise token convolution (``kernel_size`` taps per side).
    Castling-ViT normalises ``q`` and ``k`` to unit length (angular similarity); a norm divides
    by the data and is not a polynomial, so this form leaves them unnormalised, as Eq. 76 does.

    Args:
        dim: channels; heads: attention heads (``dim % heads == 0``, default 1);
        kernel_size: taps of ``M_DW`` (default 3); spatial_dims: 2 (``(B, H, W, dim)``,
        default) or 1 (``(B, N, dim)``); bias: biases of the ``q, k, v`` maps (default False).

    Shapes: ``(B, H, W, dim) -> (B, H, W, dim)`` or ``(B, N, dim) -> (B, N, dim)``.
    """

    def __init__(self, dim: int, *, heads: int = 1, kernel_size: int = 3, spatial_dims: int = 2,
                 bias: bool = False) -> None:
        super().__init__()
        self.dim = _positive_int(dim, "dim", "CastlingAttention")
        self.heads = _positive_int(heads, "heads", "CastlingAttention")
        if dim % heads:
            raise ConfigError(f"CastlingAttention dim ({dim}) must be divisible by heads "
                              f"({heads})")
        self.spatial_dims = _check_spatial_dims("CastlingAttention", spatial_dims)
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        kernel_size = _positive_int(kernel_size, "kernel_size", "CastlingAttention")
        self.dwconv = _TokenConv(dim, 1, kernel_size, self.spatial_dims, shared=False,
                                 causal=False, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        _check_tokens("CastlingAttention", x, self.spatial_dims, self.dim)
        b, shape = x.shape[0], x.shape[1:-1]
        q, k, v = self.qkv(x).reshape(b, -1, 3, self.heads, self.dim // self.heads).unbind(2)
        n = q.shape[1]
        state = torch.einsum("bnhd,bnhe->bhde", k, v) / (torch.pi * n)  # (B, heads, dh, dh)
        linear_angular = torch.einsum("bnhd,bhde->bnhe", q, state).reshape(b, *shape, self.dim)
        v = v.reshape(b, *shape, self.dim)
        local = self.dwconv(v.movedim(-1, 1)).movedim(1, -1)
        return self.proj(linear_angular + 0.5 * v + local)


class Hyena(nn.Module):
    """Order-``N`` Hyena operator with explicit long filters (PADRe App. B.3), degree ``N + 1``:
    ``z^1 = x^0``, ``z^{n+1} = x^n * (h^n conv z^n)``, ``O = z^{N+1} W_o + b``.

    The ``N + 1`` projections ``x^n`` are one pointwise map followed by a short depthwise
    convolution over the sequence (``short_filter`` taps), as in Hyena. The long filters ``h^n``
    are learned per channel with ``max_len`` taps; Hyena parameterises them implicitly (a small
    network of the position), which changes how the weights are produced but not the polynomial
    in the input, so explicit filters are used here. With ``causal`` (default, Hyena's language
    setting) token ``t`` reads tokens ``t - max_len + 1 .. t``.

    Args:
        dim: channels; order: ``N`` (default 2, Hyena's common choice, degree 3);
        max_len: taps of the long filters (default 64; sequences may be longer, each token then
        reads the last ``max_len`` tokens); short_filter: taps of the short convolutions
        (default 3); causal: see above; bias: biases of the projections (default False).

    Shapes: ``(B, N, dim) -> (B, N, dim)``.
    """

    def __init__(self, dim: int, *, order: int = 2, max_len: int = 64, short_filter: int = 3,
                 causal: bool = True, bias: bool = False) -> None:
        super().__init__()
        self.dim = _positive_int(dim, "dim", "Hyena")
        self.order = _positive_int(order, "order", "Hyena")
        self.max_len = _positive_int(max_len, "max_len", "Hyena")
        self.causal = bool(causal)
        self.in_proj = nn.Linear(dim, (order + 1) * dim, bias=bias)
        short_filter = _positive_int(short_filter, "short_filter", "Hyena")
        self.short = _TokenConv((order + 1) * dim, order + 1, short_filter, 1, shared=False,
                                causal=self.causal, bias=bias)
        self.filters = nn.ModuleList(
            _TokenConv(dim, 1, max_len, 1, shared=False, causal=self.causal, bias=False)
            for _ in range(order))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        check_shape("Hyena", x, ("B", "N", self.dim))
        xs = self.short(self.in_proj(x).movedim(-1, 1)).chunk(self.order + 1, dim=1)
        z = xs[0]
        for n in range(1, self.order + 1):
            z = xs[n] * self.filters[n - 1](z)
        return self.proj(z.movedim(1, -1))
