"""Tests of the Polynomial Mixer: equivariance, masks, recurrence, errors, Polymorpher models."""

from __future__ import annotations

import math

import pytest
import torch

import polynets as pn
from polynets.errors import ConfigError, ShapeError
from polynets.pom import PoM, block_causal_mask, causal_mask

FORMS = ("powers", "products")
AGGREGATIONS = ("mean", "sum")


def _x(b: int = 2, n: int = 12, d: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _pom(d: int = 8, seed: int = 0, **kwargs) -> PoM:
    torch.manual_seed(seed)
    return PoM(d, **kwargs).double()


def _reference(pom: PoM, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PoM written out token by token: y_s = W_o[g(W_s x_s) * agg_{t: mask[s,t]} f(x_t)]."""
    feats = pom.features(x)  # (B, N, S)
    rows = []
    for s in range(x.shape[1]):
        seen = mask[s].nonzero().flatten()
        total = feats[:, seen].sum(dim=1)
        if pom.aggregation == "mean":
            total = total / max(len(seen), 1)
        rows.append(total)
    return pom.proj_o(pom.selection(x) * torch.stack(rows, dim=1))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("gate", ["linear", "poly2", "sigmoid"])
def test_pom_without_mask_is_permutation_equivariant(form: str, gate: str) -> None:
    pom = _pom(degree=3, form=form, gate=gate)
    x = _x()
    perm = torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(pom(x[:, perm]), pom(x)[:, perm], rtol=1e-10, atol=1e-12)


def test_pom_with_causal_mask_is_not_permutation_equivariant() -> None:
    pom = _pom(mask="causal")
    x = _x()
    perm = torch.arange(x.shape[1]).flip(0)
    assert not torch.allclose(pom(x[:, perm]), pom(x)[:, perm])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_causal_outputs_equal_token_by_token_recurrent_outputs(form: str, aggregation: str) -> None:
    pom = _pom(degree=3, form=form, aggregation=aggregation, mask="causal", gate="poly2")
    x = _x(n=17)
    state = pom.init_state(x.shape[0])
    outs = []
    for t in range(x.shape[1]):
        y_t, state = pom.step(state, x[:, t])
        outs.append(y_t)
    assert state.count == x.shape[1]
    torch.testing.assert_close(torch.stack(outs, dim=1), pom(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.stack(outs, dim=1), pom(x), rtol=1e-10, atol=1e-12)


def test_causal_outputs_equal_chunked_recurrent_outputs() -> None:
    pom = _pom(mask="causal")
    x = _x(n=12)
    state = pom.init_state(2)
    y1, state = pom.step(state, x[:, :5])
    y2, state = pom.step(state, x[:, 5:])
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), pom(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_causal_equals_explicit_masked_computation(aggregation: str) -> None:
    pom = _pom(aggregation=aggregation, mask="causal")
    x = _x()
    torch.testing.assert_close(pom(x), _reference(pom, x, causal_mask(12)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_block_causal_equals_explicit_masked_computation(form: str, aggregation: str) -> None:
    pom = _pom(form=form, aggregation=aggregation, mask="block_causal", block_size=4)
    x = _x()
    mask = block_causal_mask(12, 4)
    # Eq. 7 with 1-based indices: M[i, j] = 1 iff j <= ceil(i / K) K.
    eq7 = torch.tensor([[j <= math.ceil(i / 4) * 4 for j in range(1, 13)] for i in range(1, 13)])
    assert torch.equal(mask, eq7)
    torch.testing.assert_close(pom(x), _reference(pom, x, mask), rtol=1e-10, atol=1e-12)


def test_block_causal_recurrent_blocks_equal_forward() -> None:
    pom = _pom(mask="block_causal", block_size=3)
    x = _x(n=12)
    state = pom.init_state(2)
    outs = []
    for start in range(0, 12, 6):
        y, state = pom.step(state, x[:, start:start + 6])
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, dim=1), pom(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_arbitrary_mask_equals_explicit_masked_computation(aggregation: str) -> None:
    mask = torch.rand(12, 12, generator=torch.Generator().manual_seed(3)) < 0.4
    mask[5] = False  # a token that reads nothing gets an all-zero state
    pom = _pom(aggregation=aggregation, mask=mask, gate="poly3")
    x = _x()
    torch.testing.assert_close(pom(x), _reference(pom, x, mask), rtol=1e-10, atol=1e-12)
    assert torch.equal(pom.mask, mask)


def test_mask_tensor_of_causal_pattern_matches_named_causal_mask() -> None:
    named = _pom(mask="causal")
    explicit = _pom(mask=causal_mask(12))
    explicit.load_state_dict(named.state_dict())
    x = _x()
    torch.testing.assert_close(explicit(x), named(x), rtol=1e-10, atol=1e-12)


def test_mean_aggregation_is_sum_divided_by_token_count() -> None:
    mean = _pom(aggregation="mean")
    total = _pom(aggregation="sum")
    total.load_state_dict(mean.state_dict())
    x = _x(n=10)
    torch.testing.assert_close(total.state(x) / 10, mean.state(x), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(total(x), mean(x))


def test_powers_form_state_is_the_weighted_power_sum() -> None:
    pom = _pom(degree=3, activation="linear")
    with torch.no_grad():
        pom.alpha.copy_(torch.randn_like(pom.alpha))
    x = _x()
    z = pom.proj_h(x)
    expected = sum(pom.alpha[p - 1] * z ** p for p in range(1, 4)).mean(dim=1, keepdim=True)
    torch.testing.assert_close(pom.state(x), expected, rtol=1e-10, atol=1e-12)


def test_products_form_state_concatenates_running_products() -> None:
    pom = _pom(degree=3, form="products", activation="gelu")
    x = _x()
    h1, h2, h3 = torch.nn.functional.gelu(pom.proj_h(x)).chunk(3, dim=-1)
    expected = torch.cat([h1, h1 * h2, h1 * h2 * h3], dim=-1).mean(dim=1, keepdim=True)
    torch.testing.assert_close(pom.state(x), expected, rtol=1e-10, atol=1e-12)
    assert pom.state_dim == 3 * pom.hidden


def test_linear_variant_is_a_homogeneous_check_of_its_degree() -> None:
    """Scaling the input of a bias-free linear PoM scales the output by c**(degree + 1)."""
    for degree, gate, total in ((2, "linear", 3), (3, "linear", 4), (2, "poly2", 4)):
        pom = _pom(degree=degree, gate=gate, bias=False)
        if pom.gate_coeffs is not None:
            with torch.no_grad():  # keep only the top coefficient: g(s) = c_2 s^2
                pom.gate_coeffs[:-1] = 0.0
        with torch.no_grad():  # keep only the top power so the map is homogeneous
            if pom.alpha is not None:
                pom.alpha[:-1] = 0.0
        x = _x()
        assert pom.polynomial_degree == total
        torch.testing.assert_close(pom(2.0 * x), 2.0 ** total * pom(x), rtol=1e-10, atol=1e-12)


def test_non_polynomial_variant_reports_no_degree() -> None:
    assert _pom(activation="gelu", gate="sigmoid").polynomial_degree is None
    assert not _pom(gate="sigmoid").is_polynomial
    assert _pom(gate="poly3", degree=2).polynomial_degree == 5


@pytest.mark.parametrize("kwargs, error, words", [
    ({"mask": torch.ones(12, 11, dtype=torch.bool)}, ShapeError, "(N, N)"),
    ({"mask": torch.ones(12, dtype=torch.bool)}, ShapeError, "(N, N)"),
    ({"mask": torch.ones(12, 12)}, ConfigError, "boolean"),
    ({"mask": "diagonal"}, ConfigError, "unknown mask"),
    ({"mask": "block_causal"}, ConfigError, "block_size"),
    ({"mask": "block_causal", "block_size": 0}, ConfigError, "positive int"),
    ({"mask": "causal", "block_size": 4}, ConfigError, "block_causal"),
    ({"activation": "softmax"}, ConfigError, "unknown activation"),
    ({"gate": "poly0"}, ConfigError, "unknown gate"),
    ({"gate": "relu"}, ConfigError, "unknown gate"),
    ({"form": "sums"}, ConfigError, "unknown form"),
    ({"aggregation": "max"}, ConfigError, "unknown aggregation"),
    ({"degree": 0}, ConfigError, "degree"),
    ({"expand": -1}, ConfigError, "expand"),
])
def test_bad_configuration_raises_clear_error(kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        PoM(8, **kwargs)


@pytest.mark.parametrize("pom_kwargs, x_shape, words", [
    ({}, (12, 8), r"\(B, N, dim\)"),
    ({}, (2, 12, 7), "dim=8"),
    ({}, (2, 0, 8), "no tokens"),
    ({"mask": torch.ones(12, 12, dtype=torch.bool)}, (2, 10, 8), "N=10"),
    ({"mask": "block_causal", "block_size": 5}, (2, 12, 8), "multiple of block_size=5"),
])
def test_bad_input_shape_raises_shape_error(pom_kwargs: dict, x_shape: tuple, words: str) -> None:
    pom = PoM(8, **pom_kwargs)
    with pytest.raises(ShapeError, match=words):
        pom(torch.randn(*x_shape))


def test_recurrent_step_errors() -> None:
    with pytest.raises(ConfigError, match="mask='causal'"):
        PoM(8).init_state(2)
    pom = PoM(8, mask="block_causal", block_size=4)
    state = pom.init_state(2)
    with pytest.raises(ShapeError, match="whole blocks"):
        pom.step(state, torch.randn(2, 8))
    with pytest.raises(ShapeError, match="state.total"):
        pom.step(pom.init_state(3), torch.randn(2, 4, 8))
    with pytest.raises(ShapeError, match=r"\(B, dim\)"):
        PoM(8, mask="causal").step(state, torch.randn(2, 7))


def test_block_causal_mask_rejects_block_size_that_does_not_divide() -> None:
    with pytest.raises(ShapeError, match="multiple"):
        block_causal_mask(10, 4)


def test_pom_is_exported_from_package() -> None:
    assert pn.PoM is PoM
