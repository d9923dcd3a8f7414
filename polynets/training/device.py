"""Device selection, mixed precision and distributed set-up.

``select_device`` picks CUDA > MPS > CPU unless told otherwise; ``autocast_dtype`` decides the
mixed-precision dtype (only on CUDA); ``init_distributed`` joins the process group that
``torchrun`` describes in the environment (NCCL on GPUs, gloo on CPU).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polynets.errors import ConfigError

__all__ = [
    "finish_distributed",
    "DistributedInfo",
    "autocast_dtype",
    "distributed_info",
    "init_distributed",
    "select_device",
]

_AMP_CHOICES = ("auto", "bf16", "fp16", "off")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def select_device(preference: str | torch.device = "auto") -> torch.device:
    """Return the device to compute on: CUDA > MPS > CPU for ``"auto"``, else the one named.

    ``preference`` is ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a
    ``torch.device``. A device that is named but not available raises :class:`ConfigError`.
    """
    text = str(preference).strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise ConfigError(
            f"unknown device {preference!r}; expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
        ) from exc
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {preference!r} was requested but CUDA is not available here "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                "use --device cpu or 'auto', or install a CUDA build of torch on a GPU machine"
            )
        count = torch.cuda.device_count()
        if device.index is not None and count and device.index >= count:
            raise ConfigError(
                f"device {preference!r} was requested but only {count} CUDA device(s) exist "
                f"(valid: cuda:0 .. cuda:{count - 1})"
            )
        return device
    if device.type == "mps":
        if not _mps_available():
            raise ConfigError(
                f"device {preference!r} was requested but Apple MPS is not available here; "
                "use --device cpu or 'auto'"
            )
        return device
    raise ConfigError(
        f"unsupported device type {device.type!r}; expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
    )


def autocast_dtype(device: torch.device, amp: str | bool = "auto") -> torch.dtype | None:
    """Mixed-precision dtype for ``device``: bf16 (fp16 where bf16 is unsupported) on CUDA, else None.

    ``amp`` is ``"auto"``, ``"bf16"``, ``"fp16"``, ``"off"`` (or a bool). Autocast is used only on
    CUDA; asking for bf16/fp16 on another device raises :class:`ConfigError`.
    """
    if isinstance(amp, bool):
        amp = "auto" if amp else "off"
    amp = str(amp).lower()
    if amp in ("none", "false", "no"):
        amp = "off"
    if amp not in _AMP_CHOICES:
        raise ConfigError(f"unknown amp setting {amp!r}; expected one of {', '.join(_AMP_CHOICES)}")
    if amp == "off":
        return None
    if device.type != "cuda":
        if amp == "auto":
            return None
        raise ConfigError(
            f"amp={amp!r} needs a CUDA device but training runs on {device}; use amp='auto' or 'off'"
        )
    if amp == "fp16":
        return torch.float16
    if amp == "bf16" or torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits in a ``torchrun`` job (world_size 1 when not distributed)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only process that writes checkpoints and logs."""
        return self.rank == 0


def distributed_info() -> DistributedInfo:
    """Read ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` as set by ``torchrun``."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as exc:
        raise ConfigError(f"WORLD_SIZE, RANK and LOCAL_RANK must be integers: {exc}") from exc
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"inconsistent distributed environment: RANK={rank}, WORLD_SIZE={world}")
    return DistributedInfo(rank=rank, local_rank=local, world_size=world)


def init_distributed(preference: str | torch.device = "auto") -> tuple[DistributedInfo, torch.device]:
    """Join the ``torchrun`` process group if ``WORLD_SIZE > 1`` and pick this rank's device.

    Uses NCCL with ``cuda:LOCAL_RANK`` when the selected device is CUDA, gloo otherwise. Without
    ``WORLD_SIZE > 1`` it only returns ``select_device(preference)``.
    """
    info = distributed_info()
    device = select_device(preference)
    if not info.enabled:
        return info, device
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        raise ConfigError(f"distributed training supports CUDA (nccl) and CPU (gloo), not {device}")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method="env://")
        # a process that exits with the group alive aborts in gloo's threads ("terminate called
        # without an active exception"): the group polynets made is torn down at exit
        atexit.register(finish_distributed)
    return info, device


def finish_distributed() -> None:
    """Destroy the default process group if there is one (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
