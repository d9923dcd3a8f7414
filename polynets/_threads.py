"""Torch's intra-op thread count for a block of work, restored after it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["torch_threads"]


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (None: torch's setting as it is), then restore
    the previous count. Small models train fastest on one thread: with as many threads as
    cores, every operation waits at an OpenMP barrier for the slowest core, and a core busy
    with another process stretches each step many times over."""
    if n is None:
        yield
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be a positive int or None, got {n!r}")
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
