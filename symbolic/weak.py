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

import math
from itertools import combinations

import numpy as np
from scipy.integrate import trapezoid

from symbolic.field import PolyField

__all__ = ["weak_system", "weak_lstsq", "support_lstsq", "sparse_supports", "subset_path",
           "cv_size", "forward_path"]

THRESHOLDS = (0.002, 0.01, 0.03, 0.1, 0.3)
"""Term sizes relative to the largest term of the equation tried by the thresholding."""

HALF_WIDTHS = (8, 24)
"""Half widths (samples) of the weak form's test functions."""

RESIDUALS = (1e-6, 1e-3, 1e-2, 3e-2, 0.1)
"""Relative weak-form residuals at which the best-subset path stops, one support each."""

SUBSET_BUDGET = 100_000
"""Supports of one size are enumerated exhaustively up to this many; beyond, a beam search
extends the best supports of the size below."""

BEAM = 64
"""Supports of each size kept by the beam search."""

FOLDS = 5
"""Contiguous blocks of test functions held out in turn by :func:`cv_size`."""


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


def support_lstsq(G: np.ndarray, b: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Least squares on the columns ``cols`` of ``G``, scaled to unit norm."""
    out = np.zeros(G.shape[1])
    if len(cols):
        norms = np.linalg.norm(G[:, cols], axis=0)
        norms = np.where(norms > 0, norms, 1.0)
        sol, *_ = np.linalg.lstsq(G[:, cols] / norms, b, rcond=1e-12)
        out[cols] = sol / norms
    return out


def _support_coef(G: np.ndarray, b: np.ndarray, active: np.ndarray) -> np.ndarray:
    """:func:`support_lstsq` of every equation (column of ``b``) on its support (column of
    ``active``); coef (p, dim)."""
    return np.stack([support_lstsq(G, b[:, i], np.nonzero(active[:, i])[0])
                     for i in range(b.shape[1])], axis=1)


def weak_lstsq(field: PolyField, active: np.ndarray,
               trajectories: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Least squares of the weak form on the fixed support ``active`` (p, dim); coef (p, dim)."""
    G, b = weak_system(field, trajectories)
    return _support_coef(G, b, active)


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


def _subset_residuals(R: np.ndarray, beta: np.ndarray, supports: np.ndarray) -> np.ndarray:
    """Residual norms ``min_c ||R[:, S] c - beta||`` for every row ``S`` of ``supports``
    (m, k), by batched QR; the residual is formed explicitly (no cancellation on exact data)."""
    out = np.empty(len(supports))
    chunk = max(1, 2_000_000 // max(R.shape[0] * supports.shape[1], 1))
    for lo in range(0, len(supports), chunk):
        sub = supports[lo:lo + chunk]
        Q, _ = np.linalg.qr(R[:, sub].transpose(1, 0, 2))             # (m, p, k)
        r = beta[None, :] - np.einsum("mpk,mk->mp", Q, np.einsum("mpk,p->mk", Q, beta))
        out[lo:lo + chunk] = np.linalg.norm(r, axis=1)
    return out


def subset_path(G: np.ndarray, b: np.ndarray, *, max_terms: int | None = None,
                budget: int = SUBSET_BUDGET, beam: int = BEAM) -> list[tuple[np.ndarray, float]]:
    """Best support of every size for ``G c = b`` (columns scaled to unit norm).

    Sizes with at most ``budget`` supports are searched exhaustively, larger ones by a beam of
    the ``beam`` best supports of the size below, each extended by every other column. Unlike
    greedy forward selection this finds the sparse fit of a library that is strongly correlated
    on the data (e.g. populations that stay near an invariant surface). Returns
    ``(support (p,), relative residual)`` for 1 .. ``max_terms`` terms (default: all).
    """
    p = G.shape[1]
    norms = np.linalg.norm(G, axis=0)
    A = G / np.where(norms > 0, norms, 1.0)
    Q, R = np.linalg.qr(A)                                            # A = Q R, R (p, p)
    beta = Q.T @ b
    outside = max(float(b @ b) - float(beta @ beta), 0.0)
    bnorm = float(np.linalg.norm(b)) or 1.0
    kmax = p if max_terms is None else min(p, int(max_terms))
    path: list[tuple[np.ndarray, float]] = []
    level: np.ndarray = np.zeros((1, 0), dtype=np.int64)
    for k in range(1, kmax + 1):
        if math.comb(p, k) <= budget:
            cand = np.array(list(combinations(range(p), k)), dtype=np.int64)
        else:
            grown = {tuple(sorted(s + (j,))) for s in map(tuple, level.tolist())
                     for j in range(p) if j not in s}
            cand = np.array(sorted(grown), dtype=np.int64)
        res = _subset_residuals(R, beta, cand)
        order = np.argsort(res, kind="stable")[:beam]
        level = cand[order]
        support = np.zeros(p, dtype=bool)
        support[level[0]] = True
        path.append((support, math.sqrt(float(res[order[0]]) ** 2 + outside) / bnorm))
    return path


def cv_size(G: np.ndarray, b: np.ndarray, path: list[tuple[np.ndarray, float]],
            folds: int = FOLDS) -> int:
    """Index into ``path`` of the support chosen by cross-validation over contiguous blocks of
    test functions (one-standard-error rule: the smallest support whose held-out error is within
    one standard error of the lowest), so no noise level is needed."""
    rows = G.shape[0]
    folds = max(2, min(int(folds), rows // 4)) if rows >= 8 else 0
    if not folds or not path:
        return len(path) - 1
    blocks = np.array_split(np.arange(rows), folds)
    errors = np.zeros((len(path), folds))
    for f, test in enumerate(blocks):
        train = np.setdiff1d(np.arange(rows), test)
        for j, (support, _) in enumerate(path):
            c = support_lstsq(G[train], b[train], np.nonzero(support)[0])
            errors[j, f] = float(np.mean((G[test] @ c - b[test]) ** 2))
    mean = errors.mean(axis=1)
    se = errors.std(axis=1, ddof=1) / math.sqrt(folds)
    best = int(np.argmin(mean))
    return int(np.nonzero(mean <= mean[best] + se[best])[0][0])


def sparse_supports(field: PolyField, trajectories: list[tuple[np.ndarray, np.ndarray]],
                    thresholds: tuple[float, ...] = THRESHOLDS,
                    residuals: tuple[float, ...] = RESIDUALS,
                    half_widths: tuple[int, ...] = HALF_WIDTHS,
                    iterations: int = 10) -> list[tuple[np.ndarray, np.ndarray]]:
    """Distinct ``(active (p, dim), coef (p, dim))`` from the weak form with test functions of
    each half width in ``half_widths`` (narrow ones resolve fast dynamics, wide ones average
    noise): sequentially thresholded least squares (a term is kept while ``|c| RMS(monomial)``
    is at least ``threshold`` times the largest term's), the best-subset path of every equation
    (:func:`subset_path`) with its size chosen by cross-validation (:func:`cv_size`), and the
    best-subset paths stopped at each relative residual of ``residuals``."""
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
                c = support_lstsq(G, b[:, i], np.nonzero(keep)[0])
                size = np.abs(c) * rms_m
                new = keep & (size >= threshold * size.max())
                if not new.any():
                    new[int(np.argmax(size))] = True
                if np.array_equal(new, keep):
                    break
                keep = new
            active[:, i] = keep
            coef[:, i] = support_lstsq(G, b[:, i], np.nonzero(keep)[0])
        key = active.tobytes()
        if key not in seen:
            seen.add(key)
            out.append((active, coef))
    paths = [subset_path(G, b[:, i]) for i in range(d)]
    chosen = np.stack([paths[i][cv_size(G, b[:, i], paths[i])][0] for i in range(d)], axis=1)
    key = chosen.tobytes()
    if key not in seen:
        seen.add(key)
        out.append((chosen, _support_coef(G, b, chosen)))
    for level in residuals:
        active = np.zeros((p, d), dtype=bool)
        for i, path in enumerate(paths):
            hit = [s for s, rel in path if rel <= level]
            active[:, i] = hit[0] if hit else (path[-1][0] if path else True)
        key = active.tobytes()
        if key not in seen:
            seen.add(key)
            out.append((active, _support_coef(G, b, active)))
