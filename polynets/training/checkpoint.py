"""Checkpoints: atomic writes, safe loading, and rebuilding a model from its name and arguments.

A checkpoint is a ``torch.save`` file holding only tensors and JSON-able data (dicts, lists,
strings, numbers, booleans, None), so :func:`load_checkpoint` reads it with
``torch.load(weights_only=True)`` and untrusted bytes never execute code. A model is stored as
``model_name`` + ``model_kwargs`` + ``state_dict``; :func:`load_model` rebuilds it through the
small registry here (:func:`register_model`) or ``timm.create_model`` for timm-registered names.

Loading trusts nothing in the file: a BLAKE2b digest over every field and every tensor's bytes
(written by :func:`save_checkpoint`) turns a flipped bit or a truncation into a
:class:`~polynets.errors.CheckpointError`; ``model_kwargs`` must be a dict of JSON values within
bounds, and the model is first built on PyTorch's ``meta`` device (no memory) so that arguments
asking for more than :data:`MAX_MODEL_ELEMENTS` parameters are refused before anything is allocated.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib
import io
import json
import math
import os
import pickle
import random
import re
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from polynets._io import atomic_write_bytes
from polynets.errors import CheckpointError, ConfigError, PolynetsError

__all__ = [
    "CHECKPOINT_FORMAT",
    "MAX_MODEL_ELEMENTS",
    "build_model",
    "capture_rng_state",
    "check_model_kwargs",
    "load_checkpoint",
    "load_model",
    "register_model",
    "registered_models",
    "restore_rng_state",
    "save_checkpoint",
    "unwrap_model",
]

CHECKPOINT_FORMAT = "polynets-checkpoint"
CHECKPOINT_VERSION = 2
_READABLE_VERSIONS = (1, 2)     # version 1: the same fields without the digest
MAX_MODEL_ELEMENTS = 1 << 31    # parameters + buffers a model built here may hold
MAX_MODEL_MODULES = 1 << 14     # submodules a model built here may hold
MAX_CHECKPOINT_BYTES = 1 << 36
_MAX_KWARG_INT = 1 << 24
_MAX_KWARG_ITEMS = 256

_MODEL_BUILDERS: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator: make ``build_model(name, **kwargs)`` (and checkpoints naming it) call ``fn``."""

    def decorate(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        _MODEL_BUILDERS[name.lower()] = fn
        return fn

    return decorate


_BUILTIN_MODELS = {
    "monet": ("polynets.nn.models.monet", "MONet"),
    "padre_vit": ("polynets.nn.models.padre_vit", "PADReViT"),
    "polymorpher_classifier": ("polynets.nn.models.polymorpher", "PolymorpherClassifier"),
}


def _builtin_builder(name: str) -> Callable[..., nn.Module] | None:
    if name not in _BUILTIN_MODELS:
        return None
    module, attr = _BUILTIN_MODELS[name]
    return getattr(importlib.import_module(module), attr)


def registered_models() -> list[str]:
    """Names accepted by :func:`build_model`: the registry here plus polynets' timm models."""
    import timm

    import polynets.nn.models  # noqa: F401  (registers the MONet family in timm)

    names = set(_MODEL_BUILDERS)
    names.update(_BUILTIN_MODELS)
    names.update(timm.list_models("monet*"))
    names.update(timm.list_models("padre*"))
    return sorted(names)


def model_builder(name: str) -> Callable[..., nn.Module]:
    """The callable that builds model ``name``; raises :class:`ConfigError` for unknown names."""
    import timm

    import polynets.nn.models  # noqa: F401  (registers the MONet family in timm)

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


class _TooLarge(Exception):
    pass


@contextlib.contextmanager
def _size_guard(limit_elements: int, limit_modules: int) -> Iterator[None]:
    """Count parameters, buffers and submodules as any model registers them; raise _TooLarge
    past the limits."""
    from torch.nn.modules import module as module_hooks

    seen = {"elements": 0, "modules": 0}

    def on_tensor(module: nn.Module, name: str, tensor: Any) -> None:
        if tensor is not None:
            seen["elements"] += tensor.numel()
            if seen["elements"] > limit_elements:
                raise _TooLarge(f"more than {limit_elements:,} parameters and buffers")

    def on_module(module: nn.Module, name: str, sub: Any) -> None:
        seen["modules"] += 1
        if seen["modules"] > limit_modules:
            raise _TooLarge(f"more than {limit_modules:,} submodules")

    handles = [module_hooks.register_module_parameter_registration_hook(on_tensor),
               module_hooks.register_module_buffer_registration_hook(on_tensor),
               module_hooks.register_module_module_registration_hook(on_module)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def build_model(name: str, *, max_elements: int = MAX_MODEL_ELEMENTS, **kwargs: Any) -> nn.Module:
    """Build model ``name`` with ``kwargs`` (registry, polynets classes, then timm).

    The model is first built on the ``meta`` device, which allocates nothing: arguments that
    would need more than ``max_elements`` parameters and buffers (or an absurd number of
    submodules) raise :class:`ConfigError` instead of exhausting memory.
    """
    builder = model_builder(name)
    try:
        try:
            with _size_guard(max_elements, MAX_MODEL_MODULES), torch.device("meta"):
                builder(**kwargs)
        except (RuntimeError, NotImplementedError):
            pass  # a builder that cannot run on meta: the real build below is guarded too
        with _size_guard(max_elements, MAX_MODEL_MODULES):
            return builder(**kwargs)
    except _TooLarge as exc:
        raise ConfigError(f"model {name!r} with arguments {_short(kwargs)} would hold {exc}; "
                          f"refusing to build it") from None
    except PolynetsError:
        raise
    except TypeError as exc:
        raise ConfigError(f"model {name!r} does not accept arguments {sorted(kwargs)}: {exc}") from exc
    except (ValueError, AssertionError, MemoryError, OverflowError, ZeroDivisionError, KeyError,
            IndexError, AttributeError, RuntimeError) as exc:
        raise ConfigError(f"model {name!r} cannot be built with arguments {_short(kwargs)}: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc


def _short(value: Any, limit: int = 200) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_model_kwargs(kwargs: Any, where: str = "model_kwargs") -> dict[str, Any]:
    """``kwargs`` if it is a dict of JSON values (numbers, strings, booleans, None and short
    lists / dicts of them) within bounds, else :class:`ConfigError` saying what is wrong."""
    if not isinstance(kwargs, Mapping):
        raise ConfigError(f"{where} must be a JSON object of keyword arguments, got "
                          f"{type(kwargs).__name__}")
    if len(kwargs) > _MAX_KWARG_ITEMS:
        raise ConfigError(f"{where} holds {len(kwargs)} arguments, more than {_MAX_KWARG_ITEMS}")

    def check(value: Any, at: str, depth: int) -> None:
        if value is None or isinstance(value, bool):
            return
        if isinstance(value, int):
            if abs(value) > _MAX_KWARG_INT:
                raise ConfigError(f"{at} = {value} is out of range (|value| <= {_MAX_KWARG_INT})")
            return
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ConfigError(f"{at} = {value} is not a finite number")
            return
        if isinstance(value, str):
            if len(value) > 1024:
                raise ConfigError(f"{at} is a string of {len(value)} characters (at most 1024)")
            return
        if isinstance(value, (list, tuple, Mapping)) and depth < 4 and len(value) <= _MAX_KWARG_ITEMS:
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            for key, item in items:
                if isinstance(value, Mapping) and not isinstance(key, str):
                    raise ConfigError(f"{at} has a key {key!r} that is not a string")
                check(item, f"{at}[{key!r}]", depth + 1)
            return
        raise ConfigError(f"{at} must be a number, string, boolean, null or a short list of them, "
                          f"got {type(value).__name__}")

    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{where} has a key {key!r} that is not an argument name")
        check(value, f"{where}[{key!r}]", 0)
    return dict(kwargs)


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
    payload["digest"] = _payload_digest(payload)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    path = Path(path)
    atomic_write_bytes(path, buffer.getbuffer())
    return path


def _feed(h: Any, value: Any, depth: int = 0) -> None:
    """Feed ``value`` (tensors and JSON-able data) to hash ``h`` in one unambiguous encoding."""
    if depth > 64:
        raise ValueError("nested more than 64 levels deep")
    if value is None:
        h.update(b"N")
    elif isinstance(value, bool):
        h.update(b"T" if value else b"F")
    elif isinstance(value, int):
        h.update(b"I%d;" % value)
    elif isinstance(value, float):
        h.update(b"D" + struct.pack("<d", value))
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        h.update(b"S%d:" % len(raw) + raw)
    elif isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        head = f"{t.dtype}|{tuple(t.shape)}".encode()
        h.update(b"X%d:" % len(head) + head)
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, (list, tuple)):
        h.update(b"L%d:" % len(value))
        for item in value:
            _feed(h, item, depth + 1)
    elif isinstance(value, Mapping):
        h.update(b"M%d:" % len(value))
        for key, item in value.items():
            _feed(h, key, depth + 1)
            _feed(h, item, depth + 1)
    else:
        raise TypeError(f"unexpected {type(value).__name__}")


def _payload_digest(payload: Mapping[str, Any]) -> str:
    """BLAKE2b-256 over every field of a checkpoint except ``digest`` (tensors by their bytes)."""
    h = hashlib.blake2b(digest_size=32)
    _feed(h, {k: v for k, v in payload.items() if k != "digest"})
    return h.hexdigest()


def _check_file(path: Path) -> int:
    """The size of the regular file ``path``, or CheckpointError for anything else."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}: the file does not exist") from None
    except NotADirectoryError:
        raise CheckpointError(f"no checkpoint at {path}: a directory in this path is a file") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from exc
    if stat.S_ISDIR(info.st_mode):
        raise CheckpointError(f"{path} is a directory, not a checkpoint file (e.g. {path / 'last.pt'})")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file (a pipe, device or socket); expected a checkpoint")
    if info.st_size > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(f"{path} is {info.st_size} bytes, more than the {MAX_CHECKPOINT_BYTES} allowed")
    return info.st_size


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` with ``torch.load(weights_only=True)``.

    Raises :class:`CheckpointError` if the file is missing or not a regular file, truncated or
    corrupted (its digest does not match), holds arbitrary Python objects, or was not written by
    polynets.
    """
    path = Path(path)
    size = _check_file(path)
    try:
        data = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        foreign = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if foreign is None:
            raise CheckpointError(
                f"{path} ({size} bytes) is corrupted or truncated, or not a torch checkpoint; "
                "re-save it or use another copy"
            ) from exc
        raise CheckpointError(
            f"{path} holds a Python object ({foreign.group(1)}) besides tensors and plain data; refusing to "
            "unpickle it (checkpoints load with weights_only=True, so files cannot run code). Only files written "
            "by polynets.save_checkpoint load here"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: every failure of the reader is corruption
        raise CheckpointError(
            f"{path} ({size} bytes) is corrupted or truncated and cannot be read as a checkpoint; "
            f"re-save it or use another copy ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        hint = ""
        if isinstance(data, dict) and data and all(isinstance(v, torch.Tensor) for v in data.values()):
            hint = " It looks like a bare state_dict: load it with model.load_state_dict(torch.load(...))."
        keys = ", ".join(map(str, list(data)[:6])) if isinstance(data, dict) else ""
        raise CheckpointError(
            f"{path} is not a polynets checkpoint (no format marker {CHECKPOINT_FORMAT!r}; found "
            f"{type(data).__name__}{' with keys ' + keys if keys else ''}).{hint}"
        )
    version = data.get("version")
    if isinstance(version, bool) or version not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"{path} has checkpoint version {version!r}; this polynets reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))}"
        )
    if version >= 2:
        stored = data.get("digest")
        try:
            actual = _payload_digest(data)
        except (TypeError, ValueError, RecursionError, RuntimeError) as exc:
            raise CheckpointError(f"{path} is corrupted: its contents cannot be checked ({exc})") from exc
        if not isinstance(stored, str) or not hmac.compare_digest(stored, actual):
            raise CheckpointError(
                f"{path} ({size} bytes) is corrupted or truncated: its contents do not match the digest written "
                "with it (damaged in storage or transport, or edited); re-save it or use another copy"
            )
    missing = [k for k in ("model_name", "model_kwargs", "model", "epoch", "step") if k not in data]
    if missing:
        raise CheckpointError(f"{path} is an incomplete polynets checkpoint: missing {', '.join(missing)}")
    if not isinstance(data["model_name"], str):
        raise CheckpointError(f"{path}: model_name must be a string, got {type(data['model_name']).__name__}")
    if not isinstance(data["model"], Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data["model"].items()):
        raise CheckpointError(f"{path}: the stored weights must map parameter names to tensors")
    if not isinstance(data.get("extra", {}), Mapping):
        raise CheckpointError(f"{path}: 'extra' must be a dict")
    data.setdefault("extra", {})
    return data


def load_model(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model stored in a checkpoint (``model_name`` + ``model_kwargs``) and load its weights.

    ``model_kwargs`` is checked with :func:`check_model_kwargs` and the model's size on the meta
    device before anything is allocated; every failure is a :class:`CheckpointError`.
    """
    ckpt = load_checkpoint(path, map_location=map_location)
    name = ckpt["model_name"]
    try:
        kwargs = check_model_kwargs(ckpt["model_kwargs"], "model_kwargs")
        model = build_model(name, **kwargs)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: cannot rebuild model {name!r}: {exc}") from exc
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(
            f"{path}: the stored weights do not fit model {name!r} built with "
            f"{_short(kwargs)}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from exc
    return model.to(map_location).eval()
