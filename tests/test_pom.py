"""Tests of the Polynomial Mixer: equivariance, masks, recurrence, errors, Polymorpher models."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polynets as pn
from polynets.errors import ConfigError, ShapeError
from polynets.nn.pom import PoM, block_causal_mask, causal_mask

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


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), cut=st.integers(0, 9), seed=st.integers(0, 2 ** 16),
       form=st.sampled_from(FORMS), aggregation=st.sampled_from(AGGREGATIONS))
def test_any_split_of_a_causal_sequence_into_two_steps_gives_forward(
        n: int, cut: int, seed: int, form: str, aggregation: str) -> None:
    pom = _pom(d=4, seed=seed, form=form, aggregation=aggregation, mask="causal")
    x = _x(b=1, n=n, d=4, seed=seed)
    cut = min(cut, n)
    state = pom.init_state(1)
    parts = []
    for chunk in (x[:, :cut], x[:, cut:]):
        y, state = pom.step(state, chunk)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=1), pom(x), rtol=1e-10, atol=1e-12)


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
    torch.testing.assert_close(total.shared_state(x) / 10, mean.shared_state(x), rtol=1e-12,
                               atol=1e-12)
    assert not torch.allclose(total(x), mean(x))


def test_powers_form_state_is_the_weighted_power_sum() -> None:
    pom = _pom(degree=3, activation="linear")
    with torch.no_grad():
        pom.alpha.copy_(torch.randn_like(pom.alpha))
    x = _x()
    z = pom.proj_h(x)
    expected = sum(pom.alpha[p - 1] * z ** p for p in range(1, 4)).mean(dim=1, keepdim=True)
    torch.testing.assert_close(pom.shared_state(x), expected, rtol=1e-10, atol=1e-12)


def test_products_form_state_concatenates_running_products() -> None:
    pom = _pom(degree=3, form="products", activation="gelu")
    x = _x()
    h1, h2, h3 = torch.nn.functional.gelu(pom.proj_h(x)).chunk(3, dim=-1)
    expected = torch.cat([h1, h1 * h2, h1 * h2 * h3], dim=-1).mean(dim=1, keepdim=True)
    torch.testing.assert_close(pom.shared_state(x), expected, rtol=1e-10, atol=1e-12)
    assert pom.state_dim == 3 * pom.hidden


def test_bias_free_top_term_pom_is_homogeneous_of_its_degree() -> None:
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
    ({"gate": None}, ConfigError, "unknown gate"),
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


# --- certificate (tracer) -------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, degree", [
    ({}, 3),                                           # H degree 2, linear gate 1
    ({"degree": 3}, 4),                                # H degree 3, linear gate 1
    ({"gate": "poly2"}, 4),                            # H degree 2, quadratic gate 2
    ({"degree": 3, "form": "products"}, 4),            # prod of 3 projections, linear gate
    ({"mask": "causal"}, 3),                           # cumsum is linear over tokens
    ({"mask": "block_causal", "block_size": 3}, 3),
    ({"mask": causal_mask(6), "aggregation": "sum"}, 3),
])
def test_linear_pom_certifies_as_polynomial_of_degree_k_plus_gate_degree(kwargs: dict,
                                                                          degree: int) -> None:
    """Degree = k + deg(g): H(X) sums (a linear map) degree-k token features, the gate adds deg g.

    Mean aggregation multiplies by constant reciprocal counts, so it does not change the degree.
    """
    pom = PoM(8, **kwargs).eval()
    x = torch.randn(1, 6, 8)
    cert = pn.certify(pom, x)
    assert cert.is_polynomial, cert.offending
    assert cert.degree == degree == pom.polynomial_degree
    xs = torch.randn(3, 6, 8, dtype=torch.float64)
    program = pn.trace(pom, x)
    expected = pom.double()(xs).detach().numpy()
    assert abs(program.simulate(xs.numpy()) - expected).max() < 1e-10


def test_original_pom_is_reported_non_polynomial_with_module_path() -> None:
    model = pn.PolymorpherClassifier(6, 8, 3, dim=8, depth=1, activation="gelu",
                                     gate="sigmoid").eval()
    cert = pn.certify(model, torch.randn(1, 6, 8))
    assert not cert.is_polynomial
    ops = {(o.path, o.op) for o in cert.offending}
    assert ("blocks.0.mixer", "aten.gelu") in ops
    assert ("blocks.0.mixer", "aten.sigmoid") in ops


def test_linear_polymorpher_classifier_certifies_with_composed_degree() -> None:
    """Block: X + PoM(X) has degree 3, the Mu-Layer squares it: 6; two blocks: 6 * 6 = 36."""
    for depth, degree in ((1, 6), (2, 36)):
        model = pn.PolymorpherClassifier(8, 8, 10, dim=16, depth=depth).eval()
        cert = pn.certify(model, torch.randn(1, 8, 8))
        assert cert.is_polynomial and cert.degree == degree


def test_causal_pom_expands_to_polynomials_that_read_only_past_tokens() -> None:
    import sympy
    import symbolic

    torch.manual_seed(0)
    pom = PoM(1, degree=2, expand=1, aggregation="sum", mask="causal").eval()
    exprs = symbolic.to_sympy(pom, variables=["a", "b", "c"], example_input=torch.randn(1, 3, 1))
    a, b, c = sympy.symbols("a b c")
    assert [e.free_symbols for e in exprs] == [{a}, {a, b}, {a, b, c}]
    assert all(sympy.Poly(e, a, b, c).total_degree() == 3 for e in exprs)
    x = torch.tensor([[[0.3], [-0.7], [1.1]]], dtype=torch.float64)
    values = [float(e.subs({a: 0.3, b: -0.7, c: 1.1})) for e in exprs]
    torch.testing.assert_close(torch.tensor(values, dtype=torch.float64),
                               pom.double()(x).flatten().detach(), rtol=1e-9, atol=1e-9)


def test_linear_pom_runs_encrypted_and_matches_plaintext() -> None:
    import he

    torch.manual_seed(0)
    pom = PoM(4, degree=2, expand=1).eval()
    x = 0.5 * torch.randn(1, 4, 4)
    program = he.compile(pom, x)
    client = he.Client(program)
    server = he.Server(program, client.public_context())
    out = client.decrypt(server.run(client.encrypt(x.numpy())))
    assert abs(out - pom(x).detach().numpy()).max() < 1e-3


# --- Polymorpher ----------------------------------------------------------------------------


def test_polymorpher_without_norm_is_residual_pom_plus_feed_forward() -> None:
    torch.manual_seed(0)
    block = pn.Polymorpher(8, norm="none").double()
    x = _x()
    y = x + block.mixer(x)
    torch.testing.assert_close(block(x), y + block.ff(y), rtol=1e-12, atol=1e-12)
    assert isinstance(block.ff, pn.MuLayer)


@pytest.mark.parametrize("norm", ["none", "batch", "layer"])
def test_causal_polymorpher_step_equals_forward(norm: str) -> None:
    torch.manual_seed(0)
    block = pn.Polymorpher(8, mask="causal", norm=norm, gate="poly2").double()
    block.train()
    block(_x(b=8, seed=5))  # give BatchNorm running statistics
    block.eval()
    x = _x()
    state = block.init_state(2)
    outs = []
    for t in range(x.shape[1]):
        y, state = block.step(state, x[:, t])
        outs.append(y)
    torch.testing.assert_close(torch.stack(outs, dim=1), block(x), rtol=1e-10, atol=1e-10)


def test_token_wise_polymorpher_never_mixes_tokens_and_matches_size() -> None:
    torch.manual_seed(0)
    token = pn.Polymorpher(16, mixer="token").double().eval()
    pom = pn.Polymorpher(16).double().eval()
    x = _x(d=16)
    x2 = x.clone()
    x2[:, 3] += 1.0
    changed = (token(x2) - token(x)).abs().amax(dim=(0, 2)) > 0
    assert changed.tolist() == [t == 3 for t in range(x.shape[1])]
    assert ((pom(x2) - pom(x)).abs().amax(dim=(0, 2)) > 0).all()
    n_token = sum(p.numel() for p in token.parameters())
    n_pom = sum(p.numel() for p in pom.parameters())
    assert abs(n_token - n_pom) / n_pom < 0.05


def test_classifier_shapes_head_and_pooling() -> None:
    model = pn.PolymorpherClassifier(8, 5, 3, dim=16, depth=2)
    x = torch.randn(4, 8, 5)
    assert model(x).shape == (4, 3)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (4, 16)
    model.reset_classifier(0, global_pool="sum")
    assert model(x).shape == (4, 16)
    assert model.pos_embed.shape == (1, 8, 16)


def test_classifier_and_block_reject_bad_shapes_and_options() -> None:
    model = pn.PolymorpherClassifier(8, 5, 3, dim=16, depth=1)
    with pytest.raises(ShapeError, match=r"\(B, 8, 5\)"):
        model(torch.randn(4, 7, 5))
    with pytest.raises(ShapeError, match=r"\(B, N, 16\)"):
        pn.Polymorpher(16)(torch.randn(2, 16))
    with pytest.raises(ConfigError, match="unknown ff"):
        pn.Polymorpher(16, ff="conv")
    with pytest.raises(ConfigError, match="unknown mixer"):
        pn.Polymorpher(16, mixer="attention")
    with pytest.raises(ConfigError, match="norm"):
        pn.Polymorpher(16, norm="group")
    with pytest.raises(ConfigError, match="global_pool"):
        pn.PolymorpherClassifier(8, 5, 3, global_pool="max")
    with pytest.raises(ConfigError, match="no recurrent state"):
        pn.Polymorpher(16, mixer="token").init_state(2)


@pytest.mark.slow
def test_polymorpher_learns_digit_pairs_task_that_token_wise_model_cannot() -> None:
    """Same-digit pairs (16 row tokens, label depends on tokens 8 apart): PoM >> token-wise."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "pom_sequence.py"
    spec = importlib.util.spec_from_file_location("pom_sequence", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    pom = example.train_and_evaluate("pairs", "pom", 8, progress=False)
    token = example.train_and_evaluate("pairs", "token", 8, progress=False)
    assert pom["test_accuracy"] > 0.85
    assert token["test_accuracy"] < 0.65
    assert pom["test_accuracy"] - token["test_accuracy"] > 0.25


@pytest.mark.slow
def test_benchmark_script_writes_json_plot_and_ratios(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "pom_vs_attention.py"
    subprocess.run([sys.executable, str(script), "--min-len", "32", "--max-len", "64",
                    "--budget", "0.01", "--out", str(tmp_path)], check=True, capture_output=True)
    saved = json.loads((tmp_path / "pom_vs_attention.json").read_text())
    assert (tmp_path / "pom_vs_attention.png").stat().st_size > 0
    rows = saved["runs"][0]["rows"]
    assert [r["n"] for r in rows] == [32, 64] and saved["runs"][0]["device"] == "cpu"
    for r in rows:
        assert r["speedup_forward"] == pytest.approx(
            r["sdpa"]["forward"]["median_s"] / r["pom"]["forward"]["median_s"])
        assert r["pom"]["memory"]["forward_backward_bytes"] >= 0
    assert saved["theoretical_crossover"] == pytest.approx((512 * 771 - 4 * 256 ** 2) / 512)


def test_constant_cache_is_bounded():
    from polynets.nn.pom import CONSTANT_CACHE_SIZE

    pom = pn.PoM(8, mask="causal").eval()
    with torch.no_grad():
        for n in range(2, 2 + 2 * CONSTANT_CACHE_SIZE):
            ref = pom(torch.randn(1, n, 8))
            assert ref.shape == (1, n, 8)
    assert 0 < len(pom._constants) <= CONSTANT_CACHE_SIZE
