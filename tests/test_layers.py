"""Tests of the MONet layers: Mu-Layer, spatial shift, Poly-Block and patch embeddings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import polynets as pn
from polynets.errors import ConfigError, ShapeError
from polynets.nn.layers import ChannelsLastBatchNorm


def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """x @ W^T + b computed from the layer's parameters, without calling the layer."""
    out = x @ layer.weight.T
    return out if layer.bias is None else out + layer.bias


def _reference_shift(x: torch.Tensor, groups: int = 4, shift: int = 1) -> torch.Tensor:
    """Explicit per-position spatial shift: loops over every output pixel of every group."""
    b, h, w, c = x.shape
    width = c // groups
    bounds = [(g * width, (g + 1) * width if g < groups - 1 else c) for g in range(groups)]
    directions = [(1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (1, -1), (-1, 1), (-1, -1)]
    out = x.clone()
    for (lo, hi), (dh, dw) in zip(bounds, directions[:groups]):
        src = x[..., lo:hi]
        moved_h = src.clone()
        for i in range(h):
            j = i - dh * shift
            if 0 <= j < h:
                moved_h[:, i] = src[:, j]
        moved = moved_h.clone()
        for i in range(w):
            j = i - dw * shift
            if 0 <= j < w:
                moved[:, :, i] = moved_h[:, :, j]
        out[..., lo:hi] = moved
    return out


# ---------------------------------------------------------------- Mu-Layer


@pytest.mark.parametrize("shortcut", [True, False])
def test_mulayer_equals_formula_computed_from_its_weights(shortcut: bool) -> None:
    torch.manual_seed(0)
    layer = pn.MuLayer(6, 5, hidden=8, rank=3, shortcut=shortcut).double()
    x = torch.randn(4, 7, 6, dtype=torch.float64)
    ax = _linear(x, layer.A)
    bdx = _linear(_linear(x, layer.D), layer.B)
    inner = ax * bdx + ax if shortcut else ax * bdx
    expected = _linear(inner, layer.C)
    torch.testing.assert_close(layer(x), expected)


def test_mulayer_shortcut_is_the_first_degree_term() -> None:
    torch.manual_seed(1)
    with_sc = pn.MuLayer(5, hidden=7, shortcut=True, bias=False).double()
    without = pn.MuLayer(5, hidden=7, shortcut=False, bias=False).double()
    without.load_state_dict(with_sc.state_dict())
    x = torch.randn(3, 5, dtype=torch.float64)
    first_degree = x @ with_sc.A.weight.T @ with_sc.C.weight.T
    torch.testing.assert_close(with_sc(x) - without(x), first_degree)


def test_mulayer_default_sizes_follow_shrinkage() -> None:
    layer = pn.MuLayer(16)
    assert (layer.hidden, layer.rank, layer.out_features) == (16, 4, 16)
    assert layer.A.weight.shape == (16, 16) and layer.D.weight.shape == (4, 16)
    assert layer.B.weight.shape == (16, 4) and layer.C.weight.shape == (16, 16)
    wide = pn.MuLayer(8, 3, hidden=24, shrinkage=8)
    assert (wide.hidden, wide.rank, wide.out_features) == (24, 3, 3)


@pytest.mark.parametrize("shape", [(6,), (2, 6), (2, 3, 6), (2, 3, 4, 5, 6)])
def test_mulayer_acts_on_last_dim_of_any_rank(shape: tuple[int, ...]) -> None:
    layer = pn.MuLayer(6, 4, hidden=12)
    assert layer(torch.randn(*shape)).shape == (*shape[:-1], 4)


def test_mulayer_spatial_shift_is_applied_to_both_branches() -> None:
    torch.manual_seed(2)
    layer = pn.MuLayer(8, hidden=8, rank=4, spatial_shift=True).double()
    x = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    ax = _reference_shift(_linear(x, layer.A))
    bdx = _linear(_reference_shift(_linear(x, layer.D)), layer.B)
    expected = _linear(ax * bdx + ax, layer.C)
    torch.testing.assert_close(layer(x), expected)


def test_mulayer_batch_norm_in_eval_is_an_affine_map_per_branch() -> None:
    torch.manual_seed(3)
    layer = pn.MuLayer(6, hidden=8, norm="batch").double()
    layer.train()
    layer(torch.randn(64, 6, dtype=torch.float64) * 3 + 1)  # populate running statistics
    layer.eval()
    x = torch.randn(5, 6, dtype=torch.float64)

    def bn(v: torch.Tensor, norm: ChannelsLastBatchNorm) -> torch.Tensor:
        scale = norm.weight / torch.sqrt(norm.running_var + norm.eps)
        return (v - norm.running_mean) * scale + norm.bias

    a = bn(_linear(x, layer.A), layer.norm_a)
    b = bn(_linear(_linear(x, layer.D), layer.B), layer.norm_b)
    torch.testing.assert_close(layer(x), _linear(a * b + a, layer.C))


def test_mulayer_layer_norm_keeps_shape() -> None:
    layer = pn.MuLayer(6, hidden=12, norm="layer")
    assert isinstance(layer.norm_a, torch.nn.LayerNorm)
    assert layer(torch.randn(2, 3, 6)).shape == (2, 3, 6)


def test_mulayer_wrong_channel_count_raises_shape_error_with_expected_shape() -> None:
    layer = pn.MuLayer(16)
    with pytest.raises(ShapeError, match=r"MuLayer expected input of shape \(\.\.\., 16\), "
                                         r"got \(2, 5, 32\)"):
        layer(torch.randn(2, 5, 32))


def test_mulayer_with_shift_rejects_input_without_spatial_dims() -> None:
    layer = pn.MuLayer(16, spatial_shift=True)
    with pytest.raises(ShapeError, match=r"\(B, H, W, 16\), got \(2, 5, 16\)"):
        layer(torch.randn(2, 5, 16))


@pytest.mark.parametrize("kwargs", [dict(norm="group"), dict(hidden=0), dict(rank=-1),
                                    dict(shrinkage=0), dict(out_features=2.5)])
def test_mulayer_invalid_config_raises_config_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        pn.MuLayer(8, **kwargs)


# ---------------------------------------------------------------- spatial shift


@pytest.mark.parametrize("groups,shift,shape", [(4, 1, (2, 5, 6, 8)), (4, 1, (1, 3, 3, 10)),
                                                (8, 1, (2, 4, 5, 16)), (4, 2, (2, 5, 5, 12))])
def test_spatial_shift_moves_each_channel_group_like_the_explicit_reference(
        groups: int, shift: int, shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape)
    out = pn.SpatialShift(groups=groups, shift=shift)(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, _reference_shift(x, groups, shift), rtol=0, atol=0)


def test_spatial_shift_moves_the_four_groups_down_up_right_left() -> None:
    x = torch.arange(3 * 3 * 4, dtype=torch.float32).reshape(1, 3, 3, 4)
    out = pn.SpatialShift()(x)
    torch.testing.assert_close(out[0, 1:, :, 0], x[0, :-1, :, 0])   # down along H
    torch.testing.assert_close(out[0, :-1, :, 1], x[0, 1:, :, 1])   # up along H
    torch.testing.assert_close(out[0, :, 1:, 2], x[0, :, :-1, 2])   # right along W
    torch.testing.assert_close(out[0, :, :-1, 3], x[0, :, 1:, 3])   # left along W
    torch.testing.assert_close(out[0, 0, :, 0], x[0, 0, :, 0])      # border keeps its values
    torch.testing.assert_close(out[0, :, -1, 3], x[0, :, -1, 3])


def test_spatial_shift_is_out_of_place_and_differentiable() -> None:
    x = torch.randn(2, 4, 4, 8, requires_grad=True)
    before = x.detach().clone()
    pn.SpatialShift()(x).pow(2).sum().backward()
    torch.testing.assert_close(x.detach(), before, rtol=0, atol=0)
    assert x.grad is not None and x.grad.shape == x.shape


def test_spatial_shift_rejects_wrong_rank_and_config() -> None:
    with pytest.raises(ShapeError, match=r"SpatialShift expected input of shape \(B, H, W, C\)"):
        pn.SpatialShift()(torch.randn(2, 4, 8))
    with pytest.raises(ConfigError):
        pn.SpatialShift(groups=3)
    with pytest.raises(ConfigError):
        pn.SpatialShift(shift=0)


# ---------------------------------------------------------------- Poly-Block


@pytest.mark.parametrize("second_shortcut", [True, False])
def test_polyblock_equals_two_mu_layers_with_norm_between_and_shortcut_over_first(
        second_shortcut: bool) -> None:
    torch.manual_seed(4)
    block = pn.PolyBlock(8, norm="layer", second_shortcut=second_shortcut).double()
    x = torch.randn(2, 3, 3, 8, dtype=torch.float64)
    z = x + block.mu1(x)
    expected = block.mu2(block.norm(z)) + (z if second_shortcut else 0.0)
    torch.testing.assert_close(block(x), expected)
    assert block.mu1.spatial_shift and not block.mu2.spatial_shift
    assert block.mu1.hidden == 8 and block.mu2.hidden == 24
    assert block.mu1.rank == 2 and block.mu2.rank == 6


@pytest.mark.parametrize("second_shortcut", [True, False])
def test_polyblock_is_a_degree_four_polynomial_of_its_input(second_shortcut: bool) -> None:
    torch.manual_seed(5)
    block = pn.PolyBlock(8, norm="none", bias=False, second_shortcut=second_shortcut).double()
    x = torch.randn(2, 3, 3, 8, dtype=torch.float64)
    scales = [1.0, 2.0, 3.0, 4.0]
    values = torch.stack([block(s * x) for s in scales])  # (4, ...)
    vander = torch.tensor([[s ** k for k in range(1, 5)] for s in scales], dtype=torch.float64)
    parts = torch.linalg.solve(vander, values.reshape(4, -1))  # parts[k-1]: degree-k term
    predicted = sum(5.0 ** k * parts[k - 1] for k in range(1, 5)).reshape(values.shape[1:])
    torch.testing.assert_close(block(5.0 * x), predicted, rtol=1e-9, atol=1e-8)
    quartic = parts[3].abs().max().item()
    assert quartic > 1e-3 * parts.abs().max().item()


def test_polyblock_without_shift_accepts_any_leading_dims() -> None:
    block = pn.PolyBlock(8, spatial_shift=False, norm="none")
    assert block(torch.randn(3, 5, 8)).shape == (3, 5, 8)


def test_polyblock_wrong_shape_raises_shape_error_with_expected_shape() -> None:
    block = pn.PolyBlock(8)
    with pytest.raises(ShapeError, match=r"PolyBlock expected input of shape \(B, H, W, 8\), "
                                         r"got \(2, 3, 3, 6\)"):
        block(torch.randn(2, 3, 3, 6))
    with pytest.raises(ShapeError, match=r"got \(2, 9, 8\)"):
        block(torch.randn(2, 9, 8))


# ---------------------------------------------------------------- patch embeddings


def test_patch_embed_outputs_channels_last_tokens_of_each_patch() -> None:
    torch.manual_seed(6)
    embed = pn.PatchEmbed(img_size=8, patch_size=4, in_chans=2, embed_dim=5)
    x = torch.randn(3, 2, 8, 8)
    out = embed(x)
    assert out.shape == (3, 2, 2, 5) and embed.num_patches == 4
    patch = x[:, :, 4:8, 0:4].reshape(3, -1)
    expected = patch @ embed.proj.weight.reshape(5, -1).T + embed.proj.bias
    torch.testing.assert_close(out[:, 1, 0], expected)


@pytest.mark.parametrize("patch,merges,grid", [(2, 0, 16), (2, 1, 8), (2, 2, 4), (4, 1, 4)])
def test_pyramid_patch_embed_shapes(patch: int, merges: int, grid: int) -> None:
    embed = pn.PyramidPatchEmbed(img_size=32, patch_size=patch, in_chans=3, embed_dim=6,
                                 merges=merges)
    assert embed(torch.randn(2, 3, 32, 32)).shape == (2, grid, grid, 6)
    assert embed.grid_size == (grid, grid) and embed.reduction == 32 // grid
    assert len(embed.merge) == merges and len(embed.levels) == merges


def test_pyramid_levels_are_merged_by_elementwise_addition() -> None:
    torch.manual_seed(7)
    embed = pn.PyramidPatchEmbed(img_size=16, patch_size=2, in_chans=1, embed_dim=4, merges=2)
    x = torch.randn(2, 1, 16, 16)
    t = embed.proj(x)
    t = embed.merge[0](t) + F.conv2d(x, embed.levels[0].weight, embed.levels[0].bias, stride=4)
    t = embed.merge[1](t) + F.conv2d(x, embed.levels[1].weight, embed.levels[1].bias, stride=8)
    torch.testing.assert_close(embed(x), t.permute(0, 2, 3, 1))
    assert embed.levels[1].kernel_size == (8, 8)


def test_pyramid_without_level_fusion_only_merges() -> None:
    embed = pn.PyramidPatchEmbed(img_size=16, patch_size=2, in_chans=1, embed_dim=4, merges=1,
                                 fuse_levels=False)
    x = torch.randn(2, 1, 16, 16)
    assert len(embed.levels) == 0
    torch.testing.assert_close(embed(x), embed.merge[0](embed.proj(x)).permute(0, 2, 3, 1))


def test_patch_embeddings_reject_wrong_rank_channels_and_size() -> None:
    embed = pn.PyramidPatchEmbed(img_size=16, patch_size=2, in_chans=3, embed_dim=4)
    for bad in [torch.randn(3, 16, 16), torch.randn(2, 1, 16, 16), torch.randn(2, 3, 16, 8)]:
        with pytest.raises(ShapeError, match=r"PyramidPatchEmbed expected input of shape "
                                             r"\(B, 3, 16, 16\), got"):
            embed(bad)


@pytest.mark.parametrize("kwargs", [dict(img_size=10, patch_size=4), dict(img_size=12, merges=2),
                                    dict(merges=-1), dict(patch_size=0)])
def test_patch_embeddings_invalid_config_raises_config_error(kwargs: dict) -> None:
    args = dict(img_size=16, patch_size=2, in_chans=1, embed_dim=4) | kwargs
    with pytest.raises(ConfigError):
        pn.PyramidPatchEmbed(**args)


def test_channels_last_batch_norm_normalises_over_all_but_the_last_dim() -> None:
    norm = ChannelsLastBatchNorm(3)
    x = torch.randn(4, 5, 6, 3) * torch.tensor([1.0, 5.0, 0.5]) + 2.0
    out = norm(x)
    flat = out.reshape(-1, 3)
    np.testing.assert_allclose(flat.mean(0).detach().numpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(flat.var(0, unbiased=False).detach().numpy(), 1.0, atol=1e-3)
