"""The switch between compiled loops (numba) and their NumPy references, for every package.

``he`` (the fused batch maps) and ``symbolic`` (the trajectory fits' right-hand side) compile
their hot loops with numba on first use and check them against NumPy; where numba is missing,
a check fails or :data:`ENV_DISABLE` is set they keep the NumPy path, which gives the same
results, only slower.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["ENV_DISABLE", "disabled", "numpy_loops"]

#: Set (to anything but ``0``) to use the NumPy paths even where numba is installed (benchmarks
#: measure both in one run with it).
ENV_DISABLE = "POLYNETS_NO_COMPILED_KERNELS"


def disabled() -> bool:
    """Whether :data:`ENV_DISABLE` asks for the NumPy paths."""
    return os.environ.get(ENV_DISABLE, "0") not in ("", "0")


@contextlib.contextmanager
def numpy_loops() -> Iterator[None]:
    """Within the block, the NumPy paths are used (sets :data:`ENV_DISABLE`, restored on
    exit): the same-run baseline benchmarks time the compiled loops against."""
    saved = os.environ.get(ENV_DISABLE)
    os.environ[ENV_DISABLE] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_DISABLE, None)
        else:
            os.environ[ENV_DISABLE] = saved
