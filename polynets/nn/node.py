"""Poly-NODE: a polynomial neural ODE vector field built from Mu-Layers, and its training.

:class:`ODEFlow` maps an input through the time-``t1`` flow of a vector field, with optional
augmentation (Dupont et al., augmented neural ODEs), and :class:`PolyANODE` is that flow with a
Poly-NODE field (MONet, Appendix G): with a fixed-step solver its output is a polynomial of the
input. :func:`annulus_data` generates Appendix G's inner-disk / annulus task and
:func:`train_flow` fits a flow to it.

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

from polynets.errors import (ConfigError, DataError, ShapeError, TrainingDivergedError,
                             check_int)
from polynets.nn.layers import MuLayer
from polynets._threads import torch_threads

__all__ = ["PolyNODE", "ODEFlow", "PolyANODE", "NODEHistory", "odeint_safe", "train_node",
           "annulus_data", "train_flow"]



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
        self.dim = check_int(dim, "PolyNODE dim")
        self.hidden = check_int(hidden, "PolyNODE hidden")
        if degree is not None:
            depth = max(1, math.ceil(math.log2(check_int(degree, "PolyNODE degree"))))
        self.depth = check_int(depth, "PolyNODE depth")
        self.width = check_int(width if width is not None else hidden, "PolyNODE width")
        self.rank = check_int(rank if rank is not None else hidden, "PolyNODE rank")
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


class ODEFlow(nn.Module):
    """Neural ODE map: ``y = W z(t1) + b``, ``dz/dt = f(t, z)``, ``z(0) = [x, 0_augment]``.

    With ``augment = 0`` this is a neural ODE flow (NODE); with ``augment > 0`` the state is
    lifted with zeros before integration (ANODE, Dupont et al. 2019), which lets the flow move
    points around each other. The readout ``W`` is linear.

    Args:
        field: the vector field, called as ``field(t, z)`` with ``z`` ``(B, in_features +
            augment)``; a :class:`PolyNODE` (polynomial) or any module of that signature.
        in_features: width of ``x``.
        out_features: width of ``y`` (default 1).
        augment: number of zero dimensions appended to ``x`` (default 0).
        t1: integration time (default 1.0).
        method: ``"rk4"`` (default, classic Runge-Kutta), ``"midpoint"`` or ``"euler"``: fixed
            steps computed out of place in this module, so with a polynomial field the map is a
            polynomial and traces; any other name is an adaptive ``torchdiffeq.odeint`` method
            (e.g. ``"dopri5"``). ``steps``: fixed steps over ``[0, t1]`` (default 10).

    Shapes: ``(B, in_features) -> (B, out_features)``.
    """

    def __init__(self, field: nn.Module, in_features: int, out_features: int = 1, *,
                 augment: int = 0, t1: float = 1.0, method: str = "rk4",
                 steps: int = 10) -> None:
        super().__init__()
        self.in_features = check_int(in_features, "ODEFlow in_features")
        self.out_features = check_int(out_features, "ODEFlow out_features")
        if isinstance(augment, bool) or not isinstance(augment, int) or augment < 0:
            raise ConfigError(f"ODEFlow augment must be a non-negative int, got {augment!r}")
        if not isinstance(t1, (int, float)) or not t1 > 0:
            raise ConfigError(f"ODEFlow t1 must be a positive number, got {t1!r}")
        self.augment, self.t1, self.method = augment, float(t1), method
        self.steps = check_int(steps, "ODEFlow steps")
        width = getattr(field, "dim", None)
        if width is not None and width != in_features + augment:
            raise ConfigError(f"ODEFlow field has dim={width}; expected in_features + augment "
                              f"= {in_features + augment}")
        self.field = field
        self.readout = nn.Linear(in_features + augment, out_features)

    @property
    def state_dim(self) -> int:
        """Width of the integrated state: ``in_features + augment``."""
        return self.in_features + self.augment

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"augment={self.augment}, t1={self.t1}, method={self.method!r}, "
                f"steps={self.steps}")

    def flow(self, x: Tensor) -> Tensor:
        """The lifted state at ``t1``: ``(B, in_features) -> (B, in_features + augment)``."""
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ShapeError(f"ODEFlow expected x of shape (B, {self.in_features}), got "
                             f"{tuple(x.shape)}")
        z = torch.cat([x, x.new_zeros(x.shape[0], self.augment)], dim=1) if self.augment else x
        if self.method not in _FIXED_STEPS:
            from torchdiffeq import odeint

            t = torch.tensor([0.0, self.t1], dtype=x.dtype, device=x.device)
            return odeint(self.field, z, t, method=self.method)[-1]
        h = self.t1 / self.steps
        for k in range(self.steps):
            z = _FIXED_STEPS[self.method](self.field, k * h, z, h)
        return z

    def forward(self, x: Tensor) -> Tensor:
        return self.readout(self.flow(x))


def _euler_step(f: nn.Module, t: float, z: Tensor, h: float) -> Tensor:
    return z + h * f(t, z)


def _midpoint_step(f: nn.Module, t: float, z: Tensor, h: float) -> Tensor:
    return z + h * f(t + h / 2, z + (h / 2) * f(t, z))


def _rk4_step(f: nn.Module, t: float, z: Tensor, h: float) -> Tensor:
    """Classic fourth-order Runge-Kutta step, written out of place (the tracer lowers it)."""
    k1 = f(t, z)
    k2 = f(t + h / 2, z + (h / 2) * k1)
    k3 = f(t + h / 2, z + (h / 2) * k2)
    k4 = f(t + h, z + h * k3)
    return z + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4)


# Fixed-step methods run here, out of place; other names go to torchdiffeq.odeint (adaptive).
_FIXED_STEPS = {"euler": _euler_step, "midpoint": _midpoint_step, "rk4": _rk4_step}


class PolyANODE(ODEFlow):
    """Poly-ANODE (MONet, Appendix G): an :class:`ODEFlow` whose field is a :class:`PolyNODE`.

    ``y = W z(t1) + b``, ``dz/dt = f(z)`` with ``f`` a stack of Mu-Layers of degree
    ``2**depth``, ``z(0) = [x, 0_augment]``. ``augment=0`` gives the Poly-NODE flow. With a
    fixed-step solver (``"rk4"``, the default) the whole map is a polynomial of ``x``: each RK4
    step composes ``f`` four times, so ``steps`` steps give degree ``(2**depth)**(4 * steps)``.

    Args:
        in_features, out_features, augment, t1, method, steps: as :class:`ODEFlow` (``augment``
            defaults to 1 here).
        hidden, depth, degree, width, rank, init_scale: passed to :class:`PolyNODE` (depth 1:
            the minimal degree-2 field of Appendix G).

    Shapes: ``(B, in_features) -> (B, out_features)``.
    """

    def __init__(self, in_features: int, out_features: int = 1, *, augment: int = 1,
                 hidden: int = 32, depth: int = 1, degree: int | None = None,
                 width: int | None = None, rank: int | None = None, init_scale: float = 0.1,
                 t1: float = 1.0, method: str = "rk4", steps: int = 10) -> None:
        in_features = check_int(in_features, "PolyANODE in_features")
        if isinstance(augment, bool) or not isinstance(augment, int) or augment < 0:
            raise ConfigError(f"PolyANODE augment must be a non-negative int, got {augment!r}")
        field = PolyNODE(in_features + augment, hidden=hidden, depth=depth, degree=degree,
                         width=width, rank=rank, init_scale=init_scale)
        super().__init__(field, in_features, out_features, augment=augment, t1=t1,
                         method=method, steps=steps)


def annulus_data(n: int, *, dim: int = 2, r1: float = 0.5, r2: float = 1.0, r3: float = 1.5,
                 seed: int = 0) -> tuple[Tensor, Tensor]:
    """Inner-disk / annulus points (Dupont et al.; MONet Appendix G): ``g(x) = -1`` for
    ``|x| <= r1``, ``g(x) = +1`` for ``r2 <= |x| <= r3``.

    Half the ``n`` points (rounded down) lie uniformly in the inner ball, the rest uniformly in
    the outer shell; no flow of ``R^dim`` that preserves the inside/outside order can separate
    them with a linear readout, an augmented one can. Returns ``x`` ``(n, dim)`` and ``y``
    ``(n, 1)`` (float32, shuffled).
    """
    n = check_int(n, "annulus_data n")
    dim = check_int(dim, "annulus_data dim")
    if not 0 < r1 < r2 < r3:
        raise ConfigError(f"annulus_data needs 0 < r1 < r2 < r3, got r1={r1}, r2={r2}, r3={r3}")
    rng = np.random.default_rng(seed)
    inner = n // 2
    direction = rng.normal(size=(n, dim))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    u = rng.uniform(size=n)
    # Uniform in volume: radius**dim uniform between the bounds' powers.
    lo = np.where(np.arange(n) < inner, 0.0, r2 ** dim)
    hi = np.where(np.arange(n) < inner, r1 ** dim, r3 ** dim)
    radius = (lo + u * (hi - lo)) ** (1.0 / dim)
    labels = np.where(np.arange(n) < inner, -1.0, 1.0)
    order = rng.permutation(n)
    x = (direction * radius[:, None])[order]
    return (torch.from_numpy(x.astype(np.float32)),
            torch.from_numpy(labels[order, None].astype(np.float32)))


def train_flow(model: nn.Module, x: Tensor, y: Tensor, *, epochs: int = 10,
               batch_size: int = 64, lr: float = 1e-3, clip_grad: float | None = 1.0,
               seed: int = 0) -> list[float]:
    """Fit ``model`` (e.g. an :class:`ODEFlow`) to ``(x, y)`` by mean squared error with Adam,
    gradients clipped to norm ``clip_grad`` (None: no clipping; a polynomial field's gradients
    grow fast away from the data).

    Returns the mean training loss of each epoch (the curves of MONet's Fig. 10-11).
    """
    epochs = check_int(epochs, "train_flow epochs")
    batch_size = check_int(batch_size, "train_flow batch_size")
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise DataError(f"train_flow expects x (n, d) and y (n, k) with the same n >= 1, got "
                        f"{tuple(x.shape)} and {tuple(y.shape)}")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(x.shape[0], generator=gen)
        total = 0.0
        for k in range(0, x.shape[0], batch_size):
            idx = perm[k:k + batch_size]
            loss = ((model(x[idx]) - y[idx]) ** 2).mean()
            if not torch.isfinite(loss):
                raise TrainingDivergedError("train_flow: non-finite loss; lower lr or the "
                                            "field's init_scale")
            opt.zero_grad()
            loss.backward()
            if clip_grad is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
            opt.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / x.shape[0])
    return losses


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
    with torch_threads(None if num_threads is None else int(num_threads)):
        return _train(model, t, X, steps=steps, window=window, batch_size=batch_size, lr=lr,
                      method=method, rtol=rtol, atol=atol, adjoint=adjoint, min_step=min_step,
                      clip_grad=clip_grad, seed=seed, progress=progress)


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
