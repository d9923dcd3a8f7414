"""Tests of the PoM diffusion transformer: a polynomial of x for a fixed condition, shapes,
flow-matching training and sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import polynets as pn
from polynets.errors import ConfigError, ShapeError
from polynets.nn.models.pom_dit import PoMDiT, PoMDiTBlock, flow_matching_loss, sample


def _randomise(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-zero weights everywhere (the zero-initialised modulation and head included) and
    non-trivial BatchNorm statistics."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, b in module.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=b.dtype))
            elif name.endswith("running_var"):
                b.copy_(1.0 + torch.rand(b.shape, generator=gen, dtype=b.dtype))
    return module


def _assert_program_equals_module(model: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        ref = model(x).numpy()
    np.testing.assert_allclose(pn.trace(model, x[:1]).simulate(x), ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("degree, gate, expected", [(2, "linear", 6), (3, "linear", 8),
                                                    (2, "poly2", 8)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_block_for_a_fixed_condition_is_a_polynomial_of_x(degree, gate, expected, tokens):
    block = _randomise(PoMDiTBlock(8, 6, degree=degree, gate=gate)).double().eval()
    c = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fixed = block.conditioned(c)
    x = torch.randn(3, tokens, 8, dtype=torch.float64)
    _assert_program_equals_module(fixed, x)
    cert = pn.certify(fixed, x)
    assert cert.is_polynomial and cert.degree == expected == block.polynomial_degree
    torch.testing.assert_close(fixed(x), block(x, c.expand(3, -1)))


def test_block_modulation_depends_on_the_condition_only() -> None:
    block = _randomise(PoMDiTBlock(8, 6)).double().eval()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    c1, c2 = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    assert not torch.allclose(block(x, c1), block(x, c2))
    # Same condition, same map: a block is determined by (x, c) and nothing else.
    torch.testing.assert_close(block(x, c1), block(x.clone(), c1.clone()))


def test_freshly_built_block_is_residual_pom_then_feed_forward() -> None:
    torch.manual_seed(0)
    block = PoMDiTBlock(8, 6).double().eval()  # zero modulation: scales 0, shifts 0, gates 1
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    y = x + block.pom(block.norm1(x))
    torch.testing.assert_close(block(x, torch.randn(2, 6, dtype=torch.float64)),
                               y + block.ff(block.norm2(y)))


def test_layer_norm_in_the_block_would_not_be_polynomial() -> None:
    block = PoMDiTBlock(8, 6).eval()
    block.norm1 = torch.nn.LayerNorm(8)
    cert = pn.certify(block.conditioned(torch.randn(6)), torch.randn(1, 4, 8))
    assert not cert.is_polynomial and any("norm1" in str(o) for o in cert.offending)


def test_whole_model_for_fixed_time_and_class_is_a_polynomial_of_the_image() -> None:
    model = _randomise(PoMDiT(dim=8, depth=2)).double().eval()
    fixed = model.conditioned(0.3, 4)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    _assert_program_equals_module(fixed, x)
    assert pn.certify(fixed, x).degree == 6 ** 2
    t, y = torch.full((2,), 0.3, dtype=torch.float64), torch.full((2,), 4)
    torch.testing.assert_close(fixed(x), model(x, t, y))


def test_model_shapes_backward_and_null_class() -> None:
    torch.manual_seed(0)
    model = _randomise(PoMDiT(img_size=(8, 4), in_chans=2, patch_size=2, dim=16, depth=1))
    x = torch.randn(3, 2, 8, 4)
    t, y = torch.rand(3), torch.tensor([0, 9, 10])  # 10: the null class
    v = model(x, t, y)
    assert v.shape == x.shape
    v.square().sum().backward()
    for name, p in model.named_parameters():
        if name == "class_embed.weight":
            used = p.grad[[0, 9, 10]]
            assert used.abs().sum() > 0 and p.grad[1:9].abs().sum() == 0
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_head_outputs_land_on_their_patch_pixels() -> None:
    p, chans = 2, 2
    model = PoMDiT(img_size=(4, 6), in_chans=chans, patch_size=p, dim=4, depth=1).eval()
    with torch.no_grad():  # every token outputs 0, 1, ..., p*p*C - 1 in (row, col, channel) order
        model.head.weight.zero_()
        model.head.bias.copy_(torch.arange(p * p * chans, dtype=torch.float32))
    v = model(torch.randn(1, chans, 4, 6), torch.rand(1), torch.zeros(1, dtype=torch.long))
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(6), indexing="ij")
    for c in range(chans):
        expected = ((rows % p) * p + cols % p) * chans + c
        assert torch.equal(v[0, c], expected.float())


def test_bad_shapes_and_labels_raise_package_errors() -> None:
    model = PoMDiT(dim=8, depth=1)
    with pytest.raises(ShapeError, match=r"\(B, 1, 8, 8\)"):
        model(torch.randn(2, 1, 6, 8), torch.rand(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ShapeError, match=r"t and y of shape \(B,\)"):
        model(torch.randn(2, 1, 8, 8), torch.rand(2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"\[0, 10\]"):
        model(torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([0, 11]))
    with pytest.raises(ShapeError, match=r"PoMDiTBlock condition expected input of shape \(2, 6\)"):
        PoMDiTBlock(8, 6)(torch.randn(2, 4, 8), torch.randn(2, 5))
    with pytest.raises(ShapeError, match=r"\(B, N, 8\)"):
        PoMDiTBlock(8, 6)(torch.randn(2, 4, 7), torch.randn(2, 6))
    with pytest.raises(ConfigError, match="divisible by patch_size"):
        PoMDiT(img_size=8, patch_size=3)
    with pytest.raises(ConfigError, match="class_dropout"):
        flow_matching_loss(model, torch.randn(2, 1, 8, 8), torch.zeros(2, dtype=torch.long),
                           class_dropout=1.0)


def test_flow_matching_training_lowers_the_loss_and_sampling_is_finite() -> None:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = torch.from_numpy((x[:256] / 8.0 - 1.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    labels = torch.from_numpy(y[:256]).long()
    torch.manual_seed(0)
    model = PoMDiT(dim=16, depth=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        loss = flow_matching_loss(model, images, labels, generator=gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:5])
    model.eval()
    out = sample(model, torch.arange(10), steps=5, guidance=2.0,
                 generator=torch.Generator().manual_seed(1))
    assert out.shape == (10, 1, 8, 8) and torch.isfinite(out).all()


@pytest.mark.slow
def test_pom_dit_example_writes_a_sample_grid_and_metrics(tmp_path) -> None:
    import json
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(examples))
    try:
        import pom_dit_digits
    finally:
        sys.path.remove(str(examples))
    metrics = pom_dit_digits.main(["--steps", "20", "--dim", "16", "--depth", "1",
                                   "--sample-steps", "3", "--per-class", "2",
                                   "--out", str(tmp_path)])
    assert (tmp_path / "samples.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved == pytest.approx(metrics)
    assert 0.0 <= saved["class_conditional_accuracy"] <= 1.0
    assert saved["block_degree_for_fixed_condition"] == 6
