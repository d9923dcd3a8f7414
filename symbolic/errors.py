"""Exception hierarchy of the symbolic package."""

from __future__ import annotations

from polynets.errors import PolynetsError


class SymbolicError(PolynetsError):
    """Base class of every error raised by :mod:`symbolic`."""
