"""Process-level parallelism for independent HE work (SEAL calls through ``tenseal.sealapi`` hold
the GIL, so threads do not run them concurrently; forked processes do).

:func:`fork_map` runs ``fn(0), ..., fn(n - 1)`` in ``workers`` forked processes. The work function
and everything it reads (keys, compiled program, input ciphertexts) reach the workers through the
fork itself, never as messages; only task indices go out and the results (bytes, arrays) come back
over the pool's pipes. Where ``fork`` is unavailable, or with one worker or one task, it runs in
this process with the same results (as does a call made from inside a worker).
"""

from __future__ import annotations

import multiprocessing
import numbers
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable

from tqdm.auto import tqdm

from he.errors import ParameterError, ResourceError

__all__ = ["fork_map", "resolve_workers", "memory_workers"]

_JOB: list[Callable[[int], Any]] = []


def resolve_workers(workers: int | None) -> int:
    """``None`` or ``0`` -> one worker per CPU core; otherwise ``workers``. Raises
    :class:`~he.errors.ParameterError` for anything but ``None`` or a non-negative int."""
    if workers is not None and (isinstance(workers, bool) or
                                not isinstance(workers, numbers.Integral) or workers < 0):
        raise ParameterError(f"workers must be a non-negative int (0: one per CPU core), got "
                             f"{workers!r}")
    if not workers:
        return max(1, os.cpu_count() or 1)
    return int(workers)


def memory_workers(workers: int | None, tasks: int, working_bytes: float | None,
                   available_bytes: int, what: str = "a task") -> int:
    """Processes to run ``tasks`` with when each holds ``working_bytes`` while it works (None:
    unknown, no limit) and ``available_bytes`` are free: ``workers`` as :func:`resolve_workers`
    reads it, at most one per task; left to choose (``None`` / ``0``), as many as the memory
    holds. Raises :class:`~he.errors.ResourceError` where not even one fits, or where the
    requested number does not (never more processes than memory for them: an out-of-memory
    kill loses the whole run)."""
    n = min(resolve_workers(workers), max(1, int(tasks)))
    if working_bytes is None or working_bytes <= 0:
        return n
    gib = 2.0 ** 30
    fit = int(available_bytes // working_bytes)
    if fit < 1:
        raise ResourceError(
            f"{what} is predicted to hold {working_bytes / gib:.1f} GiB while it runs, more "
            f"than the {available_bytes / gib:.1f} GiB available now")
    if n > fit:
        if workers:
            raise ResourceError(
                f"{n} processes each holding {working_bytes / gib:.1f} GiB ({what}) need "
                f"{n * working_bytes / gib:.1f} GiB, more than the {available_bytes / gib:.1f} "
                f"GiB available now: at most {fit} fit (workers=0 chooses)")
        n = fit
    return n


def _run_task(i: int) -> Any:
    return _JOB[0](i)


def fork_map(fn: Callable[[int], Any], n: int, workers: int, *, desc: str = "",
             progress: bool = False) -> list[Any]:
    """``[fn(i) for i in range(n)]``, computed by up to ``workers`` forked processes.

    Results come back in task order. An exception raised by ``fn`` in a worker is raised here.
    """
    bar = tqdm(total=n, desc=desc, disable=not progress, leave=False)
    try:
        if (workers <= 1 or n <= 1 or _JOB
                or "fork" not in multiprocessing.get_all_start_methods()):
            out = []
            for i in range(n):
                out.append(fn(i))
                bar.update()
            return out
        _JOB.append(fn)
        try:
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=min(workers, n), mp_context=ctx) as pool:
                out = []
                for r in pool.map(_run_task, range(n)):
                    out.append(r)
                    bar.update()
                return out
        finally:
            _JOB.clear()
    finally:
        bar.close()
