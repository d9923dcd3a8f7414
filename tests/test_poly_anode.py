"""Tests of the ODE flows (NODE / ANODE maps), Poly-ANODE, the annulus task and the example."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import polynets as pn
from polynets.errors import ConfigError, DataError, ShapeError
from polynets.nn.node import ODEFlow, PolyANODE, PolyNODE, annulus_data, train_flow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _x(n: int = 4, d: int = 2, seed: int = 0) -> torch.Tensor:
    return 0.5 * torch.randn(n, d, generator=torch.Generator().manual_seed(seed),
                             dtype=torch.float64)


def test_augmented_flow_starts_from_the_input_padded_with_zeros() -> None:
    torch.manual_seed(0)
    flow = PolyANODE(2, augment=2, steps=3).double()
    x = _x()
    zero_field = PolyANODE(2, augment=2, steps=3).double()
    for p in zero_field.field.parameters():
        p.data.zero_()
    torch.testing.assert_close(zero_field.flow(x), torch.cat([x, torch.zeros(4, 2,
                                                                             dtype=x.dtype)], 1))
    assert flow.flow(x).shape == (4, 4) and flow(x).shape == (4, 1)


def test_rk4_flow_matches_an_adaptive_solver() -> None:
    torch.manual_seed(0)
    rk4 = PolyANODE(2, augment=1, steps=40).double()
    adaptive = PolyANODE(2, augment=1, method="dopri5").double()
    adaptive.load_state_dict(rk4.state_dict())
    x = _x()
    torch.testing.assert_close(rk4(x), adaptive(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("steps, depth, degree", [(1, 1, 16), (2, 1, 256), (1, 2, 256)])
@pytest.mark.parametrize("augment", [0, 1])
def test_fixed_step_poly_anode_traces_exactly_with_degree_per_rk4_step(
        steps: int, depth: int, degree: int, augment: int) -> None:
    torch.manual_seed(0)
    flow = PolyANODE(2, augment=augment, steps=steps, depth=depth).double().eval()
    prog = pn.trace(flow, _x())
    x = _x(6, seed=1)  # other points than the traced example
    with torch.no_grad():
        np.testing.assert_allclose(prog.simulate(x), flow(x).numpy(), rtol=1e-9, atol=1e-9)
    cert = pn.certify(flow, x)
    assert cert.is_polynomial and cert.degree == degree


@pytest.mark.parametrize("method, degree", [("euler", 2), ("midpoint", 4)])
def test_lower_order_fixed_steps_give_their_degree(method: str, degree: int) -> None:
    torch.manual_seed(0)
    flow = PolyANODE(2, steps=1, method=method).double().eval()
    assert pn.certify(flow, _x()).degree == degree


def test_flow_with_a_non_polynomial_field_is_rejected_by_name() -> None:
    class TanhField(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, t, z):
            return torch.tanh(self.lin(z))

    cert = pn.certify(ODEFlow(TanhField(), 2, augment=1, steps=1).eval(), _x().float())
    assert not cert.is_polynomial and any("tanh" in str(o) for o in cert.offending)


def test_flow_backward_reaches_every_parameter() -> None:
    torch.manual_seed(0)
    flow = PolyANODE(2, augment=1, steps=2)
    flow(torch.randn(5, 2)).square().sum().backward()
    for name, p in flow.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_flow_rejects_bad_shapes_and_options() -> None:
    with pytest.raises(ShapeError, match=r"\(B, 2\)"):
        PolyANODE(2)(torch.randn(3, 3))
    with pytest.raises(ConfigError, match="in_features \\+ augment = 3"):
        ODEFlow(PolyNODE(2), 2, augment=1)
    with pytest.raises(ConfigError, match="augment must be a non-negative int"):
        PolyANODE(2, augment=-1)
    with pytest.raises(ConfigError, match="t1 must be a positive"):
        PolyANODE(2, t1=0.0)
    with pytest.raises(ConfigError, match="steps must be a positive int"):
        PolyANODE(2, steps=0)


def test_annulus_data_labels_follow_the_radii() -> None:
    x, y = annulus_data(400, r1=0.5, r2=1.0, r3=1.5, seed=3)
    r = x.norm(dim=1)
    assert x.shape == (400, 2) and y.shape == (400, 1)
    assert (y == -1).sum() == 200 and (y == 1).sum() == 200
    assert r[y[:, 0] < 0].max() <= 0.5 + 1e-6
    assert r[y[:, 0] > 0].min() >= 1.0 - 1e-6 and r[y[:, 0] > 0].max() <= 1.5 + 1e-6
    x3, _ = annulus_data(10, dim=3)
    assert x3.shape == (10, 3)
    with pytest.raises(ConfigError, match="0 < r1 < r2 < r3"):
        annulus_data(10, r1=1.0, r2=0.5)


def test_train_flow_lowers_the_loss_of_poly_anode_and_checks_data() -> None:
    x, y = annulus_data(256, seed=0)
    torch.manual_seed(0)
    flow = PolyANODE(2, augment=1, hidden=16, steps=3, init_scale=1.0)
    losses = train_flow(flow, x, y, epochs=10, batch_size=32, lr=1e-2)
    assert len(losses) == 10 and losses[-1] < 0.25 * losses[0]
    with pytest.raises(DataError, match="same n"):
        train_flow(flow, x, y[:10])


@pytest.mark.slow
def test_poly_anode_example_writes_loss_curves(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import poly_anode
    finally:
        sys.path.remove(str(EXAMPLES))
    results = poly_anode.main(["--epochs", "3", "--points", "256", "--out", str(tmp_path)])
    assert set(results) == {"NODE", "Poly-NODE", "ANODE", "Poly-ANODE"}
    data = json.loads((tmp_path / "losses.json").read_text())
    assert all(len(m["loss"]) == 3 for m in data["models"].values())
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
