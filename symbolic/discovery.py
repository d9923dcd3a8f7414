"""Equation discovery: recover a sparse polynomial ODE ``dx/dt = f(x)`` from trajectories.

Recipe of :class:`EquationDiscovery.fit`:

1. Train a :class:`~polynets.PolyNODE` (Mu-Layers, degree ``>= degree``) on the trajectories
   through ``torchdiffeq.odeint`` over short windows, in standardised units.
2. Expand it exactly with :func:`symbolic.to_sympy`, map it back to the original units and keep
   the monomials of total degree ``<= degree``: a dense polynomial field close to the data.
3. Refine all library coefficients by trajectory matching (Levenberg-Marquardt with forward
   sensitivities, multiple shooting over windows, :mod:`symbolic.shooting`).
4. Backward elimination: drop every term whose share of its equation on the data is below
   ``threshold``; when none is, drop the least significant term of each equation whose z-score
   (coefficient / standard error from the Gauss-Newton covariance) is below ``significance``;
   refit the survivors by trajectory matching; repeat until every term is large and significant.

No knowledge of the true support is used anywhere. On exact data the kept coefficients are the
least-squares trajectory fit, accurate to the integration tolerance; with noise it is a
maximum-likelihood fit of the states (Gaussian noise), far less biased than regression on
finite-difference derivatives.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import numpy as np
import sympy
import torch
from scipy.integrate import solve_ivp
from tqdm.auto import tqdm

from symbolic.errors import ExpressionError, FitError, NotFittedError, SymbolicDataError
from symbolic.expand import default_variables, to_sympy
from symbolic.export import derivative_symbol, to_latex, to_python, to_string
from symbolic.field import PolyField, as_symbols, as_trajectories, monomial_exponents
from symbolic.prune import lstsq_integral, snap_coefficients, term_scales
from symbolic.shooting import ShootingResult, fit_trajectories, make_windows

__all__ = ["EquationDiscovery"]


class EquationDiscovery:
    """Sparse polynomial ODE discovery with a Poly-NODE, exact expansion and trajectory refits.

    Args:
        degree: maximal total degree of the monomial library (constant term included).
        variables: state names (default ``x, y, z`` / ``x1..xn``), the order of X's columns.
        threshold: terms whose RMS contribution is below ``threshold`` times the RMS of their
            equation on the data are dropped.
        significance: terms whose z-score stays below this are dropped (one per equation and
            round, least significant first).
        noise: optional noise level as a fraction of each variable's standard deviation; when
            given it floors the residual variance used for z-scores.
        window: samples per multiple-shooting window of the trajectory refits (None: whole
            trajectories).
        polish: once the support is fixed, refit once more on windows ``polish`` times longer
            (more samples per fitted initial state: lower variance under noise); the longer fit
            is kept only if it converges to a residual level no worse than 1.5x per sample.
            ``1`` skips it.
        hidden, node_steps, node_window, lr: Poly-NODE width, training steps, training window
            (samples) and learning rate.
        snap_tol: if set, coefficients within this relative distance of a number with at most
            six decimals are snapped to it at the end.
        rtol, atol: tolerances of the refit integrations.
        progress: show progress bars.
        seed: seed of the Poly-NODE initialisation and batches.

    Fitted attributes: ``coef_`` (p, dim) over the monomials ``library_`` (p, dim exponents),
    ``model_`` the trained Poly-NODE, ``node_exprs_`` its exact expansion in the data's units,
    ``start_`` which dense fit seeded the elimination (``"node"``, or ``"lstsq"``, the
    integral-form least squares, when the fit started from the Poly-NODE failed or did not
    converge and the other did better), ``rounds_`` the terms and
    residual per elimination round, ``x0_`` the fitted window starts, ``fit_window_`` the final
    window length, ``timings_`` seconds spent.
    """

    def __init__(self, degree: int = 2, *, variables: Sequence[str] | None = None,
                 threshold: float = 1e-3, significance: float = 4.0, noise: float | None = None,
                 window: int | None = 50, polish: int = 2, hidden: int = 16,
                 node_steps: int = 100, node_window: int = 6, lr: float = 2e-2,
                 snap_tol: float | None = None,
                 rtol: float = 1e-10, atol: float = 1e-12, progress: bool = True,
                 seed: int = 0) -> None:
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ExpressionError(f"degree must be a positive int, got {degree!r}")
        for name, value in (("threshold", threshold), ("significance", significance)):
            if not np.isfinite(value) or value < 0:
                raise ExpressionError(f"{name} must be a non-negative number, got {value!r}")
        if noise is not None and (not np.isfinite(noise) or noise < 0):
            raise ExpressionError(f"noise must be a non-negative fraction, got {noise!r}")
        self.degree = degree
        self.variables = None if variables is None else [str(v) for v in variables]
        self.threshold = float(threshold)
        self.significance = float(significance)
        self.noise = noise
        self.window = window
        self.polish = polish
        self.hidden = hidden
        self.node_steps = node_steps
        self.node_window = node_window
        self.lr = lr
        self.snap_tol = snap_tol
        self.rtol = rtol
        self.atol = atol
        self.progress = progress
        self.seed = seed

    # ------------------------------------------------------------------------------------ fit
    def _train_node(self, trajectories: list[tuple[np.ndarray, np.ndarray]],
                    syms: list[sympy.Symbol]) -> np.ndarray:
        """Train a Poly-NODE in standardised units; its expansion in the data's units (p, d)."""
        from polynets.node import PolyNODE, train_node

        stacked = np.concatenate([X for _, X in trajectories])
        mu, sd = stacked.mean(axis=0), stacked.std(axis=0)
        sd = np.where(sd > 0, sd, 1.0)
        rates = np.concatenate([np.diff((X - mu) / sd, axis=0) / np.diff(t)[:, None]
                                for t, X in trajectories])
        rate = float(np.sqrt(np.mean(rates**2))) or 1.0
        d = len(syms)
        torch.manual_seed(self.seed)
        model = PolyNODE(d, hidden=self.hidden, degree=self.degree, dtype=torch.float64)
        self.node_history_ = train_node(
            model, [(t - t[0]) * rate for t, _ in trajectories],
            [(X - mu) / sd for _, X in trajectories], steps=self.node_steps,
            window=self.node_window, lr=self.lr, seed=self.seed, progress=self.progress)
        self.model_ = model
        zs = [sympy.Symbol(f"_z{j}") for j in range(d)]
        exprs = to_sympy(model, variables=zs)
        back = {z: (s - float(m)) / float(v) for z, s, m, v in zip(zs, syms, mu, sd)}
        physical = [sympy.expand(e.xreplace(back) * float(sd[i]) * rate)
                    for i, e in enumerate(exprs)]
        self.node_exprs_ = physical
        full = PolyField.from_exprs(physical, syms)
        rows = {tuple(int(k) for k in r): i for i, r in enumerate(full.exps)}
        coef = np.zeros((len(self.library_), d))
        for k, e in enumerate(self.library_):
            if tuple(int(v) for v in e) in rows:
                coef[k] = full.coef[rows[tuple(int(v) for v in e)]]
        return coef

    def _refit(self, coef: np.ndarray, active: np.ndarray, x0: np.ndarray | None,
               window: int | None = None) -> ShootingResult:
        return fit_trajectories(self.library_, coef, active, self.trajectories_,
                                window=window or self.window, x0=x0, rtol=self.rtol,
                                atol=self.atol)

    def fit(self, t: Any, X: Any, noise: float | None = None) -> "EquationDiscovery":
        """Discover ``dx/dt = f(x)`` from ``t`` (n,) and ``X`` (n, dim), or lists of them.

        ``noise`` (fraction of each variable's std) overrides the constructor's. Returns self.
        """
        start = time.perf_counter()
        trajectories = as_trajectories(t, X, min_points=5)
        dim = trajectories[0][1].shape[1]
        names = self.variables or default_variables(dim)
        if len(names) != dim:
            raise SymbolicDataError(f"X has {dim} state columns but {len(names)} variable "
                                    f"names were given: {names}")
        noise = self.noise if noise is None else noise
        syms = as_symbols(names)
        self.variables_ = syms
        self.trajectories_ = trajectories
        self.library_ = monomial_exponents(dim, self.degree)
        stacked = np.concatenate([Xi for _, Xi in trajectories])
        p = len(self.library_)
        active = np.ones((p, dim), dtype=bool)
        node_coef = self._train_node(trajectories, syms)
        node_time = time.perf_counter() - start
        self.start_ = "node"
        try:
            res = self._refit(node_coef, active, None)
        except FitError:
            res = None
        if res is None or not res.converged:
            field = PolyField(syms, self.library_, np.zeros((p, dim)))
            fallback = self._refit(lstsq_integral(field, active, trajectories), active, None)
            if res is None or fallback.rss < res.rss:
                res, self.start_ = fallback, "lstsq"
        field = PolyField(syms, self.library_, res.coef)
        rounds = [{"terms": int(active.sum()), "rss": res.rss}]
        bar = tqdm(desc="sparsify", unit="round", disable=not self.progress, leave=False)
        while True:
            field.coef = res.coef
            scales = term_scales(field, stacked)
            z = np.abs(np.nan_to_num(res.zscore, nan=0.0))
            if noise is not None and noise > 0:
                z = z * math.sqrt(res.sigma2 / max(res.sigma2, noise**2))
            drop = active & (scales < self.threshold)
            if not drop.any():
                for i in range(dim):
                    weak = active[:, i] & (z[:, i] < self.significance)
                    if weak.any():
                        drop[int(np.argmin(np.where(weak, z[:, i], np.inf))), i] = True
            if not drop.any():
                break
            active &= ~drop
            res = self._refit(res.coef, active, res.x0)
            rounds.append({"terms": int(active.sum()), "rss": res.rss})
            bar.update(1)
            bar.set_postfix(terms=int(active.sum()))
        bar.close()
        self.fit_window_ = self.window
        if self.window is not None and self.polish > 1:
            try:
                longer = self._refit(res.coef, active, None, window=self.window * self.polish)
                if longer.converged and longer.rss / longer.n_residuals <= \
                        1.5 * res.rss / res.n_residuals:
                    res = longer
                    self.fit_window_ = self.window * self.polish
            except FitError:
                pass
        coef = res.coef
        if self.snap_tol is not None:
            coef = snap_coefficients(coef, self.snap_tol)
        self.coef_ = coef
        self.x0_ = res.x0
        self.result_ = res
        self.rounds_ = rounds
        self.timings_ = {"node": node_time, "total": time.perf_counter() - start}
        return self

    # ------------------------------------------------------------------------------- results
    def _check(self) -> None:
        if not hasattr(self, "coef_"):
            raise NotFittedError("this EquationDiscovery is not fitted yet; call fit(t, X) first")

    @property
    def field_(self) -> PolyField:
        """The discovered vector field as a :class:`~symbolic.field.PolyField`."""
        self._check()
        return PolyField(self.variables_, self.library_, self.coef_)

    def rhs(self) -> list[sympy.Expr]:
        """Right-hand sides ``f_i(x)`` as sympy expressions (float coefficients)."""
        return self.field_.to_exprs()

    def equations(self) -> list[sympy.Eq]:
        """``[Eq(dx/dt, f_x), ...]`` with ``dx/dt`` a sympy Symbol."""
        return [sympy.Eq(derivative_symbol(v), e) for v, e in zip(self.variables_, self.rhs())]

    def coefficients(self) -> list[dict[str, float]]:
        """Per equation ``{str(monomial): coefficient}`` of the kept terms."""
        field = self.field_
        names = [str(m) for m in field.monomials()]
        return [{n: float(c) for n, c in zip(names, field.coef[:, i]) if c != 0.0}
                for i in range(field.coef.shape[1])]

    def simulate(self, x0: Any, t: Any) -> np.ndarray:
        """Integrate the discovered ODE from ``x0`` (dim,) at times ``t`` (n,) -> (n, dim).

        DOP853 at the refit tolerances; rows after a blow-up are NaN.
        """
        field = self.field_
        x0 = np.asarray(x0, dtype=np.float64).reshape(-1)
        t = np.asarray(t, dtype=np.float64)
        if x0.shape != (field.dim,):
            raise SymbolicDataError(f"x0 must have {field.dim} entries, got {x0.shape[0]}")
        as_trajectories(t, np.zeros((len(t), field.dim)), min_points=1)
        out = np.full((len(t), field.dim), np.nan)
        out[0] = x0
        if len(t) == 1:
            return out
        sol = solve_ivp(lambda _t, x: field(x[None])[0], (t[0], t[-1]), x0, method="DOP853",
                        t_eval=t, rtol=self.rtol, atol=self.atol)
        out[: sol.y.shape[1]] = sol.y.T
        return out

    def score(self, t: Any, X: Any) -> float:
        """Coefficient of determination of simulated windows against ``X``.

        Every window (of the final fit's length) is simulated from its first observed state;
        returns ``1 - SS_res / SS_tot`` over all samples (``-inf`` if a simulation blows up).
        """
        self._check()
        trajectories = as_trajectories(t, X, dim=self.field_.dim)
        res, tot = 0.0, 0.0
        stacked = np.concatenate([Xi for _, Xi in trajectories])
        mean = stacked.mean(axis=0)
        for tw, Xw in make_windows(trajectories, self.fit_window_):
            sim = self.simulate(Xw[0], tw)
            if not np.all(np.isfinite(sim)):
                return -math.inf
            res += float(np.sum((sim - Xw) ** 2))
            tot += float(np.sum((Xw - mean) ** 2))
        return 1.0 - res / tot if tot > 0 else -math.inf

    def to_latex(self, digits: int = 6) -> str:
        """The equations as a LaTeX ``aligned`` block."""
        return to_latex(self.rhs(), self.variables_, digits=digits)

    def to_python(self, name: str = "vector_field") -> str:
        """Source of ``def name(t, state)`` returning the right-hand sides."""
        return to_python(self.rhs(), self.variables_, name=name)

    def __str__(self) -> str:
        if not hasattr(self, "coef_"):
            return f"EquationDiscovery(degree={self.degree}, not fitted)"
        return to_string(self.rhs(), self.variables_)

    def __repr__(self) -> str:
        return (f"EquationDiscovery(degree={self.degree}, threshold={self.threshold}, "
                f"significance={self.significance}, window={self.window})")

    def print(self, digits: int = 6) -> None:
        """Print one ``dx/dt = ...`` line per equation."""
        self._check()
        print(to_string(self.rhs(), self.variables_, digits=digits))
