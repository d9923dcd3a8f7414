"""Benchmark dynamical systems with polynomial vector fields, integrated at tight tolerance.

Each :class:`System` knows its variables, its true equations (as ``{monomial: coefficient}`` per
state, the format of :meth:`symbolic.EquationDiscovery.coefficients`) and a default sampling.
:func:`generate` integrates it with SciPy's DOP853 (rtol 1e-13, atol 1e-15) and adds optional
Gaussian noise whose standard deviation is a fraction of each variable's standard deviation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from scipy.integrate import solve_ivp

from symbolic.errors import SymbolicDataError

__all__ = ["System", "Trajectory", "SYSTEMS", "PROJECT_SYSTEMS", "VALIDATION_SYSTEMS",
           "HELDOUT_SYSTEMS", "CHECK_SYSTEMS", "FRESH_SYSTEMS", "NOVEL_SYSTEMS", "EXTRA_SYSTEMS",
           "ALL_SYSTEMS",
           "generate", "score_terms",
           "lotka_volterra", "van_der_pol", "lorenz",
           "cubic_oscillator", "sir", "lotka_volterra_4", "brusselator", "fitzhugh_nagumo",
           "duffing", "rossler", "chen", "hopf", "lorenz_84", "halvorsen", "genesio_tesi",
           "rabinovich_fabrikant", "rucklidge", "arneodo", "nose_hoover", "lu", "liu", "seir",
           "selkov", "moore_spiegel", "rikitake", "cubic_3d", "sprott_b", "chua_cubic",
           "food_chain", "enzyme", "hindmarsh_rose"]


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


def _sir(x: np.ndarray) -> np.ndarray:
    beta, gamma = 3.0, 1.0
    return np.array([-beta * x[0] * x[1], beta * x[0] * x[1] - gamma * x[1], gamma * x[1]])


sir = System(
    "sir", ("S", "I", "R"), _sir,
    ({"I*S": -3.0}, {"I*S": 3.0, "I": -1.0}, {"I": 1.0}), (0.99, 0.01, 0.0), 10.0, 500, 2)
"""SIR epidemic (fractions of the population): beta=3, gamma=1; S + I + R = 1 is conserved, so
the library {1, S, I, R, ...} is collinear on the data. 500 points on [0, 10]."""

_LV4_R = (1.0, 0.72, 1.53, 1.27)
_LV4_A = ((1.0, 1.09, 1.52, 0.0), (0.0, 1.0, 0.44, 1.36), (2.33, 0.0, 1.0, 0.47),
          (1.21, 0.51, 0.35, 1.0))


def _lv4(x: np.ndarray) -> np.ndarray:
    r, a = np.array(_LV4_R), np.array(_LV4_A)
    return r * x * (1.0 - a @ x)


def _lv4_truth() -> tuple[dict[str, float], ...]:
    names = ("x1", "x2", "x3", "x4")
    out = []
    for i, (r, row) in enumerate(zip(_LV4_R, _LV4_A)):
        eq = {names[i]: r}
        for j, a in enumerate(row):
            if a:
                term = f"{names[i]}**2" if i == j else \
                    "*".join(sorted((names[i], names[j])))
                eq[term] = -r * a
        out.append(eq)
    return tuple(out)


lotka_volterra_4 = System(
    "lotka_volterra_4", ("x1", "x2", "x3", "x4"), _lv4, _lv4_truth(), (0.3, 0.2, 0.3, 0.2),
    50.0, 1000, 2)
"""Competitive 4-species Lotka-Volterra (Vano et al. 2006, chaotic): dx_i/dt = r_i x_i
(1 - sum_j a_ij x_j); 1000 points on [0, 50]."""


def _brusselator(x: np.ndarray) -> np.ndarray:
    a, b = 1.0, 3.0
    return np.array([a - (b + 1.0) * x[0] + x[0] ** 2 * x[1], b * x[0] - x[0] ** 2 * x[1]])


brusselator = System(
    "brusselator", ("x", "y"), _brusselator,
    ({"1": 1.0, "x": -4.0, "x**2*y": 1.0}, {"x": 3.0, "x**2*y": -1.0}), (1.0, 1.0), 20.0, 500,
    3)
"""Brusselator with a=1, b=3 (limit cycle); 500 points on [0, 20]."""


def _fhn(x: np.ndarray) -> np.ndarray:
    a, b, eps, current = 0.7, 0.8, 0.08, 0.5
    return np.array([x[0] - x[0] ** 3 / 3.0 - x[1] + current, eps * (x[0] + a - b * x[1])])


fitzhugh_nagumo = System(
    "fitzhugh_nagumo", ("v", "w"), _fhn,
    ({"1": 0.5, "v": 1.0, "w": -1.0, "v**3": -1.0 / 3.0},
     {"1": 0.056, "v": 0.08, "w": -0.064}), (-1.0, 1.0), 100.0, 1000, 3)
"""FitzHugh-Nagumo: dv/dt = v - v^3/3 - w + I, dw/dt = eps (v + a - b w) with a=0.7, b=0.8,
eps=0.08, I=0.5 (relaxation oscillations); 1000 points on [0, 100]."""


def _duffing(x: np.ndarray) -> np.ndarray:
    delta, alpha, beta = 0.1, -1.0, 1.0
    return np.array([x[1], -delta * x[1] - alpha * x[0] - beta * x[0] ** 3])


duffing = System(
    "duffing", ("x", "y"), _duffing,
    ({"y": 1.0}, {"x": 1.0, "y": -0.1, "x**3": -1.0}), (0.5, 1.2), 30.0, 600, 3)
"""Damped double-well Duffing oscillator: dx/dt = y, dy/dt = -0.1 y + x - x^3; 600 points on
[0, 30] from (0.5, 1.2)."""


def _rossler(x: np.ndarray) -> np.ndarray:
    a, b, c = 0.2, 0.2, 5.7
    return np.array([-x[1] - x[2], x[0] + a * x[1], b + x[2] * (x[0] - c)])


rossler = System(
    "rossler", ("x", "y", "z"), _rossler,
    ({"y": -1.0, "z": -1.0}, {"x": 1.0, "y": 0.2}, {"1": 0.2, "x*z": 1.0, "z": -5.7}),
    (1.0, 1.0, 0.0), 50.0, 1000, 2)
"""Rossler attractor a=b=0.2, c=5.7; 1000 points on [0, 50]."""


def _chen(x: np.ndarray) -> np.ndarray:
    a, b, c = 35.0, 3.0, 28.0
    return np.array([a * (x[1] - x[0]), (c - a) * x[0] - x[0] * x[2] + c * x[1],
                     x[0] * x[1] - b * x[2]])


chen = System(
    "chen", ("x", "y", "z"), _chen,
    ({"x": -35.0, "y": 35.0}, {"x": -7.0, "x*z": -1.0, "y": 28.0}, {"x*y": 1.0, "z": -3.0}),
    (-10.0, 0.0, 37.0), 5.0, 1000, 2)
"""Chen attractor a=35, b=3, c=28; 1000 points on [0, 5]."""


def _hopf(x: np.ndarray) -> np.ndarray:
    mu, omega = 0.5, 1.0
    r2 = x[0] ** 2 + x[1] ** 2
    return np.array([mu * x[0] - omega * x[1] - x[0] * r2, omega * x[0] + mu * x[1] - x[1] * r2])


hopf = System(
    "hopf", ("x", "y"), _hopf,
    ({"x": 0.5, "y": -1.0, "x**3": -1.0, "x*y**2": -1.0},
     {"x": 1.0, "y": 0.5, "x**2*y": -1.0, "y**3": -1.0}), (2.0, 0.0), 20.0, 500, 3)
"""Hopf normal form mu=0.5, omega=1 (limit cycle of radius sqrt(0.5)); 500 points on [0, 20]
from (2, 0)."""

PROJECT_SYSTEMS: tuple[str, ...] = ("lotka_volterra", "van_der_pol", "lorenz", "cubic_oscillator")
"""The systems the discovery defaults were developed on; the others are held out."""

SYSTEMS: dict[str, System] = {s.name: s for s in (
    lotka_volterra, van_der_pol, lorenz, cubic_oscillator, sir, lotka_volterra_4, brusselator,
    fitzhugh_nagumo, duffing, rossler, chen, hopf)}


def _lorenz_84(x: np.ndarray) -> np.ndarray:
    a, b, f, g = 0.25, 4.0, 8.0, 1.0
    return np.array([-x[1] ** 2 - x[2] ** 2 - a * x[0] + a * f,
                     x[0] * x[1] - b * x[0] * x[2] - x[1] + g,
                     b * x[0] * x[1] + x[0] * x[2] - x[2]])


lorenz_84 = System(
    "lorenz_84", ("x", "y", "z"), _lorenz_84,
    ({"1": 2.0, "x": -0.25, "y**2": -1.0, "z**2": -1.0},
     {"1": 1.0, "y": -1.0, "x*y": 1.0, "x*z": -4.0},
     {"z": -1.0, "x*y": 4.0, "x*z": 1.0}), (1.0, 0.0, -0.75), 40.0, 1000, 2)
"""Lorenz-84 atmospheric circulation model a=0.25, b=4, F=8, G=1 (chaotic); 1000 points on
[0, 40]."""


def _halvorsen(x: np.ndarray) -> np.ndarray:
    a, b = 1.4, 4.0
    return np.array([-a * x[0] - b * (x[1] + x[2]) - x[1] ** 2,
                     -a * x[1] - b * (x[2] + x[0]) - x[2] ** 2,
                     -a * x[2] - b * (x[0] + x[1]) - x[0] ** 2])


halvorsen = System(
    "halvorsen", ("x", "y", "z"), _halvorsen,
    ({"x": -1.4, "y": -4.0, "z": -4.0, "y**2": -1.0},
     {"x": -4.0, "y": -1.4, "z": -4.0, "z**2": -1.0},
     {"x": -4.0, "y": -4.0, "z": -1.4, "x**2": -1.0}), (-5.0, 0.0, 0.0), 20.0, 1000, 2)
"""Halvorsen's cyclically symmetric attractor a=1.4, b=4; 1000 points on [0, 20]."""


def _genesio_tesi(x: np.ndarray) -> np.ndarray:
    a, b, c = 0.44, 1.1, 1.0
    return np.array([x[1], x[2], -c * x[0] - b * x[1] - a * x[2] + x[0] ** 2])


genesio_tesi = System(
    "genesio_tesi", ("x", "y", "z"), _genesio_tesi,
    ({"y": 1.0}, {"z": 1.0}, {"x": -1.0, "y": -1.1, "z": -0.44, "x**2": 1.0}),
    (0.1, 0.1, 0.1), 100.0, 1000, 2)
"""Genesio-Tesi jerk system a=0.44, b=1.1, c=1 (chaotic); 1000 points on [0, 100]."""

VALIDATION_SYSTEMS: dict[str, System] = {s.name: s for s in (lorenz_84, halvorsen,
                                                             genesio_tesi)}
"""Systems kept out of the benchmark's default grid: a check of choices made on the others."""


# --------------------------------------------------------------------------- held-out family
# Eleven polynomial systems from the literature kept out of every choice made in the method:
# the discovery was neither developed nor tuned on them. Sample counts (500-2000), time steps
# and initial states vary.


def _rabinovich_fabrikant(x: np.ndarray) -> np.ndarray:
    alpha, gamma = 0.14, 0.10
    return np.array([x[1] * (x[2] - 1.0 + x[0] ** 2) + gamma * x[0],
                     x[0] * (3.0 * x[2] + 1.0 - x[0] ** 2) + gamma * x[1],
                     -2.0 * x[2] * (alpha + x[0] * x[1])])


rabinovich_fabrikant = System(
    "rabinovich_fabrikant", ("x", "y", "z"), _rabinovich_fabrikant,
    ({"x": 0.1, "y": -1.0, "y*z": 1.0, "x**2*y": 1.0},
     {"x": 1.0, "y": 0.1, "x*z": 3.0, "x**3": -1.0},
     {"z": -0.28, "x*y*z": -2.0}), (-1.0, 0.0, 0.5), 60.0, 1500, 3)
"""Rabinovich-Fabrikant alpha=0.14, gamma=0.1; 1500 points on [0, 60]."""


def _rucklidge(x: np.ndarray) -> np.ndarray:
    kappa, lam = 2.0, 6.7
    return np.array([-kappa * x[0] + lam * x[1] - x[1] * x[2], x[0], -x[2] + x[1] ** 2])


rucklidge = System(
    "rucklidge", ("x", "y", "z"), _rucklidge,
    ({"x": -2.0, "y": 6.7, "y*z": -1.0}, {"x": 1.0}, {"z": -1.0, "y**2": 1.0}),
    (1.0, 0.0, 4.5), 50.0, 1500, 2)
"""Rucklidge (double convection) kappa=2, lambda=6.7 (chaotic); 1500 points on [0, 50]."""


def _arneodo(x: np.ndarray) -> np.ndarray:
    return np.array([x[1], x[2], 5.5 * x[0] - 3.5 * x[1] - x[2] - x[0] ** 3])


arneodo = System(
    "arneodo", ("x", "y", "z"), _arneodo,
    ({"y": 1.0}, {"z": 1.0}, {"x": 5.5, "y": -3.5, "z": -1.0, "x**3": -1.0}),
    (0.2, 0.2, 0.2), 40.0, 1200, 3)
"""Arneodo-Coullet-Tresser jerk system with a cubic term (chaotic); 1200 points on [0, 40]."""


def _nose_hoover(x: np.ndarray) -> np.ndarray:
    return np.array([x[1], -x[0] + x[1] * x[2], 1.0 - x[1] ** 2])


nose_hoover = System(
    "nose_hoover", ("x", "y", "z"), _nose_hoover,
    ({"y": 1.0}, {"x": -1.0, "y*z": 1.0}, {"1": 1.0, "y**2": -1.0}), (0.0, 5.0, 0.0), 60.0,
    2000, 2)
"""Nose-Hoover thermostat (Sprott A, conservative, chaotic sea); 2000 points on [0, 60]."""


def _lu(x: np.ndarray) -> np.ndarray:
    a, b, c = 36.0, 3.0, 20.0
    return np.array([a * (x[1] - x[0]), -x[0] * x[2] + c * x[1], x[0] * x[1] - b * x[2]])


lu = System(
    "lu", ("x", "y", "z"), _lu,
    ({"x": -36.0, "y": 36.0}, {"y": 20.0, "x*z": -1.0}, {"x*y": 1.0, "z": -3.0}),
    (-3.0, 2.0, 20.0), 5.0, 800, 2)
"""Lu attractor a=36, b=3, c=20; 800 points on [0, 5] (dt 0.0063)."""


def _liu(x: np.ndarray) -> np.ndarray:
    return np.array([-x[0] - x[1] ** 2, 2.5 * x[1] - 4.0 * x[0] * x[2],
                     -5.0 * x[2] + 4.0 * x[0] * x[1]])


liu = System(
    "liu", ("x", "y", "z"), _liu,
    ({"x": -1.0, "y**2": -1.0}, {"y": 2.5, "x*z": -4.0}, {"z": -5.0, "x*y": 4.0}),
    (0.2, 0.0, 0.5), 25.0, 1000, 2)
"""Liu chaotic system a=1, b=2.5, c=5, e=1, k=4, m=4; 1000 points on [0, 25]."""


def _seir(x: np.ndarray) -> np.ndarray:
    mu, beta, sigma, gamma = 0.05, 1.5, 0.5, 0.25
    return np.array([mu - beta * x[0] * x[2] - mu * x[0], beta * x[0] * x[2] - (sigma + mu) * x[1],
                     sigma * x[1] - (gamma + mu) * x[2], gamma * x[2] - mu * x[3]])


seir = System(
    "seir", ("S", "E", "I", "R"), _seir,
    ({"1": 0.05, "S": -0.05, "I*S": -1.5}, {"I*S": 1.5, "E": -0.55}, {"E": 0.5, "I": -0.3},
     {"I": 0.25, "R": -0.05}), (0.98, 0.01, 0.01, 0.0), 50.0, 500, 2)
"""SEIR epidemic with births and deaths (fractions; S + E + I + R = 1 is conserved, so the
library is collinear on the data); 500 points on [0, 50]."""


def _selkov(x: np.ndarray) -> np.ndarray:
    a, b = 0.08, 0.6
    return np.array([-x[0] + a * x[1] + x[0] ** 2 * x[1], b - a * x[1] - x[0] ** 2 * x[1]])


selkov = System(
    "selkov", ("x", "y"), _selkov,
    ({"x": -1.0, "y": 0.08, "x**2*y": 1.0}, {"1": 0.6, "y": -0.08, "x**2*y": -1.0}),
    (0.5, 0.5), 60.0, 1000, 3)
"""Sel'kov glycolysis model a=0.08, b=0.6 (limit cycle); 1000 points on [0, 60]."""


def _moore_spiegel(x: np.ndarray) -> np.ndarray:
    T, R = 6.0, 20.0
    return np.array([x[1], x[2], -x[2] - (T - R + R * x[0] ** 2) * x[1] - T * x[0]])


moore_spiegel = System(
    "moore_spiegel", ("x", "y", "z"), _moore_spiegel,
    ({"y": 1.0}, {"z": 1.0}, {"x": -6.0, "y": 14.0, "z": -1.0, "x**2*y": -20.0}),
    (0.1, 0.0, 0.0), 50.0, 2000, 3)
"""Moore-Spiegel thermo-mechanical oscillator T=6, R=20 (chaotic); 2000 points on [0, 50]."""


def _rikitake(x: np.ndarray) -> np.ndarray:
    mu, a = 2.0, 5.0
    return np.array([-mu * x[0] + x[2] * x[1], -mu * x[1] + x[0] * (x[2] - a), 1.0 - x[0] * x[1]])


rikitake = System(
    "rikitake", ("x", "y", "z"), _rikitake,
    ({"x": -2.0, "y*z": 1.0}, {"x": -5.0, "y": -2.0, "x*z": 1.0}, {"1": 1.0, "x*y": -1.0}),
    (1.0, 0.0, 1.0), 50.0, 1500, 2)
"""Rikitake two-disc dynamo mu=2, a=5 (chaotic reversals); 1500 points on [0, 50]."""


def _cubic_3d(x: np.ndarray) -> np.ndarray:
    return np.array([-0.1 * x[0] ** 3 + 2.0 * x[1] ** 3, -2.0 * x[0] ** 3 - 0.1 * x[1] ** 3,
                     -0.3 * x[2]])


cubic_3d = System(
    "cubic_3d", ("x", "y", "z"), _cubic_3d,
    ({"x**3": -0.1, "y**3": 2.0}, {"x**3": -2.0, "y**3": -0.1}, {"z": -0.3}),
    (2.0, 0.0, 1.0), 25.0, 750, 3)
"""Damped cubic oscillator with a decaying third state (SINDy's 3-D example); 750 points on
[0, 25]."""

HELDOUT_SYSTEMS: dict[str, System] = {s.name: s for s in (
    rabinovich_fabrikant, rucklidge, arneodo, nose_hoover, lu, liu, seir, selkov, moore_spiegel,
    rikitake, cubic_3d)}
"""A second held-out family, used only to evaluate the method (benchmark
``--systems heldout``); no default was chosen on it."""


def _sprott_b(x: np.ndarray) -> np.ndarray:
    return np.array([x[1] * x[2], x[0] - x[1], 1.0 - x[0] * x[1]])


sprott_b = System(
    "sprott_b", ("x", "y", "z"), _sprott_b,
    ({"y*z": 1.0}, {"x": 1.0, "y": -1.0}, {"1": 1.0, "x*y": -1.0}),
    (0.9377, 0.8797, -0.4395), 50.0, 1000, 2)
"""Sprott's case B (J. C. Sprott, "Some simple chaotic flows", Phys. Rev. E 50, R647, 1994):
``x' = yz, y' = x - y, z' = 1 - xy``; started on the attractor (the state at t = 400 from
(0.05, 0.05, 0.05)); 1000 points on [0, 50]."""


def _chua_cubic(x: np.ndarray) -> np.ndarray:
    alpha, beta = 10.0, 100.0 / 7.0
    return np.array([alpha * (x[1] - (2.0 * x[0] ** 3 - x[0]) / 7.0), x[0] - x[1] + x[2],
                     -beta * x[1]])


chua_cubic = System(
    "chua_cubic", ("x", "y", "z"), _chua_cubic,
    ({"x": 10.0 / 7.0, "y": 10.0, "x**3": -20.0 / 7.0}, {"x": 1.0, "y": -1.0, "z": 1.0},
     {"y": -100.0 / 7.0}), (1.558, 0.6072, -6.797), 50.0, 1000, 3)
"""Chua's circuit with the piecewise-linear diode replaced by a cubic, ``f(x) = (2x^3 - x) / 7``
(alpha = 10, beta = 100/7; the smooth Chua oscillator of A. I. Khibnik, D. Roose and
L. O. Chua, "On periodic orbits and homoclinic bifurcations in Chua's circuit with a smooth
nonlinearity", Int. J. Bifurcation Chaos 3, 363, 1993); started on the attractor (the state at
t = 200 from (0.7, 0, 0)); 1000 points on [0, 50]."""


def _food_chain(x: np.ndarray) -> np.ndarray:
    return np.array([x[0] * (1.0 - x[0]) - x[0] * x[1],
                     -0.2 * x[1] + x[0] * x[1] - x[1] * x[2],
                     -0.3 * x[2] + x[1] * x[2]])


food_chain = System(
    "food_chain", ("x", "y", "z"), _food_chain,
    ({"x": 1.0, "x**2": -1.0, "x*y": -1.0}, {"y": -0.2, "x*y": 1.0, "y*z": -1.0},
     {"z": -0.3, "y*z": 1.0}), (0.2, 0.6, 0.2), 60.0, 600, 2)
"""Three-species Lotka-Volterra food chain with a logistic prey (J. D. Murray, *Mathematical
Biology I*, 3rd ed., Springer 2002, ch. 3): damped oscillations into the coexistence point
(0.7, 0.3, 0.5); 600 points on [0, 60]."""


def _enzyme(x: np.ndarray) -> np.ndarray:
    k1, k_1, k2 = 2.0, 0.5, 1.0
    return np.array([-k1 * x[1] * x[0] + k_1 * x[2], -k1 * x[1] * x[0] + (k_1 + k2) * x[2],
                     k1 * x[1] * x[0] - (k_1 + k2) * x[2]])


enzyme = System(
    "enzyme", ("S", "E", "C"), _enzyme,
    ({"E*S": -2.0, "C": 0.5}, {"E*S": -2.0, "C": 1.5}, {"E*S": 2.0, "C": -1.5}),
    (1.0, 0.5, 0.0), 20.0, 400, 2)
"""Michaelis-Menten mass-action kinetics ``E + S <-> C -> E + P`` (k1 = 2, k-1 = 0.5,
k2 = 1; L. Michaelis and M. L. Menten 1913, in the mass-action form of G. E. Briggs and
J. B. S. Haldane 1925): the enzyme is conserved, ``E + C = 0.5``, so ``1``, ``E`` and ``C``
are collinear on the data; a transient into S = 0; 400 points on [0, 20]."""


def _hindmarsh_rose(x: np.ndarray) -> np.ndarray:
    r, s, xr, current = 0.006, 4.0, -1.6, 3.25
    return np.array([x[1] - x[0] ** 3 + 3.0 * x[0] ** 2 - x[2] + current,
                     1.0 - 5.0 * x[0] ** 2 - x[1], r * (s * (x[0] - xr) - x[2])])


hindmarsh_rose = System(
    "hindmarsh_rose", ("x", "y", "z"), _hindmarsh_rose,
    ({"1": 3.25, "y": 1.0, "z": -1.0, "x**2": 3.0, "x**3": -1.0}, {"1": 1.0, "y": -1.0,
     "x**2": -5.0}, {"1": 0.0384, "x": 0.024, "z": -0.006}),
    (-1.6, -10.0, 2.0), 1000.0, 2000, 3)
"""Hindmarsh-Rose neuron (J. L. Hindmarsh and R. M. Rose, Proc. R. Soc. Lond. B 221, 87, 1984)
a = 1, b = 3, c = 1, d = 5, r = 0.006, s = 4, x_R = -1.6, I = 3.25 (bursting; a slow third
state); 2000 points on [0, 1000]."""

CHECK_SYSTEMS: dict[str, System] = {s.name: s for s in (
    sprott_b, chua_cubic, food_chain, enzyme, hindmarsh_rose)}
"""A third set of systems outside the others (benchmark ``--systems check``), used only to
check that a change to the method carries over; nothing was tuned on it."""

def _shimizu_morioka(x: np.ndarray) -> np.ndarray:
    return np.array([x[1], x[0] - 0.75 * x[1] - x[0] * x[2], -0.45 * x[2] + x[0] ** 2])


shimizu_morioka = System(
    "shimizu_morioka", ("x", "y", "z"), _shimizu_morioka,
    ({"y": 1.0}, {"x": 1.0, "y": -0.75, "x*z": -1.0}, {"z": -0.45, "x**2": 1.0}),
    (0.3684, -0.01847, 0.7519), 60.0, 1500, 2)
"""Shimizu-Morioka (T. Shimizu and N. Morioka, Phys. Lett. A 76, 201, 1980), a = 0.75,
b = 0.45; started on the attractor (the state at t = 100 from (0.1, 0, 0)); 1500 points on
[0, 60]."""


def _sprott_d(x: np.ndarray) -> np.ndarray:
    return np.array([-x[1], x[0] + x[2], x[0] * x[2] + 3.0 * x[1] ** 2])


sprott_d = System(
    "sprott_d", ("x", "y", "z"), _sprott_d,
    ({"y": -1.0}, {"x": 1.0, "z": 1.0}, {"x*z": 1.0, "y**2": 3.0}), (0.1, 0.1, 0.1), 40.0,
    1000, 2)
"""Sprott's case D (Phys. Rev. E 50, R647, 1994): ``x' = -y, y' = x + z, z' = xz + 3y^2``;
1000 points on [0, 40] from (0.1, 0.1, 0.1)."""


def _burke_shaw(x: np.ndarray) -> np.ndarray:
    return np.array([-10.0 * (x[0] + x[1]), -x[1] - 10.0 * x[0] * x[2],
                     10.0 * x[0] * x[1] + 4.272])


burke_shaw = System(
    "burke_shaw", ("x", "y", "z"), _burke_shaw,
    ({"x": -10.0, "y": -10.0}, {"y": -1.0, "x*z": -10.0}, {"1": 4.272, "x*y": 10.0}),
    (0.3397, -0.402, -0.4343), 20.0, 2000, 2)
"""Burke-Shaw (R. Shaw, Z. Naturforsch. 36a, 80, 1981), s = 10, v = 4.272; started on the
attractor (the state at t = 20 from (0.6, 0, 0)); 2000 points on [0, 20]."""


def _newton_leipnik(x: np.ndarray) -> np.ndarray:
    return np.array([-0.4 * x[0] + x[1] + 10.0 * x[1] * x[2],
                     -x[0] - 0.4 * x[1] + 5.0 * x[0] * x[2], 0.175 * x[2] - 5.0 * x[0] * x[1]])


newton_leipnik = System(
    "newton_leipnik", ("x", "y", "z"), _newton_leipnik,
    ({"x": -0.4, "y": 1.0, "y*z": 10.0}, {"x": -1.0, "y": -0.4, "x*z": 5.0},
     {"z": 0.175, "x*y": -5.0}), (0.1038, 0.04289, 0.3631), 80.0, 2000, 2)
"""Newton-Leipnik (R. B. Leipnik and T. A. Newton, Phys. Lett. A 86, 63, 1981), a = 0.4,
b = 0.175; started on the attractor (the state at t = 50 from (0.349, 0, -0.16)); 2000 points
on [0, 80]."""


def _lorenz96_4(x: np.ndarray) -> np.ndarray:
    return np.array([(x[(i + 1) % 4] - x[(i - 2) % 4]) * x[(i - 1) % 4] - x[i] + 8.0
                     for i in range(4)])


lorenz96_4 = System(
    "lorenz96_4", ("x1", "x2", "x3", "x4"), _lorenz96_4,
    ({"1": 8.0, "x1": -1.0, "x2*x4": 1.0, "x3*x4": -1.0},
     {"1": 8.0, "x2": -1.0, "x1*x3": 1.0, "x1*x4": -1.0},
     {"1": 8.0, "x3": -1.0, "x1*x2": -1.0, "x2*x4": 1.0},
     {"1": 8.0, "x4": -1.0, "x1*x3": 1.0, "x2*x3": -1.0}), (-1.88, 1.943, 3.281, 7.943), 20.0,
    2000, 2)
"""Lorenz-96 with four sites and forcing F = 8 (E. N. Lorenz, "Predictability: a problem
partly solved", ECMWF seminar, 1996); started on the attractor (the state at t = 30 from
(8.01, 8, 8, 8)); 2000 points on [0, 20]."""


def _schnakenberg(x: np.ndarray) -> np.ndarray:
    return np.array([0.1 - x[0] + x[0] ** 2 * x[1], 0.9 - x[0] ** 2 * x[1]])


schnakenberg = System(
    "schnakenberg", ("u", "v"), _schnakenberg,
    ({"1": 0.1, "u": -1.0, "u**2*v": 1.0}, {"1": 0.9, "u**2*v": -1.0}), (1.0, 0.5), 30.0, 600,
    3)
"""Schnakenberg's trimolecular reaction (J. Schnakenberg, J. Theor. Biol. 81, 389, 1979),
a = 0.1, b = 0.9: a transient into the limit cycle; 600 points on [0, 30]."""


def _may_leonard(x: np.ndarray) -> np.ndarray:
    a, b = 0.8, 1.3
    return np.array([x[i] * (1.0 - x[i] - a * x[(i + 1) % 3] - b * x[(i + 2) % 3])
                     for i in range(3)])


may_leonard = System(
    "may_leonard", ("x", "y", "z"), _may_leonard,
    ({"x": 1.0, "x**2": -1.0, "x*y": -0.8, "x*z": -1.3},
     {"y": 1.0, "y**2": -1.0, "y*z": -0.8, "x*y": -1.3},
     {"z": 1.0, "z**2": -1.0, "x*z": -0.8, "y*z": -1.3}), (0.3, 0.2, 0.1), 60.0, 800, 2)
"""May-Leonard three-species competition (R. M. May and W. J. Leonard, SIAM J. Appl. Math.
29, 243, 1975), alpha = 0.8, beta = 1.3: a heteroclinic cycle, each species in turn near 1;
800 points on [0, 60]."""


def _dadras(x: np.ndarray) -> np.ndarray:
    return np.array([x[1] - 3.0 * x[0] + 2.7 * x[1] * x[2], 1.7 * x[1] - x[0] * x[2] + x[2],
                     2.0 * x[0] * x[1] - 9.0 * x[2]])


dadras = System(
    "dadras", ("x", "y", "z"), _dadras,
    ({"x": -3.0, "y": 1.0, "y*z": 2.7}, {"y": 1.7, "z": 1.0, "x*z": -1.0},
     {"z": -9.0, "x*y": 2.0}), (1.834, -1.109, -0.4415), 30.0, 1500, 2)
"""Dadras-Momeni (S. Dadras and H. R. Momeni, Phys. Lett. A 373, 3637, 2009), a = 3,
b = 2.7, c = 1.7, d = 2, e = 9; started on the attractor (the state at t = 30 from
(1, 1, 1)); 1500 points on [0, 30]."""


def _rossler_hyper(x: np.ndarray) -> np.ndarray:
    return np.array([-x[1] - x[2], x[0] + 0.25 * x[1] + x[3], 3.0 + x[0] * x[2],
                     -0.5 * x[2] + 0.05 * x[3]])


rossler_hyper = System(
    "rossler_hyper", ("x", "y", "z", "w"), _rossler_hyper,
    ({"y": -1.0, "z": -1.0}, {"x": 1.0, "y": 0.25, "w": 1.0}, {"1": 3.0, "x*z": 1.0},
     {"z": -0.5, "w": 0.05}), (-10.0, -6.0, 0.0, 10.0), 20.0, 500, 2)
"""Rossler's hyperchaotic system (O. E. Rossler, Phys. Lett. A 71, 155, 1979), a = 0.25,
b = 3, c = 0.5, d = 0.05; 500 points on [0, 20]."""


def _lorenz_stenflo(x: np.ndarray) -> np.ndarray:
    return np.array([-x[0] + x[1] + 1.5 * x[3], x[0] * (26.0 - x[2]) - x[1],
                     x[0] * x[1] - 0.7 * x[2], -x[0] - x[3]])


lorenz_stenflo = System(
    "lorenz_stenflo", ("x", "y", "z", "w"), _lorenz_stenflo,
    ({"x": -1.0, "y": 1.0, "w": 1.5}, {"x": 26.0, "y": -1.0, "x*z": -1.0},
     {"z": -0.7, "x*y": 1.0}, {"x": -1.0, "w": -1.0}), (2.901, 10.88, 12.36, -0.1364), 15.0,
    800, 2)
"""Lorenz-Stenflo (L. Stenflo, Phys. Scr. 53, 83, 1996), a = 1, b = 0.7, c = 1.5, r = 26;
started on the attractor (the state at t = 20 from (1, 1, 1, 1)); 800 points on [0, 15]."""


def _vdp_duffing(x: np.ndarray) -> np.ndarray:
    return np.array([x[1], -x[0] - 0.5 * x[0] ** 3 + 0.8 * (1.0 - x[0] ** 2) * x[1]])


vdp_duffing = System(
    "vdp_duffing", ("x", "y"), _vdp_duffing,
    ({"y": 1.0}, {"x": -1.0, "y": 0.8, "x**3": -0.5, "x**2*y": -0.8}), (0.5, 0.0), 40.0, 500,
    3)
"""Van der Pol-Duffing oscillator ``x'' = 0.8 (1 - x^2) x' - x - 0.5 x^3``: a transient into
its limit cycle; 500 points on [0, 40]."""


def _sprott_j(x: np.ndarray) -> np.ndarray:
    return np.array([2.0 * x[2], -2.0 * x[1] + x[2], -x[0] + x[1] + x[1] ** 2])


sprott_j = System(
    "sprott_j", ("x", "y", "z"), _sprott_j,
    ({"z": 2.0}, {"y": -2.0, "z": 1.0}, {"x": -1.0, "y": 1.0, "y**2": 1.0}),
    (19.59, 0.8267, -3.822), 60.0, 800, 2)
"""Sprott's case J (Phys. Rev. E 50, R647, 1994); started on the attractor (the state at
t = 50 from (0.1, 0.1, 0.1)); 800 points on [0, 60]."""


def _chen_lee(x: np.ndarray) -> np.ndarray:
    return np.array([5.0 * x[0] - x[1] * x[2], -10.0 * x[1] + x[0] * x[2],
                     -0.38 * x[2] + x[0] * x[1] / 3.0])


chen_lee = System(
    "chen_lee", ("x", "y", "z"), _chen_lee,
    ({"x": 5.0, "y*z": -1.0}, {"y": -10.0, "x*z": 1.0}, {"z": -0.38, "x*y": 1.0 / 3.0}),
    (-0.2653, -1.389, 12.06), 20.0, 1000, 2)
"""Chen-Lee (H.-K. Chen and C.-I Lee, Chaos Solitons Fractals 21, 957, 2004), a = 5,
b = -10, c = -0.38; started on the attractor (the state at t = 20 from (1, 1, 1)); 1000 points
on [0, 20]."""


def _coupled_duffing(x: np.ndarray) -> np.ndarray:
    return np.array([x[1], -x[0] - x[0] ** 3 - 0.1 * x[1] + 0.5 * x[2], x[3],
                     -2.0 * x[2] - 0.3 * x[2] ** 3 - 0.1 * x[3] + 0.5 * x[0]])


coupled_duffing = System(
    "coupled_duffing", ("a", "b", "c", "d"), _coupled_duffing,
    ({"b": 1.0}, {"a": -1.0, "b": -0.1, "c": 0.5, "a**3": -1.0}, {"d": 1.0},
     {"a": 0.5, "c": -2.0, "d": -0.1, "c**3": -0.3}), (1.5, 0.0, -1.0, 0.5), 30.0, 600, 3)
"""Two damped, linearly coupled Duffing oscillators of different stiffness (positions a, c;
velocities b, d); 600 points on [0, 30]."""


def _bouali(x: np.ndarray) -> np.ndarray:
    return np.array([x[0] * (4.0 - x[1]) + 0.3 * x[2], -x[1] * (1.0 - x[0] ** 2),
                     -x[0] * (1.5 - x[2]) - 0.05 * x[2]])


bouali = System(
    "bouali", ("x", "y", "z"), _bouali,
    ({"x": 4.0, "z": 0.3, "x*y": -1.0}, {"y": -1.0, "x**2*y": 1.0},
     {"x": -1.5, "z": -0.05, "x*z": 1.0}), (-0.595, 5.122, 1.277), 30.0, 1000, 3)
"""Bouali's attractor with a stretched loop (S. Bouali, Nonlinear Dyn. 70, 2375, 2012),
a = 0.3, s = 1; started on the attractor (the state at t = 20 from (1, 1, 0)); 1000 points on
[0, 30]."""

def _finance(x: np.ndarray) -> np.ndarray:
    return np.array([x[2] + (x[1] - 0.9) * x[0], 1.0 - 0.2 * x[1] - x[0] ** 2, -x[0] - 1.2 * x[2]])


finance = System(
    "finance", ("x", "y", "z"), _finance,
    ({"x": -0.9, "z": 1.0, "x*y": 1.0}, {"1": 1.0, "y": -0.2, "x**2": -1.0},
     {"x": -1.0, "z": -1.2}), (0.4361, 1.631, -0.1364), 100.0, 1500, 2)
"""Chaotic finance system (interest rate x, investment demand y, price index z; J. H. Ma and
Y. S. Chen, Appl. Math. Mech. 22, 1240, 2001), a = 0.9, b = 0.2, c = 1.2; started on the
attractor (the state at t = 100 from (1, 2, 0.5)); 1500 points on [0, 100]."""


def _sprott_c(x: np.ndarray) -> np.ndarray:
    return np.array([x[1] * x[2], x[0] - x[1], 1.0 - x[0] ** 2])


def _sprott_e(x: np.ndarray) -> np.ndarray:
    return np.array([x[1] * x[2], x[0] ** 2 - x[1], 1.0 - 4.0 * x[0]])


def _sprott_f(x: np.ndarray) -> np.ndarray:
    return np.array([x[1] + x[2], -x[0] + 0.5 * x[1], x[0] ** 2 - x[2]])


def _sprott_g(x: np.ndarray) -> np.ndarray:
    return np.array([0.4 * x[0] + x[2], x[0] * x[2] - x[1], -x[0] + x[1]])


sprott_c = System(
    "sprott_c", ("x", "y", "z"), _sprott_c,
    ({"y*z": 1.0}, {"x": 1.0, "y": -1.0}, {"1": 1.0, "x**2": -1.0}),
    (-0.7012, -0.5687, 0.5873), 50.0, 1500, 2)
"""Sprott's case C (J. C. Sprott, Phys. Rev. E 50, R647, 1994); started on the attractor (the
state at t = 100 from (0.1, 0.1, 0.1), as for cases E-G); 1500 points on [0, 50]."""

sprott_e = System(
    "sprott_e", ("x", "y", "z"), _sprott_e,
    ({"y*z": 1.0}, {"y": -1.0, "x**2": 1.0}, {"1": 1.0, "x": -4.0}),
    (0.0253, 0.0302, 3.346), 50.0, 1500, 2)
"""Sprott's case E (same source); 1500 points on [0, 50]."""

sprott_f = System(
    "sprott_f", ("x", "y", "z"), _sprott_f,
    ({"y": 1.0, "z": 1.0}, {"x": -1.0, "y": 0.5}, {"z": -1.0, "x**2": 1.0}),
    (-0.8308, -0.7971, 0.8119), 50.0, 1500, 2)
"""Sprott's case F (same source); 1500 points on [0, 50]."""

sprott_g = System(
    "sprott_g", ("x", "y", "z"), _sprott_g,
    ({"x": 0.4, "z": 1.0}, {"y": -1.0, "x*z": 1.0}, {"x": -1.0, "y": 1.0}),
    (-0.2173, -0.2291, 0.5958), 50.0, 1500, 2)
"""Sprott's case G (same source); 1500 points on [0, 50]."""


def _qi(x: np.ndarray) -> np.ndarray:
    return np.array([10.0 * (x[1] - x[0]) + x[1] * x[2], 28.0 * x[0] - x[1] - x[0] * x[2],
                     x[0] * x[1] - 8.0 / 3.0 * x[2]])


qi = System(
    "qi", ("x", "y", "z"), _qi,
    ({"x": -10.0, "y": 10.0, "y*z": 1.0}, {"x": 28.0, "y": -1.0, "x*z": -1.0},
     {"z": -8.0 / 3.0, "x*y": 1.0}), (-5.958, -0.3149, 23.78), 20.0, 2000, 2)
"""The Qi system's form (G. Qi, S. Du, G. Chen, Z. Chen and Z. Yuan, Chaos Solitons Fractals
23, 1671, 2005: Lorenz's equations with a y z term in the first) with Lorenz's parameters
a = 10, b = 8/3, c = 28; started on the attractor (the state at t = 100 from (1, 1, 1));
2000 points on [0, 20]."""


def _sakarya(x: np.ndarray) -> np.ndarray:
    return np.array([-x[0] + x[1] + x[1] * x[2], -x[0] - x[1] + 0.4 * x[0] * x[2],
                     x[2] - 0.3 * x[0] * x[1]])


sakarya = System(
    "sakarya", ("x", "y", "z"), _sakarya,
    ({"x": -1.0, "y": 1.0, "y*z": 1.0}, {"x": -1.0, "y": -1.0, "x*z": 0.4},
     {"z": 1.0, "x*y": -0.3}), (-1.457, -1.601, 3.830), 50.0, 1500, 2)
"""The Sakarya attractor as the dysts collection writes it (W. Gilpin, NeurIPS Datasets and
Benchmarks 2021), a = 0.4, b = 0.3; started on the attractor (the state at t = 100 from
(1, -1, 1)); 1500 points on [0, 50]."""


def _wang_sun(x: np.ndarray) -> np.ndarray:
    return np.array([0.2 * x[0] + x[1] * x[2], -0.01 * x[0] - 0.4 * x[1] - x[0] * x[2],
                     -x[2] - x[0] * x[1]])


wang_sun = System(
    "wang_sun", ("x", "y", "z"), _wang_sun,
    ({"x": 0.2, "y*z": 1.0}, {"x": -0.01, "y": -0.4, "x*z": -1.0}, {"z": -1.0, "x*y": -1.0}),
    (0.5695, -0.0108, 0.0040), 80.0, 1500, 2)
"""The Wang-Sun attractor as the dysts collection writes it (same source), a = 0.2,
b = -0.01, c = 1, d = -0.4, e = -1, f = -1 (a small coefficient beside unit ones); started on
the attractor (the state at t = 100 from (0.5, 0.1, 0.1)); 1500 points on [0, 80]."""


def _hyper_lorenz(x: np.ndarray) -> np.ndarray:
    return np.array([10.0 * (x[1] - x[0]) + x[3], 28.0 * x[0] - x[1] - x[0] * x[2],
                     x[0] * x[1] - 8.0 / 3.0 * x[2], -x[1] * x[2] - x[3]])


hyper_lorenz = System(
    "hyper_lorenz", ("x", "y", "z", "w"), _hyper_lorenz,
    ({"x": -10.0, "y": 10.0, "w": 1.0}, {"x": 28.0, "y": -1.0, "x*z": -1.0},
     {"z": -8.0 / 3.0, "x*y": 1.0}, {"w": -1.0, "y*z": -1.0}),
    (0.8639, 1.592, 30.77, -66.24), 20.0, 2000, 2)
"""Hyperchaotic Lorenz system (X. Wang and M. Wang, Chaos 17, 033106, 2007), r = -1; a fourth
state of a much larger range than the others; started on the attractor (the state at t = 100
from (1, 1, 1, 1)); 2000 points on [0, 20]."""


def _rayleigh(x: np.ndarray) -> np.ndarray:
    return np.array([x[1], -x[0] + 1.5 * x[1] - 0.5 * x[1] ** 3])


rayleigh = System(
    "rayleigh", ("x", "y"), _rayleigh,
    ({"y": 1.0}, {"x": -1.0, "y": 1.5, "y**3": -0.5}), (2.154, -1.159), 30.0, 800, 3)
"""Rayleigh's oscillator (Lord Rayleigh, Phil. Mag. 15, 229, 1883), mu = 1.5, on its limit
cycle (the state at t = 100 from (0.1, 0)); 800 points on [0, 30]."""


def _logistic_predator(x: np.ndarray) -> np.ndarray:
    return np.array([x[0] - 0.5 * x[0] ** 2 - x[0] * x[1], -0.6 * x[1] + 0.8 * x[0] * x[1]])


logistic_predator = System(
    "logistic_predator", ("x", "y"), _logistic_predator,
    ({"x": 1.0, "x**2": -0.5, "x*y": -1.0}, {"y": -0.6, "x*y": 0.8}), (0.3, 0.8), 40.0, 600, 2)
"""Predator and prey with logistic growth of the prey (J. D. Murray, Mathematical Biology I,
3rd ed., 2002, ch. 3): a damped spiral into the coexistence point, not a cycle; 600 points on
[0, 40] from (0.3, 0.8)."""

FRESH_SYSTEMS: dict[str, System] = {s.name: s for s in (
    shimizu_morioka, sprott_d, burke_shaw, newton_leipnik, lorenz96_4, schnakenberg,
    may_leonard, dadras, rossler_hyper, lorenz_stenflo, vdp_duffing, sprott_j, chen_lee,
    coupled_duffing, bouali)}
"""A fourth set (benchmark ``--systems fresh``), first run after the method's last change and
recorded as it came: nothing was chosen or tuned on it."""

NOVEL_SYSTEMS: dict[str, System] = {s.name: s for s in (
    finance, sprott_c, sprott_e, sprott_f, sprott_g, qi, sakarya, wang_sun, hyper_lorenz,
    rayleigh, logistic_predator)}
"""A fifth set (benchmark ``--systems novel``), written and first run after the method's last
change, like the fourth, and recorded as it came."""

def _sprott_h(x: np.ndarray) -> np.ndarray:
    return np.array([-x[1] + x[2] ** 2, x[0] + 0.5 * x[1], x[0] - x[2]])


def _sprott_k(x: np.ndarray) -> np.ndarray:
    return np.array([x[0] * x[1] - x[2], x[0] - x[1], x[0] + 0.3 * x[2]])


def _sprott_m(x: np.ndarray) -> np.ndarray:
    return np.array([-x[2], -x[0] ** 2 - x[1], 1.7 + 1.7 * x[0] + x[1]])


def _sprott_n(x: np.ndarray) -> np.ndarray:
    return np.array([-2.0 * x[1], x[0] + x[2] ** 2, 1.0 + x[1] - 2.0 * x[2]])


def _sprott_o(x: np.ndarray) -> np.ndarray:
    return np.array([x[1], x[0] - x[2], x[0] + x[0] * x[2] + 2.7 * x[1]])


def _sprott_q(x: np.ndarray) -> np.ndarray:
    return np.array([-x[2], x[0] - x[1], 3.1 * x[0] + x[1] ** 2 + 0.5 * x[2]])


def _sprott_r(x: np.ndarray) -> np.ndarray:
    return np.array([0.9 - x[1], 0.4 + x[2], x[0] * x[1] - x[2]])


def _sprott_s(x: np.ndarray) -> np.ndarray:
    return np.array([-x[0] - 4.0 * x[1], x[0] + x[2] ** 2, 1.0 + x[0]])


# Sprott's cases H, K, M, N, O, Q, R and S (J. C. Sprott, Phys. Rev. E 50, R647, 1994), each
# started on its attractor (the state at t = 50 from (0.1, 0.1, 0.1)); 1000 points on [0, 50].
sprott_h = System("sprott_h", ("x", "y", "z"), _sprott_h,
                  ({"y": -1.0, "z**2": 1.0}, {"x": 1.0, "y": 0.5}, {"x": 1.0, "z": -1.0}),
                  (-0.9242, 0.01118, -0.9562), 50.0, 1000, 2)
sprott_k = System("sprott_k", ("x", "y", "z"), _sprott_k,
                  ({"z": -1.0, "x*y": 1.0}, {"x": 1.0, "y": -1.0}, {"x": 1.0, "z": 0.3}),
                  (-2.999, -1.066, 2.588), 50.0, 1000, 2)
sprott_m = System("sprott_m", ("x", "y", "z"), _sprott_m,
                  ({"z": -1.0}, {"y": -1.0, "x**2": -1.0}, {"1": 1.7, "x": 1.7, "y": 1.0}),
                  (-2.044, -2.048, -0.1462), 50.0, 1000, 2)
sprott_n = System("sprott_n", ("x", "y", "z"), _sprott_n,
                  ({"y": -2.0}, {"x": 1.0, "z**2": 1.0}, {"1": 1.0, "y": 1.0, "z": -2.0}),
                  (-10.47, 7.55, 3.502), 50.0, 1000, 2)
sprott_o = System("sprott_o", ("x", "y", "z"), _sprott_o,
                  ({"y": 1.0}, {"x": 1.0, "z": -1.0}, {"x": 1.0, "y": 2.7, "x*z": 1.0}),
                  (-0.02461, -0.5521, 0.5202), 50.0, 1000, 2)
sprott_q = System("sprott_q", ("x", "y", "z"), _sprott_q,
                  ({"z": -1.0}, {"x": 1.0, "y": -1.0}, {"x": 3.1, "z": 0.5, "y**2": 1.0}),
                  (-6.519, -2.606, -0.2826), 50.0, 1000, 2)
sprott_r = System("sprott_r", ("x", "y", "z"), _sprott_r,
                  ({"1": 0.9, "y": -1.0}, {"1": 0.4, "z": 1.0}, {"z": -1.0, "x*y": 1.0}),
                  (-1.259, -1.353, 3.232), 50.0, 1000, 2)
sprott_s = System("sprott_s", ("x", "y", "z"), _sprott_s,
                  ({"x": -1.0, "y": -4.0}, {"x": 1.0, "z**2": 1.0}, {"1": 1.0, "x": 1.0}),
                  (-3.261, -0.02456, -0.1673), 50.0, 1000, 2)


def _henon_heiles(x: np.ndarray) -> np.ndarray:
    return np.array([x[2], x[3], -x[0] - 2.0 * x[0] * x[1], -x[1] - x[0] ** 2 + x[1] ** 2])


henon_heiles = System(
    "henon_heiles", ("x", "y", "u", "v"), _henon_heiles,
    ({"u": 1.0}, {"v": 1.0}, {"x": -1.0, "x*y": -2.0}, {"y": -1.0, "x**2": -1.0, "y**2": 1.0}),
    (0.0, 0.1, 0.45, 0.1), 100.0, 1000, 2)
"""Henon-Heiles Hamiltonian (M. Henon and C. Heiles, Astron. J. 69, 73, 1964), positions x, y and
momenta u, v at energy 0.111 (bounded, below the escape energy 1/6); conservative, so no
attractor: 1000 points on [0, 100]."""


def _lorenz96_5(x: np.ndarray) -> np.ndarray:
    return np.array([(x[(i + 1) % 5] - x[(i - 2) % 5]) * x[(i - 1) % 5] - x[i] + 8.0
                     for i in range(5)])


def _lorenz96_5_truth() -> tuple[dict[str, float], ...]:
    names = ("a", "b", "c", "d", "e")
    eqs = []
    for i in range(5):
        nxt, prev, prev2 = names[(i + 1) % 5], names[(i - 1) % 5], names[(i - 2) % 5]
        eqs.append({"1": 8.0, names[i]: -1.0, "*".join(sorted((nxt, prev))): 1.0,
                    "*".join(sorted((prev2, prev))): -1.0})
    return tuple(eqs)


lorenz96_5 = System(
    "lorenz96_5", ("a", "b", "c", "d", "e"), _lorenz96_5, _lorenz96_5_truth(),
    (0.68, 1.083, 1.61, 8.288, -1.496), 10.0, 1000, 2)
"""Lorenz-96 with five sites and forcing F = 8 (E. N. Lorenz, Proc. Seminar on Predictability,
ECMWF, 1996): 5 states, 21 monomials per equation; started on the attractor (the state at
t = 20 from (8.01, 8, 8, 8, 8)); 1000 points on [0, 10]."""


def _sprott_torus(x: np.ndarray) -> np.ndarray:
    return np.array([x[1] + 2.0 * x[0] * x[1] + x[0] * x[2], 1.0 - 2.0 * x[0] ** 2 + x[1] * x[2],
                     x[0] - x[0] ** 2 - x[1] ** 2])


sprott_torus = System(
    "sprott_torus", ("x", "y", "z"), _sprott_torus,
    ({"y": 1.0, "x*y": 2.0, "x*z": 1.0}, {"1": 1.0, "x**2": -2.0, "y*z": 1.0},
     {"x": 1.0, "x**2": -1.0, "y**2": -1.0}), (1.0, 0.0, 0.0), 50.0, 1000, 2)
"""Sprott's flow with a strange attractor and invariant tori (J. C. Sprott, Phys. Lett. A 378,
1361, 2014), from (1, 0, 0), on a torus; 1000 points on [0, 50]."""

EXTRA_SYSTEMS: dict[str, System] = {s.name: s for s in (
    sprott_h, sprott_k, sprott_m, sprott_n, sprott_o, sprott_q, sprott_r, sprott_s,
    henon_heiles, lorenz96_5, sprott_torus)}
"""A sixth set (benchmark ``--systems extra``): Sprott's cases H, K, M, N, O, Q, R and S
(J. C. Sprott, Phys. Rev. E 50, R647, 1994; each started on its attractor, the state at
t = 50 from (0.1, 0.1, 0.1), 1000 points on [0, 50]), a Hamiltonian, a five-site Lorenz-96 and
a flow on an invariant torus; written and first run after the method's last change, and recorded
as it came (that run found the round-off term of Sprott N's clean data that led to the
exact-data rule of :meth:`symbolic.EquationDiscovery._select`)."""

ALL_SYSTEMS: dict[str, System] = {**SYSTEMS, **VALIDATION_SYSTEMS, **HELDOUT_SYSTEMS,
                                  **CHECK_SYSTEMS, **FRESH_SYSTEMS, **NOVEL_SYSTEMS,
                                  **EXTRA_SYSTEMS}


def score_terms(found: list[dict[str, float]], truth: list[dict[str, float]]) -> dict:
    """Compare discovered equations with the truth, both ``[{monomial: coefficient}, ...]``.

    Returns ``max_rel_error`` (largest relative error over the true terms, a missed term
    counting 1.0), ``missed`` (true terms absent) and ``spurious`` (terms not in the truth).
    """
    rel, missed, spurious = 0.0, 0, 0
    for est, true in zip(found, truth):
        for term, value in true.items():
            rel = max(rel, abs(est.get(term, 0.0) - value) / abs(value))
            missed += term not in est
        spurious += len(set(est) - set(true))
    return {"max_rel_error": rel, "missed": missed, "spurious": spurious}


def generate(system: System | str, *, n: int | None = None, t_end: float | None = None,
             x0: tuple[float, ...] | None = None, noise: float = 0.0,
             seed: int = 0) -> Trajectory:
    """Integrate ``system`` and sample it at ``n`` evenly spaced times on ``[0, t_end]``.

    ``noise`` is the noise standard deviation as a fraction of each variable's standard
    deviation along the clean trajectory (0.05 = 5 %); the noise is drawn from a generator seeded
    with ``seed``. Returns a :class:`Trajectory` with ``t`` (n,) and ``X`` (n, dim).
    """
    if isinstance(system, str):
        if system not in ALL_SYSTEMS:
            raise SymbolicDataError(f"unknown system {system!r}; expected one of "
                                    f"{sorted(ALL_SYSTEMS)}")
        system = ALL_SYSTEMS[system]
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
                    t_eval=t, rtol=1e-13, atol=1e-15)
    if not sol.success:
        raise SymbolicDataError(f"integration of {system.name} failed: {sol.message}")
    clean = sol.y.T.copy()
    rng = np.random.default_rng(seed)
    X = clean + noise * clean.std(axis=0) * rng.standard_normal(clean.shape)
    return Trajectory(system, t, X, clean, float(noise), int(seed))
