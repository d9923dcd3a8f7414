"""What compiling costs before any ciphertext: a program deeper than any chain is refused before
it is lowered, and a model is lowered once (the certificate's lowering is the compiler's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import he
import he.compiler
import polynets.ir.certify
from he.errors import TooDeepError
from he.params import SECURITY_LEVELS, check_products, choose_params, most_levels
from polynets.ir.certify import certify_lowered, degree_depth
from polynets.ir.lowering import lower
from _models import Square


def _squares(n: int) -> nn.Module:
    """``n`` products in a row, each after a map by a tenth: the values stay finite (they fall
    to zero from anywhere within 10)."""
    layers: list[nn.Module] = []
    for _ in range(n):
        lin = nn.Linear(2, 2)
        with torch.no_grad():
            lin.weight.copy_(0.1 * torch.eye(2))
            lin.bias.zero_()
        layers += [lin, Square()]
    return nn.Sequential(*layers).eval()


@settings(max_examples=40, deadline=None)
@given(security=st.sampled_from(SECURITY_LEVELS), max_abs=st.floats(0.01, 1e6),
       g_in=st.floats(1e-3, 50.0), g_rs=st.floats(1e-3, 50.0), precision=st.integers(1, 30),
       rotations=st.booleans(), scale=st.one_of(st.none(), st.integers(20, 60)))
def test_no_parameters_hold_more_levels_than_the_bound(security, max_abs, g_in, g_rs, precision,
                                                       rotations, scale):
    with pytest.raises(TooDeepError):
        choose_params(most_levels(security) + 1, max_abs=max_abs, gain=(g_in, g_rs),
                      precision_bits=precision, rotations=rotations, security=security,
                      scale_bits=scale)


def test_a_depth_within_the_bound_passes_the_check_and_one_more_does_not() -> None:
    for security in SECURITY_LEVELS:
        most = most_levels(security)
        assert 0 < most
        check_products(most, security)
        with pytest.raises(TooDeepError, match=f"{security}-bit security") as info:
            check_products(most + 1, security)
        assert (info.value.levels_needed, info.value.levels_supported) == (most + 1, most)
    assert most_levels(256) < most_levels(192) < most_levels(128)


def test_a_program_deeper_than_any_chain_is_refused_before_it_is_lowered(monkeypatch) -> None:
    def no_lowering(*args, **kwargs):
        raise AssertionError("lowered a program that no chain holds")

    monkeypatch.setattr(polynets.ir.certify, "lower", no_lowering)
    monkeypatch.setattr(he.compiler, "lower", no_lowering)
    n = most_levels(128) + 1
    for packing in ("vector", "batch", "auto"):
        with pytest.raises(TooDeepError, match=f"{n} ciphertext products in a row") as info:
            he.compile(_squares(n), torch.ones(1, 2), packing=packing)
        assert info.value.levels_needed == n


def test_the_check_counts_products_not_linear_maps() -> None:
    """A deep stack of linear maps around few products is not refused by the product count
    (its levels are counted on the lowering, which composes the maps)."""
    layers: list[nn.Module] = [nn.Linear(2, 2) for _ in range(3 * most_levels(128))]
    model = nn.Sequential(*layers, Square()).eval()
    # the server applies the composed map (the client could: the square alone is then left)
    prog = he.compile(model, torch.randn(4, 2), packing="vector", first_map="server")
    assert prog.params.levels == 2


def test_degree_and_depth_need_no_lowering(monkeypatch) -> None:
    model = nn.Sequential(nn.Linear(3, 4), Square(), nn.Linear(4, 4), Square(),
                          nn.Linear(4, 2)).eval()
    cert = polynets.ir.certify.certify(model, torch.randn(1, 3))
    monkeypatch.setattr(polynets.ir.certify, "lower", lambda *a, **k: pytest.fail("lowered"))
    assert degree_depth(cert.program) == (cert.degree, cert.depth) == (4, 2)


def test_the_certificate_lowering_is_the_program_lowering() -> None:
    model = nn.Sequential(nn.Linear(3, 6), Square(), nn.Linear(6, 6), Square(),
                          nn.Linear(6, 2)).eval()
    cert, lowered = certify_lowered(model, torch.randn(1, 3))
    assert lowered is not None and cert.levels_exact
    again = lower(cert.program)
    assert [(s.kind, s.inputs, s.shape) for s in lowered.steps] == \
        [(s.kind, s.inputs, s.shape) for s in again.steps]
    for a, b in zip(lowered.steps, again.steps):
        assert all(abs(x - y).max() == 0 for x, y in zip(a.terms, b.terms))
    # a program deeper than asked is not lowered; its level count is the node-by-node bound
    deep, none = certify_lowered(model, torch.randn(1, 3), max_depth=1)
    assert none is None and not deep.levels_exact and deep.depth == 2
    assert deep.levels >= cert.levels


def test_compiling_a_model_lowers_it_once(monkeypatch) -> None:
    calls: list[int] = []

    def counted(program, keep=()):
        calls.append(len(keep))
        return lower(program, keep)

    monkeypatch.setattr(polynets.ir.certify, "lower", counted)
    monkeypatch.setattr(he.compiler, "lower", counted)
    model = nn.Sequential(nn.Linear(4, 8), Square(), nn.Linear(8, 3)).eval()
    x = torch.randn(16, 4)
    prog = he.compile(model, x[:1], calibration=x, packing="vector")
    assert calls == [0]
    np.testing.assert_allclose(prog.simulate(x[:4].numpy()), model(x[:4]).detach().numpy(),
                               rtol=1e-5, atol=1e-6)
