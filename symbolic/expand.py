"""Exact expansion of polynomial models into sympy expressions, read from the polynomial program.

``to_sympy`` lowers a model with :func:`polynets.ir.certify` / :func:`polynets.ir.trace` to a
:class:`~polynets.ir.program.PolyProgram` and runs the program's NumPy interpreter on an ``object``
array whose entries are sparse polynomials (``{exponent tuple: coefficient}``), so every node's
value is kept expanded as it is computed. Plain sympy expressions with one ``sympy.expand`` at the
end give the same result but are far slower on Poly-NODE sizes (a depth-2, hidden-32 Poly-NODE in
3 variables: about 130 s with ``expand``, 12 s with ``sympy.Poly`` over RR, well under a second
here).
"""

from __future__ import annotations

from fractions import Fraction
from numbers import Number
from typing import Any, Sequence

import numpy as np
import sympy
import torch
from torch import nn

from polynets.ir.program import PolyProgram
from symbolic.errors import ExpressionError, NotPolynomialError
from symbolic.field import as_symbols

__all__ = ["to_sympy", "default_variables"]


class _Sparse:
    """A polynomial as ``{exponents: coefficient}``; supports ``+``, ``-``, ``*`` with numbers."""

    __slots__ = ("terms",)

    def __init__(self, terms: dict[tuple[int, ...], Any]):
        self.terms = terms

    @staticmethod
    def _lift(other: Any, like: "_Sparse") -> "_Sparse":
        if isinstance(other, _Sparse):
            return other
        if isinstance(other, Number):
            dim = len(next(iter(like.terms))) if like.terms else 0
            return _Sparse({(0,) * dim: other} if other != 0 else {})
        return NotImplemented  # type: ignore[return-value]

    def __add__(self, other: Any) -> "_Sparse":
        o = self._lift(other, self)
        if o is NotImplemented:
            return NotImplemented
        out = dict(self.terms)
        for m, c in o.terms.items():
            out[m] = out.get(m, 0) + c
        return _Sparse(out)

    __radd__ = __add__

    def __neg__(self) -> "_Sparse":
        return _Sparse({m: -c for m, c in self.terms.items()})

    def __sub__(self, other: Any) -> "_Sparse":
        return self + (-other)

    def __rsub__(self, other: Any) -> "_Sparse":
        return (-self) + other

    def __mul__(self, other: Any) -> "_Sparse":
        if isinstance(other, Number):
            return _Sparse({m: c * other for m, c in self.terms.items()} if other != 0 else {})
        if not isinstance(other, _Sparse):
            return NotImplemented
        out: dict[tuple[int, ...], Any] = {}
        for ma, ca in self.terms.items():
            for mb, cb in other.terms.items():
                m = tuple(a + b for a, b in zip(ma, mb))
                out[m] = out.get(m, 0) + ca * cb
        return _Sparse(out)

    __rmul__ = __mul__


def default_variables(n: int, *, time_input: bool = False) -> list[str]:
    """``x, y, z`` for up to three states, else ``x1 ... xn``; ``t`` appended for time input."""
    names = ["x", "y", "z"][:n] if n <= 3 else [f"x{i + 1}" for i in range(n)]
    return names + (["t"] if time_input else [])


def _program_of(model: Any, example_input: Any) -> tuple[PolyProgram, bool]:
    """The polynomial program of ``model`` and whether its last input column is time."""
    if isinstance(model, PolyProgram):
        return model, False
    from polynets.ir.certify import certify
    from polynets.nn.node import PolyNODE

    if not isinstance(model, nn.Module):
        raise ExpressionError(f"to_sympy expects a polynets model (nn.Module) or a PolyProgram, "
                              f"got {type(model).__name__}")
    time_input = False
    if isinstance(model, PolyNODE):
        time_input = model.time_input
        example_input = torch.zeros(1, model.in_features) if example_input is None \
            else example_input
        model = model.as_polynomial()
    if example_input is None:
        width = getattr(model, "in_features", None)
        if not isinstance(width, int):
            raise ExpressionError(f"cannot tell the input shape of {type(model).__name__}; pass "
                                  f"example_input=torch.zeros(1, ...) of the model's input shape")
        example_input = torch.zeros(1, width)
    cert = certify(model, example_input)
    if not cert.is_polynomial:
        reasons = "; ".join(str(o) for o in cert.offending)
        raise NotPolynomialError(f"{type(model).__name__} is not a polynomial of its input, so "
                                 f"it has no exact expansion: {reasons}")
    if cert.program is None:
        raise ExpressionError(f"the output of {type(model).__name__} does not depend on its "
                              f"input; there is nothing to expand")
    return cert.program, time_input


def to_sympy(model: nn.Module | PolyProgram, variables: Sequence[str | sympy.Symbol] | None = None,
             example_input: Any = None, rational: bool = False) -> list[sympy.Expr]:
    """Expand a polynomial model into one sympy expression per output entry.

    ``f(x) = sum_m c_m x^m`` exactly as the float64 program computes it. ``model``: any polynets
    polynomial model (Mu-Layer stacks, MONet-style blocks, PoM, :class:`~polynets.PolyNODE` whose
    inputs are ``[x, t]``) or a :class:`~polynets.PolyProgram`. ``variables``: one name per
    input entry (flattened sample shape; default ``x, y, z`` / ``x1..xn``, ``t`` last for a
    time-dependent Poly-NODE). ``example_input``: a batch ``(1, ...)`` fixing the input shape
    (default ``(1, in_features)``). ``rational``: coefficients as the simplest rationals
    (``sympy.nsimplify``) of their float values instead of Floats. Returns a list of length
    ``prod(output sample shape)``. A non-polynomial model raises
    :class:`~symbolic.errors.NotPolynomialError` naming the offending modules.
    """
    program, time_input = _program_of(model, example_input)
    width = int(np.prod(program.input_shape[1:], dtype=np.int64))
    if variables is None:
        variables = default_variables(width - int(time_input), time_input=time_input)
    syms = as_symbols(variables)
    if len(syms) != width:
        raise ExpressionError(f"the model has {width} input entries, so it needs {width} "
                              f"variable names; got {len(syms)}: {[s.name for s in syms]}")
    inputs = np.empty(width, dtype=object)
    for j in range(width):
        inputs[j] = _Sparse({tuple(int(k == j) for k in range(width)): 1.0})
    out = program.run(inputs.reshape((1,) + tuple(program.input_shape[1:])))
    exprs = []
    for value in np.asarray(out, dtype=object).reshape(-1):
        terms = value.terms if isinstance(value, _Sparse) else {(0,) * width: value}
        parts = []
        for m, c in terms.items():
            c = float(c)
            if c == 0.0:
                continue
            coef = sympy.nsimplify(Fraction(c).limit_denominator(10**12), rational=True) \
                if rational else sympy.Float(c, 17)
            parts.append(coef * sympy.Mul(*[s**k for s, k in zip(syms, m)]))
        exprs.append(sympy.Add(*parts))
    return exprs
