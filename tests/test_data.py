"""Dataset loaders: built-in sets, idx parsing, directory sets and their missing-file messages."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from polynets.training.data import load_dataset, read_idx
from polynets.errors import DataError

MNIST_DIR = Path("/work/shared/data/mnist")


def test_digits_are_standardised_images_with_a_deterministic_stratified_split():
    train, test, info = load_dataset("digits", seed=0)
    assert (len(train), len(test)) == (1437, 360)
    assert (info.num_classes, info.in_chans, info.img_size, info.kind) == (10, 1, 8, "image")
    x, y = train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    xs = torch.stack([train[i][0] for i in range(len(train))])
    assert abs(xs.mean().item()) < 1e-4 and abs(xs.std().item() - 1) < 1e-3
    again, _, _ = load_dataset("digits", seed=0)
    other, _, _ = load_dataset("digits", seed=1)
    assert torch.equal(again.targets, train.targets)
    assert not torch.equal(other.targets, train.targets)
    assert torch.bincount(test.targets).min() >= 35, "every class is in the test split"
    assert info["num_classes"] == 10 and info.model_kwargs() == {"num_classes": 10, "in_chans": 1, "img_size": 8}


def test_digits_rows_is_a_sequence_of_eight_rows():
    train, _, info = load_dataset("digits_rows")
    image_train, _, _ = load_dataset("digits")
    assert (info.seq_len, info.in_features, info.kind) == (8, 8, "sequence")
    assert train[3][0].shape == (8, 8)
    assert torch.allclose(train[3][0], image_train[3][0][0])


@pytest.mark.parametrize("name, features, classes", [("breast_cancer", 30, 2), ("wine", 13, 3)])
def test_tabular_sets_are_standardised_on_train_statistics(name, features, classes):
    train, test, info = load_dataset(name, test_size=0.25)
    assert (info.in_features, info.num_classes, info.kind) == (features, classes, "tabular")
    xs = torch.stack([train[i][0] for i in range(len(train))])
    assert torch.allclose(xs.mean(0), torch.zeros(features), atol=1e-4)
    assert len(test) == pytest.approx(0.25 * (len(train) + len(test)), abs=1)


def test_mnist_t10k_only_directory_is_parsed_and_split():
    train, test, info = load_dataset("mnist", data_dir=MNIST_DIR, test_size=0.2)
    assert (len(train), len(test)) == (8000, 2000)
    assert (info.in_chans, info.img_size, info.num_classes) == (1, 28, 10)
    images = read_idx(MNIST_DIR / "t10k-images-idx3-ubyte.gz")
    labels = read_idx(MNIST_DIR / "t10k-labels-idx1-ubyte.gz")
    assert images.shape == (10000, 28, 28) and images.dtype == np.uint8 and labels.max() == 9
    x, _ = train[0]
    assert x.shape == (1, 28, 28)


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_uses_train_and_test_files_when_both_exist(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 10)):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    train, test, info = load_dataset("fashion_mnist", data_dir=tmp_path)
    assert (len(train), len(test), info.num_train) == (30, 10, 30)


def test_truncated_idx_file_is_reported(tmp_path):
    data = gzip.decompress((MNIST_DIR / "t10k-labels-idx1-ubyte.gz").read_bytes())
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(data[:500])
    with pytest.raises(DataError, match="truncated"):
        read_idx(tmp_path / "t10k-labels-idx1-ubyte")


def test_missing_data_directory_names_the_expected_files(tmp_path):
    with pytest.raises(DataError, match="does not exist.*t10k-images-idx3-ubyte"):
        load_dataset("mnist", data_dir=tmp_path / "absent")
    with pytest.raises(DataError, match=r"no mnist files in .*train-images-idx3-ubyte\[\.gz\]"):
        load_dataset("mnist", data_dir=tmp_path)
    with pytest.raises(DataError, match="never downloaded.*--data-dir"):
        load_dataset("cifar10")


def test_cifar_requires_the_binary_version(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(DataError, match="binary version: put cifar-10-batches-bin/"):
        load_dataset("cifar10", data_dir=tmp_path)


def test_cifar100_binary_records_are_read(tmp_path):
    base = tmp_path / "cifar-100-binary"
    base.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train.bin", 6), ("test.bin", 4)):
        records = np.concatenate([np.stack([np.full(n, 3), np.arange(n) * 7], 1),
                                  rng.integers(0, 256, (n, 3072))], 1).astype(np.uint8)
        (base / name).write_bytes(records.tobytes())
    train, test, info = load_dataset("cifar100", data_dir=tmp_path)
    assert (info.num_classes, info.in_chans, info.img_size) == (100, 3, 32)
    assert train.targets.tolist() == [0, 7, 14, 21, 28, 35], "fine labels (second byte) are used"
    assert test[0][0].shape == (3, 32, 32)


def test_imagefolder_splits_one_directory(tmp_path):
    from PIL import Image

    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(5):
            Image.new("RGB", (20, 12), color=(i * 40, 10, 200 if cls == "cat" else 0)).save(tmp_path / cls / f"{i}.png")
    train, test, info = load_dataset("imagefolder", data_dir=tmp_path, img_size=16, test_size=0.2)
    assert info.class_names == ["cat", "dog"] and (len(train), len(test)) == (8, 2)
    assert train[0][0].shape == (3, 16, 16)


def test_unknown_dataset_lists_the_choices():
    with pytest.raises(DataError, match="expected one of digits"):
        load_dataset("imagenet")


def _noise_folder(root: Path, classes=("cat", "dog"), per_class: int = 3) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in classes:
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(40, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{i}.png")


def test_imagefolder_training_images_get_timm_augmentation_and_test_images_stay_fixed(tmp_path):
    _noise_folder(tmp_path / "train")
    _noise_folder(tmp_path / "val", per_class=1)
    train, test, info = load_dataset("imagefolder", data_dir=tmp_path, img_size=16)
    steps = [type(t).__name__ for t in train.transform.transforms]
    assert "RandAugment" in steps and "RandomErasing" in steps
    torch.manual_seed(0)
    views = [train[0][0] for _ in range(4)]
    assert views[0].shape == (3, 16, 16)
    assert any(not torch.equal(views[0], v) for v in views[1:])
    assert torch.equal(test[0][0], test[0][0]) and test[0][0].shape == (3, 16, 16)
    assert "RandAugment" not in [type(t).__name__ for t in test.transform.transforms]
    plain, _, _ = load_dataset("imagefolder", data_dir=tmp_path, img_size=16, auto_augment=None, re_prob=0.0)
    steps = [type(t).__name__ for t in plain.transform.transforms]
    assert "RandAugment" not in steps and "RandomErasing" not in steps


def test_imagefolder_rejects_unknown_augmentation_settings(tmp_path):
    _noise_folder(tmp_path)
    with pytest.raises(DataError, match="not a timm augmentation policy"):
        load_dataset("imagefolder", data_dir=tmp_path, img_size=16, auto_augment="foo")
    with pytest.raises(DataError, match="re_prob"):
        load_dataset("imagefolder", data_dir=tmp_path, img_size=16, re_prob=2.0)
