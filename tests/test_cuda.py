"""The CUDA training path: mixed precision, channels-last, checkpoints that move between devices,
and models trained on a GPU that still trace to the exact polynomial they compute.

Every test here needs a CUDA device and is skipped without one (the CPU paths are tested in
``test_train.py``, ``test_monet.py`` and the rest).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Subset

import polynets as pn
from polynets.training.data import load_dataset
from polynets.training.device import autocast_dtype, select_device
from polynets.training.train import TrainConfig, Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MONET_KWARGS = dict(img_size=8, in_chans=1, num_classes=10, patch_size=2, embed_dim=32, depth=2,
                    norm="batch")


@pytest.fixture(scope="module")
def digits():
    train, test, info = load_dataset("digits", seed=0)
    return Subset(train, range(1024)), Subset(test, range(256)), info


def _config(tmp_path, **overrides) -> TrainConfig:
    base = dict(epochs=6, batch_size=64, lr=3e-3, warmup_epochs=0.5, device="cuda", amp="auto",
                progress=False, out_dir=str(tmp_path), log_every=8, seed=3)
    base.update(overrides)
    return TrainConfig(**base)


def test_auto_picks_cuda_and_bf16():
    assert select_device("auto").type == "cuda"
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert autocast_dtype(torch.device("cuda"), "auto") == expected
    assert autocast_dtype(torch.device("cuda"), "off") is None


def test_monet_trains_on_cuda_and_its_checkpoint_evaluates_the_same_on_cpu(tmp_path, digits):
    train, test, _ = digits
    torch.manual_seed(0)
    model = pn.MONet(**MONET_KWARGS)
    trainer = Trainer(model, _config(tmp_path), model_name="monet", model_kwargs=MONET_KWARGS)
    history = trainer.fit(train, test)
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_accuracy"] > 0.8
    # the checkpoint written on the GPU rebuilds on the CPU; float32 there against bf16
    # autocast on the GPU: the same accuracy up to a few borderline images
    cpu_model = pn.load_model(tmp_path / "last.pt", map_location="cpu").eval()
    assert next(cpu_model.parameters()).device.type == "cpu"
    cpu = Trainer(cpu_model, _config(tmp_path / "cpu", device="cpu", amp="off"))
    assert cpu.evaluate(test)["accuracy"] == pytest.approx(history[-1]["val_accuracy"], abs=0.03)


def test_cuda_trained_monet_traces_to_its_exact_polynomial(tmp_path, digits):
    train, test, _ = digits
    torch.manual_seed(1)
    model = pn.MONet(**MONET_KWARGS)
    Trainer(model, _config(tmp_path, epochs=2), model_name="monet",
            model_kwargs=MONET_KWARGS).fit(train, test)
    model = model.cpu().eval()
    x = torch.stack([test[i][0] for i in range(16)])
    prog = pn.trace(model, x[:1])
    with torch.no_grad():
        want = model.double()(x.double()).numpy()
    np.testing.assert_allclose(prog.simulate(x.numpy()), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layer", ["pom", "padre"])
def test_bf16_autocast_matches_float32_on_polynomial_mixers(layer):
    """A polynomial layer's forward and backward under bf16 autocast stay within bf16's rounding
    of the float32 result (a degree-2/3 polynomial multiplies relative errors by its degree)."""
    torch.manual_seed(0)
    if layer == "pom":
        net = pn.PoM(dim=64, degree=2, expand=2).cuda()
    else:
        net = pn.PADRe(dim=64, degree=3).cuda()
    shape = (8, 49, 64) if layer == "pom" else (8, 7, 7, 64)
    x = torch.randn(*shape, device="cuda", requires_grad=True)
    ref = net(x)
    (g_ref,) = torch.autograd.grad(ref.square().mean(), x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = net(x)
    (g,) = torch.autograd.grad(out.float().square().mean(), x)
    assert out.dtype == torch.bfloat16
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 5e-2
    assert (g - g_ref).norm() / g_ref.norm() < 1e-1


def test_training_throughput_benchmark_runs_on_cuda(tmp_path):
    import runpy
    import sys

    out = tmp_path / "tp.json"
    argv = sys.argv
    sys.argv = ["training_throughput.py", "--models", "monet_t", "--img-size", "112",
                "--batch-size", "8", "--rounds", "1", "--steps", "1", "--out", str(out)]
    try:
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" /
                           "training_throughput.py"), run_name="__main__")
    finally:
        sys.argv = argv
    import json

    data = json.loads(out.read_text())
    assert data["machine"]["device"] == "cuda"
    assert data["machine"]["amp"] is not None
    assert all(row["images_per_s"] > 0 for s in data["settings"] for row in s["rows"])
