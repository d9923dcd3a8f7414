"""Trajectory matching of sparse polynomial ODEs: Levenberg-Marquardt over short windows.

Model: ``dx/dt = phi(x) @ C`` where only the entries of ``C`` (p, dim) marked ``active`` are
free. The samples of every trajectory are cut into windows of at most ``window`` samples; each
window starts from its own free initial state (multiple shooting), so chaotic systems fit too.
The residual is ``(x_model(t_j) - X_j) / scale`` over all samples; its Jacobian comes from the
forward sensitivity equations ``dS/dt = J_f S + df/dtheta``, integrated together with the state
by SciPy's DOP853 in float64 at tight tolerances (for these small systems at rtol 1e-10 this is
one to two orders of magnitude faster than a torch right-hand side under torchdiffeq), and
Levenberg-Marquardt steps minimise it. The result carries the Gauss-Newton covariance of the
coefficients, from which z-scores follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.integrate import solve_ivp

from symbolic.errors import FitError

__all__ = ["ShootingResult", "fit_trajectories", "make_windows"]


@dataclass
class ShootingResult:
    """Outcome of :func:`fit_trajectories`.

    ``coef`` (p, dim) fitted coefficients (zero where inactive); ``zscore`` (p, dim) the
    coefficient over its standard error (NaN where inactive); ``x0`` (windows, dim) the fitted
    window initial states; ``rss`` the weighted residual sum of squares over ``n_residuals``
    residuals; ``sigma2`` its per-degree-of-freedom variance.
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


class _Sensitivity:
    """Right-hand side of state + forward sensitivities, batched over windows (NumPy).

    State (flattened): (W, dim, 1 + q + dim): column 0 the state, then d x / d theta for the q
    active coefficients, then d x / d x0.
    """

    def __init__(self, exps: np.ndarray, coef: np.ndarray, active: np.ndarray, windows: int):
        self.E = np.asarray(exps, dtype=np.float64)                          # (p, d)
        self.Em1 = np.maximum(self.E - 1.0, 0.0)
        self.C = np.asarray(coef, dtype=np.float64)                          # (p, d)
        self.k, self.i = np.nonzero(active)
        self.q = len(self.k)
        self.d = self.E.shape[1]
        self.shape = (windows, self.d, 1 + self.q + self.d)
        self.evaluations = 0

    def __call__(self, t: float, flat: np.ndarray) -> np.ndarray:
        self.evaluations += 1
        s = flat.reshape(self.shape)
        x = s[..., 0]                                                        # (W, d)
        pw = x[:, None, :] ** self.E                                         # (W, p, d)
        phi = pw.prod(axis=2)                                                # (W, p)
        pwm1 = x[:, None, :] ** self.Em1
        dphi = np.empty_like(pw)                                             # (W, p, d)
        for j in range(self.d):
            others = np.delete(pw, j, axis=2).prod(axis=2)
            dphi[..., j] = self.E[:, j] * pwm1[..., j] * others
        out = np.empty_like(s)
        out[..., 0] = phi @ self.C
        jac = np.einsum("wkj,ki->wij", dphi, self.C)                         # (W, d, d)
        out[..., 1:] = jac @ s[..., 1:]
        out[:, self.i, 1 + np.arange(self.q)] += phi[:, self.k]
        return out.reshape(-1)


def make_windows(trajectories: list[tuple[np.ndarray, np.ndarray]],
                 window: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut each trajectory into consecutive windows of at most ``window`` samples (>= 3 each).

    ``window=None`` keeps every trajectory whole. Returns ``(t_window, X_window)`` pairs.
    """
    out = []
    for t, X in trajectories:
        n = len(t)
        count = 1 if window is None else max(1, int(np.ceil(n / max(int(window), 3))))
        count = min(count, max(1, n // 3))
        for idx in np.array_split(np.arange(n), count):
            out.append((t[idx], X[idx]))
    return out


def _integrate(rhs: _Sensitivity, s0: np.ndarray, t_rel: np.ndarray, rtol: float, atol: float,
               method: str, max_evaluations: int = 200_000) -> np.ndarray | None:
    """Integrate the sensitivity system; None when it blows up or the solver fails.

    Returns the solution at ``t_rel`` with shape (T, *s0.shape).
    """
    scale = float(np.abs(s0[..., 0]).max()) + 1.0

    def guarded(t: float, y: np.ndarray) -> np.ndarray:
        if rhs.evaluations > max_evaluations:
            raise OverflowError("too many evaluations")
        return rhs(t, y)

    def escape(t: float, y: np.ndarray) -> float:
        return 1e6 * scale - float(np.abs(y.reshape(rhs.shape)[..., 0]).max())

    escape.terminal = True  # type: ignore[attr-defined]
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            sol = solve_ivp(guarded, (0.0, float(t_rel[-1])), s0.reshape(-1), method=method,
                            t_eval=t_rel, rtol=rtol, atol=atol, events=escape)
    except (OverflowError, FloatingPointError, ValueError):
        return None
    if sol.status != 0 or sol.y.shape[1] != len(t_rel) or not np.all(np.isfinite(sol.y)):
        return None
    return sol.y.T.reshape((len(t_rel),) + s0.shape)


def _evaluate(exps: np.ndarray, coef: np.ndarray, x0: np.ndarray, active: np.ndarray,
              windows: list[tuple[np.ndarray, np.ndarray]], groups: list[list[int]],
              scale: np.ndarray, rtol: float, atol: float, method: str,
              budget: int = 200_000) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Residuals (N,), Jacobian (N, q + W * d) and right-hand-side evaluations used at
    (coef, x0); None if integration fails or needs more than ``budget`` evaluations."""
    d, nw = exps.shape[1], len(windows)
    res_parts, jac_parts = [], []
    used = 0
    for group in groups:
        rhs = _Sensitivity(exps, coef, active, len(group))
        q = rhs.q
        t_rel = windows[group[0]][0] - windows[group[0]][0][0]
        s0 = np.zeros(rhs.shape)
        s0[:, :, 0] = x0[group]
        s0[:, :, 1 + q:] = np.eye(d)
        sol = _integrate(rhs, s0, t_rel, rtol, atol, method, max(budget - used, 1))
        used += rhs.evaluations
        if sol is None:
            return None                                     # sol: (T, G, d, 1 + q + d)
        for g, wi in enumerate(group):
            data = windows[wi][1]                           # (T, d)
            res_parts.append(((sol[:, g, :, 0] - data) / scale).reshape(-1))
            block = np.zeros((sol.shape[0] * d, q + nw * d))
            block[:, :q] = (sol[:, g, :, 1:1 + q] / scale[None, :, None]).reshape(-1, q)
            block[:, q + wi * d:q + (wi + 1) * d] = \
                (sol[:, g, :, 1 + q:] / scale[None, :, None]).reshape(-1, d)
            jac_parts.append(block)
    return np.concatenate(res_parts), np.concatenate(jac_parts, axis=0), used


def fit_trajectories(exps: np.ndarray, coef: np.ndarray, active: np.ndarray,
                     trajectories: list[tuple[np.ndarray, np.ndarray]], *,
                     window: int | None = None, x0: np.ndarray | None = None,
                     rtol: float = 1e-10, atol: float = 1e-12, method: str = "DOP853",
                     max_iter: int = 60, tol: float = 1e-10) -> ShootingResult:
    """Fit the active coefficients of ``dx/dt = phi(x) @ coef`` to trajectories.

    ``exps`` (p, d) monomial exponents, ``coef`` (p, d) initial coefficients, ``active`` (p, d)
    bool mask of free entries, ``trajectories`` a list of ``(t (n,), X (n, d))``. ``x0``
    (windows, d) optional initial guesses of the window starts (default: the first sample of
    each window). Levenberg-Marquardt until the relative cost change falls below ``tol``.
    """
    exps = np.asarray(exps, dtype=np.int64)
    coef = np.where(active, np.asarray(coef, dtype=np.float64), 0.0)
    active = np.asarray(active, dtype=bool)
    windows = make_windows(trajectories, window)
    d = exps.shape[1]
    scale = np.concatenate([X for _, X in trajectories]).std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    keys: dict[tuple, list[int]] = {}
    for wi, (tw, _) in enumerate(windows):
        rel = tw - tw[0]
        keys.setdefault((len(rel),) + tuple(np.round(rel / max(rel[-1], 1e-300), 9)),
                        []).append(wi)
    groups = list(keys.values())
    x = np.array([X[0] for _, X in windows]) if x0 is None else np.array(x0, dtype=np.float64)
    q = int(active.sum())
    theta = np.concatenate([coef[active], x.reshape(-1)])

    def unpack(th: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = np.zeros_like(coef)
        c[active] = th[:q]
        return c, th[q:].reshape(-1, d)

    current = _evaluate(exps, *unpack(theta), active, windows, groups, scale, rtol, atol, method)
    if current is None:
        current = _evaluate(exps, *unpack(theta), active, windows, groups, scale, rtol, atol,
                            "LSODA")
        if current is None:
            raise FitError("the initial polynomial model blows up on the data's time span; "
                           "start from smaller coefficients or use shorter windows")
    r, jac, used = current
    cost = float(r @ r)
    lam = 1e-3
    converged = False
    it = 0
    for it in range(1, max_iter + 1):
        g = jac.T @ r
        h = jac.T @ jac
        diag = np.diag(h).copy()
        diag[diag <= 0] = 1.0
        improved = False
        while lam < 1e12:
            try:
                step = np.linalg.solve(h + lam * np.diag(diag), -g)
            except np.linalg.LinAlgError:
                lam *= 10.0
                continue
            trial = theta + step
            out = _evaluate(exps, *unpack(trial), active, windows, groups, scale, rtol, atol,
                            method, budget=max(5000, 20 * used))
            if out is not None and float(out[0] @ out[0]) < cost:
                new_cost = float(out[0] @ out[0])
                rel_change = (cost - new_cost) / max(cost, 1e-300)
                small_step = np.linalg.norm(step) <= 1e-10 * (np.linalg.norm(theta) + 1e-10)
                theta, (r, jac, used), cost = trial, out, new_cost
                lam = max(lam / 10.0, 1e-12)
                improved = True
                if rel_change < tol or small_step:
                    converged = True
                break
            lam *= 10.0
        if not improved:
            converged = True
            break
        if converged:
            break
    c, x = unpack(theta)
    n_res, n_par = r.size, theta.size
    sigma2 = cost / max(n_res - n_par, 1)
    zscore = np.full(coef.shape, np.nan)
    try:
        cov = np.linalg.pinv(jac.T @ jac)[:q, :q] * sigma2
        se = np.sqrt(np.maximum(np.diag(cov), 1e-300))
        zscore[active] = theta[:q] / se
    except np.linalg.LinAlgError:
        pass
    return ShootingResult(c, zscore, x, cost, n_res, n_par, sigma2, it, converged)
