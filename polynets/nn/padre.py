"""PADRe: polynomial attention drop-in replacement (Letourneau et al., PADRe, Eq. 1-8).

``Y_i = A_i X B_i`` (``A_i`` mixes tokens, ``B_i`` mixes channels), ``Z_1 = Y_1``,
``Z_{i+1} = (C_i Z_i D_i) * Y_{i+1}`` (Hadamard product), ``P = sum_i w_i * Z_i`` and
``O = P V + b``. Every entry of ``Z_i`` is a homogeneous polynomial of degree ``i`` in ``X``
(Lemma 1), so the output is a polynomial of degree ``d`` built from linear maps and products only:
it traces to a polynomial program, certifies with degree ``d`` and encrypts unchanged.

The structured maps are the paper's instance (Section 4.1): token mixing by depthwise
convolutions over the token grid (``k x k``, 2-D) or the sequence (``k`` taps, 1-D), channel
mixing by pointwise (``1 x 1``) convolutions, one head. Options: several heads (Section 3,
independent copies of the framework on groups of channels), the token resize ``O = U P V``
(Eq. 7) and the multimodal form of Appendix A.1, ``Z_j = prod_{i <= j} Y_i^{(c_i)}`` with
``c_i`` in ``{a, b}``: called as ``padre(x, context)``, a polynomial of degree ``d`` in the pair
(trace it through :class:`polynets.nn.pair.PairInput`, the tracer takes one input).

Appendix B's polynomial instances of the framework are here too, each in the polynomial form
the appendix analyses: :class:`Conv2Former` (degree 2), :class:`CastlingAttention` (Castling-ViT
at inference, degree 3) and :class:`Hyena` (order ``N``, degree ``N + 1``). SimA, Mamba and
softmax attention are not polynomials (norms, softplus and exp of the data); ``pn.certify``
rejects them by the offending op.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polynets.errors import ConfigError, check_int
from polynets.nn.layers import check_shape, make_norm

__all__ = ["PADRe", "Conv2Former", "CastlingAttention", "Hyena", "TOKEN_MIXINGS", "WEIGHTS",
           "CONTEXT_MIXINGS"]

TOKEN_MIXINGS = ("depthwise", "shared")
"""``"depthwise"``: one ``k x k`` kernel per channel (the default; Table 2's parameter counts
rule out dense ``k x k`` convolutions); ``"shared"``: one kernel for all channels of a map."""

WEIGHTS = ("channel", "position")
"""``"channel"``: one weight per channel and degree, broadcast over tokens (the default; any
number of tokens); ``"position"``: Eq. 6's per-token, per-channel weights (fixes the tokens)."""


CONTEXT_MIXINGS = ("mean", "conv")
"""Token map ``A_i^{(b)}`` of the second mode (multimodal PADRe): ``"mean"`` (the default,
``(1/M) 1_N 1_M^T``: every token reads the mean of the context tokens, any context length
``M``) or ``"conv"`` (the same depthwise token convolution as mode a; the context must have the
token shape of ``x``)."""


def _positive_int(value: object, name: str, owner: str = "PADRe") -> int:
    return check_int(value, f"{owner} {name}")


def _token_shape(value: int | Sequence[int] | None, spatial_dims: int,
                 why: str = 'weights="position"') -> tuple[int, ...]:
    if value is None:
        raise ConfigError(f"PADRe {why} needs token_shape: (H, W) for 2-D tokens, "
                          "N for 1-D tokens")
    shape = (value,) if isinstance(value, int) else tuple(value)
    if len(shape) != spatial_dims or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape):
        want = "(H, W)" if spatial_dims == 2 else "N"
        raise ConfigError(f"PADRe token_shape must be {want} of positive ints for "
                          f"spatial_dims={spatial_dims}, got {value!r}")
    return shape


def _check_modes(modes: object, degree: int) -> str:
    """Appendix A.1's mode sequence ``c_1 .. c_d``: ``degree`` letters ``a``/``b``."""
    if not isinstance(modes, str) or len(modes) != degree or set(modes) - {"a", "b"}:
        raise ConfigError(f"PADRe modes must be a string of degree={degree} letters 'a' (the "
                          f"input) and 'b' (the context), e.g. {'a' * (degree - 1) + 'b'!r}; "
                          f"got {modes!r}")
    if "a" not in modes:
        raise ConfigError(f"PADRe modes={modes!r} never reads the input x; use at least one "
                          "'a' (and one 'b' for cross terms)")
    return modes


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
    """PADRe mixer: ``O = U [sum_i w_i * Z_i (+ L)] V + b``, ``Z_1 = A_1 X B_1``,
    ``Z_{i+1} = (C_i Z_i D_i) * (A_{i+1} X B_{i+1})``.

    Args:
        dim: channels ``D`` of the tokens.
        degree: ``d``, the degree of the output in ``X`` (PADRe-2, -3, -4 ...).
        kernel_size: taps of the token convolutions ``A_i``, ``C_i`` per spatial dim (default 11,
            the paper's 11 x 11 on grids and 11 on sequences).
        spatial_dims: 2 (default): tokens on a grid, input ``(B, H, W, dim)``; 1: a sequence,
            input ``(B, N, dim)``.
        token_mixing: ``"depthwise"`` (default, one kernel per channel) or ``"shared"`` (one
            kernel per map and head, shared by its channels).
        z_mixing: apply ``C_i`` (token convolution) and ``D_i`` (pointwise) to ``Z_i`` before the
            product (default True, as in the paper's Fig. 1); False sets them to the identity.
        first_order: include ``w_1 * Z_1`` in the sum (default False: the block's shortcut
            supplies the degree-1 term, Section 4.1). Needed for ``degree=1``.
        weights: ``"channel"`` (default): ``w_i`` is one weight per channel broadcast over
            tokens; ``"position"``: Eq. 6's per-token weights ``W[m, n, i]``, which fix the token
            shape to ``token_shape``.
        token_shape: ``(H, W)`` (2-D) or ``N`` (1-D): the fixed token shape, needed by
            ``weights="position"`` and ``out_tokens`` and used only by them.
        constant: add Eq. 6's degree-0 term ``L`` to ``P``, shaped like one ``w_i`` (per
            channel, or per token and channel with ``weights="position"``). Default False:
            the output projection's bias gives the constant (Section 4.1).
        causal: 1-D only: pad on the left so token ``t`` reads tokens ``t - k + 1 .. t``
            (default False: centred padding).
        out_features: ``G``, the width of the output projection ``V`` (default ``dim``).
        proj: apply the output projection ``V`` with bias ``b`` (default True; the paper's final
            pointwise layer, which also gives the constant term). With False, ``out_features``
            must equal ``dim`` and the output is ``U P``.
        norm: ``"none"`` (default) or ``"batch"``: normalise the ``Y_i`` (Section 3.3's
            optional normalisation; batch norm folds into the maps at inference).
        bias: biases in ``A_i, B_i, C_i, D_i`` (default False, so ``Z_i`` is homogeneous of
            degree ``i`` as in Lemma 1).
        heads: ``h`` independent copies of the framework on ``dim / h`` channels each
            (Section 3): ``B_i``, ``D_i`` are block-diagonal (grouped pointwise maps), shared
            token kernels are one per map and head, and ``V`` mixes the heads, as attention's
            output projection does. Default 1, the paper's single head.
        out_tokens: Eq. 7's token resize ``U`` (``F x N``), applied to ``P`` before ``V``:
            ``F`` (1-D) or ``(F_h, F_w)`` (2-D) output tokens; needs ``token_shape``. Default
            None: no resize.
        resize_rank: ``r``: ``U = U_2 U_1`` with ``U_1`` ``(r x N)`` and ``U_2`` ``(F x r)``,
            the low-rank structure Eq. 7 suggests. Default None: a dense ``U``.
        modes: Appendix A.1's multimodal form: ``d`` letters ``c_i`` in ``{a, b}``; ``Y_i``
            is ``A_i X B_i`` for ``a`` and ``A_i^{(b)} X^{(b)} B_i^{(b)}`` of the context for
            ``b``. Called as ``padre(x, context)``. Default None: all ``a``, one input.
        context_dim: channels of the context (default ``dim``).
        context_mixing: the token map ``A_i^{(b)}`` of the context, one of
            :data:`CONTEXT_MIXINGS` (default ``"mean"``: any context length).

    Shapes: ``(B, H, W, dim) -> (B, H, W, out_features)`` (2-D) or
    ``(B, N, dim) -> (B, N, out_features)`` (1-D), with ``(F_h, F_w)`` or ``F`` output tokens
    under ``out_tokens``. The context is ``(B, M, context_dim)`` or ``(B, H', W', context_dim)``
    (``"conv"``: the token shape of ``x``).
    """

    def __init__(self, dim: int, *, degree: int = 2, kernel_size: int = 11,
                 spatial_dims: int = 2, token_mixing: str = "depthwise", z_mixing: bool = True,
                 first_order: bool = False, weights: str = "channel",
                 token_shape: int | Sequence[int] | None = None, constant: bool = False,
                 causal: bool = False,
                 out_features: int | None = None, proj: bool = True, norm: str = "none",
                 bias: bool = False, heads: int = 1,
                 out_tokens: int | Sequence[int] | None = None, resize_rank: int | None = None,
                 modes: str | None = None, context_dim: int | None = None,
                 context_mixing: str = "mean") -> None:
        super().__init__()
        self.dim = _positive_int(dim, "dim")
        self.degree = _positive_int(degree, "degree")
        self.kernel_size = _positive_int(kernel_size, "kernel_size")
        self.heads = _positive_int(heads, "heads")
        if dim % heads:
            raise ConfigError(f"PADRe dim ({dim}) must be divisible by heads ({heads})")
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
        if weights == "position":
            self.token_shape: tuple[int, ...] | None = _token_shape(token_shape, spatial_dims)
        elif out_tokens is not None:
            self.token_shape = _token_shape(token_shape, spatial_dims, "out_tokens")
        elif token_shape is not None:
            raise ConfigError('PADRe token_shape is only used with weights="position" or '
                              "out_tokens")
        else:
            self.token_shape = None
        self.out_tokens = self._check_out_tokens(out_tokens, resize_rank)
        self.modes = _check_modes(modes, degree) if modes is not None else "a" * degree
        if context_mixing not in CONTEXT_MIXINGS:
            raise ConfigError(f"PADRe context_mixing must be one of {CONTEXT_MIXINGS}, got "
                              f"{context_mixing!r}")
        self.context_mixing = context_mixing
        self.context_dim = _positive_int(context_dim if context_dim is not None else dim,
                                         "context_dim")
        n_a, n_b = self.modes.count("a"), self.modes.count("b")
        if n_b and self.context_dim % heads:
            raise ConfigError(f"PADRe context_dim ({self.context_dim}) must be divisible by "
                              f"heads ({heads})")
        if norm not in ("none", "batch"):
            raise ConfigError(f"PADRe norm must be 'none' or 'batch', got {norm!r}")
        d, c = self.degree, self.dim
        conv = nn.Conv2d if spatial_dims == 2 else nn.Conv1d
        shared = token_mixing == "shared"

        def token_conv(maps: int) -> _TokenConv:
            return _TokenConv(maps * c, maps * heads, kernel_size, spatial_dims, shared=shared,
                              causal=causal, bias=bias)

        # Y_i of mode a at once: B_i as one (grouped) pointwise map to n_a * dim channels, A_i.
        self.channel_mix = conv(c, n_a * c, 1, bias=bias, groups=heads)
        self.token_mix = token_conv(n_a)
        self.norm = make_norm(norm, n_a * c) if norm == "batch" else None
        if n_b:
            self.context_channel_mix = conv(self.context_dim, n_b * c, 1, bias=bias,
                                            groups=heads)
            self.context_token_mix = token_conv(n_b) if context_mixing == "conv" else None
            self.context_norm = make_norm(norm, n_b * c) if norm == "batch" else None
        steps = d - 1 if self.z_mixing else 0
        self.z_channel = nn.ModuleList(conv(c, c, 1, bias=bias, groups=heads)
                                       for _ in range(steps))
        self.z_token = nn.ModuleList(token_conv(1) for _ in range(steps))
        self.terms = tuple(range(0 if self.first_order else 1, d))  # 0-based degrees - 1
        wshape = (len(self.terms), c) + (
            self.token_shape if weights == "position" else (1,) * spatial_dims)
        self.w = nn.Parameter(torch.ones(wshape))
        self.constant = nn.Parameter(torch.zeros(wshape[1:])) if constant else None
        if self.out_tokens is not None:
            n_in, n_out = math.prod(self.token_shape), math.prod(self.out_tokens)
            self.resize: nn.Module | None = (
                nn.Linear(n_in, n_out, bias=False) if resize_rank is None else
                nn.Sequential(nn.Linear(n_in, resize_rank, bias=False),
                              nn.Linear(resize_rank, n_out, bias=False)))
        else:
            self.resize = None
        self.proj = nn.Linear(c, self.out_features) if proj else nn.Identity()
        self.reset_parameters()

    def _check_out_tokens(self, out_tokens: object,
                          resize_rank: object) -> tuple[int, ...] | None:
        if out_tokens is None:
            if resize_rank is not None:
                raise ConfigError("PADRe resize_rank is only used with out_tokens")
            return None
        shape = (out_tokens,) if isinstance(out_tokens, int) \
            else tuple(out_tokens)  # type: ignore[call-overload]
        if len(shape) != self.spatial_dims or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape):
            want = "(F_h, F_w)" if self.spatial_dims == 2 else "F"
            raise ConfigError(f"PADRe out_tokens must be {want} of positive ints for "
                              f"spatial_dims={self.spatial_dims}, got {out_tokens!r}")
        if resize_rank is not None:
            _positive_int(resize_rank, "resize_rank")
        return shape

    def reset_parameters(self) -> None:
        """Unit-gain maps: pointwise weights ``N(0, 1 / fan_in)``, kernels ``N(0, 1 / taps)``,
        ``w_i = 1``, the resize and output projection as ``nn.Linear``; biases zero."""
        pointwise = [self.channel_mix, *self.z_channel]
        tokens = [self.token_mix, *self.z_token]
        if "b" in self.modes:
            pointwise.append(self.context_channel_mix)
            if self.context_token_mix is not None:
                tokens.append(self.context_token_mix)
        for m in pointwise:
            nn.init.normal_(m.weight, std=m.weight.shape[1] ** -0.5)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        for m in tokens:
            m.reset_parameters()
        nn.init.ones_(self.w)
        if self.constant is not None:
            nn.init.zeros_(self.constant)
        if self.resize is not None:
            for m in self.resize.modules():
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
        if isinstance(self.proj, nn.Linear):
            self.proj.reset_parameters()

    def extra_repr(self) -> str:
        extra = "" if self.heads == 1 else f", heads={self.heads}"
        if self.out_tokens is not None:
            extra += f", out_tokens={self.out_tokens}"
        if "b" in self.modes:
            extra += f", modes={self.modes!r}, context_mixing={self.context_mixing!r}"
        return (f"dim={self.dim}, degree={self.degree}, kernel_size={self.kernel_size}, "
                f"spatial_dims={self.spatial_dims}, token_mixing={self.token_mixing!r}, "
                f"weights={self.weights!r}, first_order={self.first_order}, "
                f"causal={self.causal}, out_features={self.out_features}{extra}")

    def _check_input(self, x: Tensor) -> None:
        tokens: tuple[int | str, ...] = ("H", "W") if self.spatial_dims == 2 else ("N",)
        if self.token_shape is not None:
            tokens = self.token_shape
        check_shape("PADRe", x, ("B", *tokens, self.dim))

    def _check_context(self, x: Tensor, context: Tensor | None) -> None:
        if "b" not in self.modes:
            if context is not None:
                raise ConfigError("this PADRe has no context mode; build it with modes= "
                                  "(e.g. 'aab') to call it as padre(x, context)")
            return
        if context is None:
            raise ConfigError(f"PADRe modes={self.modes!r} reads a context: call it as "
                              "padre(x, context)")
        if self.context_mixing == "conv":
            tokens: tuple[int | str, ...] = tuple(x.shape[1:-1])
        else:
            tokens = ("H'", "W'") if self.spatial_dims == 2 else ("M",)
        check_shape("PADRe context", context, (x.shape[0], *tokens, self.context_dim))

    def _maps(self, t: Tensor, count: int, channel_mix: nn.Module, token_mix: nn.Module | None,
              norm: nn.Module | None, spatial: tuple[int, ...]) -> list[Tensor]:
        """``count`` maps ``A_i X B_i`` of channels-first tokens t, each (B, dim, *spatial).

        With heads the grouped pointwise map gives channels ordered (head, map, channel); they
        are reordered to (map, head, channel) so each map holds all heads. Without a token
        convolution the map is the mean over the tokens, broadcast to ``spatial``.
        """
        y = channel_mix(t)
        if self.heads > 1:
            b, rest = y.shape[0], y.shape[2:]
            y = y.reshape(b, self.heads, count, self.dim // self.heads, *rest).transpose(1, 2)
            y = y.reshape(b, count * self.dim, *rest)
        if token_mix is not None:
            y = token_mix(y)
        else:
            y = y.mean(dim=tuple(range(2, y.dim())), keepdim=True)
            y = y.expand(*y.shape[:2], *spatial)
        if norm is not None:
            y = norm(y.movedim(1, -1)).movedim(-1, 1)
        return list(y.chunk(count, dim=1))

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """``x`` (B, *tokens, dim) [, ``context``] -> (B, *tokens or out_tokens, out_features)."""
        self._check_input(x)
        self._check_context(x, context)
        t = x.movedim(-1, 1)  # (B, dim, *S): convolutions run channels-first
        spatial = tuple(t.shape[2:])
        ys_a = self._maps(t, self.modes.count("a"), self.channel_mix, self.token_mix, self.norm,
                          spatial)
        ys_b = [] if context is None else self._maps(
            context.movedim(-1, 1), self.modes.count("b"), self.context_channel_mix,
            self.context_token_mix, self.context_norm, spatial)
        ys = [(ys_a if mode == "a" else ys_b).pop(0) for mode in self.modes]  # Y_1 .. Y_d
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
        if self.resize is not None:  # O = U P: tokens N -> F
            out = self.resize(out.flatten(2)).reshape(*out.shape[:2], *self.out_tokens)
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
