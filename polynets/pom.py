"""Polynomial Mixer (PoM): a linear-time token mixer built from sums and products.

``PoM(X) = W_o [ g(W_s X) * H(X) ]`` with the shared state ``H(X) = [sum_p a_p * h(W_h X)^p] M^T``
aggregated over tokens (``M`` is all ones without a mask, lower triangular for a causal mask).
With ``activation="linear"`` (h = identity) and a polynomial gate (``"linear"`` or ``"poly<g>"``)
the module is a polynomial of its input of degree ``degree + gate degree``; ``activation="gelu"``
with ``gate="sigmoid"`` is the original formulation.

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

from polynets.errors import ConfigError, ShapeError

__all__ = ["PoM", "PoMState", "causal_mask", "block_causal_mask"]

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
_FORMS = ("powers", "products")
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
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


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
        form: ``"powers"`` (``sum_p a_p h(W_h x)^p``, state width D) or ``"products"`` (the
            follow-up papers' ``[h(W_1 x); h(W_1 x) h(W_2 x); ...; prod_m h(W_m x)]``, width kD).
        bias: whether the projections have biases.

    Shapes: x (B, N, d) -> (B, N, d).
    """

    def __init__(self, dim: int, *, degree: int = 2, expand: float = 2, activation: str = "linear",
                 gate: str = "linear", mask: str | Tensor | None = None,
                 block_size: int | None = None, aggregation: str = "mean", form: str = "powers",
                 bias: bool = True) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("degree", degree)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
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
        gate_degree = _parse_gate(gate)

        self.dim, self.degree, self.expand = dim, degree, expand
        self.activation, self.gate = activation, gate
        self.aggregation, self.form = aggregation, form
        self.hidden = int(round(expand * dim))
        self.state_dim = self.hidden * (degree if form == "products" else 1)
        self._mask_kind, self.block_size = self._configure_mask(mask, block_size)

        self.proj_h = nn.Linear(dim, self.hidden * (degree if form == "products" else 1), bias=bias)
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
                f"aggregation={self.aggregation!r}, form={self.form!r}")

    # --- building blocks -------------------------------------------------------------------

    def _check_tokens(self, x: Tensor, what: str, ranks: tuple[int, ...]) -> None:
        if x.dim() not in ranks or x.shape[-1] != self.dim:
            expected = " or ".join({2: "(B, dim)", 3: "(B, N, dim)"}[r] for r in ranks)
            raise ShapeError(f"PoM {what} must have shape {expected} with dim={self.dim}, "
                             f"got {tuple(x.shape)}")

    def features(self, x: Tensor) -> Tensor:
        """Per-token state contributions ``sum_p a_p h(W_h x)^p``: (..., d) -> (..., S)."""
        z = self.proj_h(x)
        act = _ACTIVATIONS[self.activation]
        if act is not None:
            z = act(z)
        if self.form == "powers":
            return _power_series(self.alpha, z)
        parts = list(z.chunk(self.degree, dim=-1))
        for m in range(1, self.degree):
            parts[m] = parts[m] * parts[m - 1]
        return torch.cat(parts, dim=-1)

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
        """Per-(length, dtype, device) cache of the constant mask matrix and reciprocal counts."""
        key = (name, length, like.dtype, like.device)
        if key not in self._constants:
            if name == "mask":
                self._constants[key] = _constant(self.mask_bool.cpu().numpy(), like)
            else:
                self._constants[key] = self._inv_counts(0, length, like)
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

    def shared_state(self, x: Tensor) -> Tensor:
        """The shared state H(X): (B, N, d) -> (B, 1, S) without a mask, else (B, N, S)."""
        self._check_tokens(x, "input", (3,))
        n = x.shape[1]
        self._check_length(n)
        feats = self.features(x)
        mean = self.aggregation == "mean"
        if self._mask_kind == "global":
            return feats.mean(dim=1, keepdim=True) if mean else feats.sum(dim=1, keepdim=True)
        if self._mask_kind == "tensor":
            summed = torch.matmul(self._cached("mask", n, feats), feats)
        else:
            summed = self._prefix_state(feats, None)
        return summed * self._cached("inv_counts", n, summed) if mean else summed

    def _check_length(self, n: int) -> None:
        if n == 0:
            raise ShapeError("PoM input has no tokens (N = 0)")
        if self._mask_kind == "tensor" and n != self.mask_bool.shape[0]:
            raise ShapeError(f"mask has shape {tuple(self.mask_bool.shape)} but the input has "
                             f"N={n} tokens; expected N={self.mask_bool.shape[0]}")
        if self._mask_kind == "block_causal" and n % self.block_size:
            raise ShapeError(f"block-causal PoM needs N to be a multiple of "
                             f"block_size={self.block_size}, got N={n}")

    def forward(self, x: Tensor) -> Tensor:
        """``W_o [ g(W_s x) * H(x) ]``: (B, N, d) -> (B, N, d)."""
        h = self.shared_state(x)
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
