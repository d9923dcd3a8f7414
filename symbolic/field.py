"""Polynomial vector fields as arrays, and checked trajectory data.

A :class:`PolyField` is ``dx/dt = f(x)`` with ``f_i(x) = sum_k coef[k, i] * prod_j x_j**exps[k, j]``
over a fixed list of monomials (``exps``: (p, dim) non-negative ints, ``coef``: (p, n_out)). It
converts to and from lists of sympy expressions and evaluates monomials, their Jacobians and the
field in NumPy or PyTorch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import sympy

from symbolic.errors import ExpressionError, SymbolicDataError

__all__ = ["PolyField", "monomial_exponents", "monomial_values", "as_symbols",
           "as_trajectories"]


def as_symbols(variables: Sequence[str | sympy.Symbol]) -> list[sympy.Symbol]:
    """Turn names (or symbols) into sympy Symbols; names must be distinct identifiers."""
    out = [v if isinstance(v, sympy.Symbol) else sympy.Symbol(str(v)) for v in variables]
    if len({s.name for s in out}) != len(out):
        raise ExpressionError(f"variable names must be distinct, got {[s.name for s in out]}")
    return out


def monomial_exponents(dim: int, degree: int, *, constant: bool = True) -> np.ndarray:
    """All exponent vectors of total degree ``<= degree`` in ``dim`` variables, shape (p, dim).

    Ordered by total degree, then lexicographically (x before y): 1, x, y, x**2, x*y, y**2, ...
    """
    rows = []
    for total in range(0 if constant else 1, degree + 1):
        for combo in itertools.combinations_with_replacement(range(dim), total):
            e = [0] * dim
            for j in combo:
                e[j] += 1
            rows.append(e)
    return np.array(rows, dtype=np.int64).reshape(-1, dim)


@dataclass
class PolyField:
    """Polynomial map ``f(x) = phi(x) @ coef`` with monomials ``phi_k(x) = prod_j x_j**exps[k, j]``.

    ``variables``: dim sympy Symbols; ``exps``: (p, dim) ints; ``coef``: (p, n_out) float64.
    """

    variables: list[sympy.Symbol]
    exps: np.ndarray
    coef: np.ndarray

    @classmethod
    def from_exprs(cls, exprs: Sequence[Any], variables: Sequence[str | sympy.Symbol] | None = None,
                   *, exps: np.ndarray | None = None) -> "PolyField":
        """Read polynomials into arrays; ``exps`` fixes the monomial list (others must be zero)."""
        if isinstance(exprs, (str, bytes, sympy.Basic)):
            raise ExpressionError(f"expected a list of expressions, one per equation, got one "
                                  f"{type(exprs).__name__} ({str(exprs)[:60]!r}); wrap it in a "
                                  f"list")
        converted = []
        for i, e in enumerate(exprs):
            try:
                converted.append(sympy.sympify(e))
            except (sympy.SympifyError, TypeError, ValueError) as exc:
                raise ExpressionError(f"expression {i} ({str(e)[:60]!r}) is not an expression: "
                                      f"{exc}") from exc
        exprs = converted
        if variables is None:
            free = set().union(*(e.free_symbols for e in exprs)) if exprs else set()
            variables = sorted(free, key=lambda s: s.name)
        syms = as_symbols(variables)
        if not syms:
            raise ExpressionError("the expressions have no variables; pass variables=[...]")
        terms: list[dict[tuple[int, ...], float]] = []
        for i, e in enumerate(exprs):
            extra = e.free_symbols - set(syms)
            if extra:
                raise ExpressionError(
                    f"expression {i} uses {sorted(s.name for s in extra)}, which are not among "
                    f"the variables {[s.name for s in syms]}")
            try:
                poly = sympy.Poly(e, *syms)
            except sympy.PolynomialError as exc:
                raise ExpressionError(f"expression {i} is not a polynomial: {e}") from exc
            terms.append({tuple(int(k) for k in m): float(c) for m, c in poly.terms()
                          if float(c) != 0.0})
        if exps is None:
            keys = sorted(set().union(*(t.keys() for t in terms)) if terms else set(),
                          key=lambda m: (sum(m), tuple(-k for k in m)))
            exps = np.array(keys, dtype=np.int64).reshape(-1, len(syms))
        index = {tuple(int(k) for k in row): r for r, row in enumerate(exps)}
        coef = np.zeros((len(exps), len(exprs)))
        for i, t in enumerate(terms):
            for m, c in t.items():
                if m not in index:
                    raise ExpressionError(
                        f"expression {i} has the term {sympy.Mul(*[s**k for s, k in zip(syms, m)])}"
                        f" outside the monomial library")
                coef[index[m], i] = c
        return cls(syms, np.asarray(exps, dtype=np.int64), coef)

    @property
    def dim(self) -> int:
        return len(self.variables)

    def monomials(self) -> list[sympy.Expr]:
        """The monomials as sympy expressions, in row order of ``exps``."""
        return [sympy.Mul(*[s**int(k) for s, k in zip(self.variables, row)]) for row in self.exps]

    def to_exprs(self, coef: np.ndarray | None = None) -> list[sympy.Expr]:
        """One sympy expression per output column (float coefficients, zero terms omitted)."""
        coef = self.coef if coef is None else coef
        mons = self.monomials()
        return [sympy.Add(*[sympy.Float(float(c), 17) * m for c, m in zip(coef[:, i], mons)
                            if c != 0.0]) for i in range(coef.shape[1])]

    def theta(self, X: np.ndarray) -> np.ndarray:
        """Monomials evaluated on samples ``X`` (N, dim) -> (N, p)."""
        return monomial_values(X, self.exps)

    def __call__(self, X: np.ndarray) -> np.ndarray:
        """``f(X)`` for samples ``X`` (N, dim) -> (N, n_out)."""
        return self.theta(X) @ self.coef


def monomial_values(X: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """The monomials of exponents ``exps`` (p, dim) evaluated on samples ``X`` (N, dim) ->
    (N, p)."""
    X = np.asarray(X, dtype=np.float64)
    return np.prod(X[:, None, :] ** np.asarray(exps)[None, :, :], axis=2)


def as_trajectories(t: Any, X: Any, *, dim: int | None = None,
                    min_points: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    """Validate one trajectory (``t`` (n,), ``X`` (n, dim)) or lists of them.

    Returns a list of ``(t_i, X_i)`` float64 pairs. Raises :class:`SymbolicDataError` for NaN or
    inf, mismatched lengths, a wrong state dimension, too few samples or times that do not
    strictly increase.
    """
    if isinstance(t, (list, tuple)) and len(t) and np.ndim(t[0]) >= 1:
        if not isinstance(X, (list, tuple)) or len(X) != len(t):
            raise SymbolicDataError(
                f"got {len(t)} time arrays; expected a list of as many state arrays, got "
                f"{len(X) if isinstance(X, (list, tuple)) else type(X).__name__}")
        pairs = list(zip(t, X))
    else:
        pairs = [(t, X)]
    out = []
    for k, (ti, Xi) in enumerate(pairs):
        name = f"trajectory {k}" if len(pairs) > 1 else "the trajectory"
        try:
            ti = np.asarray(ti, dtype=np.float64)
            Xi = np.asarray(Xi, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise SymbolicDataError(f"{name}: t and X must be numeric arrays ({exc})") from exc
        if Xi.ndim == 1:
            Xi = Xi[:, None]
        if ti.ndim != 1 or Xi.ndim != 2:
            raise SymbolicDataError(f"{name}: expected t of shape (n,) and X of shape (n, dim), "
                                    f"got {ti.shape} and {Xi.shape}")
        if ti.shape[0] != Xi.shape[0]:
            raise SymbolicDataError(f"{name}: t has {ti.shape[0]} samples but X has "
                                    f"{Xi.shape[0]} rows; they must match")
        if dim is not None and Xi.shape[1] != dim:
            raise SymbolicDataError(f"{name}: X has {Xi.shape[1]} state columns, expected {dim}")
        if ti.shape[0] < min_points:
            raise SymbolicDataError(f"{name}: needs at least {min_points} samples, got "
                                    f"{ti.shape[0]}")
        if not (np.all(np.isfinite(ti)) and np.all(np.isfinite(Xi))):
            raise SymbolicDataError(f"{name}: t and X must be finite (found NaN or inf)")
        if np.any(np.diff(ti) <= 0):
            bad = int(np.argmax(np.diff(ti) <= 0))
            raise SymbolicDataError(f"{name}: times must strictly increase, but t[{bad + 1}]="
                                    f"{ti[bad + 1]} <= t[{bad}]={ti[bad]}")
        dim = Xi.shape[1]
        out.append((ti, Xi))
    return out
