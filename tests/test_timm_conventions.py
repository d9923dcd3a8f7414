"""timm conventions of every model polynets registers in timm.

Each test loops over all registered polynets architectures (found through timm's registry, so a
new family is covered without editing this file) at the smallest image side its strides allow.
"""

from __future__ import annotations

import copy
import socket

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2

import polynets as pn
from polynets.training.checkpoint import save_checkpoint
from polynets.errors import ConfigError
from polynets.nn.models.monet import checkpoint_filter_fn
from polynets.nn.models.padre_vit import PADReViT


def _polynets_models() -> list[str]:
    return sorted(name for name in timm.list_models()
                  if timm.models.model_entrypoint(name).__module__.startswith("polynets."))


NAMES = _polynets_models()


def _small_side(name: str) -> int:
    """The coarsest feature stride of the architecture: its smallest valid image side."""
    with torch.device("meta"):
        model = timm.create_model(name)
    return max(info["reduction"] for info in model.feature_info)


@pytest.fixture(scope="module")
def small_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {name: timm.create_model(name, img_size=_small_side(name), num_classes=5)
            for name in NAMES}


def _input(model: torch.nn.Module, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, model.in_chans, *model.img_size, generator=g)


def test_the_registry_holds_both_families() -> None:
    assert {"monet_t", "monet_s", "monet_ms_t", "monet_ms_s", "padre_vit_t",
            "padre_vit_mini"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_untrained_model_in_eval_mode_gives_finite_outputs(name: str, small_models) -> None:
    model = small_models[name].eval()
    with torch.no_grad():
        out = model(_input(model))
    assert out.shape == (2, 5)
    assert torch.isfinite(out).all()


def test_default_build_at_224_is_finite_in_eval_mode() -> None:
    torch.manual_seed(0)
    model = timm.create_model("monet_t", num_classes=10).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 224, 224))
    assert torch.isfinite(out).all() and out.abs().max() < 1e3


@pytest.mark.parametrize("name", NAMES)
def test_no_weight_decay_names_parameters_that_timm_keeps_out_of_decay(name: str,
                                                                        small_models) -> None:
    model = small_models[name]
    params = dict(model.named_parameters())
    skip = model.no_weight_decay()
    assert skip <= set(params)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    decay_of = {id(p): group["weight_decay"] for group in optimizer.param_groups
                for p in group["params"]}
    for pname, p in params.items():
        expected = 0.0 if p.ndim <= 1 or pname in skip else 0.05
        assert decay_of[id(p)] == expected, pname


def test_padre_vit_keeps_its_position_embedding_out_of_weight_decay(small_models) -> None:
    assert small_models["padre_vit_mini"].no_weight_decay() == {"pos_embed"}


@pytest.mark.parametrize("name", NAMES)
def test_grad_checkpointing_recomputes_units_and_gives_the_same_gradients(name: str,
                                                                          small_models) -> None:
    plain = copy.deepcopy(small_models[name]).train()
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing()
    calls = []
    ckpt.feature_units()[0].register_forward_pre_hook(lambda *args: calls.append(1))
    x = _input(plain, batch=4)
    plain(x).square().sum().backward()
    ckpt(x).square().sum().backward()
    assert len(calls) == 2, "the first unit runs once forward and once more in backward"
    for (pname, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=pname)
    ckpt.set_grad_checkpointing(False)
    calls.clear()
    ckpt(x).sum().backward()
    assert len(calls) == 1


@pytest.mark.parametrize("name", NAMES)
def test_forward_intermediates_gives_one_map_per_feature_info_entry(name: str,
                                                                    small_models) -> None:
    model = small_models[name].eval()
    x = _input(model)
    with torch.no_grad():
        final, maps = model.forward_intermediates(x)
        tokens = model.forward_features(x)
        last_two = model.forward_intermediates(x, indices=2, output_fmt="NHWC",
                                               intermediates_only=True)
        first, first_maps = model.forward_intermediates(x, indices=[0], stop_early=True)
    torch.testing.assert_close(final, tokens)
    assert len(maps) == len(model.feature_info)
    side = model.img_size[0]
    for fmap, info in zip(maps, model.feature_info):
        assert fmap.shape == (2, info["num_chs"], side // info["reduction"],
                              side // info["reduction"])
    torch.testing.assert_close(model.final_norm(maps[-1].permute(0, 2, 3, 1)), tokens)
    torch.testing.assert_close(last_two[-1], maps[-1].permute(0, 2, 3, 1))
    torch.testing.assert_close(first_maps[0], maps[0])
    torch.testing.assert_close(first, model.final_norm(maps[0].permute(0, 2, 3, 1)))


def test_forward_intermediates_rejects_indices_and_formats_it_cannot_give(small_models) -> None:
    model = small_models["monet_ms_t"]
    x = _input(model)
    with pytest.raises(ConfigError, match="4 feature units"):
        model.forward_intermediates(x, indices=[7])
    with pytest.raises(ConfigError, match="output_fmt"):
        model.forward_intermediates(x, output_fmt="NLC")


@pytest.mark.parametrize("name", NAMES)
def test_features_only_returns_channels_last_maps_at_the_default_indices(name: str) -> None:
    side = _small_side(name)
    model = timm.create_model(name, img_size=side, features_only=True)
    maps = model(torch.randn(2, model.in_chans, side, side))
    infos = model.feature_info.get_dicts()
    stages = {info["module"].split(".blocks")[0] for info in infos}
    assert len(maps) == (len(stages) if len(stages) > 1 else 3)
    for fmap, info in zip(maps, infos):
        assert fmap.shape == (2, side // info["reduction"], side // info["reduction"],
                              info["num_chs"])


def test_features_only_gives_every_stage_of_a_multi_stage_monet_and_honours_out_indices() -> None:
    model = timm.create_model("monet_ms_t", img_size=32, features_only=True)
    assert model.feature_info.channels() == [64, 128, 192, 192]
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    picked = timm.create_model("monet_t", img_size=14, features_only=True, out_indices=(0, 31))
    assert len(picked(torch.randn(2, 3, 14, 14))) == 2


def _refuse_connections(*args, **kwargs):
    raise AssertionError("the builder tried to open a network connection")


@pytest.mark.parametrize("name", NAMES)
def test_pretrained_warns_that_no_weights_exist_and_builds_without_network(
        name: str, monkeypatch) -> None:
    monkeypatch.setattr(socket, "create_connection", _refuse_connections)
    monkeypatch.setattr(socket.socket, "connect", _refuse_connections)
    side = _small_side(name)
    with pytest.warns(UserWarning, match=f"no pretrained weights are published for {name}"):
        model = timm.create_model(name, pretrained=True, img_size=side, num_classes=3)
    assert model(torch.randn(2, model.in_chans, side, side)).shape == (2, 3)


def test_pretrained_loads_a_local_polynets_checkpoint_through_the_filter(tmp_path) -> None:
    torch.manual_seed(1)
    source = timm.create_model("monet_ms_t", img_size=32, num_classes=4)
    path = save_checkpoint(tmp_path / "m.pt", model=source, model_name="monet_ms_t",
                           model_kwargs={"img_size": 32, "num_classes": 4})
    loaded = timm.create_model("monet_ms_t", img_size=32, num_classes=4, pretrained=True,
                               pretrained_cfg_overlay=dict(file=str(path), num_classes=4))
    for key, value in source.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, msg=key)


def test_checkpoint_filter_strips_wrapper_prefixes_and_unwraps_containers() -> None:
    model = pn.MONet(img_size=8, in_chans=1, num_classes=3, patch_size=2, embed_dim=8, depth=1)
    state = model.state_dict()
    wrapped = {"state_dict": {f"module._orig_mod.{k}": v for k, v in state.items()}}
    filtered = checkpoint_filter_fn(wrapped, model)
    assert filtered.keys() == state.keys()
    assert all(filtered[k] is v for k, v in state.items())


def test_padre_vit_weights_load_at_another_image_size_with_resampled_positions(tmp_path) -> None:
    torch.manual_seed(2)
    source = timm.create_model("padre_vit_mini", img_size=8, embed_dim=8, depth=1)
    path = tmp_path / "vit.pth"
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, path)
    bigger = timm.create_model("padre_vit_mini", img_size=16, embed_dim=8, depth=1,
                               pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert isinstance(bigger, PADReViT) and bigger.pos_embed.shape == (1, 8, 8, 8)
    torch.testing.assert_close(bigger.blocks[0].mlp.C.weight, source.blocks[0].mlp.C.weight)
    # a constant position embedding stays constant when resampled
    with torch.no_grad():
        source.pos_embed.fill_(0.5)
    torch.save(source.state_dict(), path)
    again = timm.create_model("padre_vit_mini", img_size=16, embed_dim=8, depth=1,
                              pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    torch.testing.assert_close(again.pos_embed, torch.full((1, 8, 8, 8), 0.5))


@pytest.mark.parametrize("name", NAMES)
def test_group_matcher_drives_timm_layer_decay(name: str, small_models) -> None:
    model = small_models[name]
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, layer_decay=0.5)
    scales = sorted({group["lr_scale"] for group in optimizer.param_groups})
    assert len(scales) > 2 and scales[-1] == 1.0
    covered = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    assert covered == sum(p.numel() for p in model.parameters())
