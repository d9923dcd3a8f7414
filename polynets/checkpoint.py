"""Checkpoints: atomic writes, safe loading, and rebuilding a model from its name and arguments.

A checkpoint is a ``torch.save`` file holding only tensors and JSON-able data (dicts, lists,
strings, numbers, booleans, None), so :func:`load_checkpoint` reads it with
``torch.load(weights_only=True)`` and untrusted bytes never execute code. A model is stored as
``model_name`` + ``model_kwargs`` + ``state_dict``; :func:`load_model` rebuilds it through the
small registry here (:func:`register_model`) or ``timm.create_model`` for timm-registered names.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import random
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from polynets.errors import CheckpointError, ConfigError
from polynets.program import atomic_write_bytes

__all__ = [
    "CHECKPOINT_FORMAT",
    "build_model",
    "capture_rng_state",
    "load_checkpoint",
    "load_model",
    "register_model",
    "registered_models",
    "restore_rng_state",
    "save_checkpoint",
    "unwrap_model",
]

CHECKPOINT_FORMAT = "polynets-checkpoint"
CHECKPOINT_VERSION = 1

_MODEL_BUILDERS: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator: make ``build_model(name, **kwargs)`` (and checkpoints naming it) call ``fn``."""

    def decorate(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        _MODEL_BUILDERS[name.lower()] = fn
        return fn

    return decorate


_BUILTIN_MODELS = {
    "monet": ("polynets.models.monet", "MONet"),
    "padre_vit": ("polynets.models.padre_vit", "PADReViT"),
    "polymorpher_classifier": ("polynets.models.polymorpher", "PolymorpherClassifier"),
}


def _builtin_builder(name: str) -> Callable[..., nn.Module] | None:
    if name not in _BUILTIN_MODELS:
        return None
    module, attr = _BUILTIN_MODELS[name]
    return getattr(importlib.import_module(module), attr)


def registered_models() -> list[str]:
    """Names accepted by :func:`build_model`: the registry here plus polynets' timm models."""
    import timm

    import polynets.models  # noqa: F401  (registers the MONet family in timm)

    names = set(_MODEL_BUILDERS)
    names.update(_BUILTIN_MODELS)
    names.update(timm.list_models("monet*"))
    names.update(timm.list_models("padre*"))
    return sorted(names)


def model_builder(name: str) -> Callable[..., nn.Module]:
    """The callable that builds model ``name``; raises :class:`ConfigError` for unknown names."""
    import timm

    import polynets.models  # noqa: F401  (registers the MONet family in timm)

    key = name.lower()
    if key in _MODEL_BUILDERS:
        return _MODEL_BUILDERS[key]
    builtin = _builtin_builder(key)
    if builtin is not None:
        return builtin
    if timm.is_model(name):
        return lambda **kwargs: timm.create_model(name, **kwargs)
    raise ConfigError(
        f"unknown model {name!r}; expected a polynets model ({', '.join(registered_models())}) "
        "or a timm model name"
    )


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build model ``name`` with ``kwargs`` (registry, polynets classes, then timm)."""
    builder = model_builder(name)
    try:
        return builder(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"model {name!r} does not accept arguments {sorted(kwargs)}: {exc}") from exc


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside DistributedDataParallel / DataParallel / torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def capture_rng_state() -> dict[str, Any]:
    """Snapshot of the torch, CUDA, numpy and python random generators as tensors and lists."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore generators from :func:`capture_rng_state`'s snapshot."""
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state(
        ("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_plain(value: Any, where: str) -> None:
    """Raise ConfigError unless ``value`` is made of tensors and JSON-able data only."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise ConfigError(f"checkpoint key {where}[{key!r}] must be a string or integer")
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise ConfigError(
        f"checkpoint field {where} holds a {type(value).__name__}; only tensors and JSON-able "
        "data (dict, list, str, int, float, bool, None) can be stored"
    )


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    model_name: str,
    model_kwargs: Mapping[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    epoch: int = 0,
    step: int = 0,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> Path:
    """Atomically write a checkpoint of the unwrapped ``model`` (plus optimizer, scheduler, RNG).

    ``model_kwargs`` must be JSON-able (it rebuilds the model in :func:`load_model`); ``extra``
    may hold tensors and JSON-able data. The file is written beside ``path`` and moved into
    place with ``os.replace``, so a crash never leaves a half-written checkpoint.
    """
    kwargs = dict(model_kwargs or {})
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model_kwargs must be JSON-able to rebuild the model: {exc}") from exc
    payload: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "model_name": str(model_name),
        "model_kwargs": kwargs,
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "epoch": int(epoch),
        "step": int(step),
        "extra": dict(extra or {}),
        "rng": capture_rng_state() if rng else None,
    }
    _check_plain(payload, "checkpoint")
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    path = Path(path)
    atomic_write_bytes(path, buffer.getbuffer())
    return path


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` with ``torch.load(weights_only=True)``.

    Raises :class:`CheckpointError` if the file is missing, truncated or corrupted, holds
    arbitrary Python objects, or was not written by polynets.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: the file does not exist")
    try:
        data = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        foreign = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if foreign is None:
            raise CheckpointError(
                f"{path} ({path.stat().st_size} bytes) is corrupted or truncated, or not a torch checkpoint; "
                "re-save it or use another copy"
            ) from exc
        raise CheckpointError(
            f"{path} holds a Python object ({foreign.group(1)}) besides tensors and plain data; refusing to "
            "unpickle it (checkpoints load with weights_only=True, so files cannot run code). Only files written "
            "by polynets.save_checkpoint load here"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError, AttributeError) as exc:
        size = path.stat().st_size
        raise CheckpointError(
            f"{path} ({size} bytes) is corrupted or truncated and cannot be read as a checkpoint; "
            f"re-save it or use another copy ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        hint = ""
        if isinstance(data, dict) and data and all(isinstance(v, torch.Tensor) for v in data.values()):
            hint = " It looks like a bare state_dict: load it with model.load_state_dict(torch.load(...))."
        raise CheckpointError(
            f"{path} is not a polynets checkpoint (no format marker {CHECKPOINT_FORMAT!r}; found "
            f"{type(data).__name__}{' with keys ' + ', '.join(map(str, list(data)[:6])) if isinstance(data, dict) else ''})."
            f"{hint}"
        )
    if data.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {data.get('version')!r}; this polynets reads version {CHECKPOINT_VERSION}"
        )
    missing = [k for k in ("model_name", "model_kwargs", "model", "epoch", "step") if k not in data]
    if missing:
        raise CheckpointError(f"{path} is an incomplete polynets checkpoint: missing {', '.join(missing)}")
    return data


def load_model(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model stored in a checkpoint (``model_name`` + ``model_kwargs``) and load its weights."""
    ckpt = load_checkpoint(path, map_location=map_location)
    try:
        model = build_model(ckpt["model_name"], **ckpt["model_kwargs"])
    except ConfigError as exc:
        raise CheckpointError(f"{path}: cannot rebuild model {ckpt['model_name']!r}: {exc}") from exc
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise CheckpointError(
            f"{path}: the stored weights do not fit model {ckpt['model_name']!r} built with "
            f"{ckpt['model_kwargs']}: {str(exc).splitlines()[0]}"
        ) from exc
    return model.to(map_location).eval()
