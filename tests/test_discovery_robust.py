"""EquationDiscovery beyond its own systems: mixed sampling, honest fits, estimator contract."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError as SklearnNotFittedError
from sklearn.utils.validation import check_is_fitted

from symbolic import EquationDiscovery, ExpressionError, NotFittedError
from symbolic.field import monomial_exponents
from symbolic.shooting import fit_trajectories, group_windows, make_windows
from symbolic.systems import SYSTEMS, generate

LV_TRUTH = [{"x": 1.56, "x*y": -1.12}, {"y": -3.10, "x*y": 1.21}]


def _lv_coef() -> np.ndarray:
    coef = np.zeros((6, 2))        # library 1, x, y, x**2, x*y, y**2
    coef[1, 0], coef[4, 0], coef[2, 1], coef[4, 1] = 1.56, -1.12, -3.10, 1.21
    return coef


def _mixed_steps() -> list:
    """Two Lotka-Volterra trajectories on [0, 5]: dt 0.1 (51 samples) and dt 0.2 (26)."""
    a = generate("lotka_volterra", n=51, t_end=5.0)
    b = generate("lotka_volterra", n=26, t_end=5.0, x0=(3.0, 2.0))
    return [(a.t, a.X), (b.t, b.X)]


def _errors(found, truth):
    rel, missed, spurious = 0.0, 0, 0
    for est, true in zip(found, truth):
        for term, value in true.items():
            rel = max(rel, abs(est.get(term, 0.0) - value) / abs(value))
            missed += term not in est
        spurious += len(set(est) - set(true))
    return rel, missed, spurious


def test_windows_with_different_time_steps_are_not_grouped_together():
    windows = make_windows(_mixed_steps(), 10)
    for group in group_windows(windows):
        steps = {round(float(np.diff(windows[i][0]).mean()), 9) for i in group}
        lengths = {len(windows[i][0]) for i in group}
        assert len(steps) == 1 and len(lengths) == 1


@pytest.mark.parametrize("window", [10, None])
def test_mixed_time_steps_have_zero_residual_at_the_true_coefficients(window):
    coef = _lv_coef()
    res = fit_trajectories(monomial_exponents(2, 2), coef, coef != 0, _mixed_steps(),
                           window=window, max_iter=1)
    assert res.rss < 1e-14


def test_mixed_time_steps_fit_recovers_the_true_coefficients():
    coef = _lv_coef()
    res = fit_trajectories(monomial_exponents(2, 2), 1.1 * coef, coef != 0, _mixed_steps(),
                           window=10)
    assert res.converged
    np.testing.assert_allclose(res.coef, coef, rtol=1e-7, atol=1e-12)


def test_discovery_on_trajectories_with_different_steps_and_lengths():
    (ta, Xa), (tb, Xb) = _mixed_steps()
    model = EquationDiscovery(degree=2, node_steps=60, progress=False).fit([ta, tb], [Xa, Xb])
    rel, missed, spurious = _errors(model.coefficients(), LV_TRUTH)
    assert (missed, spurious) == (0, 0) and rel < 1e-6


def test_irregular_sampling_is_fitted_on_each_windows_own_grid():
    traj = generate("lotka_volterra", n=400, t_end=10.0)
    keep = np.sort(np.random.default_rng(0).choice(400, size=120, replace=False))
    coef = _lv_coef()
    res = fit_trajectories(monomial_exponents(2, 2), 1.05 * coef, coef != 0,
                           [(traj.t[keep], traj.X[keep])], window=12)
    assert res.converged
    np.testing.assert_allclose(res.coef, coef, rtol=1e-7, atol=1e-12)


def test_a_fit_stopped_by_its_evaluation_budget_is_not_reported_converged():
    coef = _lv_coef()
    res = fit_trajectories(monomial_exponents(2, 2), 1.3 * coef, coef != 0, _mixed_steps(),
                           window=10, max_iter=2)
    assert not res.converged and res.status == 0


def test_estimator_follows_the_scikit_learn_contract():
    model = EquationDiscovery(degree=3, variables=("u", "v"), threshold=0.01, progress=False)
    params = model.get_params()
    assert params["degree"] == 3 and params["variables"] == ("u", "v")
    copy = clone(model)
    assert copy is not model and copy.get_params() == params
    assert model.set_params(significance=5.0) is model and model.significance == 5.0
    with pytest.raises(SklearnNotFittedError):
        check_is_fitted(model)
    with pytest.raises(NotFittedError) as info:
        model.equations()
    assert isinstance(info.value, SklearnNotFittedError)
    with pytest.raises(ExpressionError, match="degree"):
        EquationDiscovery(degree=0).fit(np.arange(10.0), np.ones((10, 2)))


def test_fitted_estimator_passes_check_is_fitted_and_clones_unfitted():
    traj = generate("lotka_volterra", n=40, t_end=4.0)
    model = EquationDiscovery(degree=2, node_steps=30, progress=False)
    assert model.fit(traj.t, traj.X) is model
    check_is_fitted(model)
    assert model.converged_ and {"node", "total"} <= set(model.timings_)
    fresh = clone(model)
    with pytest.raises(SklearnNotFittedError):
        check_is_fitted(fresh)


def test_new_benchmark_systems_have_consistent_truth():
    import sympy

    from symbolic.field import PolyField

    for name, system in SYSTEMS.items():
        traj = generate(name, n=50)
        syms = sympy.symbols(system.variables)
        local = {s.name: s for s in syms}
        exprs = [sum((c * sympy.sympify(m, locals=local) for m, c in eq.items()), sympy.S(0))
                 for eq in system.truth]
        field = PolyField.from_exprs(exprs, syms)
        np.testing.assert_allclose(field(traj.clean), np.array([system.rhs(x) for x in
                                                                traj.clean]), atol=1e-9)


def test_conservation_law_sir_is_recovered_exactly_despite_its_collinear_library():
    traj = generate("sir")                     # S + I + R = 1: the library is collinear
    model = EquationDiscovery(degree=2, variables=traj.system.variables, node_steps=30,
                              progress=False).fit(traj.t, traj.X)
    rel, missed, spurious = _errors(model.coefficients(), traj.truth)
    assert (missed, spurious) == (0, 0) and rel < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name, noise", [("sir", 0.05), ("brusselator", 0.05),
                                         ("hopf", 0.1)])
def test_held_out_systems_with_noise_give_a_model_with_the_right_terms(name, noise):
    traj = generate(name, noise=noise, seed=0)
    model = EquationDiscovery(degree=traj.system.degree, variables=traj.system.variables,
                              progress=False).fit(traj.t, traj.X)
    rel, missed, spurious = _errors(model.coefficients(), traj.truth)
    assert (missed, spurious) == (0, 0) and rel < 0.1
