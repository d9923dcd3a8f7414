"""Poly-NODE: a polynomial neural ODE vector field built from Mu-Layers, and its training.

``PolyNODE`` is ``f(t, x)`` for ``dx/dt = f(t, x)``: a stack of Mu-Layers
(``Y = C[(AX) * (BDX) + AX]``), so ``f`` is a polynomial of degree ``2**depth`` in ``x`` (and
``t`` with ``time_input=True``). :func:`train_node` fits it to sampled trajectories by
integrating through :func:`torchdiffeq.odeint` over short windows (multiple shooting: every
window starts from the observed state), which keeps chaotic systems trainable. Integration
failures ("underflow in dt", too many steps, non-finite states) fall back to a fixed-step RK4
with a floor step size, so training never dies on a stiff batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from polynets.errors import ConfigError, DataError, ShapeError, TrainingDivergedError
from polynets.layers import MuLayer

__all__ = ["PolyNODE", "NODEHistory", "odeint_safe", "train_node"]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


class PolyNODE(nn.Module):
    """Polynomial vector field ``dx/dt = f(t, x)``, ``f = Mu_depth o ... o Mu_1``.

    Each Mu-Layer is ``Y = C[(AX) * (BDX) + AX]`` (degree 2), so ``f`` has degree ``2**depth``;
    ``degree=k`` instead picks the smallest depth with ``2**depth >= k``. Layer widths: ``dim (+1 with time_input) -> width -> ... -> width -> dim``, each Mu-Layer with
    hidden size ``hidden`` and rank ``rank`` (default ``hidden``). The last projection starts at
    ``init_scale`` times its default initialisation so the initial field is gentle.
    Shapes: ``t`` scalar or broadcastable to ``x[..., :1]``, ``x`` ``(..., dim) -> (..., dim)``.
    """

    def __init__(self, dim: int, *, hidden: int = 32, depth: int = 1, degree: int | None = None,
                 width: int | None = None, rank: int | None = None, time_input: bool = False,
                 bias: bool = True, init_scale: float = 0.1,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim = _positive_int(dim, "PolyNODE dim")
        self.hidden = _positive_int(hidden, "PolyNODE hidden")
        if degree is not None:
            depth = max(1, math.ceil(math.log2(_positive_int(degree, "PolyNODE degree"))))
        self.depth = _positive_int(depth, "PolyNODE depth")
        self.width = _positive_int(width if width is not None else hidden, "PolyNODE width")
        self.rank = _positive_int(rank if rank is not None else hidden, "PolyNODE rank")
        self.time_input = bool(time_input)
        sizes = [self.dim + int(self.time_input)] + [self.width] * (self.depth - 1) + [self.dim]
        self.layers = nn.ModuleList(
            MuLayer(sizes[i], sizes[i + 1], hidden=self.hidden, rank=self.rank, bias=bias)
            for i in range(self.depth))
        with torch.no_grad():
            last = self.layers[-1].C
            last.weight.mul_(init_scale)
            if last.bias is not None:
                last.bias.zero_()
        if dtype is not None:
            self.to(dtype)

    @property
    def degree(self) -> int:
        """Total degree of ``f`` in its inputs: ``2**depth``."""
        return 2 ** self.depth

    @property
    def in_features(self) -> int:
        """Width of the polynomial's input: ``dim``, plus one with ``time_input`` (t last)."""
        return self.dim + int(self.time_input)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden={self.hidden}, depth={self.depth}, "
                f"degree={self.degree}, time_input={self.time_input}")

    def field(self, z: Tensor) -> Tensor:
        """The polynomial itself: ``z`` ``(..., in_features)`` (``[x, t]``) -> ``(..., dim)``."""
        for layer in self.layers:
            z = layer(z)
        return z

    def forward(self, t: Tensor | float, x: Tensor) -> Tensor:
        if x.dim() < 1 or x.shape[-1] != self.dim:
            raise ShapeError(f"PolyNODE expected x of shape (..., {self.dim}), got "
                             f"{tuple(x.shape)}")
        if self.time_input:
            tt = torch.as_tensor(t, dtype=x.dtype, device=x.device)
            x = torch.cat([x, tt.expand(x.shape[:-1]).unsqueeze(-1)], dim=-1)
        return self.field(x)

    def as_polynomial(self) -> nn.Module:
        """A one-input module ``z -> f`` (``z = [x]`` or ``[x, t]``) that the tracer can lower."""
        return _FieldModule(self)


class _FieldModule(nn.Module):
    def __init__(self, node: PolyNODE) -> None:
        super().__init__()
        self.node = node

    def forward(self, z: Tensor) -> Tensor:
        return self.node.field(z)


def odeint_safe(func: nn.Module, y0: Tensor, t: Tensor, *, method: str = "dopri5",
                rtol: float = 1e-6, atol: float = 1e-8, adjoint: bool = False,
                min_step: float | None = None, max_num_steps: int = 10_000) -> Tensor:
    """``torchdiffeq.odeint`` that falls back to fixed-step RK4 when the adaptive solver fails.

    Failures are torchdiffeq's AssertionError/RuntimeError ("underflow in dt", too many steps)
    and non-finite solutions. The fallback step is ``min_step`` (default: a quarter of the
    smallest gap in ``t``). Returns ``(len(t), *y0.shape)``.
    """
    from torchdiffeq import odeint, odeint_adjoint

    solver = odeint_adjoint if adjoint else odeint
    if method not in ("rk4", "euler", "midpoint", "explicit_adams", "implicit_adams"):
        try:
            sol = solver(func, y0, t, rtol=rtol, atol=atol, method=method,
                         options={"max_num_steps": max_num_steps})
            if torch.isfinite(sol).all():
                return sol
        except (AssertionError, RuntimeError):
            pass
    step = min_step if min_step is not None else float(torch.diff(t).abs().min()) / 4.0
    return solver(func, y0, t, method="rk4", options={"step_size": step})


@dataclass
class NODEHistory:
    """Loss per step of :func:`train_node` and how often the fixed-step fallback was used."""

    loss: list[float] = field(default_factory=list)
    fallbacks: int = 0
    skipped: int = 0


def _windows(trajectories: Sequence[tuple[np.ndarray, np.ndarray]],
             window: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Groups of equal-grid windows: (relative times (T,), states (G, T, dim)) per group."""
    groups: dict[tuple, tuple[np.ndarray, list[np.ndarray]]] = {}
    for t, X in trajectories:
        n = len(t)
        size = min(window, n)
        for s in range(0, n - size + 1):
            rel = t[s:s + size] - t[s]
            key = (size,) + tuple(np.round(rel / rel[-1], 9)) + (round(float(rel[-1]), 12),)
            groups.setdefault(key, (rel, []))[1].append(X[s:s + size])
    return [(rel, np.stack(segs)) for rel, segs in groups.values()]


def train_node(model: PolyNODE, t: Any, X: Any, *, steps: int = 300, window: int = 8,
               batch_size: int = 64, lr: float = 1e-2, method: str = "dopri5",
               rtol: float = 1e-5, atol: float = 1e-7, adjoint: bool = False,
               min_step: float | None = None, clip_grad: float = 1.0, seed: int = 0,
               num_threads: int | None = 1, progress: bool = True) -> NODEHistory:
    """Fit ``model`` to trajectories by integrating it over short windows.

    ``t``: (n,) and ``X``: (n, dim), or lists of them for several trajectories. Each step
    integrates a random batch of windows of ``window`` consecutive samples from their observed
    first state (multiple shooting) and minimises the mean squared error, per variable scaled by
    the data's standard deviation, with Adam (cosine-decayed ``lr``). Runs in the model's dtype
    (use ``model.double()`` for float64). ``num_threads``: torch threads while training (small
    ODE batches run fastest on one; None keeps torch's setting). Returns the
    :class:`NODEHistory`.
    """
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(int(num_threads))
    try:
        return _train(model, t, X, steps=steps, window=window, batch_size=batch_size, lr=lr,
                      method=method, rtol=rtol, atol=atol, adjoint=adjoint, min_step=min_step,
                      clip_grad=clip_grad, seed=seed, progress=progress)
    finally:
        torch.set_num_threads(previous)


def _train(model: PolyNODE, t: Any, X: Any, *, steps: int, window: int, batch_size: int,
           lr: float, method: str, rtol: float, atol: float, adjoint: bool,
           min_step: float | None, clip_grad: float, seed: int, progress: bool) -> NODEHistory:
    if not isinstance(model, PolyNODE):
        raise ConfigError(f"train_node expects a PolyNODE, got {type(model).__name__}")
    pairs = list(zip(t, X)) if isinstance(t, (list, tuple)) else [(t, X)]
    trajectories = []
    for ti, Xi in pairs:
        ti = np.asarray(ti, dtype=np.float64)
        Xi = np.asarray(Xi, dtype=np.float64)
        if ti.ndim != 1 or Xi.ndim != 2 or Xi.shape != (len(ti), model.dim):
            raise DataError(f"expected t (n,) and X (n, {model.dim}), got {ti.shape} and "
                            f"{Xi.shape}")
        if not (np.isfinite(ti).all() and np.isfinite(Xi).all()) or np.any(np.diff(ti) <= 0):
            raise DataError("t and X must be finite and t must strictly increase")
        trajectories.append((ti, Xi))
    window = max(2, int(window))
    groups = _windows(trajectories, window)
    sizes = np.array([g[1].shape[0] for g in groups], dtype=np.float64)
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    scale = torch.as_tensor(np.concatenate([X for _, X in trajectories]).std(axis=0),
                            dtype=dtype, device=device).clamp_min(1e-12)
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: 0.5 * (1.0 + math.cos(math.pi * min(k, steps) / max(steps, 1))))
    history = NODEHistory()
    from tqdm.auto import tqdm

    bar = tqdm(range(steps), desc="Poly-NODE", disable=not progress, leave=False)
    for _ in bar:
        g = int(rng.choice(len(groups), p=sizes / sizes.sum()))
        rel, segs = groups[g]
        pick = rng.choice(segs.shape[0], size=min(batch_size, segs.shape[0]), replace=False)
        data = torch.as_tensor(segs[pick], dtype=dtype, device=device)      # (B, T, dim)
        tt = torch.as_tensor(rel, dtype=dtype, device=device)
        loss = None
        for fixed in (False, True):
            opt.zero_grad()
            try:
                pred = odeint_safe(model, data[:, 0], tt, method="rk4" if fixed else method,
                                   rtol=rtol, atol=atol, adjoint=adjoint, min_step=min_step)
                loss = (((pred.transpose(0, 1) - data) / scale) ** 2).mean()
                if not torch.isfinite(loss):
                    raise FloatingPointError("non-finite loss")
                loss.backward()
                break
            except (AssertionError, RuntimeError, FloatingPointError):
                loss = None
                history.fallbacks += int(not fixed)
        if loss is None:
            history.skipped += 1
            if history.skipped > max(10, steps // 4):
                raise TrainingDivergedError(
                    f"Poly-NODE training diverged: {history.skipped} batches gave non-finite "
                    f"trajectories even with fixed steps; lower lr or init_scale, or use shorter "
                    f"windows")
            continue
        nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        opt.step()
        sched.step()
        history.loss.append(float(loss.detach()))
        bar.set_postfix(loss=f"{history.loss[-1]:.3g}")
    return history
