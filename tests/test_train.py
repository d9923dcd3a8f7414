"""Trainer behaviour: learning, exact resume after interruption, divergence, metrics log, plots."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import Subset

import polynets as pn
from polynets.data import load_dataset
from polynets.device import autocast_dtype, select_device
from polynets.errors import ConfigError, TrainingDivergedError
from polynets.train import TrainConfig, Trainer, warmup_cosine

MONET_KWARGS = dict(img_size=8, in_chans=1, num_classes=10, patch_size=2, embed_dim=16, depth=1)


@pytest.fixture(scope="module")
def digits():
    train, test, info = load_dataset("digits", seed=0)
    return Subset(train, range(320)), Subset(test, range(128)), info


def small_monet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return pn.MONet(**MONET_KWARGS)


def config(tmp_path, **overrides) -> TrainConfig:
    base = dict(epochs=2, batch_size=32, lr=3e-3, warmup_epochs=0.5, device="cpu", progress=False,
                deterministic=True, out_dir=str(tmp_path), log_every=4, seed=3)
    base.update(overrides)
    return TrainConfig(**base)


class InterruptAfter:
    """Cross-entropy that sends this process SIGINT (Ctrl-C) during its n-th call, mid-step."""

    def __init__(self, calls: int) -> None:
        self.calls, self.count = calls, 0

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.count += 1
        if self.count == self.calls:
            os.kill(os.getpid(), signal.SIGINT)
        return nn.functional.cross_entropy(logits, target)


def test_small_monet_learns_digits(tmp_path, digits):
    train, test, _ = digits
    trainer = Trainer(small_monet(), config(tmp_path, epochs=3), model_name="monet", model_kwargs=MONET_KWARGS)
    history = trainer.fit(train, test)
    assert len(history) == 3
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_accuracy"] > 0.5
    assert trainer.evaluate(test)["accuracy"] == pytest.approx(history[-1]["val_accuracy"])


def test_resume_after_interrupt_gives_identical_weights_and_history(tmp_path, digits):
    train, test, _ = digits
    full = Trainer(small_monet(), config(tmp_path / "full", epochs=3), model_name="monet",
                   model_kwargs=MONET_KWARGS, loss_fn=nn.functional.cross_entropy)
    expected_history = full.fit(train, test)

    run = tmp_path / "interrupted"
    interrupted = Trainer(small_monet(), config(run, epochs=3), model_name="monet", model_kwargs=MONET_KWARGS,
                          loss_fn=InterruptAfter(calls=16))  # 10 steps per epoch: stops in epoch 2
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(train, test)
    assert (run / "last.pt").exists()

    resumed = Trainer(small_monet(seed=99), config(run, epochs=3), model_name="monet", model_kwargs=MONET_KWARGS,
                      loss_fn=nn.functional.cross_entropy)
    history = resumed.fit(train, test, resume=True)

    for name, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    assert resumed.global_step == full.global_step == 30
    for got, want in zip(history, expected_history, strict=True):
        for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr", "step"):
            assert got[key] == want[key], key
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps), "the log keeps no records from beyond the checkpoint"


def test_non_finite_loss_raises_with_remedies(tmp_path, digits):
    train, _, _ = digits

    def exploding(logits, target):
        return nn.functional.cross_entropy(logits, target) * float("inf")

    trainer = Trainer(small_monet(), config(tmp_path, epochs=1), loss_fn=exploding)
    with pytest.raises(TrainingDivergedError) as err:
        trainer.fit(train)
    message = str(err.value)
    assert "step 1 (epoch 1, batch 1)" in message
    for remedy in ("learning rate", "clip_grad", "norm='batch'"):
        assert remedy in message


def test_metrics_log_has_step_and_epoch_records(tmp_path, digits):
    train, test, _ = digits
    Trainer(small_monet(), config(tmp_path, epochs=2)).fit(train, test)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert {"train_loss", "train_accuracy", "val_loss", "val_accuracy", "samples_per_s"} <= set(epochs[0])
    assert [r["step"] for r in steps] == [4, 8, 12, 16, 20]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["config"]["epochs"] == 2 and run["device"] == "cpu"


def test_plot_run_writes_png(tmp_path, digits):
    from polynets.plot import plot_run

    train, test, _ = digits
    Trainer(small_monet(), config(tmp_path, epochs=2)).fit(train, test)
    out = plot_run(tmp_path, tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ema_and_mixup_run_and_report_ema_accuracy(tmp_path, digits):
    train, test, _ = digits
    cfg = config(tmp_path, epochs=1, ema_decay=0.9, mixup=0.2, cutmix=0.5, label_smoothing=0.1, clip_grad=1.0)
    history = Trainer(small_monet(), cfg).fit(train, test)
    assert 0.0 <= history[0]["val_ema_accuracy"] <= 1.0
    assert history[0]["step"] == 10  # 320 samples, batches of 32, incomplete batches dropped


def test_mixup_on_sequences_is_rejected(tmp_path):
    train, _, _ = load_dataset("digits_rows")
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    with pytest.raises(ConfigError, match="images"):
        Trainer(model, config(tmp_path, epochs=1, mixup=0.2, num_classes=10)).fit(Subset(train, range(64)))


def test_plain_module_trains_on_tabular_data(tmp_path):
    train, test, info = load_dataset("wine")
    model = nn.Sequential(nn.Linear(info.in_features, 16), nn.BatchNorm1d(16), nn.Linear(16, info.num_classes))
    history = Trainer(model, config(tmp_path, epochs=4, batch_size=16, out_dir=None)).fit(train, test)
    assert history[-1]["val_accuracy"] > 0.8


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="min_lr"):
        TrainConfig(lr=1e-4, min_lr=1e-3)


def test_warmup_cosine_schedule_shape():
    factors = [warmup_cosine(s, warmup_steps=4, total_steps=20, min_ratio=0.1) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))
    assert math.isclose(warmup_cosine(20, warmup_steps=4, total_steps=20, min_ratio=0.1), 0.1)


def test_auto_device_is_cpu_without_accelerators():
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert select_device("auto") == torch.device("cpu")
    assert select_device("cpu") == torch.device("cpu")
    assert select_device(torch.device("cpu")) == torch.device("cpu")


def test_auto_prefers_cuda_then_mps(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert select_device("auto") == torch.device("cuda")
    assert select_device("cuda") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert select_device("auto") == torch.device("cpu")


def test_unavailable_or_unknown_devices_raise_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    for name in ("cuda", "cuda:1", "mps"):
        with pytest.raises(ConfigError, match="not available"):
            select_device(name)
    with pytest.raises(ConfigError, match="unknown device"):
        select_device("tpu-ish")


def test_autocast_only_on_cuda():
    cpu = torch.device("cpu")
    assert autocast_dtype(cpu, "auto") is None and autocast_dtype(cpu, "off") is None
    assert autocast_dtype(torch.device("cuda"), "fp16") == torch.float16
    assert autocast_dtype(torch.device("cuda"), "bf16") == torch.bfloat16
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        autocast_dtype(cpu, "bf16")
    with pytest.raises(ConfigError, match="unknown amp"):
        autocast_dtype(cpu, "fp8")
