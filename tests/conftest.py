"""Shared test configuration."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (set HYPOTHESIS_PROFILE=explore to search
# new ones): a failure in CI is then reproducible on any machine.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def one_thread():
    """Run each test on one intra-op thread: the models under test are small, and extra threads
    only contend for the cores (small models train many times faster on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
