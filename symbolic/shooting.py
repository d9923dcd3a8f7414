"""Trajectory matching of sparse polynomial ODEs: multiple shooting with SciPy's trust region.

Model: ``dx/dt = phi(x) @ C`` where only the entries of ``C`` (p, dim) marked ``active`` are
free. The samples of every trajectory are cut into windows of at most ``window`` samples; each
window starts from its own free initial state (multiple shooting), so chaotic systems fit too.
Every window is integrated on its own time grid, so trajectories sampled with different time
steps or irregularly fit together; windows with identical relative grids share one batched
integration. The residual is ``(x_model(t_j) - X_j) / scale`` over all samples, ``scale`` per
state: its standard deviation, or its noise level where the caller knows or estimated it
(:func:`state_noise`). Its Jacobian comes from the forward sensitivity equations
``dS/dt = J_f S + df/dtheta``, integrated together with the state by SciPy's DOP853 in float64
at tight tolerances. The Jacobian is block-sparse (dense in the coefficients, one ``dim x dim``
block per window in the initial states) and is handed to :func:`scipy.optimize.least_squares`
(trust-region reflective) as a sparse matrix.

The result says honestly whether the fit converged: the solver must stop on one of its tolerance
tests *and* the final point must be stationary (the residual nearly orthogonal to every Jacobian
column) or reproduce the data to integration accuracy. A trust region that collapsed against a
blow-up, or an exhausted evaluation budget, is reported as not converged. The result carries the
Gauss-Newton covariance of the coefficients, from which z-scores follow.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from scipy import sparse
from scipy.integrate import solve_ivp
from scipy.optimize import least_squares
from threadpoolctl import threadpool_limits

from symbolic import _kernels
from symbolic.errors import FitError, SymbolicDataError

__all__ = ["ShootingResult", "fit_trajectories", "group_windows", "make_windows",
           "local_quadratic", "residual_scale", "state_noise"]

STATIONARY_COSINE = 1e-4
"""A fit is stationary when no Jacobian column has a cosine with the residual above this."""

EXACT_RMS = 1e-7
"""... or when the residual RMS (in units of each variable's std) is below this."""

DENSE_ENTRIES = 4_000_000
"""Up to this many Jacobian entries the trust-region steps are exact (SVD of the dense
Jacobian: fastest and most accurate for small problems); above it the sparse Jacobian goes to
LSMR, whose cost scales with its non-zeros."""

BUDGET_FACTOR = 10
"""Right-hand-side evaluations allowed per trial point, as a multiple of the start's (or of a
reference the caller gives, see ``fit_trajectories(budget=...)``)."""

NULL_EIGENVALUE = 1e-9
"""Eigenvalues of the coefficients' correlation-scaled information matrix below this fraction
of the largest span directions the data cannot identify."""

LSODA_STATES = 2000
"""Most state variables (windows x dim x (1 + coefficients + dim)) one LSODA integration
carries: its stiff mode factorises a dense Jacobian of that size squared, so a larger batch of
windows is split (a few thousand windows of a 60-coefficient model would otherwise ask for tens
of GiB)."""

LSMR_OPTIONS = {"atol": 1e-14, "btol": 1e-14, "conlim": 1e14, "maxiter": 2000}


@dataclass
class ShootingResult:
    """Outcome of :func:`fit_trajectories`.

    ``coef`` (p, dim) fitted coefficients (zero where inactive); ``zscore`` (p, dim) the
    coefficient over its standard error (NaN where inactive); ``x0`` (windows, dim) the fitted
    window initial states; ``rss`` the weighted residual sum of squares over ``n_residuals``
    residuals; ``sigma2`` its per-degree-of-freedom variance; ``converged`` whether the solver
    stopped on a tolerance at a stationary point; ``status``/``message`` the solver's own report;
    ``window`` the window length used; ``states`` the model's states at every sample, one
    (n_k, dim) array per trajectory (the data smoothed by the fitted ODE, window by window);
    ``work`` the right-hand-side evaluations one integration of the fitted model took;
    ``scale`` (dim,) what each state's residuals were divided by (:func:`residual_scale` unless
    the caller gave per-state noise levels).
    """

    coef: np.ndarray
    zscore: np.ndarray
    x0: np.ndarray
    rss: float
    n_residuals: int
    n_params: int
    sigma2: float
    iterations: int
    converged: bool
    status: int = 0
    message: str = ""
    window: int | None = None
    states: list[np.ndarray] | None = None
    work: int = 0
    scale: np.ndarray | None = None


class _Sensitivity:
    """Right-hand side of state + forward sensitivities, batched over windows (NumPy).

    State (flattened): (W, dim, 1 + q + dim): column 0 the state, then d x / d theta for the q
    active coefficients, then d x / d x0.
    """

    def __init__(self, exps: np.ndarray, coef: np.ndarray, active: np.ndarray, windows: int):
        self.E = np.asarray(exps, dtype=np.float64)                          # (p, d)
        self.Ei = np.ascontiguousarray(exps, dtype=np.int64)
        self.Em1 = np.maximum(self.Ei - 1, 0)
        self.degree = int(self.Ei.max()) if self.Ei.size else 0
        self.C = np.ascontiguousarray(coef, dtype=np.float64)                # (p, d)
        self.CT = np.ascontiguousarray(self.C.T)                             # (d, p)
        self.k, self.i = (np.ascontiguousarray(v) for v in np.nonzero(active))
        self.q = len(self.k)
        self.d = self.E.shape[1]
        self.cols = np.arange(self.d)[None, :]
        self.others = [np.delete(np.arange(self.d), j) for j in range(self.d)]
        self.shape = (windows, self.d, 1 + self.q + self.d)
        self.evaluations = 0
        #: the compiled derivative (:mod:`symbolic._kernels`), None: NumPy's below
        self.compiled = _kernels.rhs()

    def __call__(self, t: float, flat: np.ndarray) -> np.ndarray:
        self.evaluations += 1
        s = flat.reshape(self.shape)
        if self.compiled is not None:
            out = np.empty(self.shape)
            self.compiled(np.ascontiguousarray(s), self.Ei, self.C, self.k, self.i, out)
            return out.reshape(-1)
        x = s[..., 0]                                                        # (W, d)
        powers = np.empty((self.degree + 1,) + x.shape)                      # x**0 .. x**deg
        powers[0] = 1.0
        for k in range(1, self.degree + 1):
            powers[k] = powers[k - 1] * x
        pw = powers[self.Ei, :, self.cols]                                   # (p, d, W)
        phi = pw.prod(axis=1)                                                # (p, W)
        pwm1 = powers[self.Em1, :, self.cols]
        dphi = np.empty_like(pw)                                             # (p, d, W)
        for j in range(self.d):
            dphi[:, j] = self.E[:, j, None] * pwm1[:, j] * pw[:, self.others[j]].prod(axis=1)
        out = np.empty_like(s)
        out[..., 0] = (self.CT @ phi).T
        jac = np.matmul(self.CT, dphi.transpose(2, 0, 1))                    # (W, d, d)
        out[..., 1:] = jac @ s[..., 1:]
        out[:, self.i, 1 + np.arange(self.q)] += phi[self.k].T
        return out.reshape(-1)


def make_windows(trajectories: list[tuple[np.ndarray, np.ndarray]],
                 window: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut each trajectory into consecutive windows of at most ``window`` samples (>= 3 each).

    ``window=None`` keeps every trajectory whole. Returns ``(t_window, X_window)`` pairs; every
    window keeps its own sample times.
    """
    out = []
    for t, X in trajectories:
        n = len(t)
        count = 1 if window is None else max(1, int(np.ceil(n / max(int(window), 3))))
        count = min(count, max(1, n // 3))
        for idx in np.array_split(np.arange(n), count):
            out.append((t[idx], X[idx]))
    return out


def residual_scale(trajectories: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Default per-state residual scale (dim,): each state's standard deviation over all samples
    of all trajectories (1 for a constant state). Dividing the residuals by it makes the
    least squares the maximum-likelihood fit when each state's noise is proportional to its
    spread; :func:`state_noise` estimates the levels when it is not."""
    scale = np.concatenate([X for _, X in trajectories]).std(axis=0)
    return np.where(scale > 0, scale, 1.0)


def state_noise(res: "ShootingResult",
                trajectories: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Each state's noise standard deviation (dim,), in the data's units, estimated from the
    residuals of the fit ``res`` to ``trajectories``: the state's residual sum of squares over
    its samples less its share of the fitted parameters (``n_params / dim``) as degrees of
    freedom. Under Gaussian noise of per-state levels these are the weights of the
    maximum-likelihood trajectory fit (``fit_trajectories(scale=...)``)."""
    if res.states is None:
        raise FitError("the fit carries no model states to estimate the noise from")
    resid = np.concatenate([S - X for S, (_, X) in zip(res.states, trajectories)])
    dof = max(resid.shape[0] - res.n_params / max(resid.shape[1], 1), 1.0)
    return np.sqrt(np.sum(resid**2, axis=0) / dof)


def group_windows(windows: list[tuple[np.ndarray, np.ndarray]]) -> list[list[int]]:
    """Indices of windows that share one relative time grid ``t - t[0]`` (to 1e-12 of the
    longest window span), so they can be integrated as one batch on that grid."""
    span = max(float(tw[-1] - tw[0]) for tw, _ in windows) or 1.0
    keys: dict[tuple, list[int]] = {}
    for wi, (tw, _) in enumerate(windows):
        rel = np.round((tw - tw[0]) / span, 12)
        keys.setdefault((len(rel),) + tuple(rel.tolist()), []).append(wi)
    return list(keys.values())


_FORTRAN_FLUSHES: list[Any] | None = None


def _fortran_flushes() -> list[Any]:
    """``flush`` of every Fortran runtime mapped into this process (NumPy and SciPy each ship
    one), found once from ``/proc/self/maps``; none where that is unreadable (not Linux)."""
    global _FORTRAN_FLUSHES
    if _FORTRAN_FLUSHES is None:
        found = []
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "libgfortran" in line})
            for path in paths:
                found.append(ctypes.CDLL(path)._gfortran_flush_i4)
        except (OSError, AttributeError):
            pass
        _FORTRAN_FLUSHES = found
    return _FORTRAN_FLUSHES


@contextlib.contextmanager
def _fortran_quiet(on: bool) -> Iterator[None]:
    """With ``on``, what Fortran writes to standard output meanwhile goes to the null device:
    LSODA prints its warnings there (file descriptor 1, past Python's ``sys.stdout``), which
    would land in what a command writes (a JSON result). The Fortran runtimes buffer it, so
    they are flushed before the descriptor comes back."""
    if not on:
        yield
        return
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):
        yield                       # no descriptor 1 to guard
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        unit = ctypes.c_int(6)      # Fortran's standard output
        for flush in _fortran_flushes():
            flush(ctypes.byref(unit))
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _integrate(rhs: _Sensitivity, s0: np.ndarray, t_rel: np.ndarray, rtol: float, atol: float,
               method: str, max_evaluations: int) -> np.ndarray | None:
    """Integrate the sensitivity system; None when it blows up or the solver fails.

    Returns the solution at ``t_rel`` with shape (T, *s0.shape).
    """
    scale = float(np.abs(s0[..., 0]).max()) + 1.0
    over = False

    def guarded(t: float, y: np.ndarray) -> np.ndarray:
        # past the budget the field is zero, so the solver ends at once: an exception raised
        # here would cross LSODA's Fortran call-back, which prints to the terminal
        nonlocal over
        if over or rhs.evaluations > max_evaluations:
            over = True
            return np.zeros_like(y)
        return rhs(t, y)

    def escape(t: float, y: np.ndarray) -> float:
        return 1e6 * scale - float(np.abs(y.reshape(rhs.shape)[..., 0]).max())

    escape.terminal = True  # type: ignore[attr-defined]
    try:
        with np.errstate(over="ignore", invalid="ignore"), _fortran_quiet(method == "LSODA"):
            sol = solve_ivp(guarded, (0.0, float(t_rel[-1])), s0.reshape(-1), method=method,
                            t_eval=t_rel, rtol=rtol, atol=atol, events=escape)
    except (OverflowError, FloatingPointError, ValueError, MemoryError,
            np.linalg.LinAlgError):
        return None
    if over or sol.status != 0 or sol.y.shape[1] != len(t_rel) or \
            not np.all(np.isfinite(sol.y)):
        return None
    return sol.y.T.reshape((len(t_rel),) + s0.shape)


class _Shooting:
    """Residuals and block-sparse Jacobian of the multiple-shooting problem in ``theta`` =
    (active coefficients, window initial states), with the last evaluation cached."""

    def __init__(self, exps: np.ndarray, coef: np.ndarray, active: np.ndarray,
                 windows: list[tuple[np.ndarray, np.ndarray]], scale: np.ndarray, rtol: float,
                 atol: float, method: str):
        self.exps, self.active, self.windows = exps, active, windows
        self.template = np.asarray(coef, dtype=np.float64).copy()   # inactive entries fixed
        self.scale, self.rtol, self.atol, self.method = scale, rtol, atol, method
        self.d = exps.shape[1]
        self.q = int(active.sum())
        d, q = self.d, self.q
        self.groups = group_windows(windows)
        if method == "LSODA":
            size = max(1, LSODA_STATES // (d * (1 + q + d)))
            self.groups = [g[lo:lo + size] for g in self.groups for lo in range(0, len(g), size)]
        self.order = [wi for group in self.groups for wi in group]
        lengths = np.array([len(windows[wi][0]) for wi in self.order])
        self.n_res = int(lengths.sum()) * d
        self.n_par = q + len(windows) * d
        # sparsity pattern: every residual row depends on all q coefficients and on the d
        # initial states of its own window
        rows_c, cols_c, rows_x, cols_x = [], [], [], []
        start = 0
        for wi, length in zip(self.order, lengths):
            rows = start + np.arange(length * d)
            rows_c.append(np.repeat(rows, q))
            cols_c.append(np.tile(np.arange(q), len(rows)))
            rows_x.append(np.repeat(rows, d))
            cols_x.append(np.tile(q + wi * d + np.arange(d), len(rows)))
            start += length * d
        self.rows = np.concatenate(rows_c + rows_x)
        self.cols = np.concatenate(cols_c + cols_x)
        self.budget = 200_000
        self.cache: tuple[bytes, tuple[np.ndarray, sparse.csr_matrix] | None] | None = None

    def unpack(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = self.template.copy()
        c[self.active] = theta[:self.q]
        return c, theta[self.q:].reshape(-1, self.d)

    def evaluate(self, theta: np.ndarray) -> tuple[np.ndarray, sparse.csr_matrix] | None:
        key = theta.tobytes()
        if self.cache is not None and self.cache[0] == key:
            return self.cache[1]
        coef, x0 = self.unpack(theta)
        d, q = self.d, self.q
        res, jac_c, jac_x = [], [], []
        states: dict[int, np.ndarray] = {}
        used = 0
        out: tuple[np.ndarray, sparse.csr_matrix] | None = None
        # monomials no equation uses need no evaluation
        rows = self.active.any(axis=1) | (self.template != 0).any(axis=1)
        for group in self.groups:
            rhs = _Sensitivity(self.exps[rows], coef[rows], self.active[rows], len(group))
            t_rel = self.windows[group[0]][0] - self.windows[group[0]][0][0]
            s0 = np.zeros(rhs.shape)
            s0[:, :, 0] = x0[group]
            s0[:, :, 1 + q:] = np.eye(d)
            sol = _integrate(rhs, s0, t_rel, self.rtol, self.atol, self.method,
                             max(self.budget - used, 1))
            used += rhs.evaluations
            if sol is None:                                 # sol: (T, G, d, 1 + q + d)
                break
            for g, wi in enumerate(group):
                states[wi] = sol[:, g, :, 0]
                res.append(((sol[:, g, :, 0] - self.windows[wi][1]) / self.scale).reshape(-1))
                jac_c.append((sol[:, g, :, 1:1 + q] / self.scale[None, :, None]).reshape(-1))
                jac_x.append((sol[:, g, :, 1 + q:] / self.scale[None, :, None]).reshape(-1))
        else:
            data = np.concatenate(jac_c + jac_x)
            jac = sparse.csr_matrix((data, (self.rows, self.cols)),
                                    shape=(self.n_res, self.n_par))
            out = (np.concatenate(res), jac)
            self.used = used
            self.states = states
        self.cache = (key, out)
        return out

    def residuals(self, theta: np.ndarray) -> np.ndarray:
        out = self.evaluate(theta)
        return np.full(self.n_res, np.inf) if out is None else out[0]

    def jacobian(self, theta: np.ndarray) -> sparse.csr_matrix:
        out = self.evaluate(theta)
        if out is None:
            raise FitError("the trajectory fit asked for a Jacobian where the model blows up")
        return out[1]


def _stationary(r: np.ndarray, jac: sparse.csr_matrix) -> bool:
    """True when the residual reproduces the data to integration accuracy or is nearly
    orthogonal to every Jacobian column (a first-order stationary point)."""
    rnorm = float(np.linalg.norm(r))
    if rnorm <= EXACT_RMS * np.sqrt(max(r.size, 1)):
        return True
    cosine = np.abs(jac.T @ r) / (_column_norms(jac) * rnorm + 1e-300)
    return bool(np.all(cosine <= STATIONARY_COSINE))


def _column_norms(jac: sparse.csr_matrix) -> np.ndarray:
    """The Euclidean norm of every column of ``jac``."""
    return np.sqrt(np.asarray(jac.multiply(jac).sum(axis=0)).ravel())


def _coefficient_covariance(jac: sparse.csr_matrix, q: int, d: int
                            ) -> tuple[np.ndarray, np.ndarray]:
    """``[(J^T J)^+]`` restricted to the q coefficients, by the Schur complement over the
    block-diagonal initial-state part (one small block per window), and the same of ``J S``,
    the columns scaled to unit norm, from which the first is scaled back (the same where the
    inverse exists). The monomials' columns grow with their degree in the data's units (``x y``
    of states near 1e8 is 1e16 where ``x`` is 1e8), and in ``J^T J`` their squares would leave
    no digit of float64 to the small ones: a pseudo-inverse then takes the small ones for a
    null space. Both (q, q)."""
    norms = _column_norms(jac)
    unit = 1.0 / np.where(norms > 0, norms, 1.0)
    on_unit = _covariance_of((jac @ sparse.diags(unit)).tocsr(), q, d)
    return on_unit * np.outer(unit[:q], unit[:q]), on_unit


def _covariance_of(jac: sparse.csr_matrix, q: int, d: int) -> np.ndarray:
    """:func:`_coefficient_covariance` of a Jacobian as it is."""
    jtj = (jac.T @ jac).tocsr()
    A = jtj[:q, :q].toarray()
    B = jtj[:q, q:].toarray()
    D = jtj[q:, q:].tocsr()
    n = D.shape[0]
    schur = A
    if n:
        blocks = D.toarray().reshape(n // d, d, n // d, d)[np.arange(n // d), :, np.arange(n // d)]
        inv = np.linalg.pinv(blocks)                                     # (W, d, d)
        Bw = B.reshape(q, n // d, d).transpose(1, 0, 2)                  # (W, q, d)
        schur = A - np.einsum("wqd,wde,wpe->qp", Bw, inv, Bw)
    return np.linalg.pinv(schur)


def _unidentifiable(on_unit: np.ndarray) -> np.ndarray:
    """(q,) True for coefficients that lie in the null space of the information matrix (a
    library collinear on the trajectories, e.g. under a conservation law): the data cannot tell
    them from combinations of the others, so their z-score is 0. ``on_unit``: the coefficients'
    covariance on unit columns (:func:`_coefficient_covariance`; the correlation below does not
    depend on the columns' scales)."""
    info = np.linalg.pinv(on_unit)
    scale = np.sqrt(np.maximum(np.diag(info), 1e-300))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        corr = np.nan_to_num(info / scale[:, None] / scale[None, :], posinf=0.0, neginf=0.0)
    vals, vecs = np.linalg.eigh(corr)
    null = vecs[:, vals <= NULL_EIGENVALUE * max(float(vals.max()), 1e-300)]
    return np.sum(null**2, axis=1) > 0.01


def fit_trajectories(exps: np.ndarray, coef: np.ndarray, active: np.ndarray,
                     trajectories: list[tuple[np.ndarray, np.ndarray]], *,
                     window: int | None = None, x0: np.ndarray | None = None,
                     rtol: float = 1e-10, atol: float = 1e-12, method: str = "DOP853",
                     max_iter: int = 100, tol: float = 1e-10,
                     fixed: bool = False, budget: int | None = None,
                     scale: np.ndarray | None = None) -> ShootingResult:
    """Fit the active coefficients of ``dx/dt = phi(x) @ coef`` to trajectories.

    ``exps`` (p, d) monomial exponents, ``coef`` (p, d) initial coefficients, ``active`` (p, d)
    bool mask of free entries (none: only the window starts are fitted), ``trajectories`` a list
    of ``(t (n,), X (n, d))``, each with its own sample times. ``x0`` (windows, d) optional
    initial guesses of the window starts (default: the first sample of each window).
    ``scipy.optimize.least_squares`` (trust region reflective, sparse Jacobian) with ``ftol`` =
    ``xtol`` = ``gtol`` = ``tol`` and at most ``max_iter`` evaluations. Raises
    :class:`FitError` when the starting model blows up on the windows. Inactive entries are
    zero, or with ``fixed=True`` keep their value in ``coef`` (e.g. ``active`` all False and
    ``fixed=True`` fits only the window starts of a given model). ``budget``: right-hand-side
    evaluations one integration may take (default: ``BUDGET_FACTOR`` times the start's); a
    start that needs more raises FitError, a trial point that needs more counts as a blow-up.
    ``scale`` (dim,): what each state's residuals are divided by (default
    :func:`residual_scale`, each state's standard deviation); with each state's noise level
    (:func:`state_noise`) the fit is the maximum-likelihood one under per-state Gaussian noise
    of any levels.
    """
    exps = np.asarray(exps, dtype=np.int64)
    active = np.asarray(active, dtype=bool)
    coef = np.asarray(coef, dtype=np.float64)
    coef = coef.copy() if fixed else np.where(active, coef, 0.0)
    windows = make_windows(trajectories, window)
    d = exps.shape[1]
    start = np.array([X[0] for _, X in windows]) if x0 is None else \
        np.array(x0, dtype=np.float64).reshape(len(windows), d)
    theta = np.concatenate([coef[active], start.reshape(-1)])
    problem = _shooting_problem(exps, coef, active, windows, trajectories, theta, rtol, atol,
                                method, budget, scale)
    dense = problem.n_res * problem.n_par <= DENSE_ENTRIES
    jac = (lambda th: problem.jacobian(th).toarray()) if dense else problem.jacobian
    with threadpool_limits(limits=1):
        sol = least_squares(problem.residuals, theta, jac=jac, method="trf", x_scale="jac",
                            tr_solver="exact" if dense else "lsmr",
                            tr_options={} if dense else LSMR_OPTIONS,
                            ftol=tol, xtol=tol, gtol=tol, max_nfev=max_iter)
    final = problem.evaluate(sol.x)
    if final is None:
        raise FitError("the trajectory fit ended where the model blows up")
    return _shooting_result(problem, sol, final, coef, active, windows, trajectories, window)


def _shooting_problem(exps: np.ndarray, coef: np.ndarray, active: np.ndarray,
                      windows: list[tuple[np.ndarray, np.ndarray]],
                      trajectories: list[tuple[np.ndarray, np.ndarray]], theta: np.ndarray,
                      rtol: float, atol: float, method: str,
                      budget: int | None, scale: np.ndarray | None = None) -> "_Shooting":
    """The multiple-shooting problem at ``theta``, integrated by ``method`` or, where that fails,
    LSODA; a trial point needing far more right-hand-side evaluations than the start (or than
    ``budget``) is treated like a blow-up (the trust region shrinks) instead of being
    integrated at any cost. Raises FitError when the start blows up with both or needs more
    than ``budget``. ``scale``: per-state residual scale (default :func:`residual_scale`)."""
    if scale is None:
        scale = residual_scale(trajectories)
    else:
        scale = np.asarray(scale, dtype=np.float64).reshape(-1)
        if scale.shape != (exps.shape[1],) or not np.all(np.isfinite(scale) & (scale > 0)):
            raise SymbolicDataError(f"scale must hold {exps.shape[1]} positive finite numbers, "
                                    f"got {scale}")
    for solver in (method, "LSODA"):
        problem = _Shooting(exps, coef, active, windows, scale, rtol, atol, solver)
        if budget is not None:
            problem.budget = int(budget)
        if problem.evaluate(theta) is not None:
            problem.budget = min(max(5000, BUDGET_FACTOR * problem.used),
                                 problem.budget if budget is not None else 1 << 62)
            return problem
    longest = max(len(tw) for tw, _ in windows)
    within = "" if budget is None else f" or needs more than {int(budget)} right-hand-side " \
        f"evaluations (stiff)"
    raise FitError(f"the starting polynomial model blows up{within} within windows of "
                   f"{longest} samples; start from other coefficients or use shorter windows")


def _shooting_result(problem: "_Shooting", sol: Any, final: tuple[np.ndarray, Any],
                     coef: np.ndarray, active: np.ndarray,
                     windows: list[tuple[np.ndarray, np.ndarray]],
                     trajectories: list[tuple[np.ndarray, np.ndarray]],
                     window: int | None) -> ShootingResult:
    """Coefficients, window starts, z-scores (zero where unidentifiable), noise estimate and
    honest convergence flag of a finished least-squares fit."""
    r, jac = final
    c, x = problem.unpack(sol.x)
    q, d = problem.q, coef.shape[1]
    cost = float(r @ r)
    n_res, n_par = r.size, sol.x.size
    sigma2 = cost / max(n_res - n_par, 1)
    zscore = np.full(coef.shape, np.nan)
    if q:
        try:
            cov, on_unit = _coefficient_covariance(jac, q, d)
            se = np.sqrt(np.maximum(np.diag(cov * sigma2), 1e-300))
            zscore[active] = np.where(_unidentifiable(on_unit), 0.0, sol.x[:q] / se)
        except np.linalg.LinAlgError:
            pass
    converged = bool(sol.status > 0 and _stationary(r, jac))
    smoothed = np.concatenate([problem.states[wi] for wi in range(len(windows))])
    bounds = np.cumsum([len(tk) for tk, _ in trajectories])[:-1]
    return ShootingResult(c, zscore, x, cost, n_res, n_par, sigma2, int(sol.nfev), converged,
                          int(sol.status), str(sol.message), window,
                          np.split(smoothed, bounds), int(problem.used), problem.scale.copy())


def local_quadratic(exps: np.ndarray, res: ShootingResult, active: np.ndarray,
                    trajectories: list[tuple[np.ndarray, np.ndarray]], *, rtol: float = 1e-10,
                    atol: float = 1e-12, budget: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gauss-Newton model of the residual sum of squares around the fit ``res`` of the support
    ``active`` in *every* library coefficient, the window starts minimised out.

    One evaluation of the sensitivities to all coefficients at the fitted point (on the windows
    of ``res``) gives the Jacobian ``J`` and residual ``r``; the information ``J^T J`` and
    gradient ``J^T r`` are reduced over the window starts (Schur complement, one block per
    window). With coefficients scaled by ``norm`` (``c' = c * norm``, unit diagonal),
    ``RSS(c) ~ RSS + 2 g^T (c' - c0') + (c' - c0')^T S (c' - c0')``. Returns ``S`` (P, P),
    ``g`` (P,) and ``norm`` (P,) over the flattened (p, dim) coefficients. Raises
    :class:`FitError` when the model blows up on the windows.
    """
    exps = np.asarray(exps, dtype=np.int64)
    active = np.asarray(active, dtype=bool)
    coef = np.where(active, res.coef, 0.0)
    windows = make_windows(trajectories, res.window)
    d = exps.shape[1]
    theta = np.concatenate([coef.reshape(-1), np.asarray(res.x0, dtype=np.float64).reshape(-1)])
    problem = _shooting_problem(exps, coef, np.ones_like(active), windows, trajectories, theta,
                                rtol, atol, "DOP853", budget)
    r, jac = problem.evaluate(theta)
    q = problem.q
    jtj = (jac.T @ jac).tocsr()
    grad = np.asarray(jac.T @ r).ravel()
    A = jtj[:q, :q].toarray()
    g = grad[:q]
    n = jtj.shape[0] - q
    if n:
        B = jtj[:q, q:].toarray()
        # the window starts couple only within their window: read the (W, d, d) diagonal
        # blocks from the sparse matrix (its dense (n, n) form grows as the windows squared)
        D = jtj[q:, q:].tocoo()
        inside = D.row // d == D.col // d
        blocks = np.zeros((n // d, d, d))
        np.add.at(blocks, (D.row[inside] // d, D.row[inside] % d, D.col[inside] % d),
                  D.data[inside])
        inv = np.linalg.pinv(blocks)                                     # (W, d, d)
        Bw = B.reshape(q, n // d, d).transpose(1, 0, 2)                  # (W, q, d)
        A = A - np.einsum("wqd,wde,wpe->qp", Bw, inv, Bw)
        g = g - np.einsum("wqd,wde,we->q", Bw, inv, grad[q:].reshape(n // d, d))
    norm = np.sqrt(np.maximum(np.diag(A), 1e-300))
    return A / norm[:, None] / norm[None, :], g / norm, norm

