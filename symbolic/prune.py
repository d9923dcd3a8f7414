"""Sparsify polynomial equations: prune small terms, refit the survivors, snap round numbers.

``prune`` drops terms whose contribution is small: with ``data`` the contribution of term
``c * m(x)`` is ``|c| * RMS_data(m) / RMS_data(f)`` (its share of the whole right-hand side on the
samples), without data it is ``|c|``. ``refit`` re-estimates the surviving coefficients with the
support fixed, so they are not biased by the terms that were dropped: ``"lstsq"`` solves the
integral form ``X(t) - X(t0) = int Theta(X) dt xi`` by linear least squares (no differentiation
of the data), ``"trajectory"`` matches integrated trajectories (see :mod:`symbolic.shooting`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import sympy
from scipy.integrate import cumulative_simpson

from symbolic.errors import ExpressionError, SymbolicDataError
from symbolic.field import PolyField, as_trajectories
from symbolic.shooting import fit_trajectories

__all__ = ["prune", "refit", "snap", "snap_coefficients", "term_scales"]


def _stack_data(data: Any, dim: int) -> np.ndarray:
    arrays = data if isinstance(data, (list, tuple)) else [data]
    out = []
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        if a.ndim != 2 or a.shape[1] != dim:
            raise SymbolicDataError(f"data must have shape (n, {dim}) (one column per variable),"
                                    f" got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise SymbolicDataError("data must be finite (found NaN or inf)")
        out.append(a)
    return np.concatenate(out)


def term_scales(field: PolyField, X: np.ndarray) -> np.ndarray:
    """Relative size of every term on samples ``X`` (N, dim): (p, n_out).

    ``|coef[k, i]| * RMS(phi_k(X)) / RMS(f_i(X))``; zero where the coefficient is zero.
    """
    theta = field.theta(X)
    rms_m = np.sqrt(np.mean(theta**2, axis=0))                        # (p,)
    rms_f = np.sqrt(np.mean((theta @ field.coef) ** 2, axis=0))       # (n_out,)
    return np.abs(field.coef) * rms_m[:, None] / np.where(rms_f > 0, rms_f, np.inf)[None, :]


def snap_coefficients(coef: np.ndarray, tol: float = 1e-6, digits: int = 6) -> np.ndarray:
    """Round each entry to the fewest decimals (<= ``digits``) within relative ``tol`` of it."""

    def one(c: float) -> float:
        for d in range(digits + 1):
            r = round(c, d)
            if r != 0.0 and abs(r - c) <= tol * abs(c):
                return r
        return c

    return np.array([one(float(c)) for c in np.ravel(coef)]).reshape(np.shape(coef))


def snap(exprs: Sequence[Any], tol: float = 1e-6, *, digits: int = 6,
         variables: Sequence[str | sympy.Symbol] | None = None) -> list[sympy.Expr]:
    """Replace coefficients within relative ``tol`` of a number with at most ``digits`` decimals.

    E.g. ``1.5600000003 -> 1.56`` at ``tol=1e-6``; other coefficients are left as they are.
    """
    field = PolyField.from_exprs(exprs, variables)
    return field.to_exprs(snap_coefficients(field.coef, tol, digits))


def prune(exprs: Sequence[Any], threshold: float = 1e-3, *, data: Any = None,
          variables: Sequence[str | sympy.Symbol] | None = None,
          snap_tol: float | None = None) -> list[sympy.Expr]:
    """Drop the terms below ``threshold``; return the pruned expressions.

    With ``data`` (array (n, dim) or a list of them, columns in the order of ``variables``,
    default: the expressions' symbols sorted by name) a term is kept when
    ``|c| * RMS(monomial) >= threshold * RMS(expression)`` on the data; without data when
    ``|c| >= threshold``. ``snap_tol`` additionally snaps near-round coefficients (:func:`snap`).
    """
    if not np.isfinite(threshold) or threshold < 0:
        raise ExpressionError(f"threshold must be a non-negative number, got {threshold!r}")
    field = PolyField.from_exprs(exprs, variables)
    if data is not None:
        keep = term_scales(field, _stack_data(data, field.dim)) >= threshold
    else:
        keep = np.abs(field.coef) >= threshold
    out = field.to_exprs(np.where(keep, field.coef, 0.0))
    if snap_tol is not None:
        out = snap(out, snap_tol, variables=field.variables)
    return out


def lstsq_integral(field: PolyField, active: np.ndarray,
                   trajectories: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Least squares of the integral form on a fixed support; returns coef (p, dim).

    For each trajectory ``X(t_j) = X0 + int_{t0}^{t_j} Theta(X) dt @ xi`` (Simpson's rule), with
    the start ``X0`` of every trajectory a free unknown, solved per equation.
    """
    p, d = field.coef.shape
    rows, targets = [], []
    for k, (t, X) in enumerate(trajectories):
        integral = cumulative_simpson(field.theta(X), x=t, axis=0, initial=0.0)     # (n, p)
        start = np.zeros((len(t), len(trajectories)))
        start[:, k] = 1.0
        rows.append(np.hstack([integral, start]))
        targets.append(X)
    A = np.vstack(rows)
    B = np.vstack(targets)
    coef = np.zeros((p, d))
    for i in range(d):
        cols = np.concatenate([np.nonzero(active[:, i])[0], p + np.arange(len(trajectories))])
        sol, *_ = np.linalg.lstsq(A[:, cols], B[:, i], rcond=None)
        coef[cols[cols < p], i] = sol[: int(active[:, i].sum())]
    return coef


def refit(exprs: Sequence[Any], t: Any, X: Any, method: str = "lstsq", *,
          variables: Sequence[str | sympy.Symbol] | None = None, window: int | None = None,
          rtol: float = 1e-10, atol: float = 1e-12) -> list[sympy.Expr]:
    """Re-estimate the nonzero coefficients of ``dx/dt = exprs`` on trajectories ``(t, X)``.

    ``t`` (n,) and ``X`` (n, dim) or lists of them; ``exprs`` has one expression per state, in
    the order of ``variables`` (default: the symbols sorted by name), which is also the order of
    X's columns. ``method="lstsq"``: linear least squares of the integral form;
    ``"trajectory"``: trajectory matching started from the given coefficients (windows of at
    most ``window`` samples, each with a fitted initial state). The support is kept.
    """
    field = PolyField.from_exprs(exprs, variables)
    if len(exprs) != field.dim:
        raise ExpressionError(f"a vector field in {field.dim} variables needs {field.dim} "
                              f"expressions, got {len(exprs)}")
    trajectories = as_trajectories(t, X, dim=field.dim)
    active = field.coef != 0
    if method == "lstsq":
        coef = lstsq_integral(field, active, trajectories)
    elif method == "trajectory":
        coef = fit_trajectories(field.exps, field.coef, active, trajectories, window=window,
                                rtol=rtol, atol=atol).coef
    else:
        raise ExpressionError(f"method must be 'lstsq' or 'trajectory', got {method!r}")
    return field.to_exprs(coef)
