"""Exact expansion (to_sympy), pruning, refits, export and the discover command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch import nn

import polynets as pn
from polynets.errors import PolynetsError
from polynets.nn.node import PolyNODE
from polynets.ir.program import Node, PolyProgram
from symbolic import (ExpressionError, NotPolynomialError, SymbolicDataError, SymbolicError,
                      prune, refit, snap, to_latex, to_python, to_sympy)
from symbolic.cli import read_csv
from symbolic.discovery import EquationDiscovery
from symbolic.systems import generate

x, y, z = sympy.symbols("x y z")


def _numeric(exprs, symbols, points):
    f = sympy.lambdify(symbols, exprs, "numpy")
    return np.array([np.asarray(f(*p), dtype=np.float64) for p in points])


@pytest.mark.parametrize("depth", [1, 2])
def test_to_sympy_of_random_polynode_matches_model_at_random_points(depth):
    torch.manual_seed(depth)
    model = PolyNODE(3, hidden=6, depth=depth, init_scale=1.0).double()
    exprs = to_sympy(model, ["x", "y", "z"])
    assert len(exprs) == 3
    assert max(sympy.Poly(e, x, y, z).total_degree() for e in exprs) == 2 ** depth
    points = np.random.default_rng(0).normal(size=(20, 3))
    expected = model(0.0, torch.as_tensor(points)).detach().numpy()
    np.testing.assert_allclose(_numeric(exprs, (x, y, z), points), expected, rtol=1e-9, atol=1e-9)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.integers(1, 3), hidden=st.integers(1, 4),
       shortcut=st.booleans())
def test_to_sympy_equals_mulayer_for_any_weights(seed, width, hidden, shortcut):
    torch.manual_seed(seed)
    layer = pn.MuLayer(width, 2, hidden=hidden, rank=1, shortcut=shortcut).double()
    names = [f"u{i}" for i in range(width)]
    exprs = to_sympy(layer, names)
    points = np.random.default_rng(seed).normal(size=(4, width))
    np.testing.assert_allclose(_numeric(exprs, sympy.symbols(names), points).reshape(4, 2),
                               layer(torch.as_tensor(points)).detach().numpy(),
                               rtol=1e-9, atol=1e-9)


def test_to_sympy_of_mulayer_stack_matches_model_at_random_points():
    torch.manual_seed(0)
    model = nn.Sequential(pn.MuLayer(2, 4, hidden=5, rank=2), pn.MuLayer(4, 2, hidden=3)).double()
    exprs = to_sympy(model, ["x", "y"], example_input=torch.zeros(1, 2))
    points = np.random.default_rng(1).uniform(-2, 2, size=(15, 2))
    expected = model(torch.as_tensor(points)).detach().numpy()
    np.testing.assert_allclose(_numeric(exprs, (x, y), points), expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("block", ["polyblock", "pom"])
def test_to_sympy_of_monet_block_and_pom_matches_model(block):
    torch.manual_seed(2)
    if block == "polyblock":
        model = pn.PolyBlock(4, norm="batch", spatial_shift=False).double()
        model.train()
        model(torch.randn(16, 4, dtype=torch.float64))
        example = torch.randn(1, 4, dtype=torch.float64)
    else:
        model = pn.PoM(2, degree=2, expand=1).double()
        example = torch.randn(1, 3, 2, dtype=torch.float64)
    model.eval()
    names = [f"v{i}" for i in range(example.numel())]
    exprs = to_sympy(model, names, example_input=example)
    points = np.random.default_rng(3).normal(size=(5, example.numel()))
    expected = model(torch.as_tensor(points).reshape((5,) + example.shape[1:]))
    np.testing.assert_allclose(_numeric(exprs, sympy.symbols(names), points).reshape(5, -1),
                               expected.detach().numpy().reshape(5, -1), rtol=1e-9, atol=1e-9)


def test_hand_set_mulayer_expands_to_hand_computed_polynomial():
    layer = pn.MuLayer(2, 1, hidden=1, rank=1)
    with torch.no_grad():
        layer.A.weight.copy_(torch.tensor([[1.0, 2.0]]))
        layer.A.bias.copy_(torch.tensor([1.0]))
        layer.D.weight.copy_(torch.tensor([[1.0, 0.0]]))
        layer.D.bias.zero_()
        layer.B.weight.copy_(torch.tensor([[3.0]]))
        layer.B.bias.zero_()
        layer.C.weight.copy_(torch.tensor([[2.0]]))
        layer.C.bias.copy_(torch.tensor([0.5]))
    # C[(AX) * (BDX) + AX] = 2 [(x + 2y + 1) * 3x + (x + 2y + 1)] + 1/2
    expected = sympy.expand(2 * ((x + 2 * y + 1) * 3 * x + (x + 2 * y + 1)) + sympy.Rational(1, 2))
    (expr,) = to_sympy(layer, ["x", "y"], rational=True)
    assert sympy.expand(expr - expected) == 0
    (as_float,) = to_sympy(layer, ["x", "y"])
    assert all(isinstance(c, sympy.Float) for c in sympy.Poly(as_float, x, y).coeffs())


def test_to_sympy_reads_a_hand_built_program():
    nodes = [Node("input", (), (1, 2)),
             Node("gather", (0,), (1, 1), {"index": np.array([[0]])}),
             Node("gather", (0,), (1, 1), {"index": np.array([[1]])}),
             Node("mul", (1, 2), (1, 1)),
             Node("add_const", (3,), (1, 1), {"value": np.array([2.0])})]
    (expr,) = to_sympy(PolyProgram(nodes, 4), ["u", "v"])
    u, v = sympy.symbols("u v")
    assert sympy.expand(expr - (u * v + 2)) == 0


def test_non_polynomial_model_raises_with_the_offending_module():
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    with pytest.raises(NotPolynomialError, match="Tanh") as info:
        to_sympy(model, ["x", "y"], example_input=torch.zeros(1, 2))
    assert isinstance(info.value, SymbolicError) and isinstance(info.value, PolynetsError)


def test_time_dependent_polynode_expands_in_state_and_time():
    torch.manual_seed(1)
    model = PolyNODE(2, hidden=3, time_input=True, init_scale=1.0).double()
    exprs = to_sympy(model)
    t = sympy.Symbol("t")
    assert any(t in e.free_symbols for e in exprs)
    point = np.array([[0.3, -0.7, 1.5]])
    expected = model(torch.tensor(1.5, dtype=torch.float64),
                     torch.as_tensor(point[:, :2])).detach().numpy()
    np.testing.assert_allclose(_numeric(exprs, (x, y, t), point), expected, rtol=1e-9, atol=1e-9)


def test_wrong_number_of_variable_names_is_rejected():
    with pytest.raises(ExpressionError, match="needs 2 variable names"):
        to_sympy(PolyNODE(2, hidden=3), ["x"])


def test_prune_uses_term_scale_on_data_and_absolute_size_without():
    exprs = [2.0 * x + 1e-4 * x * y + 0.5, -y + 0.01 * x**2]
    X = np.random.default_rng(0).uniform(0.5, 1.5, size=(50, 2))
    pruned = prune(exprs, 1e-3, data=X)
    assert sympy.expand(pruned[0] - (2.0 * x + 0.5)) == 0
    assert sympy.expand(pruned[1] - (-y + 0.01 * x**2)) == 0
    assert sympy.expand(prune(exprs, 0.02)[1] + y) == 0
    # data scale matters: on large x the small x**2 coefficient dominates the equation
    big_x = prune([-y + 0.01 * x**2], 0.1, data=np.full((4, 2), [100.0, 1.0]))[0]
    assert sympy.expand(big_x - 0.01 * x**2) == 0


def test_prune_then_refit_on_exact_data_recovers_exact_coefficients():
    traj = generate("lotka_volterra")
    rough = [1.5 * x - 1.1 * x * y + 1e-5 * y**2 - 2e-5, -3.0 * y + 1.3 * x * y + 1e-5 * x]
    pruned = prune(rough, 1e-3, data=traj.X)
    assert [len(e.args) for e in pruned] == [2, 2]
    fitted = refit(pruned, traj.t, traj.X, method="trajectory", variables=["x", "y"])
    truth = {(0, 1, 0): 1.56, (0, 1, 1): -1.12, (1, 0, 1): -3.10, (1, 1, 1): 1.21}
    for (eq, i, j), value in truth.items():
        coef = float(sympy.Poly(fitted[eq], x, y).coeff_monomial(x**i * y**j))
        assert abs(coef - value) <= 1e-8 * abs(value)
    linear = refit(pruned, traj.t, traj.X, method="lstsq")
    for (eq, i, j), value in truth.items():
        coef = float(sympy.Poly(linear[eq], x, y).coeff_monomial(x**i * y**j))
        assert abs(coef - value) <= 5e-3 * abs(value)


def test_snap_rounds_only_near_round_coefficients():
    out = snap([1.5600000003 * x - 0.123456789 * y], 1e-6)
    poly = sympy.Poly(out[0], x, y)
    assert float(poly.coeff_monomial(x)) == 1.56
    assert float(poly.coeff_monomial(y)) == -0.123456789


@pytest.mark.parametrize("case, message", [
    ("nan", "finite"), ("shape", "must match"), ("time", "strictly increase"),
    ("columns", "state columns")])
def test_refit_rejects_bad_trajectory_data(case, message):
    traj = generate("lotka_volterra", n=20)
    t, X = traj.t.copy(), traj.X.copy()
    if case == "nan":
        X[3, 1] = np.nan
    elif case == "shape":
        t = t[:-1]
    elif case == "time":
        t[5] = t[4]
    else:
        X = np.hstack([X, X[:, :1]])
    with pytest.raises(SymbolicDataError, match=message):
        refit([1.56 * x - 1.12 * x * y, -3.1 * y + 1.21 * x * y], t, X)


def test_refit_rejects_unknown_method_and_foreign_symbols():
    traj = generate("lotka_volterra", n=20)
    with pytest.raises(ExpressionError, match="method"):
        refit([x, y], traj.t, traj.X, method="magic")
    with pytest.raises(ExpressionError, match="not among the variables"):
        refit([x * z, y], traj.t, traj.X, variables=["x", "y"])


def test_exports_give_latex_and_runnable_python():
    exprs = [1.56 * x - 1.12 * x * y, -3.1 * y + 1.21 * x * y]
    latex = to_latex(exprs, [x, y])
    assert r"\frac{dx}{dt} &=" in latex and "1.56" in latex
    namespace: dict = {}
    exec(compile(to_python(exprs, [x, y], name="lv"), "<generated>", "exec"), namespace)
    assert np.allclose(namespace["lv"](0.0, [2.0, 3.0]), [1.56 * 2 - 1.12 * 6, -9.3 + 1.21 * 6])


def test_generated_noise_is_a_fraction_of_each_variables_std():
    clean = generate("lorenz", n=400, t_end=4.0)
    noisy = generate("lorenz", n=400, t_end=4.0, noise=0.05, seed=3)
    ratio = (noisy.X - clean.X).std(axis=0) / clean.X.std(axis=0)
    assert np.all(np.abs(ratio - 0.05) < 0.01)
    assert np.array_equal(noisy.X, generate("lorenz", n=400, t_end=4.0, noise=0.05, seed=3).X)


def test_read_csv_reports_missing_time_column(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("time,x\n0,1\n1,2\n")
    with pytest.raises(SymbolicDataError, match="no time column 't'"):
        read_csv(str(path))
    t, X, names = read_csv(str(path), time_column="time")
    assert names == ["x"] and X.shape == (2, 1) and t.tolist() == [0.0, 1.0]


def test_prune_refuses_one_expression_or_text_that_is_none_naming_it():
    with pytest.raises(ExpressionError, match="got one str .* wrap it in a list"):
        prune("x + y", 1e-3)
    with pytest.raises(ExpressionError, match="expression 1 .* is not an expression"):
        prune(["x", "y +"], 1e-3)
    assert [str(e) for e in prune(["x + 1e-5*y", "2*y"], 1e-3)] == ["1.0*x", "2.0*y"]


def test_read_csv_refuses_binary_files_and_the_time_column_as_a_state(tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes(bytes(range(128, 256)) * 8)
    with pytest.raises(SymbolicDataError, match="is not a CSV text file"):
        read_csv(str(path))
    path.write_text("t,x,y\n0,1,2\n1,2,3\n")
    with pytest.raises(SymbolicDataError, match="time column 't' cannot be a state"):
        read_csv(str(path), columns=["t", "x"])


@pytest.mark.parametrize("kwargs, match", [
    ({"node_steps": -5}, "node_steps must be a non-negative int"),
    ({"snap_tol": -1.0}, "snap_tol must be None or a non-negative number")])
def test_discovery_refuses_negative_steps_and_snap_tolerance(kwargs, match):
    traj = generate("lotka_volterra", n=40, t_end=4.0)
    with pytest.raises(ExpressionError, match=match):
        EquationDiscovery(degree=2, progress=False, **kwargs).fit(traj.t, traj.X)


def test_discover_command_prints_json_equations_from_a_csv(tmp_path, capsys):
    from polynets.cli import main

    traj = generate("lotka_volterra", n=40, t_end=4.0)
    path = tmp_path / "lv.csv"
    rows = "\n".join(",".join(f"{v:.17g}" for v in (ti, *xi)) for ti, xi in zip(traj.t, traj.X))
    path.write_text("t,x,y\n" + rows + "\n")
    assert main(["discover", str(path), "--quiet", "--format", "json", "--steps", "30"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["variables"] == ["x", "y"]
    assert [sorted(c) for c in out["coefficients"]] == [["x", "x*y"], ["x*y", "y"]]
    assert abs(out["coefficients"][0]["x"] - 1.56) < 1e-6


def test_discover_subcommand_is_registered_in_polynets_cli():
    from polynets.cli import build_parser

    args = build_parser().parse_args(["discover", "data.csv", "--degree", "3", "--noise", "0.05"])
    assert args.degree == 3 and args.noise == 0.05 and callable(args.func)
