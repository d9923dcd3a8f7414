"""Shared test configuration."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Run each test on one intra-op thread: the models under test are small, and extra threads
    only contend for the cores (small models train many times faster on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
