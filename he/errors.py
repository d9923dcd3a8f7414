"""Exception hierarchy of the CKKS backend.

Every error :mod:`he` raises on bad input is an :class:`HEError`; each subclass names one way a
request can be wrong, and its message says what was expected instead.
"""

from __future__ import annotations

from polynets.errors import PolynetsError, ShapeError


class HEError(PolynetsError):
    """Base class of every error raised by :mod:`he`."""


class NotEncryptableError(HEError):
    """The model is not a polynomial of its input (a module cannot be lowered to CKKS ops).

    ``certificate`` holds the polynomial certificate (or None when the program could not be
    traced at all); its message names the offending module, its path and a hint.
    """

    def __init__(self, message: str, certificate: object = None):
        super().__init__(message)
        self.certificate = certificate


class TooDeepError(HEError):
    """The program needs more CKKS levels than any 128-bit-secure parameter set provides."""

    def __init__(self, message: str, levels_needed: int = 0, levels_supported: int = 0):
        super().__init__(message)
        self.levels_needed = levels_needed
        self.levels_supported = levels_supported


class ParameterError(HEError):
    """Requested CKKS parameters are invalid or not accepted by SEAL at the security level."""


class InputShapeError(HEError, ShapeError):
    """Data given to encrypt (or to calibrate with) has the wrong shape; the message gives the
    expected one (:func:`batch_of`)."""


def batch_of(sample: tuple[int, ...]) -> str:
    """How a message writes the shape of a batch of samples of shape ``sample``:
    ``"(B, 3, 4)"``, ``"(B, 6,)"``."""
    return "(B, " + ", ".join(map(str, sample)) + ("," if len(sample) == 1 else "") + ")"


class SerializationError(HEError):
    """Bytes of a ciphertext, context, key set or compiled program are malformed or truncated."""


class KeyMismatchError(HEError):
    """A ciphertext or context belongs to another key set or another compiled program."""


class SecretKeyError(HEError):
    """A secret key was offered where only public material is allowed, or is missing."""


class ResourceError(HEError):
    """Evaluating would need more memory than the machine has available now (as the cost model
    predicts it); the message says how much, and what to change."""


class MemoryBudgetWarning(UserWarning):
    """No candidate the compiler priced keeps its server within the memory budget it was
    compiled for (the one needing least memory was kept); the message says how much it needs
    and what to change."""


class CalibrationRangeWarning(UserWarning):
    """Data given to encrypt lies outside the range the parameters were calibrated for."""
