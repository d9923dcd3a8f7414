"""Polynomial Mixer (PoM): a linear-time token mixer built from sums and products.

``PoM(X) = W_o [ g(W_s X) * H(X) ]`` with the shared state ``H(X) = [sum_p a_p * h(W_h X)^p] M^T``
aggregated over tokens (``M`` is all ones without a mask, lower triangular for a causal mask).
With ``activation="linear"`` (h = identity) and a polynomial gate (``"linear"`` or ``"poly<g>"``)
the module is a polynomial of its input of degree ``degree + gate degree``; ``activation="gelu"``
with ``gate="sigmoid"`` is the original formulation.

Cross-PoM (PoM-video, Listings 4-5): ``PoM(x_q, x_c, mask=...)`` takes the selection from the
queries ``x_q`` and the state from a second sequence ``x_c``; it is a polynomial of the pair, of
degree ``degree`` in ``x_c`` and the gate degree in ``x_q``. The tracer lowers one-input models:
trace it through :class:`polynets.nn.pair.PairInput`, which splits one concatenated input.

The speech paper's variants (pom-speech-encoders, Section 3.2) are options: ``form="jump"`` (mode
jump: only the top product ``prod_m h(W_m x)`` feeds the state), ``selective=True`` (the state
reads half of the features) and :class:`SplitPoM` (2-way / 3-way frequency split: one PoM per
group of features). The paper uses ``h = GELU`` and a sigmoid gate; with ``activation="linear"``
and a polynomial gate (the defaults) every variant is a polynomial.

Every op on the polynomial path is one the polynomial program can express: linear maps, Hadamard
products, sums or cumulative sums over tokens, products with constant matrices and multiplication
by constant reciprocal counts.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polynets.errors import ConfigError, ShapeError, check_int

__all__ = ["PoM", "PoMState", "SplitPoM", "causal_mask", "block_causal_mask"]

#: Constant tensors (masks, reciprocal counts) a PoM keeps per sequence length, dtype and device.
CONSTANT_CACHE_SIZE = 16

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor] | None] = {
    "linear": None,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "tanh": torch.tanh,
}
_FIXED_GATES: dict[str, Callable[[Tensor], Tensor] | None] = {
    "linear": None,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
_FORMS = ("powers", "products", "jump")
_AGGREGATIONS = ("mean", "sum")
_NAMED_MASKS = ("causal", "block_causal")
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


class PoMState(NamedTuple):
    """Recurrent state of a causal (or block-causal) PoM.

    ``total``: (B, S) running sum of the token features ``sum_p a_p h(W_h x)^p`` seen so far
    (S = ``PoM.state_dim``); ``count``: number of tokens consumed.
    """

    total: Tensor
    count: int


def causal_mask(n: int) -> Tensor:
    """Boolean (n, n) lower-triangular mask: ``M[s, t] = t <= s`` (token s reads tokens up to s)."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def block_causal_mask(n: int, block_size: int) -> Tensor:
    """Boolean (n, n) block-causal mask (PoM Eq. 7): ``M[s, t] = t // K <= s // K``, K = block."""
    _check_block_size(block_size)
    if n % block_size:
        raise ShapeError(f"sequence length {n} is not a multiple of block_size={block_size}")
    blocks = torch.arange(n) // block_size
    return blocks[None, :] <= blocks[:, None]


def _check_block_size(block_size: object) -> int:
    return check_int(block_size, "block_size")


def _parse_gate(gate: str) -> int | None:
    """Degree of a ``"poly<g>"`` gate (g >= 1), or None for a fixed gate name."""
    if isinstance(gate, str) and gate in _FIXED_GATES:
        return None
    digits = gate[4:] if isinstance(gate, str) and gate.startswith("poly") else ""
    if digits.isdigit() and int(digits) >= 1:
        return int(digits)
    raise ConfigError(
        f"unknown gate {gate!r}; expected one of {sorted(_FIXED_GATES)} or 'poly<g>' with g >= 1 "
        "(e.g. 'poly2')")


def _power_series(coeffs: Tensor, z: Tensor) -> Tensor:
    """``sum_{j=1}^{J} coeffs[j - 1] * z**j`` by Horner's rule (no constant term); coeffs (J, S)."""
    out = coeffs[-1] * z
    for j in range(coeffs.shape[0] - 2, -1, -1):
        out = (out + coeffs[j]) * z
    return out


def _constant(values: np.ndarray, like: Tensor) -> Tensor:
    """A NumPy array as a constant tensor with the dtype and device of ``like``."""
    np_dtype = _NUMPY_DTYPES.get(like.dtype, np.float32)
    out = torch.from_numpy(np.ascontiguousarray(values, dtype=np_dtype))
    if out.dtype != like.dtype or out.device != like.device:
        out = out.to(device=like.device, dtype=like.dtype)
    return out


class PoM(nn.Module):
    """Polynomial Mixer: ``PoM(X) = W_o [g(W_s X) * H(X)]``, ``H(X) = [sum_p a_p h(W_h X)^p] M^T``.

    Args:
        dim: token width d. Input and output are (B, N, d).
        degree: k, the degree of the token polynomial in H.
        expand: D / d, the width of the state per degree term (D = expand * d).
        activation: h, ``"linear"`` (identity, polynomial) or ``"gelu"``/``"relu"``/``"silu"``/
            ``"tanh"``.
        gate: g, ``"linear"`` (affine selection W_s x + b), ``"poly<g>"`` (learned per-channel
            polynomial of degree g, initialised to 0.5 + z/4, the sigmoid's first-order Taylor
            expansion), or ``"sigmoid"``/``"tanh"``.
        mask: None (one global state), ``"causal"`` (prefix sums), ``"block_causal"`` (needs
            ``block_size``; a token reads its own block and all earlier blocks, Eq. 7-8) or a
            boolean (N, N) tensor with ``mask[s, t]`` True when token s reads token t.
        block_size: K for ``mask="block_causal"``.
        aggregation: ``"mean"`` (divide the state by the number of tokens it sums) or ``"sum"``.
        form: ``"powers"`` (``sum_p a_p h(W_h x)^p``, state width D), ``"products"`` (the
            follow-up papers' ``[h(W_1 x); h(W_1 x) h(W_2 x); ...; prod_m h(W_m x)]``, width kD)
            or ``"jump"`` (the speech paper's mode jump: only ``prod_m h(W_m x)``, width D).
        selective: the speech paper's selective PoM: only the first ``dim // 2`` features feed
            the state H (the others reach the output through the selection only, unmixed).
            Default False (all features feed H).
        bias: whether the projections have biases.

    Call: ``pom(x)`` (self-mixing) or ``pom(x_q, x_c, mask=None)`` (Cross-PoM: selection from
    the queries ``x_q`` (B, N, d), state from ``x_c`` (B, M, d)). A call ``mask`` (boolean
    (N, M), or (B, N, M) per sample, True where query s reads context token t; Listing 3's full
    mask) needs a PoM built without a mask; a PoM built with a mask mixes ``x_c`` of the same
    length N under that mask.

    Shapes: x (B, N, d) [, x_c (B, M, d)] -> (B, N, d).
    """

    def __init__(self, dim: int, *, degree: int = 2, expand: float = 2, activation: str = "linear",
                 gate: str = "linear", mask: str | Tensor | None = None,
                 block_size: int | None = None, aggregation: str = "mean", form: str = "powers",
                 selective: bool = False, bias: bool = True) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("degree", degree)):
            check_int(value, name)
        if not isinstance(expand, (int, float)) or expand <= 0 or int(round(expand * dim)) < 1:
            raise ConfigError(f"expand must be a positive number with expand * dim >= 1, "
                              f"got expand={expand!r} for dim={dim}")
        if activation not in _ACTIVATIONS:
            raise ConfigError(f"unknown activation {activation!r}; expected one of "
                              f"{sorted(_ACTIVATIONS)}")
        if aggregation not in _AGGREGATIONS:
            raise ConfigError(f"unknown aggregation {aggregation!r}; expected one of "
                              f"{list(_AGGREGATIONS)}")
        if form not in _FORMS:
            raise ConfigError(f"unknown form {form!r}; expected one of {list(_FORMS)}")
        if not isinstance(selective, bool):
            raise ConfigError(f"selective must be True or False, got {selective!r}")
        if selective and dim < 2:
            raise ConfigError(f"selective=True mixes dim // 2 features and needs dim >= 2, "
                              f"got dim={dim}")
        gate_degree = _parse_gate(gate)

        self.dim, self.degree, self.expand = dim, degree, expand
        self.activation, self.gate = activation, gate
        self.aggregation, self.form, self.selective = aggregation, form, selective
        self.mixed_features = dim // 2 if selective else dim
        self.hidden = int(round(expand * dim))
        self.state_dim = self.hidden * (degree if form == "products" else 1)
        self._mask_kind, self.block_size = self._configure_mask(mask, block_size)

        self.proj_h = nn.Linear(self.mixed_features,
                                self.hidden * (1 if form == "powers" else degree), bias=bias)
        self.proj_s = nn.Linear(dim, self.state_dim, bias=bias)
        self.proj_o = nn.Linear(self.state_dim, dim, bias=bias)
        if form == "powers":
            # alpha[p - 1] multiplies h^p; initialised to 1 / p! so higher powers start small.
            alpha = torch.tensor([1.0 / math.factorial(p) for p in range(1, degree + 1)])
            self.alpha = nn.Parameter(alpha[:, None].repeat(1, self.hidden))
        else:
            self.register_parameter("alpha", None)
        if gate_degree is None:
            self.register_parameter("gate_coeffs", None)
        else:
            coeffs = torch.zeros(gate_degree + 1, self.state_dim)
            coeffs[0], coeffs[1] = 0.5, 0.25
            self.gate_coeffs = nn.Parameter(coeffs)
        self._gate_degree = 1 if gate == "linear" else gate_degree
        self._constants: dict[tuple, Tensor] = {}

    def _configure_mask(self, mask: str | Tensor | None,
                        block_size: int | None) -> tuple[str, int | None]:
        if mask is None or (isinstance(mask, str) and mask == "causal"):
            if block_size is not None:
                raise ConfigError(f"block_size is only used with mask='block_causal', "
                                  f"got block_size={block_size!r} with mask={mask!r}")
            return ("global" if mask is None else "causal"), None
        if isinstance(mask, str):
            if mask != "block_causal":
                raise ConfigError(f"unknown mask {mask!r}; expected None, one of "
                                  f"{list(_NAMED_MASKS)} or a boolean (N, N) tensor")
            if block_size is None:
                raise ConfigError("mask='block_causal' needs block_size=K (tokens per block)")
            return "block_causal", _check_block_size(block_size)
        if not isinstance(mask, Tensor):
            raise ConfigError(f"mask must be None, a string or a boolean tensor, "
                              f"got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise ConfigError(f"mask tensor must be boolean (True where token s reads token t), "
                              f"got dtype {mask.dtype}")
        if mask.dim() != 2 or mask.shape[0] != mask.shape[1] or mask.shape[0] == 0:
            raise ShapeError(f"mask tensor must have shape (N, N), got {tuple(mask.shape)}")
        if block_size is not None:
            raise ConfigError("block_size is only used with mask='block_causal'")
        self.register_buffer("mask_bool", mask.detach().cpu().clone(), persistent=False)
        return "tensor", None

    @property
    def mask(self) -> str | Tensor | None:
        """The mask as given: None, ``"causal"``, ``"block_causal"`` or the boolean tensor."""
        kinds = {"global": None, "causal": "causal", "block_causal": "block_causal"}
        return kinds[self._mask_kind] if self._mask_kind in kinds else self.mask_bool

    @property
    def is_polynomial(self) -> bool:
        """True when h is the identity and g is a polynomial (``"linear"`` or ``"poly<g>"``)."""
        return self.activation == "linear" and self._gate_degree is not None

    @property
    def polynomial_degree(self) -> int | None:
        """Total degree in X: ``degree`` (state H) + gate degree (1 for linear); None otherwise."""
        return self.degree + self._gate_degree if self.is_polynomial else None

    def extra_repr(self) -> str:
        mask = self._mask_kind + (f", block_size={self.block_size}" if self.block_size else "")
        return (f"dim={self.dim}, degree={self.degree}, expand={self.expand}, "
                f"activation={self.activation!r}, gate={self.gate!r}, mask={mask}, "
                f"aggregation={self.aggregation!r}, form={self.form!r}"
                + (", selective=True" if self.selective else ""))

    # --- building blocks -------------------------------------------------------------------

    def _check_tokens(self, x: Tensor, what: str, ranks: tuple[int, ...]) -> None:
        if x.dim() not in ranks or x.shape[-1] != self.dim:
            expected = " or ".join({2: "(B, dim)", 3: "(B, N, dim)"}[r] for r in ranks)
            raise ShapeError(f"PoM {what} must have shape {expected} with dim={self.dim}, "
                             f"got {tuple(x.shape)}")

    def features(self, x: Tensor) -> Tensor:
        """Per-token state contributions (``sum_p a_p h(W_h x)^p``, the running products, or
        their top product): (..., d) -> (..., S). ``selective`` reads the first dim // 2
        features only."""
        z = self.proj_h(x[..., :self.mixed_features] if self.selective else x)
        act = _ACTIVATIONS[self.activation]
        if act is not None:
            z = act(z)
        if self.form == "powers":
            return _power_series(self.alpha, z)
        parts = list(z.chunk(self.degree, dim=-1))
        for m in range(1, self.degree):
            parts[m] = parts[m] * parts[m - 1]
        return parts[-1] if self.form == "jump" else torch.cat(parts, dim=-1)

    def selection(self, x: Tensor) -> Tensor:
        """Token-wise gate ``g(W_s x)``: (..., d) -> (..., S)."""
        s = self.proj_s(x)
        if self.gate_coeffs is not None:
            return self.gate_coeffs[0] + _power_series(self.gate_coeffs[1:], s)
        fn = _FIXED_GATES[self.gate]
        return s if fn is None else fn(s)

    def _inv_counts(self, offset: int, length: int, like: Tensor) -> Tensor:
        """Constant (length, 1) reciprocals of the number of tokens each position's state sums.

        Positions ``offset .. offset + length - 1``; computed in NumPy, outside autograd and any
        trace, so the state is normalised by a constant.
        """
        if self._mask_kind == "tensor":
            counts = self.mask_bool.cpu().numpy().sum(axis=1).astype(np.float64)
        else:
            pos = np.arange(offset, offset + length, dtype=np.float64)
            if self._mask_kind == "block_causal":
                counts = (np.floor(pos / self.block_size) + 1.0) * self.block_size
            else:
                counts = pos + 1.0
        return _constant(1.0 / np.maximum(counts, 1.0)[:, None], like)

    def _cached(self, name: str, length: int, like: Tensor) -> Tensor:
        """Per-(length, dtype, device) cache of the constant mask matrix and reciprocal counts,
        least recently used first out beyond :data:`CONSTANT_CACHE_SIZE` entries."""
        key = (name, length, like.dtype, like.device)
        if key in self._constants:
            self._constants[key] = self._constants.pop(key)          # most recently used last
        else:
            if name == "mask":
                self._constants[key] = _constant(self.mask_bool.cpu().numpy(), like)
            else:
                self._constants[key] = self._inv_counts(0, length, like)
            while len(self._constants) > CONSTANT_CACHE_SIZE:
                del self._constants[next(iter(self._constants))]
        return self._constants[key]

    def _prefix_state(self, feats: Tensor, carry: Tensor | None) -> Tensor:
        """Causal / block-causal running sums of feats (B, T, S), plus an optional carry (B, S)."""
        if self._mask_kind == "causal":
            summed = feats.cumsum(dim=1)
        else:
            b, t, s = feats.shape
            k = self.block_size
            blocks = feats.reshape(b, t // k, k, s).sum(dim=2).cumsum(dim=1)
            summed = blocks.unsqueeze(2).expand(b, t // k, k, s).reshape(b, t, s)
        return summed if carry is None else summed + carry.unsqueeze(1)

    def shared_state(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """The shared state H of the tokens ``x`` (B, M, d): (B, 1, S) without a mask, (B, M, S)
        with the PoM's mask, (B, N, S) with a call ``mask`` (N, M) or (B, N, M) (query s
        aggregates the tokens t with ``mask[s, t]``; mean aggregation divides by their count)."""
        self._check_tokens(x, "input", (3,))
        n = x.shape[1]
        self._check_length(n)
        feats = self.features(x)
        mean = self.aggregation == "mean"
        if mask is not None:
            rows = mask.shape[-2] if isinstance(mask, Tensor) and mask.dim() >= 2 else -1
            self._check_call_mask(mask, x.shape[0], rows, n)
            weights = mask.to(device=feats.device, dtype=feats.dtype)
            summed = torch.matmul(weights, feats)
            return summed / weights.sum(dim=-1, keepdim=True).clamp_min(1.0) if mean else summed
        if self._mask_kind == "global":
            return feats.mean(dim=1, keepdim=True) if mean else feats.sum(dim=1, keepdim=True)
        if self._mask_kind == "tensor":
            summed = torch.matmul(self._cached("mask", n, feats), feats)
        else:
            summed = self._prefix_state(feats, None)
        return summed * self._cached("inv_counts", n, summed) if mean else summed

    def _check_call_mask(self, mask: object, batch: int, n: int, m: int) -> None:
        """A call mask must be boolean (N, M) or (B, N, M) (B or 1) on a PoM without a mask."""
        if self._mask_kind != "global":
            raise ConfigError(f"a mask at call time needs a PoM built without a mask; this PoM "
                              f"has mask={self._mask_kind!r}")
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise ConfigError(f"PoM call mask must be a boolean tensor (True where query s reads "
                              f"context token t), got "
                              f"{getattr(mask, 'dtype', type(mask).__name__)}")
        ok = mask.dim() == 2 or (mask.dim() == 3 and mask.shape[0] in (1, batch))
        if not ok or tuple(mask.shape[-2:]) != (n, m):
            raise ShapeError(f"PoM call mask must have shape (N, M) = ({n}, {m}) or "
                             f"(B, N, M) = ({batch}, {n}, {m}), got {tuple(mask.shape)}")

    def _check_length(self, n: int) -> None:
        if n == 0:
            raise ShapeError("PoM input has no tokens (N = 0)")
        if self._mask_kind == "tensor" and n != self.mask_bool.shape[0]:
            raise ShapeError(f"mask has shape {tuple(self.mask_bool.shape)} but the input has "
                             f"N={n} tokens; expected N={self.mask_bool.shape[0]}")
        if self._mask_kind == "block_causal" and n % self.block_size:
            raise ShapeError(f"block-causal PoM needs N to be a multiple of "
                             f"block_size={self.block_size}, got N={n}")

    def forward(self, x: Tensor, context: Tensor | None = None, *,
                mask: Tensor | None = None) -> Tensor:
        """``W_o [g(W_s x_q) * H(x_c)]`` with ``x_c = x_q`` unless a context is given:
        (B, N, d) [, (B, M, d)] -> (B, N, d)."""
        self._check_tokens(x, "input" if context is None else "query input", (3,))
        self._check_length(x.shape[1])
        if context is None:
            context = x
        else:
            self._check_tokens(context, "context input", (3,))
            if context.shape[0] != x.shape[0]:
                raise ShapeError(f"PoM context must have the queries' batch size B="
                                 f"{x.shape[0]}: expected ({x.shape[0]}, M, {self.dim}), got "
                                 f"{tuple(context.shape)}")
        if mask is not None:
            self._check_call_mask(mask, x.shape[0], x.shape[1], context.shape[1])
        elif self._mask_kind != "global" and context.shape[1] != x.shape[1]:
            raise ShapeError(f"a PoM built with mask={self._mask_kind!r} mixes a context as long "
                             f"as the queries: expected ({x.shape[0]}, {x.shape[1]}, {self.dim}), "
                             f"got {tuple(context.shape)}")
        h = self.shared_state(context, mask)
        return self.proj_o(self.selection(x) * h)

    # --- recurrent inference ---------------------------------------------------------------

    def init_state(self, batch: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> PoMState:
        """Empty recurrent state for ``batch`` sequences (causal or block-causal masks only)."""
        self._check_recurrent()
        ref = self.proj_o.weight
        total = torch.zeros(batch, self.state_dim, device=device or ref.device,
                            dtype=dtype or ref.dtype)
        return PoMState(total, 0)

    def _check_recurrent(self) -> None:
        if self._mask_kind not in ("causal", "block_causal"):
            raise ConfigError(f"recurrent step needs mask='causal' or 'block_causal', this PoM "
                              f"has mask={self._mask_kind!r}")

    def step(self, state: PoMState, x: Tensor) -> tuple[Tensor, PoMState]:
        """Consume the next token(s) with O(1) work per token and return their outputs.

        ``x`` is one token (B, d) or a chunk (B, T, d); with ``mask="block_causal"`` a chunk must
        hold whole blocks (T a multiple of block_size, and one token at a time is refused).
        Returns ``(y, new_state)`` with y shaped like x; feeding a sequence token by token (or chunk
        by chunk) gives exactly ``forward`` of the whole sequence.
        """
        self._check_recurrent()
        self._check_tokens(x, "step input", (2, 3))
        single = x.dim() == 2
        chunk = x.unsqueeze(1) if single else x
        if state.total.shape != (chunk.shape[0], self.state_dim):
            raise ShapeError(f"state.total must have shape ({chunk.shape[0]}, {self.state_dim}), "
                             f"got {tuple(state.total.shape)}")
        if self._mask_kind == "block_causal" and chunk.shape[1] % self.block_size:
            raise ShapeError(f"block-causal step needs chunks of whole blocks (a multiple of "
                             f"block_size={self.block_size} tokens), got {chunk.shape[1]}")
        summed = self._prefix_state(self.features(chunk), state.total)
        last = summed[:, -1] if chunk.shape[1] else state.total  # an empty chunk changes nothing
        new_state = PoMState(last, state.count + chunk.shape[1])
        h = summed * self._inv_counts(state.count, chunk.shape[1], summed) \
            if self.aggregation == "mean" else summed
        y = self.proj_o(self.selection(chunk) * h)
        return (y.squeeze(1) if single else y), new_state


def _split_sizes(dim: int, ways: int) -> tuple[int, ...]:
    """``ways`` contiguous group widths summing to dim, the first ``dim % ways`` one wider."""
    base, extra = divmod(dim, ways)
    return tuple(base + (i < extra) for i in range(ways))


class SplitPoM(nn.Module):
    """Frequency-split PoM (pom-speech-encoders, Section 3.2): ``[PoM'(X') | PoM''(X'') | ...]``.

    The features are split into ``ways`` contiguous groups ``X = [X' | X'' | ...]`` (widths
    differing by at most one) and each group has its own PoM: its own projections, its own
    state ``H(X')`` and its own selection, so features of different groups never mix here (they
    do through the block's shortcut and feed-forward). The paper's 2-way and 3-way splits are
    ``ways=2`` and ``ways=3``. A polynomial of the same degree as one of its PoMs.

    Args:
        dim: token width d (at least ``ways``).
        ways: number of feature groups (default 2).
        **pom_kwargs: passed to every group's :class:`PoM` (degree, expand, activation, gate,
            mask, block_size, aggregation, form, selective, bias).

    Call: ``split(x)`` or ``split(x_q, x_c, mask=None)`` as :meth:`PoM.forward`, group by group.
    Shapes: x (B, N, d) [, x_c (B, M, d)] -> (B, N, d).
    """

    def __init__(self, dim: int, *, ways: int = 2, **pom_kwargs) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("ways", ways)):
            check_int(value, f"SplitPoM {name}")
        if ways > dim:
            raise ConfigError(f"SplitPoM needs at least one feature per group: ways={ways} > "
                              f"dim={dim}")
        self.dim, self.ways = dim, ways
        self.sizes = _split_sizes(dim, ways)
        self.groups = nn.ModuleList(PoM(size, **pom_kwargs) for size in self.sizes)

    @property
    def is_polynomial(self) -> bool:
        """True when every group's PoM is a polynomial."""
        return all(g.is_polynomial for g in self.groups)

    @property
    def polynomial_degree(self) -> int | None:
        """The groups' common degree in X, or None when not a polynomial."""
        return self.groups[0].polynomial_degree

    def extra_repr(self) -> str:
        return f"dim={self.dim}, ways={self.ways}, sizes={self.sizes}"

    def forward(self, x: Tensor, context: Tensor | None = None, *,
                mask: Tensor | None = None) -> Tensor:
        """Each group of features through its own PoM, outputs concatenated."""
        for name, t in (("input", x), ("context input", context)):
            if t is not None and (t.dim() != 3 or t.shape[-1] != self.dim):
                raise ShapeError(f"SplitPoM {name} must have shape (B, N, dim) with "
                                 f"dim={self.dim}, got {tuple(t.shape)}")
        xs = x.split(self.sizes, dim=-1)
        cs = context.split(self.sizes, dim=-1) if context is not None else (None,) * self.ways
        return torch.cat([pom(xg, cg, mask=mask) for pom, xg, cg in zip(self.groups, xs, cs)],
                         dim=-1)
