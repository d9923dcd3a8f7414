"""Weak-form least squares and sequentially thresholded supports: cheap, derivative-free starts.

For a smooth test function ``psi`` vanishing at both ends of its support, ``dx/dt = Theta(x) xi``
gives ``-int psi'(t) x(t) dt = int psi(t) Theta(x(t)) dt @ xi`` with no derivative of the data
(weak SINDy). :func:`weak_system` builds ``G`` (K, p) and ``b`` (K, dim) from overlapping bumps
``psi(t) = (1 - s^2)^4``, ``s = (t - c) / h``, on every trajectory (trapezoid quadrature on the
samples, so any sampling works). :func:`sparse_supports` runs sequentially thresholded least
squares on it over a grid of thresholds and returns the distinct supports with their
coefficients; a library that is collinear on the data (a conservation law such as
``S + I + R = 1``) is thinned by the thresholding instead of making the fit singular.
"""

from __future__ import annotations

import numpy as np
from scipy.integrate import trapezoid

from symbolic.field import PolyField

__all__ = ["weak_system", "weak_lstsq", "sparse_supports"]

THRESHOLDS = (0.002, 0.01, 0.03, 0.1, 0.3)
"""Term sizes relative to the largest term of the equation tried by the thresholding."""

HALF_WIDTHS = (8, 24)
"""Half widths (samples) of the weak form's test functions."""

RESIDUALS = (1e-6, 1e-3, 1e-2, 3e-2, 0.1)
"""Relative weak-form residuals at which forward selection stops, one support each."""


def weak_system(field: PolyField, trajectories: list[tuple[np.ndarray, np.ndarray]], *,
                half_width: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Weak-form equations ``G @ xi = b``: ``G`` (K, p), ``b`` (K, dim), K test functions.

    Bumps of ``2 * half_width + 1`` samples (fewer on short trajectories), centred every
    ``half_width`` samples.
    """
    rows, rhs = [], []
    for t, X in trajectories:
        n = len(t)
        h = int(max(2, min(half_width, (n - 1) // 2)))
        theta = field.theta(X)                                        # (n, p)
        for centre in range(h, n - h, h):
            lo, hi = centre - h, centre + h + 1
            tt = t[lo:hi]
            c, width = 0.5 * (tt[0] + tt[-1]), 0.5 * (tt[-1] - tt[0])
            s = (tt - c) / width
            psi = (1.0 - s**2) ** 4
            dpsi = -8.0 * s * (1.0 - s**2) ** 3 / width
            rows.append(trapezoid(psi[:, None] * theta[lo:hi], tt, axis=0))
            rhs.append(-trapezoid(dpsi[:, None] * X[lo:hi], tt, axis=0))
    return np.array(rows).reshape(-1, field.exps.shape[0]), np.array(rhs).reshape(-1, field.dim)


def _lstsq(G: np.ndarray, b: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Least squares on the columns ``cols`` of ``G``, scaled to unit norm."""
    out = np.zeros(G.shape[1])
    if len(cols):
        norms = np.linalg.norm(G[:, cols], axis=0)
        norms = np.where(norms > 0, norms, 1.0)
        sol, *_ = np.linalg.lstsq(G[:, cols] / norms, b, rcond=1e-12)
        out[cols] = sol / norms
    return out


def weak_lstsq(field: PolyField, active: np.ndarray,
               trajectories: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Least squares of the weak form on the fixed support ``active`` (p, dim); coef (p, dim)."""
    G, b = weak_system(field, trajectories)
    return np.stack([_lstsq(G, b[:, i], np.nonzero(active[:, i])[0])
                     for i in range(field.dim)], axis=1)


def forward_path(G: np.ndarray, b: np.ndarray) -> list[tuple[np.ndarray, float]]:
    """Orthogonal least squares forward selection on ``G c = b``: at every step the column
    whose addition lowers the residual most. Returns ``(support (p,), relative residual)`` for
    1, 2, ... terms; on a library that is collinear on the data it finds sparse exact fits that
    thresholding a dense solution misses."""
    p = G.shape[1]
    norms = np.linalg.norm(G, axis=0)
    A = G / np.where(norms > 0, norms, 1.0)
    bnorm = float(np.linalg.norm(b)) or 1.0
    chosen: list[int] = []
    path = []
    Q = np.zeros((G.shape[0], 0))
    r = b.copy()
    for _ in range(p):
        rest = [j for j in range(p) if j not in chosen]
        proj = A[:, rest] - Q @ (Q.T @ A[:, rest])            # parts orthogonal to the chosen
        pn = np.linalg.norm(proj, axis=0)
        gain = np.where(pn > 1e-10, np.abs(proj.T @ r) / np.where(pn > 1e-10, pn, 1.0), -1.0)
        if gain.max() < 0:
            break
        k = int(np.argmax(gain))
        q = proj[:, k] / pn[k]
        Q = np.hstack([Q, q[:, None]])
        r = r - q * (q @ r)
        chosen.append(rest[k])
        support = np.zeros(p, dtype=bool)
        support[chosen] = True
        path.append((support, float(np.linalg.norm(r)) / bnorm))
    return path


def sparse_supports(field: PolyField, trajectories: list[tuple[np.ndarray, np.ndarray]],
                    thresholds: tuple[float, ...] = THRESHOLDS,
                    residuals: tuple[float, ...] = RESIDUALS,
                    half_widths: tuple[int, ...] = HALF_WIDTHS,
                    iterations: int = 10) -> list[tuple[np.ndarray, np.ndarray]]:
    """Distinct ``(active (p, dim), coef (p, dim))`` from the weak form with test functions of
    each half width in ``half_widths`` (narrow ones resolve fast dynamics, wide ones average
    noise): sequentially thresholded least squares (a term is kept while ``|c| RMS(monomial)``
    is at least ``threshold`` times the largest term's), then forward selection stopped at each
    relative residual of ``residuals``."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    seen: set[bytes] = set()
    for half_width in half_widths:
        G, b = weak_system(field, trajectories, half_width=half_width)
        _supports(field, trajectories, G, b, thresholds, residuals, iterations, out, seen)
    return out


def _supports(field: PolyField, trajectories: list[tuple[np.ndarray, np.ndarray]],
              G: np.ndarray, b: np.ndarray, thresholds: tuple[float, ...],
              residuals: tuple[float, ...], iterations: int,
              out: list[tuple[np.ndarray, np.ndarray]], seen: set[bytes]) -> None:
    """Append the supports of one weak system ``G``, ``b`` not in ``seen`` to ``out``."""
    X = np.concatenate([Xi for _, Xi in trajectories])
    theta = field.theta(X)                                            # (N, p)
    rms_m = np.sqrt(np.mean(theta**2, axis=0))                        # (p,)
    p, d = field.exps.shape[0], field.dim
    for threshold in thresholds:
        active = np.ones((p, d), dtype=bool)
        coef = np.zeros((p, d))
        for i in range(d):
            keep = np.ones(p, dtype=bool)
            for _ in range(iterations):
                c = _lstsq(G, b[:, i], np.nonzero(keep)[0])
                size = np.abs(c) * rms_m
                new = keep & (size >= threshold * size.max())
                if not new.any():
                    new[int(np.argmax(size))] = True
                if np.array_equal(new, keep):
                    break
                keep = new
            active[:, i] = keep
            coef[:, i] = _lstsq(G, b[:, i], np.nonzero(keep)[0])
        key = active.tobytes()
        if key not in seen:
            seen.add(key)
            out.append((active, coef))
    paths = [forward_path(G, b[:, i]) for i in range(d)]
    for level in residuals:
        active = np.zeros((p, d), dtype=bool)
        for i, path in enumerate(paths):
            hit = [s for s, rel in path if rel <= level]
            active[:, i] = hit[0] if hit else (path[-1][0] if path else True)
        key = active.tobytes()
        if key not in seen:
            seen.add(key)
            coef = np.stack([_lstsq(G, b[:, i], np.nonzero(active[:, i])[0])
                             for i in range(d)], axis=1)
            out.append((active, coef))
