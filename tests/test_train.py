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
from polynets.training.data import load_dataset
from polynets.errors import ConfigError, TrainingDivergedError
from polynets.training.train import TrainConfig, Trainer

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
    from polynets.training.plot import plot_run

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
    with pytest.raises(ConfigError, match="sched must be one of"):
        TrainConfig(sched="plateau")
    with pytest.raises(ConfigError, match="not one of timm's optimizers"):
        TrainConfig(opt="adamx")
    with pytest.raises(ConfigError, match="layer_decay"):
        TrainConfig(layer_decay=1.5)
    for bad in (0, True, "2", 1.5):
        with pytest.raises(ConfigError, match="num_threads must be a positive int or None"):
            TrainConfig(num_threads=bad)


class _ThreadRecorder(nn.Module):
    """A linear classifier that records torch's intra-op thread count at every forward."""

    def __init__(self, d_in: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, classes)
        self.seen: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add(torch.get_num_threads())
        return self.fc(x)


@pytest.mark.parametrize("threads", [1, None])
def test_training_runs_on_the_configured_threads_and_restores_them(tmp_path, threads):
    train, _, info = load_dataset("wine")
    model = _ThreadRecorder(info.in_features, info.num_classes)
    outer = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        Trainer(model, config(tmp_path, epochs=1, batch_size=32, out_dir=None,
                              num_threads=threads)).fit(train)
        assert model.seen == {1 if threads == 1 else 2}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(outer)


class _LrRecorder(nn.Module):
    """Cross-entropy that records the optimizer's learning rate at every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.trainer: Trainer | None = None
        self.lrs: list[float] = []

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.lrs.append(self.trainer.optimizer.param_groups[0]["lr"])
        return nn.functional.cross_entropy(logits, target)


def test_learning_rate_warms_up_linearly_then_follows_a_cosine_to_min_lr(tmp_path, digits):
    train, _, _ = digits
    recorder = _LrRecorder()
    trainer = Trainer(small_monet(), config(tmp_path, epochs=2, warmup_epochs=0.4, lr=1e-2, min_lr=1e-4,
                                            out_dir=None), loss_fn=recorder)
    recorder.trainer = trainer
    trainer.fit(train)
    lrs = recorder.lrs  # 10 steps per epoch: 4 of warm-up, 16 of decay
    assert len(lrs) == 20
    assert lrs[:4] == pytest.approx([1e-4 + k * (1e-2 - 1e-4) / 4 for k in range(4)])
    assert lrs[4] == pytest.approx(1e-2)
    for k in range(16):
        cosine = 1e-4 + (1e-2 - 1e-4) * 0.5 * (1 + math.cos(math.pi * k / 16))
        assert lrs[4 + k] == pytest.approx(cosine)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_optimizer_keeps_biases_norms_and_no_weight_decay_names_out_of_decay(tmp_path, digits):
    from polynets.nn.models.padre_vit import PADReViT

    train, _, _ = digits
    torch.manual_seed(0)
    model = PADReViT(img_size=8, in_chans=1, num_classes=10, patch_size=2, embed_dim=8, depth=1,
                     kernel_size=3)
    trainer = Trainer(model, config(tmp_path, epochs=1, weight_decay=0.1, out_dir=None))
    trainer.fit(Subset(train, range(64)))
    decay = {id(p): g["weight_decay"] for g in trainer.optimizer.param_groups for p in g["params"]}
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert decay[id(model.pos_embed)] == 0.0
    assert decay[id(model.stem.proj.bias)] == 0.0 and decay[id(model.norm.weight)] == 0.0
    assert decay[id(model.stem.proj.weight)] == 0.1 and decay[id(model.head.weight)] == 0.1


def test_opt_and_layer_decay_choose_timm_optimizer_and_per_layer_rates(tmp_path, digits):
    train, _, _ = digits
    trainer = Trainer(small_monet(), config(tmp_path, epochs=1, opt="sgd", layer_decay=0.5, out_dir=None))
    trainer.fit(Subset(train, range(64)))
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    scales = {g["lr_scale"] for g in trainer.optimizer.param_groups}
    rates = {g["lr"] for g in trainer.optimizer.param_groups}
    assert len(scales) > 1 and max(scales) == 1.0
    assert max(rates) == pytest.approx(trainer.history[-1]["lr"])


def test_resume_with_more_epochs_follows_the_longer_schedule(tmp_path, digits):
    train, _, _ = digits
    settings = dict(warmup_epochs=0.0, lr=1e-2, min_lr=1e-4)
    short = Trainer(small_monet(), config(tmp_path, epochs=1, **settings), model_name="monet")
    short.fit(train)
    assert short.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    recorder = _LrRecorder()
    longer = Trainer(small_monet(), config(tmp_path, epochs=2, **settings), model_name="monet", loss_fn=recorder)
    recorder.trainer = longer
    longer.fit(train, resume=True)
    assert len(recorder.lrs) == 10  # only the second epoch runs
    for k, lr in enumerate(recorder.lrs, start=10):
        assert lr == pytest.approx(1e-4 + (1e-2 - 1e-4) * 0.5 * (1 + math.cos(math.pi * k / 20)))
