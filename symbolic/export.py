"""Render systems of equations ``dx_i/dt = f_i(x)`` as text, LaTeX and Python source."""

from __future__ import annotations

from typing import Sequence

import sympy

from symbolic.errors import ExpressionError

__all__ = ["derivative_symbol", "to_string", "to_latex", "to_python"]

ORDER = "rev-grlex"
"""Term order of printed equations: by increasing degree (``1.56*x - 1.12*x*y``)."""


def derivative_symbol(var: sympy.Symbol) -> sympy.Symbol:
    """The symbol ``dx/dt`` standing for the derivative of ``var``."""
    return sympy.Symbol(f"d{var.name}/dt")


def _round(expr: sympy.Expr, digits: int) -> sympy.Expr:
    return expr.xreplace({n: sympy.Float(float(f"{float(n):.{digits}g}"), digits)
                          for n in expr.atoms(sympy.Float)})


def _check(exprs: Sequence[sympy.Expr], variables: Sequence[sympy.Symbol]) -> None:
    if len(exprs) != len(variables):
        raise ExpressionError(f"need one expression per variable: {len(exprs)} expressions for "
                              f"{len(variables)} variables")


def to_string(exprs: Sequence[sympy.Expr], variables: Sequence[sympy.Symbol], *,
              digits: int = 6) -> str:
    """Lines ``dx/dt = 1.56*x - 1.12*x*y`` with coefficients to ``digits`` significant digits."""
    _check(exprs, variables)
    return "\n".join(f"d{v.name}/dt = {sympy.sstr(_round(e, digits), full_prec=False, order=ORDER)}"
                     for v, e in zip(variables, exprs))


def to_latex(exprs: Sequence[sympy.Expr], variables: Sequence[sympy.Symbol], *,
             digits: int = 6) -> str:
    """An ``aligned`` LaTeX block, one ``\\frac{dx}{dt} &= ...`` row per equation."""
    _check(exprs, variables)
    rows = [rf"\frac{{d{sympy.latex(v)}}}{{dt}} &= "
            f"{sympy.latex(_round(e, digits), full_prec=False, order=ORDER)}"
            for v, e in zip(variables, exprs)]
    return "\\begin{aligned}\n" + " \\\\\n".join(rows) + "\n\\end{aligned}"


def to_python(exprs: Sequence[sympy.Expr], variables: Sequence[sympy.Symbol], *,
              name: str = "vector_field") -> str:
    """Source of ``def name(t, state) -> list[float]`` computing the right-hand sides.

    Full-precision coefficients; the function runs with ``scipy.integrate.solve_ivp``.
    """
    _check(exprs, variables)
    if not name.isidentifier():
        raise ExpressionError(f"function name must be a Python identifier, got {name!r}")
    names = ", ".join(v.name for v in variables)
    unpack = f"    {names}{',' if len(variables) == 1 else ''} = state\n"
    body = ",\n".join(f"        {sympy.pycode(e)}" for e in exprs)
    doc = "; ".join(f"d{v.name}/dt" for v in variables)
    return (f"def {name}(t, state):\n    \"\"\"Right-hand side ({doc}).\"\"\"\n{unpack}"
            f"    return [\n{body},\n    ]\n")
