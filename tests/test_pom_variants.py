"""Tests of Cross-PoM, the speech paper's PoM variants, and PADRe's heads, resize and
multimodal form: exact traces, stated degrees, the maths they compute, and shape errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polynets as pn
from polynets.errors import ConfigError, ShapeError
from polynets.nn.padre import PADRe
from polynets.nn.pair import PairInput
from polynets.nn.pom import PoM, SplitPoM


def _t(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _assert_program_equals_module(model: torch.nn.Module, x: torch.Tensor) -> None:
    model = model.double().eval()
    with torch.no_grad():
        ref = model(x).numpy()
    np.testing.assert_allclose(pn.trace(model, x).simulate(x), ref, rtol=1e-9, atol=1e-9)


def _cross(pom: torch.nn.Module, n: int, m: int, d: int, b: int = 2, seed: int = 0,
           **call) -> tuple[PairInput, torch.Tensor, torch.Tensor, torch.Tensor]:
    xq, xc = _t(b, n, d, seed=seed), _t(b, m, d, seed=seed + 1)
    wrapper = PairInput(pom.double().eval(), (n, d), (m, d), **call)
    return wrapper, xq, xc, PairInput.pack(xq, xc)


# ----------------------------------------------------------------------------------- Cross-PoM
def test_cross_pom_selects_from_queries_and_aggregates_the_context() -> None:
    torch.manual_seed(0)
    pom = PoM(6, degree=2, gate="poly2").double()
    xq, xc = _t(2, 4, 6), _t(2, 9, 6, seed=1)
    expected = pom.proj_o(pom.selection(xq) * pom.features(xc).mean(dim=1, keepdim=True))
    torch.testing.assert_close(pom(xq, xc), expected, rtol=1e-12, atol=1e-12)


def test_cross_pom_of_a_sequence_with_itself_is_self_pom_and_single_input_call_is_unchanged():
    torch.manual_seed(0)
    pom = PoM(6, degree=3, mask="causal").double()
    x = _t(2, 7, 6)
    torch.testing.assert_close(pom(x, x), pom(x), rtol=0, atol=0)


def test_cross_pom_output_depends_on_the_context_only_through_its_state() -> None:
    torch.manual_seed(0)
    pom = PoM(4, degree=2).double()
    xq, xc = _t(1, 3, 4), _t(1, 8, 4, seed=1)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(pom(xq, xc[:, perm]), pom(xq, xc), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("aggregation", ["mean", "sum"])
def test_cross_pom_call_mask_equals_token_by_token_aggregation(aggregation: str) -> None:
    torch.manual_seed(0)
    pom = PoM(5, degree=2, aggregation=aggregation).double()
    xq, xc = _t(2, 4, 5), _t(2, 6, 5, seed=1)
    mask = torch.tensor([[1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    feats = pom.features(xc)
    rows = []
    for s in range(4):
        seen = mask[s].nonzero().flatten()
        total = feats[:, seen].sum(dim=1)
        rows.append(total / max(len(seen), 1) if aggregation == "mean" else total)
    expected = pom.proj_o(pom.selection(xq) * torch.stack(rows, dim=1))
    torch.testing.assert_close(pom(xq, xc, mask=mask), expected, rtol=1e-12, atol=1e-12)
    per_sample = torch.stack([mask, mask.flip(0)])
    out = pom(xq, xc, mask=per_sample)
    torch.testing.assert_close(out[0], expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[1], pom(xq[1:], xc[1:], mask=mask.flip(0))[0])


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 5), m=st.integers(1, 6), degree=st.integers(1, 3),
       form=st.sampled_from(["powers", "products", "jump"]),
       gate=st.sampled_from(["linear", "poly2"]), masked=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_cross_pom_traces_exactly_and_certifies_degree_in_the_pair(
        n: int, m: int, degree: int, form: str, gate: str, masked: bool, seed: int) -> None:
    torch.manual_seed(seed)
    pom = PoM(4, degree=degree, form=form, gate=gate, expand=1)
    call = {}
    if masked:
        call["mask"] = torch.rand(n, m, generator=torch.Generator().manual_seed(seed)) > 0.4
    wrapper, _, _, z = _cross(pom, n, m, 4, seed=seed, **call)
    _assert_program_equals_module(wrapper, z)
    cert = pn.certify(wrapper, z)
    gate_degree = 1 if gate == "linear" else 2
    assert cert.is_polynomial and cert.degree == pom.polynomial_degree == degree + gate_degree


def test_cross_pom_is_degree_k_in_the_context_and_gate_degree_in_the_queries() -> None:
    torch.manual_seed(0)
    pom = PoM(3, degree=3, form="jump", bias=False).double()  # homogeneous parts
    xq, xc = _t(1, 2, 3), _t(1, 4, 3, seed=1)
    for sq, sc in ((2.0, 1.0), (1.0, 2.0), (-1.5, 0.5)):
        lhs = pom(sq * xq, sc * xc)
        torch.testing.assert_close(lhs, sq * sc ** 3 * pom(xq, xc), rtol=1e-10, atol=1e-12)


def test_cross_pom_backward_reaches_every_parameter() -> None:
    torch.manual_seed(0)
    pom = PoM(4, degree=2, gate="poly2")
    xq, xc = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 5, 4, requires_grad=True)
    pom(xq, xc, mask=torch.ones(3, 5, dtype=torch.bool)).square().sum().backward()
    for name, p in pom.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert xq.grad.abs().sum() > 0 and xc.grad.abs().sum() > 0


@pytest.mark.parametrize("pom_kwargs, xq, xc, call, error, words", [
    ({}, (2, 3, 4), (2, 5, 3), {}, ShapeError, r"context input must have shape \(B, N, dim\)"),
    ({}, (2, 3, 4), (3, 5, 4), {}, ShapeError, r"batch size B=2: expected \(2, M, 4\)"),
    ({}, (2, 3, 5), (2, 5, 4), {}, ShapeError, r"query input must have shape \(B, N, dim\)"),
    ({"mask": "causal"}, (2, 3, 4), (2, 5, 4), {}, ShapeError, r"expected \(2, 3, 4\)"),
    ({}, (2, 3, 4), (2, 5, 4), {"mask": torch.ones(3, 4, dtype=torch.bool)}, ShapeError,
     r"\(N, M\) = \(3, 5\)"),
    ({}, (2, 3, 4), (2, 5, 4), {"mask": torch.ones(3, 3, 5, dtype=torch.bool)}, ShapeError,
     r"\(B, N, M\) = \(2, 3, 5\)"),
    ({}, (2, 3, 4), (2, 5, 4), {"mask": torch.ones(3, 5)}, ConfigError, "boolean"),
    ({"mask": "causal"}, (2, 3, 4), (2, 3, 4), {"mask": torch.ones(3, 3, dtype=torch.bool)},
     ConfigError, "built without a mask"),
])
def test_cross_pom_bad_inputs_name_the_expected_shape(pom_kwargs, xq, xc, call, error, words):
    pom = PoM(4, **pom_kwargs)
    with pytest.raises(error, match=words):
        pom(torch.randn(xq), torch.randn(xc), **call)


def test_pair_input_round_trips_and_rejects_bad_shapes() -> None:
    a, b = _t(3, 2, 4), _t(3, 5, 4, seed=1)
    wrapper = PairInput(PoM(4), (2, 4), (5, 4))
    ra, rb = wrapper.unpack(PairInput.pack(a, b))
    assert torch.equal(ra, a) and torch.equal(rb, b)
    with pytest.raises(ShapeError, match=r"\(B, 28\)"):
        wrapper(torch.randn(3, 27))
    with pytest.raises(ConfigError, match="same leading batch"):
        PairInput.pack(a, b[:2])
    with pytest.raises(ConfigError, match="per-sample shape"):
        PairInput(PoM(4), (2, 0), (5, 4))


# -------------------------------------------------------------------- speech-paper variants
def test_mode_jump_state_is_the_top_product_only() -> None:
    torch.manual_seed(0)
    pom = PoM(4, degree=3, form="jump", expand=2).double()
    assert pom.state_dim == 8 and pom.proj_h.out_features == 24
    x = _t(2, 5, 4)
    z1, z2, z3 = pom.proj_h(x).chunk(3, dim=-1)
    torch.testing.assert_close(pom.features(x), z1 * z2 * z3, rtol=1e-12, atol=1e-12)
    assert pom.polynomial_degree == 4


def test_mode_jump_with_bias_free_maps_is_homogeneous_in_the_state() -> None:
    torch.manual_seed(0)
    pom = PoM(4, degree=3, form="jump", bias=False).double()
    x = _t(1, 5, 4)
    torch.testing.assert_close(pom.shared_state(2.0 * x), 8.0 * pom.shared_state(x))


def test_selective_pom_state_reads_only_the_first_half_of_the_features() -> None:
    torch.manual_seed(0)
    pom = PoM(6, degree=2, selective=True).double()
    assert pom.mixed_features == 3 and pom.proj_h.in_features == 3
    x = _t(2, 5, 6)
    changed = x.clone()
    changed[..., 3:] = _t(2, 5, 3, seed=5)
    torch.testing.assert_close(pom.shared_state(changed), pom.shared_state(x))
    changed[..., :3] += 1.0
    assert not torch.allclose(pom.shared_state(changed), pom.shared_state(x))


def test_split_pom_groups_never_mix_and_sizes_cover_the_features() -> None:
    torch.manual_seed(0)
    split = SplitPoM(8, ways=3, degree=2).double()
    assert split.sizes == (3, 3, 2) and sum(split.sizes) == 8
    x = _t(2, 5, 8)
    y = split(x)
    changed = x.clone()
    changed[..., 3:6] += 1.0  # second group only
    y2 = split(changed)
    torch.testing.assert_close(y2[..., :3], y[..., :3])
    torch.testing.assert_close(y2[..., 6:], y[..., 6:])
    assert not torch.allclose(y2[..., 3:6], y[..., 3:6])
    torch.testing.assert_close(y[..., 3:6], split.groups[1](x[..., 3:6]))


@pytest.mark.parametrize("make, degree", [
    (lambda: PoM(6, degree=3, form="jump"), 4),
    (lambda: PoM(6, degree=2, selective=True, gate="poly2"), 4),
    (lambda: PoM(6, degree=3, form="products", selective=True, mask="causal"), 4),
    (lambda: SplitPoM(6, ways=2, degree=2), 3),
    (lambda: SplitPoM(7, ways=3, degree=3, form="jump", gate="poly2"), 5),
])
@pytest.mark.parametrize("n", [1, 4])
def test_speech_variants_trace_exactly_and_certify_their_degree(make, degree, n) -> None:
    torch.manual_seed(0)
    model = make()
    x = _t(2, n, model.dim)
    _assert_program_equals_module(model, x)
    cert = pn.certify(model, x)
    assert cert.is_polynomial and cert.degree == degree == model.polynomial_degree


def test_split_pom_cross_call_traces_through_pair_input() -> None:
    torch.manual_seed(0)
    wrapper, _, _, z = _cross(SplitPoM(6, ways=2, degree=2), 3, 5, 6)
    _assert_program_equals_module(wrapper, z)
    assert pn.certify(wrapper, z).degree == 3


def test_speech_variants_backward_and_original_gelu_form_is_not_polynomial() -> None:
    torch.manual_seed(0)
    for model in (PoM(6, form="jump", degree=3), PoM(6, selective=True), SplitPoM(6, ways=3)):
        model(torch.randn(2, 4, 6)).square().sum().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    original = SplitPoM(6, ways=2, activation="gelu", gate="sigmoid", form="jump")
    assert not original.is_polynomial and original.polynomial_degree is None
    cert = pn.certify(original.eval(), torch.randn(1, 4, 6))
    assert not cert.is_polynomial and any("gelu" in str(o) for o in cert.offending)


@pytest.mark.parametrize("make, error, words", [
    (lambda: PoM(4, form="top"), ConfigError, "unknown form"),
    (lambda: PoM(1, selective=True), ConfigError, "dim >= 2"),
    (lambda: PoM(4, selective=1), ConfigError, "True or False"),
    (lambda: SplitPoM(4, ways=5), ConfigError, "ways=5 > dim=4"),
    (lambda: SplitPoM(4, ways=0), ConfigError, "positive int"),
])
def test_speech_variant_bad_configuration_raises(make, error, words) -> None:
    with pytest.raises(error, match=words):
        make()


def test_split_pom_bad_shape_names_the_expected_shape() -> None:
    with pytest.raises(ShapeError, match=r"\(B, N, dim\) with dim=6"):
        SplitPoM(6)(torch.randn(2, 3, 5))


# ----------------------------------------------------------------- PADRe heads, resize, modes
def test_padre_heads_are_independent_copies_on_channel_groups() -> None:
    torch.manual_seed(0)
    m = PADRe(8, degree=3, kernel_size=3, heads=2, proj=False).double()
    assert m.channel_mix.groups == 2 and all(c.groups == 2 for c in m.z_channel)
    x = _t(2, 4, 4, 8)
    y = m(x)
    changed = x.clone()
    changed[..., 4:] += 1.0  # second head's channels only
    y2 = m(changed)
    torch.testing.assert_close(y2[..., :4], y[..., :4])
    assert not torch.allclose(y2[..., 4:], y[..., 4:])


@pytest.mark.parametrize("kwargs, shape", [
    (dict(heads=2), (2, 4, 5, 8)),
    (dict(heads=4, token_mixing="shared", spatial_dims=1, degree=4), (2, 7, 8)),
    (dict(token_shape=(4, 5), out_tokens=(2, 3)), (2, 4, 5, 8)),
    (dict(token_shape=6, out_tokens=3, spatial_dims=1, resize_rank=2, out_features=3,
          weights="position", heads=2), (2, 6, 8)),
])
def test_padre_heads_and_resize_trace_exactly_with_degree_d(kwargs, shape) -> None:
    torch.manual_seed(0)
    m = PADRe(8, kernel_size=3, **{"degree": 3, **kwargs})
    x = _t(*shape)
    _assert_program_equals_module(m, x)
    assert pn.certify(m.double().eval(), x).degree == m.degree


def test_padre_resize_is_u_times_p_before_the_output_projection() -> None:
    torch.manual_seed(0)
    m = PADRe(4, degree=2, kernel_size=3, spatial_dims=1, token_shape=5, out_tokens=2).double()
    plain = PADRe(4, degree=2, kernel_size=3, spatial_dims=1).double()
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("resize")})
    x = _t(3, 5, 4)
    p = plain(x) - plain.proj.bias  # P V
    expected = torch.einsum("fn,bng->bfg", m.resize.weight, p) + m.proj.bias
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)
    assert m(x).shape == (3, 2, 4)


def test_multimodal_padre_is_the_chain_of_mode_maps() -> None:
    torch.manual_seed(0)
    m = PADRe(4, degree=2, kernel_size=3, spatial_dims=1, modes="ab", z_mixing=False,
              context_dim=3, proj=False).double()
    x, c = _t(2, 5, 4), _t(2, 7, 3, seed=1)
    y_a = m.token_mix(m.channel_mix(x.movedim(-1, 1)))
    y_b = m.context_channel_mix(c.movedim(-1, 1)).mean(dim=2, keepdim=True)
    expected = (m.w[0] * y_a * y_b).movedim(1, -1)
    torch.testing.assert_close(m(x, c), expected, rtol=1e-12, atol=1e-12)


def test_multimodal_padre_degree_in_each_mode_follows_its_letters() -> None:
    torch.manual_seed(0)
    # modes "aba": Z_2 = (a)(b), Z_3 = (a)(b)(a): every term holds exactly one context factor.
    m = PADRe(4, degree=3, kernel_size=3, modes="aba", proj=False).double()
    x, c = _t(1, 3, 3, 4), _t(1, 2, 2, 4, seed=1)
    torch.testing.assert_close(m(x, 3.0 * c), 3.0 * m(x, c), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m(x, -0.5 * c), -0.5 * m(x, c), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(m(2.0 * x, c), 2.0 * m(x, c))  # degrees 1 and 2 in x


@settings(max_examples=10, deadline=None)
@given(modes=st.sampled_from(["ab", "ba", "aab", "abb", "abab"]),
       mixing=st.sampled_from(["mean", "conv"]), spatial_dims=st.sampled_from([1, 2]),
       heads=st.sampled_from([1, 2]), norm=st.sampled_from(["none", "batch"]),
       seed=st.integers(0, 2 ** 16))
def test_multimodal_padre_traces_exactly_and_has_degree_d_in_the_pair(
        modes, mixing, spatial_dims, heads, norm, seed) -> None:
    torch.manual_seed(seed)
    m = PADRe(4, degree=len(modes), kernel_size=3, spatial_dims=spatial_dims, modes=modes,
              context_mixing=mixing, heads=heads, norm=norm, first_order=True)
    tokens = (3, 4) if spatial_dims == 2 else (5,)
    ctx_tokens = tokens if mixing == "conv" else ((2, 2) if spatial_dims == 2 else (6,))
    x, c = _t(2, *tokens, 4, seed=seed), _t(2, *ctx_tokens, 4, seed=seed + 1)
    wrapper = PairInput(m, x.shape[1:], c.shape[1:])
    z = PairInput.pack(x, c)
    _assert_program_equals_module(wrapper, z)
    assert pn.certify(wrapper, z).degree == len(modes)


def test_multimodal_padre_backward_reaches_both_modes() -> None:
    torch.manual_seed(0)
    m = PADRe(4, degree=3, kernel_size=3, spatial_dims=1, modes="aba", context_mixing="conv")
    m(torch.randn(2, 5, 4), torch.randn(2, 5, 4)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kwargs, match", [
    (dict(heads=3), r"divisible by heads \(3\)"),
    (dict(modes="aa", degree=3), "modes must be a string of degree=3"),
    (dict(modes="bb"), "never reads the input"),
    (dict(modes="ac"), "letters 'a'"),
    (dict(modes="ab", context_mixing="attention"), "context_mixing must be one of"),
    (dict(modes="ab", context_dim=3, heads=2), r"context_dim \(3\) must be divisible"),
    (dict(out_tokens=(2, 2)), "out_tokens needs token_shape"),
    (dict(out_tokens=4, token_shape=(3, 3)), r"out_tokens must be \(F_h, F_w\)"),
    (dict(resize_rank=2), "only used with out_tokens"),
])
def test_padre_option_errors(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        PADRe(4, **kwargs)


@pytest.mark.parametrize("kwargs, x, c, error, match", [
    (dict(modes="ab"), (2, 3, 3, 4), None, ConfigError, r"padre\(x, context\)"),
    (dict(), (2, 3, 3, 4), (2, 3, 3, 4), ConfigError, "no context mode"),
    (dict(modes="ab", context_mixing="conv"), (2, 3, 3, 4), (2, 2, 3, 4), ShapeError,
     r"PADRe context expected input of shape \(2, 3, 3, 4\)"),
    (dict(modes="ab", context_dim=2), (2, 3, 3, 4), (2, 5, 5, 4), ShapeError,
     r"\(2, H', W', 2\)"),
    (dict(token_shape=(3, 3), out_tokens=(1, 2)), (2, 3, 4, 4), None, ShapeError,
     r"\(B, 3, 3, 4\)"),
])
def test_padre_bad_inputs_name_the_expected_shape(kwargs, x, c, error, match) -> None:
    m = PADRe(4, kernel_size=3, **kwargs)
    with pytest.raises(error, match=match):
        m(torch.randn(x), None if c is None else torch.randn(c))


# ------------------------------------------------------------- mixers inside the Polymorpher
def test_polymorpher_takes_any_mixer_and_stays_a_polynomial() -> None:
    from polynets.nn.models.polymorpher import PolymorpherClassifier

    torch.manual_seed(0)
    model = PolymorpherClassifier(6, 3, 2, dim=8, depth=1, norm="batch",
                                  mixer=lambda d: PADRe(d, degree=3, kernel_size=3,
                                                        spatial_dims=1))
    assert isinstance(model.blocks[0].mixer, PADRe)
    x = _t(4, 6, 3)
    _assert_program_equals_module(model, x)
    assert pn.certify(model, x).degree == 3 * 2  # PADRe-3, then the Mu-Layer squares
    with pytest.raises(ConfigError, match="must return an nn.Module"):
        PolymorpherClassifier(6, 3, 2, dim=8, mixer=lambda d: d)


@pytest.mark.slow
def test_mixer_ablation_benchmark_writes_json_with_mean_std_and_degrees(tmp_path) -> None:
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "mixer_ablation.py"
    spec = importlib.util.spec_from_file_location("mixer_ablation", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x = _t(2, 16, 64).float()
    cross = bench.CrossHalves(64, degree=2)
    a, b = x.chunk(2, dim=1)
    torch.testing.assert_close(cross(x), torch.cat([cross.pom(a, b), cross.pom(b, a)], dim=1))
    report = bench.main(["--mixers", "none", "cross_pom", "--seeds", "0", "1", "--epochs", "1",
                         "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "mixer_ablation.json").read_text())
    assert set(saved["mixers"]) == {"none", "cross_pom"} == set(report["mixers"])
    for r in saved["mixers"].values():
        accs = [run["test_accuracy"] for run in r["runs"]]
        assert r["accuracy_mean"] == pytest.approx(np.mean(accs))
        assert r["accuracy_std"] == pytest.approx(np.std(accs, ddof=1))
    assert saved["mixers"]["none"]["degree"] == 16 and saved["mixers"]["cross_pom"]["degree"] == 36


# ------------------------------------------------------------------------------- encrypted
@pytest.mark.slow
@pytest.mark.parametrize("packing", ["batch", "vector"])
@pytest.mark.parametrize("make", [
    lambda: PairInput(PoM(4, degree=2, expand=1), (3, 4), (5, 4)),
    lambda: PairInput(PADRe(4, degree=2, kernel_size=3, spatial_dims=1, modes="ab"),
                      (3, 4), (5, 4)),
    lambda: SplitPoM(4, ways=2, degree=2, form="jump"),
], ids=["cross_pom", "multimodal_padre", "split_pom"])
def test_two_input_and_speech_mixers_decrypt_to_the_model_output(packing, make) -> None:
    he = pytest.importorskip("he")
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(3, 32) if isinstance(model, PairInput) else torch.randn(3, 3, 4)
    prog = he.compile(model, x, calibration=x, packing=packing)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    y = client.decrypt(server.run(client.encrypt(x).to_bytes()))
    with torch.no_grad():
        ref = model(x).numpy()
    assert y.shape == ref.shape
    assert float(np.abs(y - ref).max()) <= prog.params.expected_error + 1e-9
