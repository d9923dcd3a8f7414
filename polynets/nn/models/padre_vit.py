"""PADRe vision transformer: DeiT with PADRe in place of attention and Mu-Layers in place of MLPs.

Patch embedding plus learned positions, then blocks ``Z = X + PADRe(N_1 X)``,
``Y = Z + MuLayer(N_2 Z)`` on the token grid, a final norm, mean pooling over tokens and a
linear classifier (PADRe, Section 4.2). With ``norm="batch"`` (default) the eval-mode network is
a polynomial of its input: each block has degree ``2 * degree``.

After ``import polynets``, ``timm.create_model(name, num_classes=.., in_chans=.., img_size=..)``
builds:

===============  =====  =====  ======  =====  ======  ==========================================
name             width  depth  degree  patch  kernel  for
===============  =====  =====  ======  =====  ======  ==========================================
padre_vit_t      192    12     2       16     11      224 x 224 images (DeiT-Tiny with PADRe-2)
padre3_vit_t     192    12     3       16     11      224 x 224 images (DeiT-Tiny with PADRe-3)
padre_vit_mini   64     4      2       2      3       8 x 8 digits (4 x 4 tokens), 28 x 28 MNIST
===============  =====  =====  ======  =====  ======  ==========================================
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, resample_abs_pos_embed_nhwc, trunc_normal_
from timm.models import generate_default_cfgs, named_apply, register_model
from torch import Tensor, nn

from polynets.errors import ConfigError, check_int
from polynets.nn.layers import NORMS, MuLayer, PatchEmbed, check_shape, make_norm, to_2tuple
from polynets.nn.models.monet import (INITS, TokenGridModel, _check_pool, build_token_model,
                                   checkpoint_filter_fn as _unwrap_state_dict)
from polynets.nn.padre import PADRe

__all__ = ["PADReBlock", "PADReViT", "checkpoint_filter_fn"]


def _init_weights(module: nn.Module, name: str = "", scheme: str = "trunc_normal") -> None:
    """Linear and patch-embedding weights by ``scheme``, biases zero; a PADRe mixer keeps its
    own unit-gain initialisation (applied after its children, as ``named_apply`` is depth-first).
    """
    if isinstance(module, PADRe):
        module.reset_parameters()
    elif isinstance(module, (nn.Linear, nn.Conv2d)):
        INITS[scheme](module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class PADReBlock(nn.Module):
    """Transformer block with PADRe token mixing: ``Z = X + PADRe(N_1 X)``,
    ``Y = Z + MuLayer(N_2 Z)``.

    The PADRe mixer has no first-order term (the shortcut supplies it); the Mu-Layer has hidden
    size ``dim * mlp_ratio`` and rank ``hidden // shrinkage``. Degree in ``X``: ``2 * degree``.
    ``drop_path`` is stochastic depth on both branches (identity in eval mode).
    Shape: ``(B, H, W, dim) -> (B, H, W, dim)``.
    """

    def __init__(self, dim: int, *, degree: int = 2, kernel_size: int = 11,
                 token_mixing: str = "depthwise", mlp_ratio: int = 3, shrinkage: int = 4,
                 norm: str = "batch", drop_path: float = 0.0) -> None:
        super().__init__()
        self.dim = dim
        self.norm1 = make_norm(norm, dim)
        self.mixer = PADRe(dim, degree=degree, kernel_size=kernel_size,
                           token_mixing=token_mixing)
        self.norm2 = make_norm(norm, dim)
        self.mlp = MuLayer(dim, dim, hidden=dim * mlp_ratio, shrinkage=shrinkage)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        check_shape("PADReBlock", x, ("B", "H", "W", self.dim))
        x = x + self.drop_path(self.mixer(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PADReViT(TokenGridModel, nn.Module):
    """PADRe vision transformer: ``logits = W mean_tokens(N(Blocks(Embed(I) + E_pos))) + b``.

    Args:
        img_size, in_chans, num_classes: image geometry and classes (timm's builder passes them).
        patch_size: side of the non-overlapping patches (tokens on an ``H/p x W/p`` grid).
        embed_dim, depth: width and number of :class:`PADReBlock`.
        degree: PADRe degree ``d`` (PADRe-2, -3, ...); kernel_size: token convolution taps per
            side; token_mixing: ``"depthwise"`` or ``"shared"`` (see :class:`~polynets.PADRe`).
        mlp_ratio, shrinkage: Mu-Layer hidden size ``embed_dim * mlp_ratio`` and rank ratio
            (defaults 3 and 4: ``9 dim^2`` weights, about DeiT's ``8 dim^2`` MLP).
        norm: ``"batch"`` (default; folds into the affine maps at inference, so the eval-mode
            model is a polynomial and can be encrypted), ``"layer"`` (not a polynomial) or
            ``"none"``.
        global_pool: ``"avg"`` (mean over tokens) or ``""`` (classify every token).
        drop_rate: dropout before the classifier; drop_path_rate: stochastic depth, rising
            linearly to this value over the blocks.
        init: weight initialiser of the linear and patch layers, one of
            :data:`~polynets.nn.models.monet.INITS` (default ``"trunc_normal"``, std 0.02, DeiT's).

    Timm conventions (:class:`~polynets.nn.models.monet.TokenGridModel`): ``forward_features``
    returns channels-last tokens ``(B, H', W', C)``, ``forward_head(x, pre_logits=False)`` pools
    and classifies, ``reset_classifier`` keeps the pooling unless told otherwise,
    ``forward_intermediates`` gives the blocks' outputs. Shape:
    ``(B, in_chans, H, W) -> (B, num_classes)``.
    """

    def __init__(self, img_size: int | Sequence[int] = 224, in_chans: int = 3,
                 num_classes: int = 1000, *, patch_size: int = 16, embed_dim: int = 192,
                 depth: int = 12, degree: int = 2, kernel_size: int = 11,
                 token_mixing: str = "depthwise", mlp_ratio: int = 3, shrinkage: int = 4,
                 norm: str = "batch", global_pool: str = "avg", drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, init: str = "trunc_normal") -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("depth", depth), ("mlp_ratio", mlp_ratio)):
            check_int(value, f"PADReViT {name}")
        if norm not in NORMS:
            raise ConfigError(f"norm must be one of {NORMS}, got {norm!r}")
        if init not in INITS:
            raise ConfigError(f"init must be one of {tuple(INITS)}, got {init!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            raise ConfigError(f"num_classes must be a non-negative int, got {num_classes!r}")
        if not 0.0 <= drop_rate < 1.0 or not 0.0 <= drop_path_rate < 1.0:
            raise ConfigError(f"drop_rate and drop_path_rate must be in [0, 1), got "
                              f"{drop_rate!r} and {drop_path_rate!r}")
        self.global_pool = _check_pool(global_pool)
        self.img_size = to_2tuple(img_size, "img_size")
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dim
        self.depth, self.degree = depth, degree
        self.norm_kind = norm
        self.init_scheme = init
        self.stem = PatchEmbed(self.img_size, patch_size, in_chans, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, *self.stem.grid_size, embed_dim))
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.Sequential(*(
            PADReBlock(embed_dim, degree=degree, kernel_size=kernel_size,
                       token_mixing=token_mixing, mlp_ratio=mlp_ratio, shrinkage=shrinkage,
                       norm=norm, drop_path=rate)
            for rate in rates))
        self.norm = make_norm(norm, embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes else nn.Identity()
        self.feature_info = [dict(num_chs=embed_dim, reduction=self.stem.reduction,
                                  module=f"blocks.{i}") for i in range(depth)]
        self.pretrained_cfg = self.default_cfg = {
            "num_classes": num_classes, "input_size": (in_chans, *self.img_size),
            "fixed_input_size": True, "first_conv": "stem.proj", "classifier": "head",
        }
        trunc_normal_(self.pos_embed, std=0.02)
        named_apply(partial(_init_weights, scheme=init), self)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters kept out of weight decay by timm's optimiser factory."""
        return {"pos_embed"}

    def embed_tokens(self, x: Tensor) -> Tensor:
        """Image ``(B, in_chans, H, W)`` to positioned tokens ``(B, H/p, W/p, embed_dim)``."""
        check_shape("PADReViT", x, ("B", self.in_chans, *self.img_size))
        return self.stem(x) + self.pos_embed

    def feature_units(self) -> list[nn.Module]:
        """The PADRe blocks."""
        return list(self.blocks)

    def final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for timm's layer-wise learning-rate decay: embedding, blocks, norm."""
        return dict(stem=r"^stem|^pos_embed",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def _init_head(self) -> None:
        _init_weights(self.head, "head", self.init_scheme)

    def extra_repr(self) -> str:
        return (f"img_size={self.img_size}, in_chans={self.in_chans}, "
                f"num_classes={self.num_classes}, embed_dim={self.embed_dim}, "
                f"depth={self.depth}, degree={self.degree}, norm={self.norm_kind!r}, "
                f"global_pool={self.global_pool!r}")


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None,
        "crop_pct": 0.875, "interpolation": "bicubic", "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.proj", "classifier": "head", "license": "apache-2.0",
        "paper_name": "PADRe: A Unifying Polynomial Attention Drop-in Replacement",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "padre_vit_t": _cfg(),
    "padre3_vit_t": _cfg(),
    "padre_vit_mini": _cfg(num_classes=10, input_size=(1, 8, 8), crop_pct=1.0,
                           mean=(0.0,), std=(1.0,)),
})


def checkpoint_filter_fn(state_dict: dict[str, Any], model: PADReViT) -> dict[str, Any]:
    """Weights of a saved PADRe ViT for ``model``, position embeddings resampled to its grid
    (fine-tuning at another image size)."""
    out = _unwrap_state_dict(state_dict, model)
    pos = out.get("pos_embed")
    if isinstance(pos, Tensor) and pos.shape != model.pos_embed.shape:
        out["pos_embed"] = resample_abs_pos_embed_nhwc(pos, list(model.stem.grid_size))
    return out


def _create_padre_vit(variant: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Features: the outputs of the last three blocks (fewer if there are fewer)."""
    return build_token_model(PADReViT, variant, pretrained, min(3, kwargs.get("depth", 12)),
                             filter_fn=checkpoint_filter_fn, **kwargs)


@register_model
def padre_vit_t(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """DeiT-Tiny with PADRe-2 (Table 2): 12 blocks of width 192, 14x14 tokens at 224."""
    args = dict(patch_size=16, embed_dim=192, depth=12, degree=2, kernel_size=11)
    return _create_padre_vit("padre_vit_t", pretrained, **{**args, **kwargs})


@register_model
def padre3_vit_t(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """DeiT-Tiny with PADRe-3 (Table 2): 12 blocks of width 192, 14x14 tokens at 224."""
    args = dict(patch_size=16, embed_dim=192, depth=12, degree=3, kernel_size=11)
    return _create_padre_vit("padre3_vit_t", pretrained, **{**args, **kwargs})


@register_model
def padre_vit_mini(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Small PADRe-2 ViT for 8x8 digits (4x4 tokens) or 28x28 MNIST (14x14 tokens): 4 blocks
    of width 64, 2x2 patches, 3x3 token convolutions."""
    args = dict(patch_size=2, embed_dim=64, depth=4, degree=2, kernel_size=3)
    return _create_padre_vit("padre_vit_mini", pretrained, **{**args, **kwargs})
