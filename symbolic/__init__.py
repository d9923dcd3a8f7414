"""symbolic: exact sympy expansion of polynomial models and equation discovery.

``to_sympy`` reads a model's polynomial program into sympy polynomials; ``prune`` / ``refit``
sparsify them; ``EquationDiscovery`` recovers ``dx/dt = f(x)`` from trajectories with a
Poly-NODE; ``systems`` generates benchmark trajectories.
"""

from symbolic.discovery import EquationDiscovery
from symbolic.errors import (ExpressionError, FitError, IdentifiabilityWarning, NotFittedError,
                             NotPolynomialError, SymbolicDataError, SymbolicError)
from symbolic.expand import to_sympy
from symbolic.export import to_latex, to_python, to_string
from symbolic.field import PolyField, monomial_exponents
from symbolic.prune import prune, refit, snap, term_scales
from symbolic import systems

__all__ = ["EquationDiscovery", "ExpressionError", "FitError", "IdentifiabilityWarning",
           "NotFittedError", "NotPolynomialError", "PolyField", "SymbolicDataError",
           "SymbolicError", "monomial_exponents", "prune", "refit", "snap", "systems",
           "term_scales", "to_latex", "to_python", "to_string", "to_sympy"]
