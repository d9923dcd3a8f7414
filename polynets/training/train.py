"""Training loop for polynomial classifiers: timm's optimizers and schedules, AMP, EMA, Mixup, DDP, resume.

``Trainer(model, TrainConfig(...)).fit(train_ds, val_ds) -> history`` trains a classifier on
``(x, label)`` datasets. The recipe follows the MONet paper: AdamW (``timm.optim.create_optimizer_v2``,
which keeps biases, norm weights and the model's ``no_weight_decay()`` names out of weight decay)
with linear warm-up and cosine decay (``timm.scheduler.create_scheduler_v2``, updated every step),
label smoothing, gradient clipping, optional EMA and timm's Mixup/CutMix for images. The device is picked automatically (CUDA > MPS > CPU); on CUDA the
forward runs under bf16/fp16 autocast with channels-last memory. Under ``torchrun`` the model is
wrapped in DistributedDataParallel and only rank 0 writes. With ``out_dir`` set, every run writes
``run.json``, ``metrics.jsonl`` (one JSON object per line) and ``last.pt`` (plus ``best.pt`` when
validating); ``resume=True`` continues from ``last.pt`` with identical results for a fixed seed,
also after an interruption part-way through an epoch.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from tqdm.auto import tqdm

from polynets.training.checkpoint import load_checkpoint, restore_rng_state, save_checkpoint, unwrap_model
from polynets.training.metrics import MetricsLog, read_metrics_log
from polynets.training.device import autocast_dtype, init_distributed
from polynets.errors import CheckpointError, ConfigError, TrainingDivergedError
from polynets.ir.program import atomic_write_bytes
from polynets._threads import torch_threads

__all__ = [
    "ResumableDistributedSampler", "SCHEDULES", "TrainConfig", "Trainer", "read_metrics_log", "seed_everything",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

SCHEDULES = ("cosine", "tanh", "poly")
"""Learning-rate schedules of ``TrainConfig.sched`` (timm's names): each warms up linearly from
``min_lr`` for ``warmup_epochs``, then decays to ``min_lr`` at the end of the run."""


@dataclass
class TrainConfig:
    """Hyper-parameters and run settings of :class:`Trainer` (defaults suit small image sets).

    ``opt`` is any optimizer name of ``timm.optim.list_optimizers()`` (default ``"adamw"``);
    ``sched`` one of :data:`SCHEDULES`; ``layer_decay`` (None: off) scales each layer's learning
    rate by ``layer_decay ** (layers after it)`` through the model's ``group_matcher``.
    ``warmup_epochs`` may be fractional; ``clip_grad`` is a max global L2 norm (None: off);
    ``amp`` is ``"auto"|"bf16"|"fp16"|"off"`` (autocast on CUDA only); ``checkpoint_every`` is
    in epochs; ``log_every`` in optimizer steps; ``num_classes`` is needed by Mixup/CutMix when
    the model has no ``num_classes`` attribute. ``num_threads``: torch's intra-op threads while
    training (None: torch's setting; small models on a CPU shared with other work train many
    times faster on 1).
    """

    epochs: int = 10
    batch_size: int = 64
    opt: str = "adamw"
    sched: str = "cosine"
    lr: float = 1e-3
    weight_decay: float = 0.05
    layer_decay: float | None = None
    warmup_epochs: float = 1.0
    min_lr: float = 1e-5
    label_smoothing: float = 0.0
    clip_grad: float | None = None
    device: str = "auto"
    amp: str = "auto"
    compile: bool = False
    ema_decay: float | None = None
    mixup: float = 0.0
    cutmix: float = 0.0
    seed: int = 0
    out_dir: str | None = None
    checkpoint_every: int = 1
    num_workers: int = 0
    log_every: int = 10
    progress: bool = True
    deterministic: bool = False
    resume: bool = False
    num_classes: int | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        positive = {"epochs": self.epochs, "batch_size": self.batch_size, "lr": self.lr,
                    "checkpoint_every": self.checkpoint_every, "log_every": self.log_every}
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"TrainConfig.{name} must be positive, got {value!r}")
        nonneg = {"weight_decay": self.weight_decay, "warmup_epochs": self.warmup_epochs, "min_lr": self.min_lr,
                  "mixup": self.mixup, "cutmix": self.cutmix, "num_workers": self.num_workers}
        for name, value in nonneg.items():
            if value < 0:
                raise ConfigError(f"TrainConfig.{name} must be >= 0, got {value!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"TrainConfig.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise ConfigError(f"TrainConfig.clip_grad must be positive or None, got {self.clip_grad}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"TrainConfig.ema_decay must be in (0, 1) or None, got {self.ema_decay}")
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or
                                             not isinstance(self.num_threads, int) or
                                             self.num_threads < 1):
            raise ConfigError(f"TrainConfig.num_threads must be a positive int or None, got "
                              f"{self.num_threads!r}")
        if self.min_lr > self.lr:
            raise ConfigError(f"TrainConfig.min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.sched not in SCHEDULES:
            raise ConfigError(f"TrainConfig.sched must be one of {SCHEDULES}, got {self.sched!r}")
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            raise ConfigError(f"TrainConfig.layer_decay must be in (0, 1] or None, got {self.layer_decay}")
        from timm.optim import list_optimizers

        if self.opt.lower() not in list_optimizers():
            raise ConfigError(f"TrainConfig.opt {self.opt!r} is not one of timm's optimizers "
                              f"(timm.optim.list_optimizers(), e.g. 'adamw', 'sgd', 'lamb')")


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler (per-epoch permutation from ``seed + epoch``) that can start part-way.

    ``start_index`` skips the first samples of this rank's share of the epoch, so an epoch
    interrupted after k batches resumes with exactly the batches it had not seen.
    """

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start_index = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start_index, None)

    def __len__(self) -> int:
        return self.num_samples - self.start_index


@contextmanager
def _deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Use deterministic kernels (and no cuDNN autotuning) inside the block, then restore."""
    if not enabled:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2], saved[3]


@contextmanager
def _deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Inside the block a first Ctrl-C (SIGINT) only raises a flag, read between optimizer steps,
    so the trainer can checkpoint a consistent state; a second Ctrl-C interrupts at once."""
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hit.is_set
        return

    def handler(signum: int, frame: Any) -> None:
        if hit.is_set():
            raise KeyboardInterrupt
        hit.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


class Trainer:
    """Trains ``model`` for classification with :class:`TrainConfig`.

    ``loss_fn(logits (B, K), target) -> scalar`` defaults to cross-entropy with label smoothing
    (soft-target cross-entropy under Mixup/CutMix); evaluation uses ``loss_fn`` when given, else
    plain cross-entropy. ``model_name``/``model_kwargs`` go into checkpoints so
    :func:`polynets.training.checkpoint.load_model` can rebuild the model; ``run_info`` (JSON-able) is
    stored with them (the CLI records the dataset there).
    """

    def __init__(self, model: nn.Module, config: TrainConfig | None = None, *, loss_fn: LossFn | None = None,
                 model_name: str | None = None, model_kwargs: Mapping[str, Any] | None = None,
                 run_info: Mapping[str, Any] | None = None) -> None:
        self.config = config if config is not None else TrainConfig()
        self.dist, self.device = init_distributed(self.config.device)
        self.amp_dtype = autocast_dtype(self.device, self.config.amp)
        self.channels_last = self.device.type == "cuda"
        model = unwrap_model(model).to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        cfg = getattr(model, "pretrained_cfg", None) or {}
        self.model_name = model_name or cfg.get("architecture") or type(model).__name__
        self.model_kwargs = dict(model_kwargs or {})
        self.run_info = dict(run_info or {})
        self.loss_fn = loss_fn
        self.history: list[dict[str, Any]] = []
        self.global_step = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None  # a timm.scheduler.Scheduler, stepped per optimizer update
        self.ema: Any = None
        self.out_dir = Path(self.config.out_dir) if self.config.out_dir else None

    # ----------------------------------------------------------------- set-up helpers
    def _num_classes(self) -> int:
        n = self.config.num_classes or getattr(self.model, "num_classes", None)
        if not n:
            raise ConfigError("Mixup/CutMix need the number of classes: set TrainConfig.num_classes")
        return int(n)

    def _build_optimizer(self, steps_per_epoch: int) -> None:
        """timm's optimizer (weight decay off for biases, norms and ``no_weight_decay()`` names)
        and its per-update schedule: warm-up over whole steps, then decay to ``min_lr``."""
        from timm.optim import create_optimizer_v2
        from timm.scheduler import create_scheduler_v2

        cfg = self.config
        self.optimizer = create_optimizer_v2(self.model, cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                             layer_decay=cfg.layer_decay)
        total = cfg.epochs * steps_per_epoch
        warmup_steps = min(total, round(cfg.warmup_epochs * steps_per_epoch))
        decay_steps = max(1, total - warmup_steps)
        self.scheduler, _ = create_scheduler_v2(
            self.optimizer, cfg.sched, num_epochs=decay_steps / steps_per_epoch, min_lr=cfg.min_lr,
            warmup_lr=cfg.min_lr, warmup_epochs=warmup_steps / steps_per_epoch, warmup_prefix=True,
            step_on_epochs=False, updates_per_epoch=steps_per_epoch)

    def _lr(self) -> float:
        """The scheduled learning rate (of the last layers, under layer decay)."""
        assert self.optimizer is not None
        return max(group["lr"] for group in self.optimizer.param_groups)

    def _train_loss(self, mixing: bool) -> LossFn:
        if self.loss_fn is not None:
            return self.loss_fn
        if mixing:
            from timm.loss import SoftTargetCrossEntropy

            return SoftTargetCrossEntropy()
        return nn.CrossEntropyLoss(label_smoothing=self.config.label_smoothing)

    def _autocast(self) -> Any:
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(self.device, non_blocking=True)
        if self.channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def _diverged(self, value: float, step: int, epoch: int, batch: int) -> TrainingDivergedError:
        lr = self.config.lr
        saved = ""
        if self.out_dir is not None and (self.out_dir / "last.pt").exists():
            saved = f" The last good checkpoint is {self.out_dir / 'last.pt'}."
        return TrainingDivergedError(
            f"training diverged: the loss became {value} at step {step} (epoch {epoch + 1}, batch {batch + 1}). "
            "Polynomial networks multiply activations, so large inputs or weights grow without bound. "
            f"Remedies: lower the learning rate (lr={lr:g} -> {lr / 10:g}); clip gradients (clip_grad=1.0, "
            f"now {self.config.clip_grad}); use normalisation inside the blocks (norm='batch'); use a longer "
            f"warm-up (warmup_epochs, now {self.config.warmup_epochs:g}); standardise the inputs.{saved}"
        )

    def _checkpoint(self, name: str, *, epoch: int, batch: int, progress: Mapping[str, float],
                    scaler: Any = None) -> Path | None:
        if self.out_dir is None or not self.dist.is_main:
            return None
        extra = {
            "batch_in_epoch": batch,
            "progress": dict(progress),
            "history": self.history,
            "config": dataclasses.asdict(self.config),
            "run_info": self.run_info,
            "ema": self.ema.module.state_dict() if self.ema is not None else None,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        }
        return save_checkpoint(self.out_dir / name, model=self.model, model_name=self.model_name,
                               model_kwargs=self.model_kwargs, optimizer=self.optimizer, scheduler=self.scheduler,
                               epoch=epoch, step=self.global_step, extra=extra)

    def _restore(self, scaler: Any) -> tuple[int, int, dict[str, float], dict[str, Any] | None]:
        """Load ``out_dir/last.pt``; returns (epoch, batch in epoch, partial-epoch sums, rng state)."""
        assert self.out_dir is not None
        path = self.out_dir / "last.pt"
        ckpt = load_checkpoint(path, map_location="cpu")
        if ckpt["model_name"] != self.model_name:
            raise CheckpointError(f"{path} holds model {ckpt['model_name']!r}, but this run trains {self.model_name!r}")
        try:
            self.model.load_state_dict(ckpt["model"])
        except RuntimeError as exc:
            raise CheckpointError(f"{path} does not fit this model: {str(exc).splitlines()[0]}") from exc
        assert self.optimizer is not None and self.scheduler is not None
        if ckpt["optimizer"] is not None:
            self.optimizer.load_state_dict(ckpt["optimizer"])
        extra = ckpt["extra"]
        saved_batch = (extra.get("config") or {}).get("batch_size", self.config.batch_size)
        if extra.get("batch_in_epoch", 0) and saved_batch != self.config.batch_size:
            raise ConfigError(f"{path} was saved part-way through an epoch with batch_size={saved_batch}; resume "
                              f"with the same batch size (got {self.config.batch_size})")
        if self.ema is not None and extra.get("ema") is not None:
            self.ema.module.load_state_dict(extra["ema"])
        if extra.get("scaler") is not None:
            scaler.load_state_dict(extra["scaler"])
        self.global_step = int(ckpt["step"])
        # the schedule is a function of the step: this run's settings (e.g. more epochs) apply from here on
        self.scheduler.step_update(self.global_step)
        self.history = list(extra.get("history", []))
        return int(ckpt["epoch"]), int(extra.get("batch_in_epoch", 0)), dict(extra.get("progress", {})), ckpt["rng"]

    # ----------------------------------------------------------------- public API
    def fit(self, train_dataset: Dataset, val_dataset: Dataset | None = None, *,
            resume: bool | None = None) -> list[dict[str, Any]]:
        """Train for ``config.epochs`` epochs; returns the history, one metrics dict per epoch.

        Each dict holds epoch, step, lr, train_loss, train_accuracy, samples_per_s, time_s and,
        with ``val_dataset``, val_loss / val_accuracy (and val_ema_* with EMA). ``resume``
        (default ``config.resume``) continues from ``out_dir/last.pt`` when it exists.
        """
        cfg = self.config
        resume = cfg.resume if resume is None else resume
        with _deterministic_algorithms(cfg.deterministic), torch_threads(cfg.num_threads), \
                _deferred_interrupt() as interrupted:
            return self._fit(train_dataset, val_dataset, resume, interrupted)

    def _fit(self, train_dataset: Dataset, val_dataset: Dataset | None, resume: bool,
             interrupted: Callable[[], bool]) -> list[dict[str, Any]]:
        cfg = self.config
        seed_everything(cfg.seed + self.dist.rank)
        mixing = cfg.mixup > 0 or cfg.cutmix > 0
        sampler = ResumableDistributedSampler(train_dataset, num_replicas=self.dist.world_size, rank=self.dist.rank,
                                              seed=cfg.seed)
        per_rank = sampler.num_samples
        steps_per_epoch = per_rank // cfg.batch_size if mixing else math.ceil(per_rank / cfg.batch_size)
        if steps_per_epoch == 0:
            raise ConfigError(f"{per_rank} samples per process is fewer than one batch of {cfg.batch_size} "
                              "(Mixup/CutMix drop incomplete batches); lower batch_size")
        self._build_optimizer(steps_per_epoch)
        if cfg.ema_decay is not None:
            from timm.utils import ModelEmaV3

            self.ema = ModelEmaV3(self.model, decay=cfg.ema_decay)
        mixup_fn = None
        if mixing:
            from timm.data import Mixup

            mixup_fn = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.label_smoothing,
                             num_classes=self._num_classes())
        scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        start_epoch, start_batch, progress, rng = 0, 0, {}, None
        checkpoint_path = self.out_dir / "last.pt" if self.out_dir is not None else None
        if resume and checkpoint_path is not None and checkpoint_path.exists():
            start_epoch, start_batch, progress, rng = self._restore(scaler)
        elif resume and self.dist.is_main:
            why = f"no checkpoint at {checkpoint_path}" if checkpoint_path is not None else \
                "nothing to resume from without a run directory (--out / out_dir)"
            print(f"polynets: {why}; starting from scratch", file=sys.stderr)
        log = None
        if self.out_dir is not None and self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            run = {"model_name": self.model_name, "model_kwargs": self.model_kwargs, "config": dataclasses.asdict(cfg),
                   "run_info": self.run_info, "device": str(self.device), "world_size": self.dist.world_size,
                   "amp": str(self.amp_dtype) if self.amp_dtype else None}
            atomic_write_bytes(self.out_dir / "run.json", (json.dumps(run, indent=2) + "\n").encode())
            log = MetricsLog(self.out_dir / "metrics.jsonl",
                              keep_until_step=self.global_step if start_epoch or start_batch else None)
        net: nn.Module = self.model
        if self.dist.enabled:
            net = nn.parallel.DistributedDataParallel(
                net, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if cfg.compile:
            net = torch.compile(net)
        if rng is not None:
            if self.dist.is_main:
                restore_rng_state(rng)
            else:
                seed_everything(cfg.seed + 7919 * self.dist.rank + self.global_step)
        loss_fn = self._train_loss(mixing)
        best = max((h.get("val_accuracy", -1.0) for h in self.history), default=-1.0)
        for epoch in range(start_epoch, cfg.epochs):
            record = self._train_epoch(net, train_dataset, sampler, epoch, start_batch, steps_per_epoch, progress,
                                       loss_fn, mixup_fn, scaler, log, interrupted)
            start_batch, progress = 0, {}
            if self.dist.enabled:  # running statistics (BatchNorm) follow rank 0, as DDP's next forward would
                for buffer in self.model.buffers():
                    dist.broadcast(buffer, src=0)
            if val_dataset is not None:
                record.update({f"val_{k}": v for k, v in self.evaluate(val_dataset).items()})
                if self.ema is not None:
                    record.update({f"val_ema_{k}": v for k, v in self.evaluate(val_dataset, model=self.ema.module).items()})
            self.history.append(record)
            if log is not None:
                log.write(record)
            if self.dist.is_main and cfg.progress:
                shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
                                  if k != "kind")
                tqdm.write(shown, file=sys.stderr)
            last = epoch + 1 == cfg.epochs
            if (epoch + 1) % cfg.checkpoint_every == 0 or last:
                self._checkpoint("last.pt", epoch=epoch + 1, batch=0, progress={}, scaler=scaler)
            if record.get("val_accuracy", -1.0) > best:
                best = record["val_accuracy"]
                self._checkpoint("best.pt", epoch=epoch + 1, batch=0, progress={}, scaler=scaler)
        return self.history

    def _train_epoch(self, net: nn.Module, dataset: Dataset, sampler: ResumableDistributedSampler, epoch: int,
                     start_batch: int, steps_per_epoch: int, progress: Mapping[str, float], loss_fn: LossFn,
                     mixup_fn: Any, scaler: Any, log: MetricsLog | None,
                     interrupted: Callable[[], bool]) -> dict[str, Any]:
        cfg = self.config
        assert self.optimizer is not None and self.scheduler is not None
        sampler.set_epoch(epoch)
        sampler.start_index = start_batch * cfg.batch_size
        loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                            pin_memory=self.device.type == "cuda", drop_last=mixup_fn is not None,
                            generator=torch.Generator().manual_seed(cfg.seed * 100003 + epoch))
        net.train()
        # loss sum and correct count on the device (no per-step sync), sample counts on the host; the sums
        # of steps done before an interruption are all-reduced totals, carried by rank 0 only
        restored = [progress.get(k, 0.0) if self.dist.is_main else 0.0 for k in ("loss_sum", "correct", "seen")]
        sums = torch.tensor(restored[:2], dtype=torch.float64, device=self.device)
        seen, restored_total = restored[2], float(progress.get("seen", 0.0))
        check_every = cfg.log_every if self.device.type == "cuda" else 1
        pending: list[tuple[int, int, torch.Tensor]] = []
        window_loss, window_seen = torch.zeros((), dtype=torch.float64, device=self.device), 0
        t0 = t_log = time.perf_counter()
        bar = tqdm(total=steps_per_epoch, initial=start_batch, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                   disable=not (cfg.progress and self.dist.is_main), leave=False, dynamic_ncols=True, file=sys.stderr)
        try:
            for batch, (x, y) in enumerate(loader, start=start_batch):
                x, y = self._to_device(x, y)
                if mixup_fn is not None and x.ndim != 4:
                    raise ConfigError(f"Mixup/CutMix apply to images (B, C, H, W); this dataset gives {tuple(x.shape)}")
                target = y
                if mixup_fn is not None:
                    x, target = mixup_fn(x, y)
                with self._autocast():
                    logits = net(x)
                    loss = loss_fn(logits, target)
                self.optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if cfg.clip_grad is not None:
                    scaler.unscale_(self.optimizer)
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
                scaler.step(self.optimizer)
                scaler.update()
                self.global_step += 1
                self.scheduler.step_update(self.global_step)
                if self.ema is not None:
                    self.ema.update(self.model, step=self.global_step)
                n = y.shape[0]
                lv = loss.detach().double()
                sums += torch.stack([lv * n, (logits.detach().argmax(-1) == y).sum().double()])
                window_loss += lv * n
                seen, window_seen = seen + n, window_seen + n
                pending.append((self.global_step, batch, lv))
                bar.update(1)
                if len(pending) >= check_every or batch + 1 == steps_per_epoch:
                    values = torch.stack([p[2] for p in pending]).cpu()
                    bad = (~torch.isfinite(values)).nonzero()
                    if len(bad):
                        step, bad_batch, _ = pending[int(bad[0])]
                        raise self._diverged(float(values[int(bad[0])]), step, epoch, bad_batch)
                    pending.clear()
                if self.global_step % cfg.log_every == 0:
                    now = time.perf_counter()
                    rate = window_seen * self.dist.world_size / max(now - t_log, 1e-9)
                    mean_loss, correct = window_loss.item() / window_seen, sums[1].item()
                    bar.set_postfix(loss=f"{mean_loss:.4f}", acc=f"{correct / max(seen, 1.0):.3f}",
                                    samples_s=f"{rate:.0f}")
                    if log is not None:
                        log.write({"kind": "step", "epoch": epoch + 1, "step": self.global_step, "loss": mean_loss,
                                   "lr": self._lr(), "samples_per_s": rate})
                    window_loss.zero_()
                    window_seen, t_log = 0, now
                if self._stop_requested(interrupted):
                    total = self._reduced(sums, seen)
                    saved = self._checkpoint("last.pt", epoch=epoch, batch=batch + 1, scaler=scaler,
                                             progress={"loss_sum": total[0], "correct": total[1], "seen": total[2]})
                    where = f"saved {saved}" if saved is not None else "no out_dir, nothing saved"
                    tqdm.write(f"interrupted after step {self.global_step}: {where}; continue with resume=True",
                               file=sys.stderr)
                    raise KeyboardInterrupt
        finally:
            bar.close()
        elapsed = time.perf_counter() - t0
        loss_sum, correct, total_seen = self._reduced(sums, seen)
        return {"kind": "epoch", "epoch": epoch + 1, "step": self.global_step,
                "lr": self._lr(), "train_loss": loss_sum / max(total_seen, 1.0),
                "train_accuracy": correct / max(total_seen, 1.0),
                "samples_per_s": (total_seen - restored_total) / max(elapsed, 1e-9), "time_s": elapsed}

    def _reduced(self, sums: torch.Tensor, seen: float) -> list[float]:
        """[loss sum, correct, seen] summed over all ranks."""
        total = torch.cat([sums, torch.tensor([seen], dtype=torch.float64).to(self.device)])
        if self.dist.enabled:
            dist.all_reduce(total)
        return total.tolist()

    def _stop_requested(self, interrupted: Callable[[], bool]) -> bool:
        """True once Ctrl-C was pressed on any rank (ranks agree every log_every steps under DDP)."""
        if not self.dist.enabled:
            return interrupted()
        if self.global_step % self.config.log_every:
            return False
        flag = torch.tensor([float(interrupted())], device=self.device)
        dist.all_reduce(flag)
        return bool(flag.item())

    @torch.no_grad()
    def evaluate(self, dataset: Dataset, *, model: nn.Module | None = None,
                 batch_size: int | None = None) -> dict[str, float]:
        """Mean loss and accuracy of ``model`` (default: the trained model) on ``dataset``.

        Under DDP each rank evaluates every world_size-th sample and the sums are all-reduced.
        """
        model = model if model is not None else self.model
        if self.dist.enabled:
            dataset = Subset(dataset, range(self.dist.rank, len(dataset), self.dist.world_size))
        loader = DataLoader(dataset, batch_size=batch_size or self.config.batch_size, shuffle=False,
                            num_workers=self.config.num_workers, pin_memory=self.device.type == "cuda")
        loss_fn = self.loss_fn if self.loss_fn is not None else nn.CrossEntropyLoss()
        was_training = model.training
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        try:
            for x, y in loader:
                x, y = self._to_device(x, y)
                with self._autocast():
                    logits = model(x)
                    loss = loss_fn(logits, y)
                n = y.shape[0]
                sums += torch.stack([loss.detach().double() * n, (logits.argmax(-1) == y).sum().double(),
                                     torch.tensor(float(n), dtype=torch.float64, device=self.device)])
        finally:
            model.train(was_training)
        if self.dist.enabled:
            dist.all_reduce(sums)
        loss_sum, correct, seen = sums.tolist()
        if seen == 0:
            raise ConfigError("cannot evaluate on an empty dataset")
        return {"loss": loss_sum / seen, "accuracy": correct / seen}
