"""Polymorpher: transformer-like blocks with the Polynomial Mixer in place of attention.

``P(X) = X + PoM(X) + FF(X + PoM(X))``. With the linear PoM (``activation="linear"``, polynomial
gate), a Mu-Layer feed-forward (``ff="mu"``) and ``norm="none"`` or ``"batch"`` (an affine map at
inference) a whole stack is a polynomial of its input.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from polynets.errors import ConfigError, ShapeError, check_int
from polynets.nn.layers import MuLayer, make_norm
from polynets.nn.models.head import ClassifierHead
from polynets.nn.pom import PoM, PoMState

__all__ = ["Polymorpher", "PolymorpherClassifier"]

_FFS = ("mu", "mlp")
_MIXERS = ("pom", "token")
_POOLS = ("mean", "sum")


def _feed_forward(kind: str, dim: int, hidden: int, rank: int | None, bias: bool) -> nn.Module:
    """Token-wise two-layer feed-forward: a Mu-Layer (polynomial) or Linear-GELU-Linear."""
    if kind == "mu":
        return MuLayer(dim, dim, hidden=hidden, rank=rank, bias=bias)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(dim, hidden, bias=bias), nn.GELU(),
                             nn.Linear(hidden, dim, bias=bias))
    raise ConfigError(f"unknown ff {kind!r}; expected one of {list(_FFS)}")


def _matched_hidden(dim: int, weights: int) -> int:
    """Smallest Mu-Layer hidden width m whose weights (A, D, B, C; rank m // 4) reach weights."""
    m = 1
    while 2 * dim * m + (dim + m) * max(1, m // 4) < weights:
        m += 1
    return m


class Polymorpher(nn.Module):
    """Polymorpher block: ``Y = X + PoM(N_1 X)``, ``P(X) = Y + FF(N_2 Y)``.

    With ``norm="none"`` this is exactly ``P(X) = X + PoM(X) + FF(X + PoM(X))``. ``norm="batch"``
    (BatchNorm over channels, an affine map at inference) keeps the block polynomial;
    ``norm="layer"`` is for comparison only.

    Args:
        dim: token width d.
        degree, expand, activation, gate, mask, block_size, aggregation, form: passed to
            :class:`polynets.nn.pom.PoM`.
        ff: ``"mu"`` (Mu-Layer ``C[(AX) * (BDX) + AX]``, polynomial) or ``"mlp"`` (GELU MLP).
        mlp_ratio: hidden width of the feed-forward, as a multiple of d.
        rank: rank of the Mu-Layer's ``BD`` branch (default hidden // 4).
        norm: ``"none"``, ``"batch"`` or ``"layer"``.
        mixer: ``"pom"``, ``"token"`` to replace the mixer by a token-wise Mu-Layer of about
            the same size (a baseline that never mixes tokens), or a callable ``dim -> module``
            building any token mixer ``(B, N, dim) -> (B, N, dim)`` (e.g. a 1-D
            :class:`~polynets.nn.padre.PADRe`); the PoM arguments are then unused.

    Shapes: x (B, N, d) -> (B, N, d).
    """

    def __init__(self, dim: int, *, degree: int = 2, expand: float = 2,
                 activation: str = "linear", gate: str = "linear",
                 mask: str | Tensor | None = None, block_size: int | None = None,
                 aggregation: str = "mean", form: str = "powers", ff: str = "mu",
                 mlp_ratio: float = 2, rank: int | None = None, norm: str = "none",
                 mixer: str | Callable[[int], nn.Module] = "pom", bias: bool = True) -> None:
        super().__init__()
        if not callable(mixer) and mixer not in _MIXERS:
            raise ConfigError(f"unknown mixer {mixer!r}; expected one of {list(_MIXERS)} or a "
                              f"callable dim -> module")
        if not isinstance(mlp_ratio, (int, float)) or mlp_ratio <= 0:
            raise ConfigError(f"mlp_ratio must be a positive number, got {mlp_ratio!r}")
        self.dim = dim
        self.norm1 = make_norm(norm, dim)
        if callable(mixer):
            built = mixer(dim)
            if not isinstance(built, nn.Module):
                raise ConfigError(f"mixer callable must return an nn.Module, got "
                                  f"{type(built).__name__}")
            self.mixer: nn.Module = built
        elif mixer == "pom":
            self.mixer = PoM(dim, degree=degree, expand=expand, activation=activation,
                             gate=gate, mask=mask, block_size=block_size,
                             aggregation=aggregation, form=form, bias=bias)
        else:
            state = int(round(expand * dim)) * (degree if form == "products" else 1)
            self.mixer = MuLayer(dim, dim, hidden=_matched_hidden(dim, 3 * dim * state), bias=bias)
        self.norm2 = make_norm(norm, dim)
        self.ff = _feed_forward(ff, dim, max(1, int(round(mlp_ratio * dim))), rank, bias)

    def forward(self, x: Tensor) -> Tensor:
        """``Y = X + PoM(N_1 X)``, ``Y + FF(N_2 Y)``: (B, N, d) -> (B, N, d)."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ShapeError(f"Polymorpher input must have shape (B, N, {self.dim}), "
                             f"got {tuple(x.shape)}")
        y = x + self.mixer(self.norm1(x))
        return y + self.ff(self.norm2(y))

    def init_state(self, batch: int, **kwargs) -> PoMState:
        """Empty recurrent state of the block's (causal or block-causal) PoM."""
        if not isinstance(self.mixer, PoM):
            raise ConfigError("a token-wise Polymorpher has no recurrent state")
        return self.mixer.init_state(batch, **kwargs)

    def step(self, state: PoMState, x: Tensor) -> tuple[Tensor, PoMState]:
        """Next token(s) (B, d) or (B, T, d) through the block with O(1) work per token.

        Exact for causal masks in eval mode (norms and feed-forward act token by token).
        """
        if not isinstance(self.mixer, PoM):
            raise ConfigError("a token-wise Polymorpher has no recurrent state")
        mixed, state = self.mixer.step(state, self.norm1(x))
        y = x + mixed
        return y + self.ff(self.norm2(y)), state


class PolymorpherClassifier(ClassifierHead, nn.Module):
    """Sequence classifier: tokens -> linear embedding + learned positions -> Polymorphers ->
    norm -> mean pool -> linear head.

    ``logits = W_c mean_t N(P_L(...P_1(E x_t + p_t)))``. Input (B, seq_len, in_features), output
    (B, num_classes). Keyword arguments not listed are passed to every :class:`Polymorpher`.

    Args:
        seq_len: N, the number of tokens (positions are learned, one vector per token).
        in_features: width of each input token.
        num_classes: classes of the head (0 gives no head: ``forward`` returns pooled features).
        dim: token width inside the blocks.
        depth: number of Polymorpher blocks.
        norm: norm in the blocks and before pooling (``"batch"`` default, polynomial at inference).
        global_pool: ``"mean"`` or ``"sum"`` over tokens.
    """

    def __init__(self, seq_len: int, in_features: int, num_classes: int, dim: int = 64,
                 depth: int = 2, *, norm: str = "batch", global_pool: str = "mean",
                 drop_rate: float = 0.0, **block_kwargs) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("in_features", in_features), ("dim", dim),
                            ("depth", depth)):
            check_int(value, name)
        check_int(num_classes, "num_classes", minimum=0)
        self.seq_len, self.in_features, self.num_classes, self.dim = (
            seq_len, in_features, num_classes, dim)
        self.num_features = dim
        self.global_pool = self._check_pool(global_pool)
        self.embed = nn.Linear(in_features, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, seq_len, dim))
        self.blocks = nn.Sequential(*[Polymorpher(dim, norm=norm, **block_kwargs)
                                      for _ in range(depth)])
        self.norm = make_norm(norm, dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    @staticmethod
    def _check_pool(global_pool: str) -> str:
        if global_pool not in _POOLS:
            raise ConfigError(f"unknown global_pool {global_pool!r}; expected one of "
                              f"{list(_POOLS)}")
        return global_pool

    def forward_features(self, x: Tensor) -> Tensor:
        """Token features before pooling: (B, seq_len, in_features) -> (B, seq_len, dim)."""
        if x.dim() != 3 or x.shape[1:] != (self.seq_len, self.in_features):
            raise ShapeError(f"PolymorpherClassifier input must have shape (B, {self.seq_len}, "
                             f"{self.in_features}), got {tuple(x.shape)}")
        return self.norm(self.blocks(self.embed(x) + self.pos_embed))

    def pool(self, x: Tensor) -> Tensor:
        """Tokens (B, N, dim) to (B, dim): their mean, or sum with ``global_pool="sum"``."""
        return x.mean(dim=1) if self.global_pool == "mean" else x.sum(dim=1)
