"""Exception hierarchy of the CKKS backend."""

from __future__ import annotations

from polynets.errors import PolynetsError


class HEError(PolynetsError):
    """Base class of every error raised by :mod:`he`."""
