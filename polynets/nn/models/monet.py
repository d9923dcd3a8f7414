"""MONet: Multilinear Operator Networks (single-stage and multi-stage), registered in timm.

A MONet is a pyramid patch embedding, a stack of Poly-Blocks on channels-last tokens (grouped in
stages; between stages a 3x3 stride-2 convolution halves the grid and changes the width), global
mean pooling and a linear classifier. Nothing in it is an activation function: with
``norm="batch"`` the eval-mode network is a polynomial of its input.

After ``import polynets``, ``timm.create_model(name, num_classes=.., in_chans=.., img_size=..)``
builds the four configurations of the paper's Table 1:

=============  ============  ===================  ===============  =========  =========
name           blocks        hidden size          patch (stride)   expansion  shrinkage
=============  ============  ===================  ===============  =========  =========
monet_t        32            192                  7 (14)           3          4
monet_s        45            320                  8 (16)           3          4
monet_ms_t     4, 8, 12, 10  64, 128, 192, 192    2 (4)            3          8
monet_ms_s     4, 6, 12, 14  128, 192, 256, 384   2 (4)            3          8
=============  ============  ===================  ===============  =========  =========
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import trunc_normal_
from timm.models import (build_model_with_cfg, checkpoint, generate_default_cfgs, named_apply,
                         register_model)
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from polynets.nn.models.head import ClassifierHead
from polynets.errors import ConfigError
from polynets.nn.layers import (NORMS, PatchEmbed, PolyBlock, PyramidPatchEmbed, check_shape,
                             to_2tuple)

__all__ = ["MONet", "MONetStage", "StageDownsample", "TokenGridModel", "INITS",
           "checkpoint_filter_fn"]

INITS = {
    "xavier_normal": nn.init.xavier_normal_,
    "xavier_uniform": nn.init.xavier_uniform_,
    "kaiming_normal": partial(nn.init.kaiming_normal_, nonlinearity="linear"),
    "kaiming_uniform": partial(nn.init.kaiming_uniform_, nonlinearity="linear"),
    "trunc_normal": partial(trunc_normal_, std=0.02),
}
"""Weight initialisers selectable with ``MONet(init=...)``; Xavier-normal is the default
(the paper's Appendix M found it best). Biases start at zero, norms at the identity."""


def _init_weights(module: nn.Module, name: str = "", scheme: str = "xavier_normal",
                  residual_scale: float = 1.0) -> None:
    """Initialise one module in place: weights of linear and conv layers by ``scheme``, biases
    zero; in a :class:`PolyBlock` (visited after its children, as ``named_apply`` is depth-first)
    the last projection ``C`` of each Mu-Layer under a shortcut is then multiplied by
    ``residual_scale``, so the block starts near the identity."""
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        INITS[scheme](module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, PolyBlock) and residual_scale != 1.0:
        branches = (module.mu1, module.mu2) if module.second_shortcut else (module.mu1,)
        with torch.no_grad():
            for mu in branches:
                mu.C.weight.mul_(residual_scale)


class StageDownsample(nn.Module):
    """Transition between stages: 3x3 convolution, stride 2, zero padding 1, on tokens.

    ``Y = Conv_3x3/2(X)``. Shape: ``(B, H, W, in_dim) -> (B, ceil(H/2), ceil(W/2), out_dim)``.
    """

    def __init__(self, in_dim: int, out_dim: int, *, bias: bool = True) -> None:
        super().__init__()
        self.in_dim = in_dim
        self.proj = nn.Conv2d(in_dim, out_dim, 3, stride=2, padding=1, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        check_shape("StageDownsample", x, ("B", "H", "W", self.in_dim))
        return self.proj(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


class MONetStage(nn.Module):
    """Optional :class:`StageDownsample`, then ``depth`` Poly-Blocks of width ``dim``.

    Shape: ``(B, H, W, in_dim) -> (B, H', W', dim)`` with ``H' = ceil(H/2)`` after a downsample.
    """

    def __init__(self, in_dim: int, dim: int, depth: int, *, downsample: bool, expansion: int,
                 shrinkage: int, norm: str, spatial_shift: bool, second_shortcut: bool,
                 bias: bool) -> None:
        super().__init__()
        self.downsample = StageDownsample(in_dim, dim, bias=bias) if downsample else nn.Identity()
        self.blocks = nn.Sequential(*(
            PolyBlock(dim, expansion=expansion, shrinkage=shrinkage, norm=norm,
                      spatial_shift=spatial_shift, second_shortcut=second_shortcut, bias=bias)
            for _ in range(depth)))

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(self.downsample(x))


def _as_tuple(value: int | Sequence[int], name: str) -> tuple[int, ...]:
    values = (value,) if isinstance(value, int) else tuple(value)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                             for v in values):
        raise ConfigError(f"{name} must be a positive int or a non-empty sequence of positive "
                          f"ints, got {value!r}")
    return values


class TokenGridModel(ClassifierHead):
    """timm conventions shared by models whose features are channels-last tokens ``(B, H, W, C)``.

    The model defines ``embed_tokens(image) -> tokens``, ``feature_units() -> list[nn.Module]``
    (the token-to-token modules in order; ``feature_info[i]`` describes the output of unit ``i``)
    and may override ``final_norm``. From these this class gives ``forward_features``,
    ``forward_intermediates`` (timm's signature), ``set_grad_checkpointing`` (each unit recomputed
    in the backward pass), ``no_weight_decay``, and the head: mean pooling
    (``global_pool="avg"``, or ``""`` for none), dropout and a linear classifier. The model sets
    ``num_features``, ``num_classes``, ``global_pool``, ``head_drop``, ``head`` and
    ``init_scheme``.
    """

    num_features: int
    num_classes: int
    global_pool: str
    init_scheme: str
    head: nn.Module
    head_drop: nn.Module
    grad_checkpointing: bool = False
    output_fmt: str = "NHWC"

    @abstractmethod
    def embed_tokens(self, x: Tensor) -> Tensor:
        """Image ``(B, in_chans, H, W)`` to tokens ``(B, H', W', C)``."""

    @abstractmethod
    def feature_units(self) -> list[nn.Module]:
        """The modules between the embedding and the head, in order."""

    def final_norm(self, x: Tensor) -> Tensor:
        """Normalisation after the last unit (identity unless the model has one)."""
        return x

    def _init_head(self) -> None:
        _init_weights(self.head, "head", self.init_scheme)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Names of parameters timm's optimiser factory keeps out of weight decay (besides
        biases and norm weights, which it excludes by shape)."""
        return set()

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each feature unit in the backward pass instead of storing its activations."""
        self.grad_checkpointing = bool(enable)

    def _run_unit(self, unit: nn.Module, x: Tensor) -> Tensor:
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(unit, x)
        return unit(x)

    def forward_features(self, x: Tensor) -> Tensor:
        """Image ``(B, in_chans, H, W)`` to tokens ``(B, H', W', num_features)``."""
        x = self.embed_tokens(x)
        for unit in self.feature_units():
            x = self._run_unit(unit, x)
        return self.final_norm(x)

    def forward_intermediates(self, x: Tensor, indices: int | Sequence[int] | None = None,
                              norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False
                              ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """Outputs of the feature units ``indices`` (an int ``n``: the last ``n``; None: all),
        as ``(B, C, H, W)`` (``output_fmt="NCHW"``) or channels-last tokens (``"NHWC"``).

        ``norm`` applies the final norm to each; ``stop_early`` skips the units after the last
        one asked for. Returns the list, or with it (unless ``intermediates_only``) the final
        tokens, as ``forward_features`` gives them (of the last unit run, with ``stop_early``).
        """
        if output_fmt not in ("NCHW", "NHWC"):
            raise ConfigError(f"output_fmt must be 'NCHW' or 'NHWC', got {output_fmt!r}")
        units = self.feature_units()
        try:
            take, last = feature_take_indices(len(units), indices)
        except AssertionError as exc:
            raise ConfigError(f"indices {indices!r} do not select among the {len(units)} feature "
                              f"units of {type(self).__name__}: {exc}") from exc
        x = self.embed_tokens(x)
        intermediates = []
        for i, unit in enumerate(units[:last + 1] if stop_early else units):
            x = self._run_unit(unit, x)
            if i in take:
                y = self.final_norm(x) if norm else x
                intermediates.append(y.permute(0, 3, 1, 2) if output_fmt == "NCHW" else y)
        if intermediates_only:
            return intermediates
        return self.final_norm(x), intermediates

    def pool(self, x: Tensor) -> Tensor:
        """Tokens ``(B, H', W', C)`` to ``(B, C)`` (with ``global_pool=""`` the tokens are kept
        and classified one by one)."""
        check_shape(f"{type(self).__name__} head", x, ("B", "H", "W", self.num_features))
        return x.mean(dim=(1, 2)) if self.global_pool == "avg" else x

    @staticmethod
    def _check_pool(global_pool: str) -> str:
        return _check_pool(global_pool)


class MONet(TokenGridModel, nn.Module):
    """Multilinear Operator Network: ``logits = W mean_tokens(Blocks(Embed(I))) + b``.

    Single-stage when ``embed_dim`` and ``depth`` are ints (one width throughout); multi-stage
    when they are equal-length sequences (stage ``i`` has ``depth[i]`` Poly-Blocks of width
    ``embed_dim[i]``; each later stage starts with a 3x3 stride-2 convolution). The embedding is
    a :class:`PyramidPatchEmbed` (``embed="pyramid"``: ``patch_size`` patches, ``merges`` 2x2
    merges, coarser levels added when ``fuse_levels``) or a plain :class:`PatchEmbed`
    (``embed="patch"``). Timm conventions (:class:`TokenGridModel`): ``forward_features``
    returns channels-last tokens, ``forward_head(x, pre_logits=False)`` pools
    (``global_pool="avg"``, or ``""`` for none) and classifies, ``reset_classifier`` keeps the
    pooling unless told otherwise; ``forward_intermediates`` and ``feature_info`` give one map per
    stage of a multi-stage model and one per Poly-Block of a single-stage one.

    ``norm``: ``"batch"`` (default; folds into the affine maps at inference, so the eval-mode
    model is a polynomial and can be encrypted), ``"layer"`` (the paper's training setup, not a
    polynomial) or ``"none"``. ``second_shortcut``: see :class:`~polynets.nn.layers.PolyBlock`.
    ``init``: weight initialiser, one of :data:`INITS` (default ``"xavier_normal"``, Appendix M),
    applied once to every linear and conv layer. ``residual_scale`` multiplies the initial last
    projection ``C`` of every Mu-Layer under a shortcut (default ``1 / (2 * blocks)``, so that
    each block starts near the identity and the untrained eval-mode network, whose BatchNorms
    are still the identity, stays finite: with scale 1 its degree-``4^blocks`` polynomial
    overflows); ``1.0`` keeps the plain ``init``. ``expansion`` and ``shrinkage`` are the
    Poly-Block's ratios; ``drop_rate`` is dropout before the classifier.

    Shape: ``(B, in_chans, H, W) -> (B, num_classes)`` with ``(H, W) == img_size``.
    """

    def __init__(self, img_size: int | Sequence[int] = 224, in_chans: int = 3,
                 num_classes: int = 1000, *, patch_size: int = 7,
                 embed_dim: int | Sequence[int] = 192, depth: int | Sequence[int] = 32,
                 expansion: int = 3, shrinkage: int = 4, norm: str = "batch",
                 embed: str = "pyramid", merges: int = 1, fuse_levels: bool = True,
                 spatial_shift: bool = True, second_shortcut: bool = True,
                 global_pool: str = "avg", drop_rate: float = 0.0,
                 init: str = "xavier_normal", residual_scale: float | None = None,
                 bias: bool = True) -> None:
        super().__init__()
        dims = _as_tuple(embed_dim, "embed_dim")
        depths = _as_tuple(depth, "depth")
        if residual_scale is None:
            residual_scale = 1.0 / (2 * sum(depths))
        if isinstance(residual_scale, bool) or not isinstance(residual_scale, (int, float)) \
                or not 0.0 <= residual_scale <= 1.0:
            raise ConfigError(f"residual_scale must be a number in [0, 1] or None, got "
                              f"{residual_scale!r}")
        if len(dims) != len(depths):
            raise ConfigError(f"embed_dim and depth must have the same number of stages, got "
                              f"{len(dims)} widths {dims} and {len(depths)} depths {depths}")
        if norm not in NORMS:
            raise ConfigError(f"norm must be one of {NORMS}, got {norm!r}")
        if init not in INITS:
            raise ConfigError(f"init must be one of {tuple(INITS)}, got {init!r}")
        if embed not in ("pyramid", "patch"):
            raise ConfigError(f"embed must be 'pyramid' or 'patch', got {embed!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            raise ConfigError(f"num_classes must be a non-negative int, got {num_classes!r}")
        if not 0.0 <= drop_rate < 1.0:
            raise ConfigError(f"drop_rate must be in [0, 1), got {drop_rate!r}")
        self.global_pool = _check_pool(global_pool)
        self.img_size = to_2tuple(img_size, "img_size")
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_features = dims[-1]
        self.embed_dims, self.depths = dims, depths
        self.norm_kind = norm
        self.init_scheme = init
        if embed == "pyramid":
            self.stem: PatchEmbed = PyramidPatchEmbed(
                self.img_size, patch_size, in_chans, dims[0], merges=merges,
                fuse_levels=fuse_levels, bias=bias)
        else:
            self.stem = PatchEmbed(self.img_size, patch_size, in_chans, dims[0], bias=bias)
        stages = []
        self.feature_info = []
        reduction = self.stem.reduction
        for i, (dim, n) in enumerate(zip(dims, depths)):
            stages.append(MONetStage(dims[max(i - 1, 0)], dim, n, downsample=i > 0,
                                     expansion=expansion, shrinkage=shrinkage, norm=norm,
                                     spatial_shift=spatial_shift,
                                     second_shortcut=second_shortcut, bias=bias))
            reduction = reduction * 2 if i > 0 else reduction
            modules = [f"stages.{i}"] if len(dims) > 1 else [f"stages.0.blocks.{j}"
                                                            for j in range(n)]
            self.feature_info += [dict(num_chs=dim, reduction=reduction, module=m)
                                  for m in modules]
        self.stages = nn.Sequential(*stages)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        self.pretrained_cfg = self.default_cfg = {
            "num_classes": num_classes, "input_size": (in_chans, *self.img_size),
            "fixed_input_size": True, "first_conv": "stem.proj", "classifier": "head",
        }
        named_apply(partial(_init_weights, scheme=init, residual_scale=residual_scale), self)

    def embed_tokens(self, x: Tensor) -> Tensor:
        """Image ``(B, in_chans, H, W)`` to tokens ``(B, H', W', embed_dim[0])``."""
        check_shape("MONet", x, ("B", self.in_chans, *self.img_size))
        return self.stem(x)

    def feature_units(self) -> list[nn.Module]:
        """The stages of a multi-stage MONet, the Poly-Blocks of a single-stage one."""
        if len(self.stages) > 1:
            return list(self.stages)
        return list(self.stages[0].blocks)  # the first stage has no downsample

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for timm's layer-wise learning-rate decay: the stem, then the
        stages (coarse) or each block, stage transitions with the block after them."""
        return dict(stem=r"^stem", blocks=r"^stages\.(\d+)" if coarse else [
            (r"^stages\.(\d+)\.downsample", (0,)), (r"^stages\.(\d+)\.blocks\.(\d+)", None)])

    def extra_repr(self) -> str:
        return (f"img_size={self.img_size}, in_chans={self.in_chans}, "
                f"num_classes={self.num_classes}, embed_dims={self.embed_dims}, "
                f"depths={self.depths}, norm={self.norm_kind!r}, "
                f"global_pool={self.global_pool!r}")


def _check_pool(global_pool: str) -> str:
    if global_pool not in ("avg", ""):
        raise ConfigError(f"global_pool must be 'avg' or '' (no pooling), got {global_pool!r}")
    return global_pool


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None,
        "crop_pct": 0.9, "interpolation": "bicubic", "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.proj", "classifier": "head", "license": "apache-2.0",
        "paper_name": "Multilinear Operator Networks",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "monet_t": _cfg(),
    "monet_s": _cfg(),
    "monet_ms_t": _cfg(),
    "monet_ms_s": _cfg(),
})


def checkpoint_filter_fn(state_dict: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """The weights for ``model`` in a saved dict: a polynets checkpoint's ``model`` entry (or a
    ``state_dict`` entry), keys stripped of the prefixes wrapped models add (``module.`` from
    DistributedDataParallel, ``_orig_mod.`` from ``torch.compile``). timm applies it when
    ``pretrained=True`` loads a local file (``pretrained_cfg_overlay=dict(file=PATH)``)."""
    for key in ("state_dict", "model"):
        inner = state_dict.get(key)
        if isinstance(inner, Mapping):
            state_dict = inner
            break
    out = {}
    for name, value in state_dict.items():
        for prefix in ("module.", "_orig_mod."):
            name = name.removeprefix(prefix)
        out[name] = value
    return out


def _local_weights(kwargs: Mapping[str, Any]) -> bool:
    """Whether the builder's arguments name local weights (a file or a state dict)."""
    cfgs = (kwargs.get("pretrained_cfg_overlay"), kwargs.get("pretrained_cfg"))
    return any(isinstance(c, Mapping) and (c.get("file") or c.get("state_dict")) for c in cfgs)


def build_token_model(cls: type, variant: str, pretrained: bool,
                      default_indices: int | tuple[int, ...],
                      filter_fn: Any = checkpoint_filter_fn, **kwargs: Any) -> nn.Module:
    """Build ``cls`` for a timm variant.

    No pretrained weights are published: ``pretrained=True`` warns and initialises randomly,
    without any network access, unless ``pretrained_cfg_overlay=dict(file=PATH)`` names a local
    checkpoint, which timm loads through ``filter_fn``. ``features_only`` gives timm's feature
    getter over ``forward_intermediates``: channels-last tokens of the units ``out_indices``
    (default ``default_indices``; an int ``n`` means the last ``n``). Otherwise the model's ``pretrained_cfg``
    records its class count and input size.
    """
    if pretrained and not _local_weights(kwargs):
        warnings.warn(f"no pretrained weights are published for {variant}; the model is randomly "
                      f"initialised (pretrained_cfg_overlay=dict(file=PATH) loads a local "
                      f"checkpoint)", UserWarning, stacklevel=5)
        pretrained = False
    feature_cfg = dict(feature_cls="getter", out_indices=kwargs.pop("out_indices", default_indices),
                       output_fmt="NHWC")
    model = build_model_with_cfg(cls, variant, pretrained, feature_cfg=feature_cfg,
                                 pretrained_filter_fn=filter_fn, **kwargs)
    if not isinstance(model, cls):  # features_only: a timm feature extractor around the model
        return model
    cfg = {**model.pretrained_cfg, "num_classes": model.num_classes,
           "input_size": (model.in_chans, *model.img_size)}
    model.pretrained_cfg = model.default_cfg = cfg
    return model


def _create_monet(variant: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Features of a multi-stage MONet: every stage; of a single-stage one: the last three
    Poly-Blocks (fewer if it has fewer)."""
    depths = _as_tuple(kwargs["depth"], "depth")
    out_indices = min(3, depths[0]) if len(depths) == 1 else tuple(range(len(depths)))
    return build_token_model(MONet, variant, pretrained, out_indices, **kwargs)


@register_model
def monet_t(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """MONet-Tiny (Table 1): 32 Poly-Blocks of width 192, 16x16 tokens at 224."""
    args = dict(patch_size=7, embed_dim=192, depth=32, expansion=3, shrinkage=4)
    return _create_monet("monet_t", pretrained, **{**args, **kwargs})


@register_model
def monet_s(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """MONet-Small (Table 1): 45 Poly-Blocks of width 320, 14x14 tokens at 224."""
    args = dict(patch_size=8, embed_dim=320, depth=45, expansion=3, shrinkage=4)
    return _create_monet("monet_s", pretrained, **{**args, **kwargs})


@register_model
def monet_ms_t(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Multi-stage MONet-Tiny (Table 1, Appendix B): widths 64-128-192-192, 4-8-12-10 blocks."""
    args = dict(patch_size=2, embed_dim=(64, 128, 192, 192), depth=(4, 8, 12, 10),
                expansion=3, shrinkage=8)
    return _create_monet("monet_ms_t", pretrained, **{**args, **kwargs})


@register_model
def monet_ms_s(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Multi-stage MONet-Small (Table 1, Appendix B): widths 128-192-256-384, 4-6-12-14 blocks."""
    args = dict(patch_size=2, embed_dim=(128, 192, 256, 384), depth=(4, 6, 12, 14),
                expansion=3, shrinkage=8)
    return _create_monet("monet_ms_s", pretrained, **{**args, **kwargs})
