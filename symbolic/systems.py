"""Benchmark dynamical systems with polynomial vector fields, integrated at tight tolerance.

Each :class:`System` knows its variables, its true equations (as ``{monomial: coefficient}`` per
state, the format of :meth:`symbolic.EquationDiscovery.coefficients`) and a default sampling.
:func:`generate` integrates it with SciPy's DOP853 (rtol 1e-10, atol 1e-12) and adds optional
Gaussian noise whose standard deviation is a fraction of each variable's standard deviation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from scipy.integrate import solve_ivp

from symbolic.errors import SymbolicDataError

__all__ = ["System", "Trajectory", "SYSTEMS", "generate", "lotka_volterra", "van_der_pol",
           "lorenz", "cubic_oscillator"]


@dataclass(frozen=True)
class System:
    """A polynomial ODE ``dx/dt = f(x)`` with its ground truth and default sampling."""

    name: str
    variables: tuple[str, ...]
    rhs: Callable[[np.ndarray], np.ndarray]
    truth: tuple[dict[str, float], ...]
    x0: tuple[float, ...]
    t_end: float
    n: int
    degree: int


@dataclass
class Trajectory:
    """Samples of one trajectory: ``t`` (n,), ``X`` (n, dim) with noise, ``clean`` without."""

    system: System
    t: np.ndarray
    X: np.ndarray
    clean: np.ndarray
    noise: float
    seed: int
    meta: dict = field(default_factory=dict)

    @property
    def truth(self) -> list[dict[str, float]]:
        return [dict(eq) for eq in self.system.truth]


def _lv(x: np.ndarray) -> np.ndarray:
    a, b, d, g = 1.56, 1.12, 3.10, 1.21
    return np.array([a * x[0] - b * x[0] * x[1], -d * x[1] + g * x[0] * x[1]])


def _vdp(x: np.ndarray) -> np.ndarray:
    return np.array([x[1], -x[0] + x[1] - x[0] ** 2 * x[1]])


def _lorenz(x: np.ndarray) -> np.ndarray:
    s, r, b = 10.0, 28.0, 8.0 / 3.0
    return np.array([s * (x[1] - x[0]), x[0] * (r - x[2]) - x[1], x[0] * x[1] - b * x[2]])


def _cubic(x: np.ndarray) -> np.ndarray:
    return np.array([-0.1 * x[0] ** 3 + 2.0 * x[1] ** 3, -2.0 * x[0] ** 3 - 0.1 * x[1] ** 3])


lotka_volterra = System(
    "lotka_volterra", ("x", "y"), _lv,
    ({"x": 1.56, "x*y": -1.12}, {"y": -3.10, "x*y": 1.21}), (1.0, 1.0), 10.0, 100, 2)
"""Lotka-Volterra, MONet's setup: alpha=1.56, beta=1.12, delta=3.10, gamma=1.21, 100 points on
[0, 10], x0 = (1, 1)."""

van_der_pol = System(
    "van_der_pol", ("x", "y"), _vdp,
    ({"y": 1.0}, {"x": -1.0, "y": 1.0, "x**2*y": -1.0}), (0.5, 0.0), 20.0, 400, 3)
"""Van der Pol with mu=1: dx/dt = y, dy/dt = mu (1 - x^2) y - x; 400 points on [0, 20]."""

lorenz = System(
    "lorenz", ("x", "y", "z"), _lorenz,
    ({"x": -10.0, "y": 10.0}, {"x": 28.0, "y": -1.0, "x*z": -1.0},
     {"x*y": 1.0, "z": -8.0 / 3.0}), (-8.0, 7.0, 27.0), 10.0, 1000, 2)
"""Lorenz with sigma=10, rho=28, beta=8/3; 1000 points on [0, 10]."""

cubic_oscillator = System(
    "cubic_oscillator", ("x", "y"), _cubic,
    ({"x**3": -0.1, "y**3": 2.0}, {"x**3": -2.0, "y**3": -0.1}), (2.0, 0.0), 25.0, 500, 3)
"""Damped cubic oscillator: dx/dt = -0.1 x^3 + 2 y^3, dy/dt = -2 x^3 - 0.1 y^3."""

SYSTEMS: dict[str, System] = {s.name: s for s in (lotka_volterra, van_der_pol, lorenz,
                                                   cubic_oscillator)}


def generate(system: System | str, *, n: int | None = None, t_end: float | None = None,
             x0: tuple[float, ...] | None = None, noise: float = 0.0,
             seed: int = 0) -> Trajectory:
    """Integrate ``system`` and sample it at ``n`` evenly spaced times on ``[0, t_end]``.

    ``noise`` is the noise standard deviation as a fraction of each variable's standard
    deviation along the clean trajectory (0.05 = 5 %); the noise is drawn from a generator seeded
    with ``seed``. Returns a :class:`Trajectory` with ``t`` (n,) and ``X`` (n, dim).
    """
    if isinstance(system, str):
        if system not in SYSTEMS:
            raise SymbolicDataError(f"unknown system {system!r}; expected one of "
                                    f"{sorted(SYSTEMS)}")
        system = SYSTEMS[system]
    n = system.n if n is None else int(n)
    t_end = system.t_end if t_end is None else float(t_end)
    start = np.asarray(system.x0 if x0 is None else x0, dtype=np.float64)
    if n < 2 or not t_end > 0:
        raise SymbolicDataError(f"need n >= 2 samples and t_end > 0, got n={n}, t_end={t_end}")
    if start.shape != (len(system.variables),):
        raise SymbolicDataError(f"x0 must have {len(system.variables)} entries, got "
                                f"{start.shape[0] if start.ndim else 0}")
    if not np.isfinite(noise) or noise < 0:
        raise SymbolicDataError(f"noise must be a non-negative fraction, got {noise!r}")
    t = np.linspace(0.0, t_end, n)
    sol = solve_ivp(lambda _t, x: system.rhs(x), (0.0, t_end), start, method="DOP853",
                    t_eval=t, rtol=1e-10, atol=1e-12)
    if not sol.success:
        raise SymbolicDataError(f"integration of {system.name} failed: {sol.message}")
    clean = sol.y.T.copy()
    rng = np.random.default_rng(seed)
    X = clean + noise * clean.std(axis=0) * rng.standard_normal(clean.shape)
    return Trajectory(system, t, X, clean, float(noise), int(seed))
