"""Shared test configuration."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import settings

import polynets as pn

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


@pytest.fixture(scope="session")
def hand_built_program() -> tuple[pn.PolyProgram, np.ndarray]:
    """A program written node by node, with every kind of array attribute (weight, bias, a 0-d
    value, a gather index with a padding -1), and four inputs for it."""
    w = np.array([[1.0, -2.0], [0.5, 0.25], [3.0, 1.0]])
    nodes = [pn.Node("input", (), (1, 3)),
             pn.Node("linear", (0,), (1, 2),
                     {"axis": 1, "weight": w, "bias": np.array([0.1, 0.2])}),
             pn.Node("mul", (1, 1), (1, 2)),
             pn.Node("mul_const", (2,), (1, 2), {"value": np.array(3.0)}),
             pn.Node("gather", (3, 0), (1, 4), {"index": np.array([[0, 2, -1, 3]])})]
    return pn.PolyProgram(nodes, 4), np.random.default_rng(0).standard_normal((4, 3))


def _encrypted_roundtrip(model: torch.nn.Module, x: torch.Tensor, packing: str = "vector"
                         ) -> None:
    """Compile ``model`` with the defaults (calibrated on ``x``), run two samples under real
    CKKS: the decryption is within the promised error of the simulation, and the simulation is
    the float64 model's output."""
    import he

    prog = he.compile(model, x[:1], calibration=x, packing=packing)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    xs = x[:2].numpy()
    y = client.decrypt(server.run(client.encrypt(xs).to_bytes()).to_bytes())
    sim = prog.simulate(xs)
    with torch.no_grad():
        ref = model.double()(x[:2].double()).numpy()
    assert y.shape == ref.shape
    assert np.max(np.abs(y - sim)) <= prog.params.expected_error
    assert np.max(np.abs(sim - ref)) <= 1e-9 * max(1.0, float(np.max(np.abs(ref))))


@pytest.fixture(scope="session")
def encrypted_roundtrip():
    """The check every model users build must pass (:func:`_encrypted_roundtrip`)."""
    return _encrypted_roundtrip
