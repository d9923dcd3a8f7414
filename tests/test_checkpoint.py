"""Checkpoints: round trip, atomic writes, safe loading, clear errors for corrupted and foreign files."""

from __future__ import annotations

import itertools
import os
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn

import polynets as pn
from polynets.training.checkpoint import (capture_rng_state, load_checkpoint, load_model, register_model, restore_rng_state,
                                 save_checkpoint)
from polynets.errors import CheckpointError, ConfigError

KWARGS = dict(img_size=8, in_chans=1, num_classes=10, patch_size=2, embed_dim=16, depth=1)


@register_model("test_tiny_classifier")
def tiny_classifier(in_features: int = 4, num_classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, 8), nn.Linear(8, num_classes))


@pytest.fixture
def monet_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = pn.MONet(**KWARGS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path / "ckpt.pt", model=model, model_name="monet", model_kwargs=KWARGS,
                           optimizer=optimizer, epoch=3, step=42, extra={"note": "hello", "t": torch.arange(3)})
    return model, path


def test_load_model_rebuilds_monet_with_identical_outputs(monet_checkpoint):
    model, path = monet_checkpoint
    rebuilt = load_model(path)
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(model.eval()(x), rebuilt(x))
    ckpt = load_checkpoint(path)
    assert (ckpt["epoch"], ckpt["step"], ckpt["extra"]["note"]) == (3, 42, "hello")
    assert torch.equal(ckpt["extra"]["t"], torch.arange(3))
    assert ckpt["optimizer"]["state"], "optimizer moments are stored"


def test_registered_builder_and_timm_names_rebuild(tmp_path):
    model = tiny_classifier(in_features=5)
    save_checkpoint(tmp_path / "a.pt", model=model, model_name="test_tiny_classifier",
                    model_kwargs={"in_features": 5})
    assert torch.equal(load_model(tmp_path / "a.pt")[0].weight, model[0].weight)
    import timm

    timm_model = timm.create_model("monet_t", num_classes=7, img_size=28, in_chans=3)
    save_checkpoint(tmp_path / "b.pt", model=timm_model, model_name="monet_t",
                    model_kwargs={"num_classes": 7, "img_size": 28, "in_chans": 3})
    assert load_model(tmp_path / "b.pt").head.out_features == 7


def test_ddp_style_wrappers_are_unwrapped_when_saving(tmp_path):
    inner = tiny_classifier()
    wrapped = nn.DataParallel(inner)
    save_checkpoint(tmp_path / "w.pt", model=wrapped, model_name="test_tiny_classifier")
    assert set(load_checkpoint(tmp_path / "w.pt")["model"]) == set(inner.state_dict())


def test_truncated_checkpoint_is_reported_as_corrupted(monet_checkpoint, tmp_path):
    _, path = monet_checkpoint
    data = path.read_bytes()
    broken = tmp_path / "broken.pt"
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_checkpoint(broken)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all" * 10)
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_model(garbage)


def test_foreign_checkpoints_are_rejected_with_a_hint(tmp_path):
    state = tmp_path / "state_dict.pt"
    torch.save(tiny_classifier().state_dict(), state)
    with pytest.raises(CheckpointError, match="not a polynets checkpoint.*bare state_dict"):
        load_checkpoint(state)


class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickled_objects_are_refused_without_running_them(tmp_path, capsys):
    evil = tmp_path / "evil.pt"
    torch.save({"format": "polynets-checkpoint", "payload": Payload()}, evil)
    with pytest.raises(CheckpointError, match="Python object .*print.*refusing to unpickle"):
        load_checkpoint(evil)
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError):
        load_checkpoint(raw)
    assert "this must never run" not in capsys.readouterr().out


def test_missing_file_and_mismatched_weights_messages(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    save_checkpoint(tmp_path / "m.pt", model=tiny_classifier(in_features=4), model_name="test_tiny_classifier",
                    model_kwargs={"in_features": 6})
    with pytest.raises(CheckpointError, match="do not fit"):
        load_model(tmp_path / "m.pt")


def test_non_json_model_kwargs_and_objects_in_extra_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="JSON-able"):
        save_checkpoint(tmp_path / "k.pt", model=tiny_classifier(), model_name="x", model_kwargs={"f": object()})
    with pytest.raises(ConfigError, match="only tensors and JSON-able"):
        save_checkpoint(tmp_path / "e.pt", model=tiny_classifier(), model_name="x", extra={"f": {1, 2}})
    assert list(tmp_path.iterdir()) == []


def test_overwriting_is_atomic_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "last.pt"
    for step in range(3):
        save_checkpoint(path, model=tiny_classifier(), model_name="test_tiny_classifier", step=step)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"], "no temporary files are left"
    assert load_checkpoint(path)["step"] == 2


def test_rng_state_round_trip_reproduces_all_generators():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    state = capture_rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(7), random.random()
    restore_rng_state(state)
    second = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], second[0])
    assert np.array_equal(first[1], second[1]) and first[2] == second[2]


# ---------------------------------------------------------------------------- untrusted files
def _forge(path, ckpt: dict, **changes) -> None:
    """A checkpoint with ``changes`` whose digest is recomputed, as a deliberate editor would."""
    from polynets.training.checkpoint import _payload_digest

    payload = {**ckpt, **changes}
    payload["digest"] = _payload_digest(payload)
    torch.save(payload, path)


def _flipped(data: bytes, byte: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[byte] ^= 1 << bit
    return bytes(out)


def _fuzz(path, tmp_path, positions) -> tuple[int, int]:
    """Load every single-bit flip / truncation; each must fail with CheckpointError or load the
    very same checkpoint (a flip in zip padding nothing reads)."""
    from polynets.training.checkpoint import _payload_digest

    data = path.read_bytes()
    reference = _payload_digest(load_checkpoint(path))
    target, refused, same = tmp_path / "mutated.pt", 0, 0
    for mutated in positions(data):
        target.write_bytes(mutated)
        try:
            ckpt = load_checkpoint(target)
        except CheckpointError:
            refused += 1
            continue
        assert _payload_digest(ckpt) == reference, "a corrupted checkpoint loaded different contents"
        same += 1
    return refused, same


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_flipped_bits_and_truncations_are_refused_never_loaded_as_other_weights(tmp_path):
    torch.manual_seed(0)
    path = save_checkpoint(tmp_path / "c.pt", model=tiny_classifier(), model_name="test_tiny_classifier",
                           model_kwargs={"in_features": 4}, rng=False)
    refused, same = _fuzz(path, tmp_path, lambda d: itertools.chain(
        (_flipped(d, i, i % 8) for i in range(0, len(d), 3)), (d[:cut] for cut in range(0, len(d), 17))))
    assert refused > 400 and refused + same > 1000


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_every_bit_flip_and_truncation_of_a_checkpoint_is_refused_or_harmless(monet_checkpoint, tmp_path):
    torch.manual_seed(0)
    small = save_checkpoint(tmp_path / "small.pt", model=tiny_classifier(), model_name="test_tiny_classifier",
                            model_kwargs={"in_features": 4}, rng=False)
    refused, _ = _fuzz(small, tmp_path, lambda d: itertools.chain(
        (_flipped(d, i // 8, i % 8) for i in range(0, 8 * len(d), 2)), (d[:cut] for cut in range(len(d)))))
    assert refused > 3000
    _, path = monet_checkpoint
    refused, _ = _fuzz(path, tmp_path, lambda d: itertools.chain(
        (_flipped(d, i // 8, i % 8) for i in range(0, 8 * len(d), 997)), (d[:cut] for cut in range(0, len(d), 499))))
    assert refused > 500


def test_edited_tensors_are_refused_by_the_digest(monet_checkpoint, tmp_path):
    _, path = monet_checkpoint
    ckpt = load_checkpoint(path)
    name = next(iter(ckpt["model"]))
    ckpt["model"][name] = ckpt["model"][name] + 1e-3
    torch.save(ckpt, tmp_path / "edited.pt")
    with pytest.raises(CheckpointError, match="do not match the digest"):
        load_checkpoint(tmp_path / "edited.pt")
    del ckpt["digest"]
    torch.save(ckpt, tmp_path / "stripped.pt")
    with pytest.raises(CheckpointError, match="digest"):
        load_checkpoint(tmp_path / "stripped.pt")


def test_version_1_checkpoints_without_a_digest_still_load(monet_checkpoint, tmp_path):
    model, path = monet_checkpoint
    ckpt = load_checkpoint(path)
    del ckpt["digest"]
    torch.save({**ckpt, "version": 1}, tmp_path / "v1.pt")
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(load_model(tmp_path / "v1.pt")(x), model.eval()(x))
    _forge(tmp_path / "v3.pt", ckpt, version=3)
    with pytest.raises(CheckpointError, match="version 3"):
        load_checkpoint(tmp_path / "v3.pt")


@pytest.mark.parametrize("kwargs, message", [
    ([1, 2], "JSON object"),
    ("embed_dim=64", "JSON object"),
    ({"embed_dim": 200000}, "parameters and buffers"),
    ({"depth": 10 ** 9}, "out of range"),
    ({"embed_dim": float("inf")}, "finite"),
    ({"embed_dim": "x" * 5000}, "characters"),
    ({"embed_dim": {"a": [[[[1]]]]}}, "number, string"),
    ({"not an identifier": 1}, "not an argument name"),
    ({"embed_dim": torch.zeros(3)}, "number, string"),
    ({"no_such_argument": 1}, "does not accept"),
    ({"patch_size": 3}, "cannot rebuild model .monet.: img_size"),
])
def test_model_kwargs_are_validated_before_anything_is_built(monet_checkpoint, tmp_path, kwargs, message):
    _, path = monet_checkpoint
    ckpt = load_checkpoint(path)
    merged = {**KWARGS, **kwargs} if isinstance(kwargs, dict) else kwargs
    _forge(tmp_path / "k.pt", ckpt, model_kwargs=merged)
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "k.pt")


def test_wrong_types_in_a_checkpoint_are_checkpoint_errors(monet_checkpoint, tmp_path):
    _, path = monet_checkpoint
    ckpt = load_checkpoint(path)
    for changes in ({"model_name": 5}, {"model": [1, 2]}, {"model": {"w": 3}}, {"extra": [1]}):
        _forge(tmp_path / "t.pt", ckpt, **changes)
        with pytest.raises(CheckpointError):
            load_model(tmp_path / "t.pt")


def test_directories_fifos_and_devices_are_not_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_checkpoint(tmp_path / "fifo")
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_checkpoint("/dev/zero")
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        load_checkpoint(tmp_path / "f" / "last.pt")


def test_build_model_refuses_sizes_that_would_exhaust_memory():
    import time

    start = time.perf_counter()
    with pytest.raises(ConfigError, match="parameters and buffers"):
        pn.checkpoint.build_model("monet", **{**KWARGS, "embed_dim": 200000})
    assert time.perf_counter() - start < 5
    assert sum(p.numel() for p in pn.checkpoint.build_model("monet", **KWARGS).parameters()) > 0
