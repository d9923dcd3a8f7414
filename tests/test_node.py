"""Poly-NODE vector field: shapes, degree, fallback integration and training."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polynets import ConfigError, DataError, ShapeError
from polynets.nn.node import PolyNODE, odeint_safe, train_node


def test_polynode_maps_state_batches_and_reports_degree():
    model = PolyNODE(3, hidden=8, depth=2)
    assert model.degree == 4
    assert PolyNODE(3, degree=3).degree == 4 and PolyNODE(3, degree=2).depth == 1
    out = model(torch.tensor(0.5), torch.randn(5, 7, 3))
    assert out.shape == (5, 7, 3)
    with pytest.raises(ShapeError, match=r"\(\.\.\., 3\)"):
        model(0.0, torch.randn(4, 2))


def test_time_input_makes_the_field_depend_on_t():
    torch.manual_seed(0)
    model = PolyNODE(2, hidden=4, time_input=True, init_scale=1.0)
    x = torch.randn(3, 2)
    assert model.in_features == 3
    assert not torch.allclose(model(0.0, x), model(1.0, x))
    torch.testing.assert_close(model(torch.tensor(0.3), x), model.field(
        torch.cat([x, torch.full((3, 1), 0.3)], dim=1)))


def test_invalid_configuration_is_rejected():
    with pytest.raises(ConfigError, match="depth"):
        PolyNODE(2, depth=0)


class _Decay(torch.nn.Module):
    def forward(self, t, x):
        return -x


def test_odeint_safe_falls_back_to_fixed_steps_when_the_adaptive_solver_gives_up():
    t = torch.linspace(0, 1, 11, dtype=torch.float64)
    y0 = torch.ones(2, dtype=torch.float64)
    sol = odeint_safe(_Decay(), y0, t, rtol=1e-12, atol=1e-14, max_num_steps=2)
    torch.testing.assert_close(sol[:, 0], torch.exp(-t), rtol=1e-6, atol=1e-8)


def test_train_node_fits_a_linear_system():
    t = np.linspace(0, 2, 41)
    X = np.stack([np.exp(-t), 2 * np.exp(-0.5 * t)], axis=1)
    torch.manual_seed(0)
    model = PolyNODE(2, hidden=4).double()
    history = train_node(model, t, X, steps=60, window=5, lr=2e-2, progress=False)
    assert np.mean(history.loss[-10:]) < 0.2 * np.mean(history.loss[:5])


def test_train_node_runs_with_the_adjoint_method():
    t = np.linspace(0, 1, 11)
    X = np.stack([np.exp(-t), np.exp(-2 * t)], axis=1)
    model = PolyNODE(2, hidden=3).double()
    before = [p.detach().clone() for p in model.parameters()]
    history = train_node(model, t, X, steps=3, window=4, adjoint=True, progress=False)
    assert len(history.loss) == 3 and all(np.isfinite(history.loss))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_train_node_rejects_bad_data():
    model = PolyNODE(2, hidden=4)
    t = np.linspace(0, 1, 10)
    with pytest.raises(DataError, match="strictly increase"):
        train_node(model, t[::-1], np.zeros((10, 2)), steps=1, progress=False)
    with pytest.raises(DataError, match=r"\(n, 2\)"):
        train_node(model, t, np.zeros((9, 2)), steps=1, progress=False)
