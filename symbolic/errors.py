"""Exception hierarchy of the symbolic package."""

from __future__ import annotations

from sklearn.exceptions import NotFittedError as SklearnNotFittedError

from polynets.errors import PolynetsError


class SymbolicError(PolynetsError):
    """Base class of every error raised by :mod:`symbolic`."""


class NotPolynomialError(SymbolicError, ValueError):
    """A model or expression is not a polynomial of its inputs, so it cannot be expanded."""


class SymbolicDataError(SymbolicError, ValueError):
    """Trajectory data is malformed: NaN/inf, mismatched shapes, or times not increasing."""


class ExpressionError(SymbolicError, ValueError):
    """Expressions or variable names do not fit what was asked (wrong count, unknown symbols)."""


class NotFittedError(SymbolicError, SklearnNotFittedError, RuntimeError):
    """A result was requested from an estimator before ``fit`` was called (also a
    scikit-learn ``NotFittedError``)."""


class FitError(SymbolicError, RuntimeError):
    """A numerical fit could not produce a finite result (diverged or singular); the message
    says why and what to change."""


class IdentifiabilityWarning(UserWarning):
    """The data do not determine the model: they satisfy an exact linear relation among the
    library's monomials (e.g. a conserved quantity), so models that differ by multiples of it
    fit equally well and the one returned is one choice among them."""
