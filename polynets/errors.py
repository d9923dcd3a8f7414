"""Exception hierarchy of polynets.

Every error the library raises on bad input derives from :class:`PolynetsError`, so callers can
catch one type. Messages say what was wrong and what was expected.
"""

from __future__ import annotations

from typing import Callable


class PolynetsError(Exception):
    """Base class of every error raised by polynets, he and symbolic."""


class ShapeError(PolynetsError, ValueError):
    """A tensor has the wrong rank, channel count or size."""


class ConfigError(PolynetsError, ValueError):
    """An argument or configuration value is invalid."""


class TraceError(PolynetsError):
    """A model could not be lowered to a polynomial program."""


class UnsupportedOpError(TraceError):
    """The tracer met an operation it does not know how to lower, or a back end of the
    polynomial program met a program op it does not handle."""


class NonPolynomialError(TraceError):
    """The model computes something that is not a polynomial of its input."""


class ProgramFormatError(PolynetsError, ValueError):
    """Serialized program bytes are malformed, truncated or of an unknown version."""


class WriteError(PolynetsError, OSError):
    """An output file cannot be written (its path names a directory, lies under a file, or the
    disk refuses); nothing was written and no temporary file is left behind."""


class DataError(PolynetsError):
    """A dataset is missing, malformed, or inconsistent."""


class CheckpointError(PolynetsError):
    """A checkpoint is corrupted, truncated, or belongs to another model."""


class TrainingDivergedError(PolynetsError, FloatingPointError):
    """Training produced a non-finite loss."""


def check_int(value: object, name: str, *, minimum: int = 1,
              error: Callable[[str], Exception] = ConfigError) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``; otherwise
    ``error(message)`` naming ``name``, what it must be (a positive int for ``minimum=1``, a
    non-negative int for ``minimum=0``) and the value given."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
        raise error(f"{name} must be {what}, got {value!r}")
    return value
