"""The compiled right-hand side of the trajectory fits' sensitivity system.

A trajectory fit integrates, per window, the model's state with its derivatives by the active
coefficients and by the window's initial state (:class:`symbolic.shooting._Sensitivity`).
The states are few (a window's ``d`` variables and their ``d (q + d)`` sensitivities) and the
solver calls the right-hand side hundreds of thousands of times per fit, so NumPy's per-call
overhead (a dozen array operations on tiny arrays) is most of a fit's time. :func:`rhs` is the
same arithmetic compiled by numba, on first use, cached on disk and checked against the NumPy
reference on random states; where numba is missing, the check fails or
:data:`polynets._compiled.ENV_DISABLE` is set, it returns ``None`` and says why in
:func:`reason`, and the fits keep the NumPy path (the same values up to rounding).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from polynets._compiled import ENV_DISABLE, disabled

__all__ = ["rhs", "reason"]

_STATE: dict[str, Any] = {}


def reason() -> str:
    """Why the compiled right-hand side is not used ('' when it is, or not yet tried)."""
    if disabled():
        return f"{ENV_DISABLE} is set"
    return str(_STATE.get("reason", ""))


def rhs() -> Callable[..., None] | None:
    """``sensitivity(s, exps, coef, k, i, out)`` compiled and checked, or ``None``."""
    if disabled():
        return None
    if "rhs" not in _STATE:
        try:
            fn = _build()
            _check(fn)
            _STATE["rhs"] = fn
        except Exception as exc:            # noqa: BLE001 -- any failure means: use NumPy
            _STATE["rhs"] = None
            _STATE["reason"] = f"{type(exc).__name__}: {exc}"
    return _STATE["rhs"]


def _build() -> Callable[..., None]:
    import numba

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def sensitivity(s: Any, exps: Any, coef: Any, k: Any, i: Any, out: Any) -> None:
        """``out[w]`` = the derivative of window ``w``'s state ``s[w]`` (``(d, 1 + q + d)``:
        the state, its derivatives by the ``q`` active coefficients ``coef[k[m], i[m]]``,
        by the initial state) under ``dx_a/dt = sum_r coef[r, a] prod_j x_j^exps[r, j]``."""
        n_win, d, m = s.shape
        p = exps.shape[0]
        deg = 0
        for r in range(p):
            for j in range(d):
                deg = max(deg, exps[r, j])
        powers = np.empty((deg + 1, d))
        phi = np.empty(p)
        dphi = np.empty((p, d))
        jac = np.empty((d, d))
        for w in range(n_win):
            for j in range(d):
                powers[0, j] = 1.0
                for e in range(1, deg + 1):
                    powers[e, j] = powers[e - 1, j] * s[w, j, 0]
            for r in range(p):
                acc = powers[exps[r, 0], 0]
                for j in range(1, d):
                    acc *= powers[exps[r, j], j]
                phi[r] = acc
                for j in range(d):
                    e = exps[r, j]
                    if e == 0:
                        dphi[r, j] = 0.0
                        continue
                    v = e * powers[e - 1, j]
                    for l in range(d):
                        if l != j:
                            v *= powers[exps[r, l], l]
                    dphi[r, j] = v
            for a in range(d):
                f = 0.0
                for r in range(p):
                    f += coef[r, a] * phi[r]
                out[w, a, 0] = f
                for j in range(d):
                    v = 0.0
                    for r in range(p):
                        v += coef[r, a] * dphi[r, j]
                    jac[a, j] = v
            for a in range(d):
                for c in range(1, m):
                    v = 0.0
                    for j in range(d):
                        v += jac[a, j] * s[w, j, c]
                    out[w, a, c] = v
            for mm in range(k.shape[0]):
                out[w, i[mm], 1 + mm] += phi[k[mm]]

    return sensitivity


def _reference(s: np.ndarray, exps: np.ndarray, coef: np.ndarray, k: np.ndarray,
               i: np.ndarray) -> np.ndarray:
    """The same derivative written plainly in NumPy (the check's reference)."""
    x = s[..., 0]                                                        # (W, d)
    phi = np.prod(x[:, None, :] ** exps[None], axis=2)                   # (W, p)
    d = exps.shape[1]
    dphi = np.empty(phi.shape + (d,))
    for j in range(d):
        lower = exps.copy()
        lower[:, j] = np.maximum(lower[:, j] - 1, 0)
        dphi[..., j] = exps[None, :, j] * np.prod(x[:, None, :] ** lower[None], axis=2)
    out = np.empty_like(s)
    out[..., 0] = phi @ coef
    jac = np.einsum("ra,wrj->waj", coef, dphi)
    out[..., 1:] = jac @ s[..., 1:]
    out[:, i, 1 + np.arange(len(k))] += phi[:, k]
    return out


def _check(fn: Callable[..., None]) -> None:
    """The compiled derivative against :func:`_reference` on random states of a cubic
    library in three variables with four active coefficients."""
    from symbolic.field import monomial_exponents

    rng = np.random.default_rng(3)
    exps = monomial_exponents(3, 3).astype(np.int64)
    coef = rng.normal(size=(len(exps), 3))
    k = np.array([1, 4, 7, 19], dtype=np.int64)
    i = np.array([0, 2, 1, 2], dtype=np.int64)
    s = rng.normal(size=(5, 3, 1 + len(k) + 3))
    out = np.empty_like(s)
    fn(s, exps, coef, k, i, out)
    want = _reference(s, exps, coef, k, i)
    if not np.allclose(out, want, rtol=1e-12, atol=1e-12 * np.abs(want).max()):
        raise RuntimeError("compiled sensitivity right-hand side differs from NumPy")
