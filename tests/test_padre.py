"""PADRe mixer: shapes, the algebra of Eq. 1-8, tracing, certificates, encryption and errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polynets as pn
from polynets.nn.padre import PADRe


def _input(m: PADRe, batch: int = 2, side: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, side, side, m.dim) if m.spatial_dims == 2 else (batch, side + 2, m.dim)
    return torch.randn(shape, generator=g)


def _reference(model: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return copy.deepcopy(model).double().eval()(x.double()).numpy()


def _assert_close(got: np.ndarray, ref: np.ndarray, rtol: float = 1e-9) -> None:
    assert got.shape == ref.shape
    scale = max(float(np.abs(ref).max()), 1e-12)
    assert float(np.abs(got - ref).max()) <= rtol * scale


def _randomise(m: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Non-trivial per-degree weights and norm statistics, so no term is a no-op."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("w") or name == "constant":
                p.copy_(torch.randn(p.shape, generator=g))
        for b in m.modules():
            if isinstance(b, torch.nn.modules.batchnorm._BatchNorm):
                b.running_mean.copy_(torch.randn(b.num_features, generator=g))
                b.running_var.copy_(torch.rand(b.num_features, generator=g) + 0.5)
    return m.eval()


@pytest.mark.parametrize("spatial_dims, shape", [(2, (3, 5, 6, 8)), (1, (3, 7, 8))])
def test_output_keeps_tokens_and_takes_out_features(spatial_dims, shape):
    m = PADRe(8, degree=3, kernel_size=3, spatial_dims=spatial_dims, out_features=5)
    y = m(torch.randn(shape))
    assert y.shape == shape[:-1] + (5,)


def test_paper_instance_is_the_default():
    m = PADRe(16)
    assert (m.degree, m.kernel_size, m.spatial_dims) == (2, 11, 2)
    assert m.token_mixing == "depthwise" and not m.first_order
    assert m.token_mix.weight.shape == (2 * 16, 1, 11, 11)
    assert m.w.shape == (1, 16, 1, 1)  # only the degree-2 term; the shortcut gives degree 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(degree=st.integers(1, 4), spatial_dims=st.sampled_from([1, 2]),
       kernel_size=st.integers(1, 4), dim=st.integers(1, 5), side=st.integers(2, 4),
       token_mixing=st.sampled_from(["depthwise", "shared"]), z_mixing=st.booleans(),
       bias=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_program_simulation_equals_forward_and_certificate_gives_the_degree(
        degree, spatial_dims, kernel_size, dim, side, token_mixing, z_mixing, bias, seed):
    torch.manual_seed(seed)
    m = _randomise(PADRe(dim, degree=degree, kernel_size=kernel_size, spatial_dims=spatial_dims,
                         token_mixing=token_mixing, z_mixing=z_mixing, first_order=degree == 1,
                         bias=bias), seed)
    x = _input(m, side=side, seed=seed)
    _assert_close(pn.trace(m, x).simulate(x), _reference(m, x))
    cert = pn.certify(m, x)
    assert cert.is_polynomial and cert.degree == degree
    assert cert.depth == degree - 1


@pytest.mark.parametrize("kwargs", [
    dict(spatial_dims=1, causal=True),
    dict(weights="position", token_shape=(4, 4), constant=True),
    dict(norm="batch", degree=3, first_order=True),
    dict(constant=True, proj=False),
])
def test_options_trace_to_the_same_function(kwargs):
    torch.manual_seed(0)
    m = _randomise(PADRe(3, kernel_size=3, **kwargs), 1)
    x = _input(m)
    _assert_close(pn.trace(m, x).simulate(x), _reference(m, x))
    assert pn.certify(m, x).degree == m.degree


def test_constant_term_is_the_output_at_zero_input():
    m = PADRe(3, kernel_size=3, weights="position", token_shape=(2, 2), constant=True,
              proj=False)
    with torch.no_grad():
        m.constant.copy_(torch.randn(3, 2, 2))
        torch.testing.assert_close(m(torch.zeros(1, 2, 2, 3))[0], m.constant.permute(1, 2, 0))


def test_without_first_order_the_degree_two_mixer_is_homogeneous():
    torch.manual_seed(0)
    m = PADRe(4, kernel_size=3, proj=False).eval()
    x = torch.randn(2, 4, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(m(3 * x), 9 * m(x))


def test_chain_is_the_hadamard_product_of_the_mixed_maps():
    # Z_2 = (C_1 Y_1 D_1) * Y_2 with Y_i = A_i X B_i, written out with the module's own maps.
    torch.manual_seed(0)
    m = PADRe(3, kernel_size=3, spatial_dims=1, proj=False).eval()
    x = torch.randn(2, 6, 3)
    with torch.no_grad():
        w = m.channel_mix.weight[:, :, 0]  # (2 * dim, dim): B_1 and B_2 stacked
        k = m.token_mix.weight[:, 0]  # (2 * dim, taps)
        xb = torch.einsum("oc,bnc->bon", w, x)
        y = torch.nn.functional.conv1d(xb, k[:, None], padding=1, groups=6)
        y1, y2 = y[:, :3], y[:, 3:]
        c1 = torch.einsum("oc,bcn->bon", m.z_channel[0].weight[:, :, 0], y1)
        c1 = torch.nn.functional.conv1d(c1, m.z_token[0].weight, padding=1, groups=3)
        expected = (m.w[0] * (c1 * y2)).transpose(1, 2)
        torch.testing.assert_close(m(x), expected)


def test_causal_sequence_mixer_ignores_later_tokens():
    torch.manual_seed(0)
    x = torch.randn(1, 8, 4)
    later = x.clone()
    later[:, 5:] += torch.randn(1, 3, 4)
    causal = PADRe(4, degree=3, kernel_size=3, spatial_dims=1, causal=True).eval()
    centred = PADRe(4, degree=3, kernel_size=3, spatial_dims=1).eval()
    with torch.no_grad():
        torch.testing.assert_close(causal(later)[:, :5], causal(x)[:, :5])
        assert not torch.allclose(centred(later)[:, :5], centred(x)[:, :5])


def test_shared_token_kernels_are_one_per_map():
    m = PADRe(6, degree=3, kernel_size=5, token_mixing="shared")
    assert m.token_mix.weight.shape == (3, 1, 5, 5)
    assert all(t.weight.shape == (1, 1, 5, 5) for t in m.z_token)
    depthwise = PADRe(6, degree=3, kernel_size=5)
    count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    assert count(depthwise) - count(m) == (3 * 6 - 3 + 2 * (6 - 1)) * 25


def test_backward_reaches_every_parameter():
    m = PADRe(4, degree=3, kernel_size=3, first_order=True, weights="position",
              token_shape=(3, 3), constant=True)
    m(torch.randn(2, 3, 3, 4)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kwargs, shape, expected", [
    (dict(), (2, 4, 4), "(B, H, W, 4)"),
    (dict(), (2, 4, 4, 5), "(B, H, W, 4)"),
    (dict(spatial_dims=1), (2, 4, 4, 4), "(B, N, 4)"),
    (dict(weights="position", token_shape=(3, 3)), (2, 4, 4, 4), "(B, 3, 3, 4)"),
])
def test_bad_input_shape_names_the_expected_shape(kwargs, shape, expected):
    m = PADRe(4, kernel_size=3, **kwargs)
    with pytest.raises(pn.ShapeError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        m(torch.randn(shape))


@pytest.mark.parametrize("kwargs, match", [
    (dict(degree=0), "degree must be a positive int"),
    (dict(degree=1), "first_order=True"),
    (dict(spatial_dims=3), "spatial_dims must be 1"),
    (dict(causal=True), "causal=True needs spatial_dims=1"),
    (dict(token_mixing="dense"), "token_mixing must be one of"),
    (dict(weights="token"), "weights must be one of"),
    (dict(weights="position"), "needs token_shape"),
    (dict(weights="position", token_shape=5), r"token_shape must be \(H, W\)"),
    (dict(token_shape=(4, 4)), 'only used with weights="position"'),
    (dict(proj=False, out_features=3), "out_features must equal dim"),
    (dict(norm="layer"), "norm must be 'none' or 'batch'"),
    (dict(kernel_size=0), "kernel_size must be a positive int"),
])
def test_bad_configuration_raises_config_error(kwargs, match):
    with pytest.raises(pn.ConfigError, match=match):
        PADRe(4, **kwargs)


@pytest.mark.parametrize("packing", ["batch", "vector"])
def test_tiny_padre_decrypts_to_the_model_output(packing):
    he = pytest.importorskip("he")
    torch.manual_seed(0)
    m = PADRe(4, kernel_size=3).eval()
    x = torch.randn(3, 4, 4, 4)
    prog = he.compile(m, x, calibration=x, packing=packing)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    y = client.decrypt(server.run(client.encrypt(x).to_bytes()))
    ref = _reference(m, x)
    assert y.shape == ref.shape
    _assert_close(prog.simulate(x), ref)
    assert float(np.abs(y - ref).max()) <= prog.params.expected_error + 1e-9


# ----------------------------------------------------------------------------- PADRe ViT
import timm  # noqa: E402

from polynets.training.checkpoint import (build_model, load_model, registered_models,  # noqa: E402
                                 save_checkpoint)
from polynets.nn.models.padre_vit import PADReViT  # noqa: E402


def _small_vit(**kwargs) -> PADReViT:
    args = dict(img_size=8, in_chans=1, num_classes=3, patch_size=2, embed_dim=6, depth=2,
                kernel_size=3)
    return PADReViT(**{**args, **kwargs})


@pytest.mark.parametrize("name, degree, width, depth, patch", [
    ("padre_vit_t", 2, 192, 12, 16),
    ("padre3_vit_t", 3, 192, 12, 16),
    ("padre_vit_mini", 2, 64, 4, 2),
])
def test_timm_builds_the_registered_padre_vits(name, degree, width, depth, patch):
    model = timm.create_model(name, num_classes=7)
    assert isinstance(model, PADReViT)
    assert (model.degree, model.embed_dim, model.depth) == (degree, width, depth)
    assert model.stem.patch_size == (patch, patch) and model.num_classes == 7
    assert all(b.mixer.degree == degree for b in model.blocks)
    assert name in registered_models() and name in timm.list_models("padre*")


def test_deit_tiny_shape_gives_14x14_tokens_at_224():
    model = timm.create_model("padre_vit_t", num_classes=5).eval()
    with torch.no_grad():
        tokens = model.forward_features(torch.randn(1, 3, 224, 224))
    assert tokens.shape == (1, 14, 14, 192)
    assert model.forward_head(tokens).shape == (1, 5)


def test_mini_vit_classifies_digit_sized_images_by_default():
    model = timm.create_model("padre_vit_mini")
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    assert model.blocks[0].mixer.token_mix.weight.shape[-2:] == (3, 3)


@pytest.mark.parametrize("degree", [2, 3])
def test_vit_program_equals_forward_and_degree_is_two_d_per_block(degree):
    torch.manual_seed(degree)
    model = _randomise(_small_vit(degree=degree), degree)
    x = torch.randn(4, 1, 8, 8)
    _assert_close(pn.trace(model, x).simulate(x), _reference(model, x))
    assert pn.certify(model, x).degree == (2 * degree) ** 2


def test_layer_norm_vit_is_reported_as_not_a_polynomial():
    cert = pn.certify(_small_vit(norm="layer").eval(), torch.randn(1, 1, 8, 8))
    assert not cert.is_polynomial
    assert any("LayerNorm" in str(o) for o in cert.offending)


def test_vit_backward_and_head_conventions():
    model = _small_vit(drop_path_rate=0.1)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.forward_head(torch.randn(2, 4, 4, 6), pre_logits=True).shape == (2, 6)
    model.reset_classifier(5)
    assert model.global_pool == "avg" and model(torch.randn(2, 1, 8, 8)).shape == (2, 5)
    model.reset_classifier(0, global_pool="")
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 4, 4, 6)


def test_checkpoint_rebuilds_the_mini_vit_by_name(tmp_path):
    model = build_model("padre_vit_mini", num_classes=4, embed_dim=8, depth=1).eval()
    save_checkpoint(tmp_path / "p.pt", model=model, model_name="padre_vit_mini",
                    model_kwargs={"num_classes": 4, "embed_dim": 8, "depth": 1})
    rebuilt = load_model(tmp_path / "p.pt").eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), model(x))
    assert isinstance(build_model("padre_vit", img_size=8, in_chans=1, patch_size=2), PADReViT)


def test_vit_bad_image_shape_and_configuration_raise_package_errors():
    with pytest.raises(pn.ShapeError, match=r"expected input of shape \(B, 1, 8, 8\)"):
        _small_vit()(torch.randn(2, 1, 9, 8))
    with pytest.raises(pn.ConfigError, match="divisible by the embedding stride"):
        timm.create_model("padre_vit_t", img_size=8)
    with pytest.warns(UserWarning, match="no pretrained weights"):
        timm.create_model("padre_vit_mini", pretrained=True)
    with pytest.raises(pn.ConfigError, match="norm must be one of"):
        _small_vit(norm="group")
    with pytest.raises(pn.ConfigError, match="PADReViT depth must be a positive int"):
        _small_vit(depth=0)


# ------------------------------------------------- Mu-Layer with a low-rank A (MONet App. N)
def test_mulayer_low_rank_a_computes_c_of_rqx_times_bdx_plus_rqx():
    torch.manual_seed(0)
    layer = pn.MuLayer(6, 5, hidden=8, rank=2, a_rank=3).eval()
    assert layer.A.Q.weight.shape == (3, 6) and layer.A.R.weight.shape == (8, 3)
    assert layer.A.Q.bias is None
    x = torch.randn(4, 6)
    with torch.no_grad():
        rqx = layer.A.R(layer.A.Q(x))
        expected = layer.C(rqx * layer.B(layer.D(x)) + rqx)
        torch.testing.assert_close(layer(x), expected)
    full = pn.MuLayer(6, 5, hidden=8, rank=2)
    count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    assert count(full) - count(layer) == 8 * 6 - (3 * 6 + 8 * 3)


def test_mulayer_low_rank_a_traces_and_certifies_degree_two():
    torch.manual_seed(1)
    layer = pn.MuLayer(5, hidden=6, a_rank=2, spatial_shift=True, norm="batch")
    layer = _randomise(layer, 1)
    x = torch.randn(2, 3, 3, 5)
    _assert_close(pn.trace(layer, x).simulate(x), _reference(layer, x))
    assert pn.certify(layer, x).degree == 2


def test_mulayer_rejects_a_non_positive_a_rank():
    with pytest.raises(pn.ConfigError, match="MuLayer a_rank must be a positive int"):
        pn.MuLayer(4, a_rank=0)


# ------------------------------------------------------- PADRe Appendix B polynomial instances
from polynets.nn.padre import CastlingAttention, Conv2Former, Hyena  # noqa: E402


@pytest.mark.parametrize("make, shape, degree", [
    (lambda: Conv2Former(4, kernel_size=3), (2, 4, 4, 4), 2),
    (lambda: Conv2Former(4, kernel_size=3, spatial_dims=1), (2, 6, 4), 2),
    (lambda: CastlingAttention(4, heads=2), (2, 3, 4, 4), 3),
    (lambda: CastlingAttention(4, spatial_dims=1, bias=True), (2, 6, 4), 3),
    (lambda: Hyena(4, order=1, max_len=6), (2, 6, 4), 2),
    (lambda: Hyena(4, order=3, max_len=4, causal=False), (2, 6, 4), 4),
])
def test_appendix_b_mixers_trace_exactly_with_their_degree(make, shape, degree):
    torch.manual_seed(0)
    m = make().eval()
    x = torch.randn(shape)
    assert m(x).shape == shape
    _assert_close(pn.trace(m, x).simulate(x), _reference(m, x))
    cert = pn.certify(m, x)
    assert cert.is_polynomial and cert.degree == degree


def test_conv2former_is_the_product_of_a_convolved_and_a_plain_branch():
    torch.manual_seed(0)
    m = Conv2Former(3, kernel_size=3, spatial_dims=1).eval()
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        a = torch.nn.functional.conv1d(m.a(x).transpose(1, 2), m.dconv.weight, padding=1,
                                       groups=3).transpose(1, 2)
        torch.testing.assert_close(m(x), m.proj(a * m.v(x)))


def test_castling_attention_equals_its_quadratic_form():
    # (1/pi) Q (K^T V) / N computed first as K^T V equals the attention-like (Q K^T) V / (pi N).
    torch.manual_seed(0)
    m = CastlingAttention(4, heads=1, spatial_dims=1).eval()
    x = torch.randn(2, 7, 4)
    with torch.no_grad():
        q, k, v = m.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / (torch.pi * 7)
        local = torch.nn.functional.conv1d(v.transpose(1, 2), m.dwconv.weight, padding=1,
                                           groups=4).transpose(1, 2)
        torch.testing.assert_close(m(x), m.proj(scores @ v + 0.5 * v + local))


def test_causal_hyena_ignores_later_tokens():
    torch.manual_seed(0)
    m = Hyena(4, order=2, max_len=8).eval()
    x = torch.randn(1, 10, 4)
    later = x.clone()
    later[:, 6:] += 1.0
    with torch.no_grad():
        torch.testing.assert_close(m(later)[:, :6], m(x)[:, :6])
        assert not torch.allclose(m(later)[:, 6:], m(x)[:, 6:])


def test_appendix_b_mixers_reject_bad_shapes_and_options():
    with pytest.raises(pn.ShapeError, match=r"\(B, H, W, 4\)"):
        Conv2Former(4)(torch.randn(2, 5, 4))
    with pytest.raises(pn.ShapeError, match=r"\(B, N, 4\)"):
        Hyena(4)(torch.randn(2, 3, 3, 4))
    with pytest.raises(pn.ConfigError, match="divisible by heads"):
        CastlingAttention(6, heads=4)
    with pytest.raises(pn.ConfigError, match="spatial_dims must be 1"):
        Conv2Former(4, spatial_dims=3)
    with pytest.raises(pn.ConfigError, match="Hyena order must be a positive int"):
        Hyena(4, order=0)


def test_softmax_attention_is_rejected_by_name_where_the_padre_instances_pass():
    class SoftmaxAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(4, 12)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v

    cert = pn.certify(SoftmaxAttention().eval(), torch.randn(1, 5, 4))
    assert not cert.is_polynomial
    assert any("softmax" in str(o) for o in cert.offending)
