"""``precision_bits="argmax"``: the output precision of a classifier chosen from the gaps between
its two largest outputs on the calibration data, with real SEAL contexts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import he
from he.compiler import ARGMAX_QUANTILE, argmax_precision
from _models import Square


def test_bits_keep_the_promise_below_half_the_gap_of_all_but_the_quantile():
    rng = np.random.default_rng(0)
    out = rng.normal(size=(1000, 10))
    out[:, 3] += 4.0                    # a confident classifier: class 3 ahead by ~4
    bits, why = argmax_precision(out, output_abs=float(np.abs(out).max()))
    top = np.sort(out, axis=1)
    gaps = top[:, -1] - top[:, -2]
    promise = float(np.abs(out).max()) * 2.0 ** -bits
    # the promise is below half the gap of at least 1 - quantile of the samples ...
    assert np.mean(gaps > 2 * promise) >= 1 - ARGMAX_QUANTILE - 1e-12
    # ... and one bit fewer would not be
    assert np.mean(gaps > 4 * promise) < 1 - ARGMAX_QUANTILE
    assert f"{bits} bits" in why and "99%" in why


def test_closer_calls_need_more_bits():
    rng = np.random.default_rng(1)
    base = rng.normal(size=(500, 5))
    wide = base.copy()
    wide[:, 0] += 10.0
    narrow = base.copy()
    narrow[:, 0] += np.sort(base, axis=1)[:, -1] - base[:, 0] + 1e-3   # near-ties
    b_wide, _ = argmax_precision(wide, float(np.abs(wide).max()))
    b_narrow, _ = argmax_precision(narrow, float(np.abs(narrow).max()))
    assert b_narrow > b_wide


@pytest.mark.parametrize("out, message", [
    (np.zeros((40,)), r"shape \(B, classes\)"),
    (np.zeros((40, 1)), "at least two"),
    (np.ones((40, 3)), "tied"),
    (np.eye(3)[:2], "at least 20 samples"),
])
def test_outputs_that_are_not_scores_are_refused(out, message):
    with pytest.raises(he.NotEncryptableError, match=message):
        argmax_precision(out, 1.0)


def test_bits_are_clamped_to_the_compilers_range():
    out = np.tile([[0.0, 1e-30], [1.0, 1.0 + 1e-30]], (10, 1))
    bits, _ = argmax_precision(out, 1.0)
    assert bits == 40
    out = np.tile([[0.0, 100.0], [100.0, 0.0]], (10, 1))
    assert argmax_precision(out, 1.0)[0] == 1


def test_one_example_is_not_enough_calibration(classifier):
    model, x = classifier
    with pytest.raises(he.NotEncryptableError, match="at least 20 samples"):
        he.compile(model, x[:1], precision_bits="argmax")


@pytest.fixture(scope="module")
def classifier() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Square(), nn.Linear(8, 4)).eval()
    return model, torch.randn(64, 6)


@pytest.mark.parametrize("packing", ["vector", "batch"])
def test_argmax_precision_compiles_smaller_and_keeps_the_classes(classifier, packing):
    model, x = classifier
    fine = he.compile(model, x, calibration=x, packing=packing)
    prog = he.compile(model, x, calibration=x, packing=packing, precision_bits="argmax")
    bits = prog.options["precision_bits"]
    assert isinstance(bits, int) and 1 <= bits <= 40
    assert prog.options["precision"].startswith(f"precision_bits='argmax': {bits} bits")
    assert "precision: precision_bits='argmax'" in prog.summary()
    assert prog.params.scale_bits <= fine.params.scale_bits
    with torch.no_grad():
        ref = model(x).double().numpy()
    top = np.sort(ref, axis=1)
    assert prog.params.expected_error <= float(np.abs(ref).max()) * 2.0 ** -bits * (1 + 1e-9)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    y = client.decrypt(server.run(client.encrypt(x).to_bytes()))
    assert np.max(np.abs(y - prog.simulate(x))) <= prog.params.expected_error
    gaps = top[:, -1] - top[:, -2]
    clear = gaps > 2 * prog.params.expected_error
    # every sample at least as far from a tie as the quantile the rule reads is clear
    assert clear[gaps >= np.quantile(gaps[gaps > 0], ARGMAX_QUANTILE)].all()
    assert clear.mean() >= 0.95
    assert np.array_equal(y[clear].argmax(1), ref[clear].argmax(1))
    # the rule is part of the compiled program (and its fingerprint) and survives a round trip
    again = he.CompiledProgram.from_bytes(prog.to_bytes())
    assert again.options["precision"] == prog.options["precision"]


@pytest.mark.parametrize("bad", ["fast", 0, 41, 2.5, True])
def test_other_precision_settings_are_refused(classifier, bad):
    model, x = classifier
    with pytest.raises(he.NotEncryptableError, match="precision_bits must be an int in "
                                                     r"\[1, 40\] or 'argmax'"):
        he.compile(model, x, precision_bits=bad)


def test_argmax_precision_needs_a_vector_of_scores():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Square(), nn.Linear(4, 1)).eval()
    with pytest.raises(he.NotEncryptableError, match="at least two classes"):
        he.compile(model, torch.randn(8, 3), precision_bits="argmax")


def test_cli_compile_accepts_argmax(tmp_path, classifier):
    from polynets.cli import main
    from polynets.training.checkpoint import save_checkpoint

    kwargs = {"img_size": 4, "in_chans": 1, "num_classes": 3, "patch_size": 2, "embed": "patch",
              "embed_dim": 4, "depth": 1, "expansion": 1, "shrinkage": 2, "norm": "batch"}
    import polynets as pn

    model = pn.MONet(**kwargs)
    save_checkpoint(tmp_path / "m.pt", model=model, model_name="monet", model_kwargs=kwargs)
    np.save(tmp_path / "cal.npy", np.random.default_rng(0).random((32, 1, 4, 4)))
    assert main(["compile", str(tmp_path / "m.pt"), "--calibration", str(tmp_path / "cal.npy"),
                 "--precision-bits", "argmax", "-o", str(tmp_path / "m.he")]) == 0
    prog = he.load_program(tmp_path / "m.he")
    assert prog.options["precision"].startswith("precision_bits='argmax'")
    assert not math.isnan(prog.params.expected_error)
    with pytest.raises(SystemExit):
        main(["compile", str(tmp_path / "m.pt"), "--calibration", str(tmp_path / "cal.npy"),
              "--precision-bits", "many", "-o", str(tmp_path / "x.he")])
