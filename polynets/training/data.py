"""Datasets that never download: scikit-learn's bundled sets and image sets from a local directory.

``load_dataset(name, ...) -> (train_ds, test_ds, info)``. Built in: ``digits`` (8x8 images),
``digits_rows`` (digits as 8 rows of 8 pixels, a sequence task for PoM models),
``breast_cancer`` and ``wine`` (tabular). From ``data_dir``: ``mnist`` and ``fashion_mnist``
(idx or idx.gz), ``cifar10`` / ``cifar100`` (the *binary* releases), ``imagefolder``
(torchvision's ImageFolder layout). Inputs are standardised with statistics of the training split;
``imagefolder`` images go through timm's ``create_transform``: for training a random resized crop,
flip, RandAugment and random erasing (the MONet paper's recipe), for testing a resize and centre
crop, both normalised with ImageNet statistics.
"""

from __future__ import annotations

import gzip
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from polynets.errors import DataError

__all__ = ["ArrayDataset", "DatasetInfo", "DEFAULT_AUTO_AUGMENT", "available_datasets", "load_dataset",
           "read_idx"]

DEFAULT_AUTO_AUGMENT = "rand-m9-mstd0.5-inc1"
"""timm's auto-augment policy for ``imagefolder`` training images: RandAugment, magnitude 9."""


@dataclass
class DatasetInfo:
    """What a model needs to know about a dataset.

    Images: ``in_chans``, ``img_size``; sequences: ``seq_len``, ``in_features`` (per token);
    tabular: ``in_features``. ``mean``/``std`` are the per-channel (or per-feature) statistics
    used to standardise inputs, computed on the training split.
    """

    name: str
    kind: str  # "image", "sequence" or "tabular"
    num_classes: int
    num_train: int
    num_test: int
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    in_chans: int | None = None
    img_size: int | None = None
    seq_len: int | None = None
    in_features: int | None = None
    class_names: list[str] | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input sample (no batch dimension)."""
        if self.kind == "image":
            return (int(self.in_chans), int(self.img_size), int(self.img_size))
        if self.kind == "sequence":
            return (int(self.seq_len), int(self.in_features))
        return (int(self.in_features),)

    def model_kwargs(self) -> dict[str, int]:
        """The size arguments a model for this data takes (num_classes and input geometry)."""
        keys = {"image": ("in_chans", "img_size"), "sequence": ("seq_len", "in_features"), "tabular": ("in_features",)}
        out = {"num_classes": self.num_classes}
        out.update({k: getattr(self, k) for k in keys[self.kind]})
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field."""
        return asdict(self)

    def __getitem__(self, key: str) -> Any:
        """Mapping-style access, ``info["num_classes"]``."""
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)


class ArrayDataset(Dataset):
    """In-memory samples ``x[i]`` (raw, any dtype) returned as ``(x[i] * scale - mean) / std``, label.

    ``x``: (N, *sample_shape); ``mean``/``std`` broadcast against one sample (e.g. (C, 1, 1)).
    Raw uint8 images stay uint8 in memory and are converted per sample.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0, mean: torch.Tensor | float = 0.0,
                 std: torch.Tensor | float = 1.0) -> None:
        if len(x) != len(y):
            raise DataError(f"{len(x)} inputs but {len(y)} labels; expected the same number")
        self.x = x
        self.y = y.long()
        self.scale = float(scale)
        self.mean = torch.as_tensor(mean, dtype=torch.float32)
        self.std = torch.as_tensor(std, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[index].float() * self.scale
        return (x - self.mean) / self.std, self.y[index]

    @property
    def targets(self) -> torch.Tensor:
        """All labels, shape (N,)."""
        return self.y


def _stratified_split(y: np.ndarray, test_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_size < 1.0:
        raise DataError(f"test_size must be in (0, 1), got {test_size}")
    idx = np.arange(len(y))
    train_idx, test_idx = train_test_split(idx, test_size=test_size, random_state=seed, stratify=y)
    return np.sort(train_idx), np.sort(test_idx)


def _channel_stats(x: torch.Tensor, scale: float, channel_dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (unbiased) std of ``x * scale`` per channel, or over everything when channel_dim is None.

    Accumulates float64 sums over chunks of samples, so a uint8 set (e.g. CIFAR) is never copied
    whole to float64.
    """
    dims = [d for d in range(x.ndim) if d != channel_dim]
    total = square = torch.zeros((), dtype=torch.float64)
    for chunk in x.split(4096):
        values = chunk.double() * scale
        total = total + values.sum(dim=dims)
        square = square + (values * values).sum(dim=dims)
    count = x.numel() // (x.shape[channel_dim] if channel_dim is not None else 1)
    mean = total / count
    var = (square - count * mean * mean) / max(count - 1, 1)
    return mean.float(), var.clamp_min(1e-16).sqrt().float()


def _image_sets(name: str, x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor,
                y_test: torch.Tensor, scale: float, num_classes: int,
                class_names: list[str] | None = None) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    """Standardise (N, C, H, W) images per channel with train statistics."""
    mean, std = _channel_stats(x_train, scale, channel_dim=1)
    shape = (-1, 1, 1)
    train = ArrayDataset(x_train, y_train, scale=scale, mean=mean.view(shape), std=std.view(shape))
    test = ArrayDataset(x_test, y_test, scale=scale, mean=mean.view(shape), std=std.view(shape))
    info = DatasetInfo(name=name, kind="image", num_classes=num_classes, num_train=len(train), num_test=len(test),
                       mean=mean.tolist(), std=std.tolist(), in_chans=int(x_train.shape[1]),
                       img_size=int(x_train.shape[-1]), class_names=class_names)
    return train, test, info


def _load_digits(name: str, data_dir: str | os.PathLike | None, seed: int, test_size: float,
                 img_size: int) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.from_numpy(bunch.images.astype(np.float32))  # (N, 8, 8), values 0..16
    y = torch.from_numpy(bunch.target.astype(np.int64))
    tr, te = _stratified_split(bunch.target, test_size, seed)
    scale = 1.0 / 16.0
    if name == "digits":
        return _image_sets(name, x[tr, None], y[tr], x[te, None], y[te], scale, 10,
                           [str(c) for c in bunch.target_names])
    mean, std = _channel_stats(x[tr], scale, channel_dim=None)
    train = ArrayDataset(x[tr], y[tr], scale=scale, mean=mean, std=std)
    test = ArrayDataset(x[te], y[te], scale=scale, mean=mean, std=std)
    info = DatasetInfo(name=name, kind="sequence", num_classes=10, num_train=len(train), num_test=len(test),
                       mean=[float(mean)], std=[float(std)], seq_len=8, in_features=8,
                       class_names=[str(c) for c in bunch.target_names])
    return train, test, info


def _load_tabular(name: str, data_dir: str | os.PathLike | None, seed: int, test_size: float,
                  img_size: int) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    from sklearn import datasets

    bunch = {"breast_cancer": datasets.load_breast_cancer, "wine": datasets.load_wine}[name]()
    tr, te = _stratified_split(bunch.target, test_size, seed)
    x = torch.from_numpy(bunch.data.astype(np.float32))
    y = torch.from_numpy(bunch.target.astype(np.int64))
    mean, std = _channel_stats(x[tr], 1.0, channel_dim=1)
    train = ArrayDataset(x[tr], y[tr], mean=mean, std=std)
    test = ArrayDataset(x[te], y[te], mean=mean, std=std)
    info = DatasetInfo(name=name, kind="tabular", num_classes=int(len(bunch.target_names)), num_train=len(train),
                       num_test=len(test), mean=mean.tolist(), std=std.tolist(), in_features=int(x.shape[1]),
                       class_names=[str(c) for c in bunch.target_names])
    return train, test, info


_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Parse an idx file (MNIST format; ``.gz`` is decompressed): magic 0x0000TTNN, NN big-endian dims."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read idx file {path}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path} is not an idx file (bad magic number {raw[:4].hex()}; expected 0000 08 NN)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path} is truncated: header needs {header} bytes, file has {len(raw)}")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(
            f"{path} is truncated or corrupted: dims {dims} need {expected} data bytes, found {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).copy()


def _find_file(dirs: Sequence[Path], stem: str) -> Path | None:
    for d in dirs:
        for candidate in (d / stem, d / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _require_dir(data_dir: str | os.PathLike | None, name: str, expected: str) -> Path:
    if data_dir is None:
        raise DataError(f"dataset {name!r} is read from a local directory (never downloaded); pass data_dir "
                        f"(--data-dir DIR) with {expected}")
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist; dataset {name!r} expects {expected}")
    return root


def _load_idx_set(name: str, data_dir: str | os.PathLike | None, seed: int, test_size: float,
                  img_size: int) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    stems = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
    sub = {"mnist": ("mnist", "MNIST/raw"), "fashion_mnist": ("fashion_mnist", "fashion-mnist", "FashionMNIST/raw")}[name]
    files = ", ".join(f"{s}[.gz]" for pair in stems.values() for s in pair)
    expected = f"the idx files {files} (train and/or t10k)"
    root = _require_dir(data_dir, name, expected)
    dirs = [root] + [root / s for s in sub]
    found: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split, (img_stem, lab_stem) in stems.items():
        img, lab = _find_file(dirs, img_stem), _find_file(dirs, lab_stem)
        if (img is None) != (lab is None):
            have, miss = (img, lab_stem) if lab is None else (lab, img_stem)
            raise DataError(f"found {have} but not its partner {miss}[.gz] in {', '.join(map(str, dirs))}")
        if img is not None:
            x, y = read_idx(img), read_idx(lab)
            if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
                raise DataError(f"{img} / {lab}: expected images (N, H, W) and labels (N,), got {x.shape} and {y.shape}")
            found[split] = (x, y)
    if not found:
        raise DataError(f"no {name} files in {', '.join(map(str, dirs))}; expected {expected}")
    if len(found) == 2:
        (xtr, ytr), (xte, yte) = found["train"], found["test"]
    else:
        x, y = next(iter(found.values()))
        tr, te = _stratified_split(y, test_size, seed)
        xtr, ytr, xte, yte = x[tr], y[tr], x[te], y[te]
    return _image_sets(name, torch.from_numpy(xtr)[:, None], torch.from_numpy(ytr).long(),
                       torch.from_numpy(xte)[:, None], torch.from_numpy(yte).long(), 1.0 / 255.0, 10)


def _read_cifar_bin(paths: Sequence[Path], label_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    record = label_bytes + 3072
    xs, ys = [], []
    for p in paths:
        raw = np.fromfile(p, dtype=np.uint8)
        if raw.size == 0 or raw.size % record:
            raise DataError(f"{p} is truncated or not a CIFAR binary batch: {raw.size} bytes is not a multiple "
                            f"of the {record}-byte record")
        rec = raw.reshape(-1, record)
        ys.append(rec[:, label_bytes - 1].astype(np.int64))  # CIFAR-100: fine label is the second byte
        xs.append(rec[:, label_bytes:].reshape(-1, 3, 32, 32))
    return np.concatenate(xs), np.concatenate(ys)


def _load_cifar(name: str, data_dir: str | os.PathLike | None, seed: int, test_size: float,
                img_size: int) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    if name == "cifar10":
        folder, train_files, test_files, label_bytes, classes = (
            "cifar-10-batches-bin", [f"data_batch_{i}.bin" for i in range(1, 6)], ["test_batch.bin"], 1, 10)
        py_folder = "cifar-10-batches-py"
    else:
        folder, train_files, test_files, label_bytes, classes = ("cifar-100-binary", ["train.bin"], ["test.bin"], 2, 100)
        py_folder = "cifar-100-python"
    expected = (f"the CIFAR binary version: {folder}/ with {', '.join(train_files + test_files)} "
                f"(the python-version pickles are not read: unpickling downloaded files can run code)")
    root = _require_dir(data_dir, name, expected)
    base = root if root.name == folder else root / folder
    if not base.is_dir():
        if (root / py_folder).is_dir() or root.name == py_folder:
            raise DataError(f"found the python (pickle) version {py_folder} under {root}; polynets requires the "
                            f"binary version: put {folder}/ with {', '.join(train_files + test_files)} in {root}")
        raise DataError(f"no {folder}/ directory in {root}; expected {expected}")
    missing = [f for f in train_files + test_files if not (base / f).is_file()]
    if missing:
        raise DataError(f"missing {', '.join(missing)} in {base}; expected {expected}")
    xtr, ytr = _read_cifar_bin([base / f for f in train_files], label_bytes)
    xte, yte = _read_cifar_bin([base / f for f in test_files], label_bytes)
    if ytr.max() >= classes or yte.max() >= classes:
        raise DataError(f"labels in {base} exceed {classes - 1}; is this the {name} binary release?")
    return _image_sets(name, torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte),
                       torch.from_numpy(yte), 1.0 / 255.0, classes)


def _load_imagefolder(name: str, data_dir: str | os.PathLike | None, seed: int, test_size: float,
                      img_size: int, *, auto_augment: str | None = DEFAULT_AUTO_AUGMENT,
                      re_prob: float = 0.25) -> tuple[Dataset, Dataset, DatasetInfo]:
    from timm.data import create_transform
    from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from torchvision.datasets import ImageFolder

    if not 0.0 <= re_prob <= 1.0:
        raise DataError(f"re_prob (random erasing probability) must be in [0, 1], got {re_prob}")
    expected = "one sub-directory per class holding images, optionally split as train/ and val/ (or test/)"
    root = _require_dir(data_dir, "imagefolder", expected)
    stats = dict(mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, interpolation="bicubic")
    try:
        train_tf = create_transform(img_size, is_training=True, auto_augment=auto_augment, re_prob=re_prob,
                                    **stats)
    except (AssertionError, ValueError, KeyError) as exc:
        raise DataError(f"auto_augment {auto_augment!r} is not a timm augmentation policy (e.g. "
                        f"{DEFAULT_AUTO_AUGMENT!r}, 'augmix-m5', 'original'): {exc}") from exc
    test_tf = create_transform(img_size, is_training=False, **stats)

    def folder(path: Path, transform: Callable[[Any], torch.Tensor]) -> ImageFolder:
        try:
            return ImageFolder(str(path), transform=transform)
        except (FileNotFoundError, OSError) as exc:
            raise DataError(f"{path}: {exc}; expected {expected}") from exc

    test_dir = next((root / s for s in ("val", "test") if (root / s).is_dir()), None)
    if (root / "train").is_dir() and test_dir is not None:
        train, test = folder(root / "train", train_tf), folder(test_dir, test_tf)
        if train.classes != test.classes:
            raise DataError(f"class folders differ between {root / 'train'} and {test_dir}")
        classes = train.classes
    else:
        full_train, full_test = folder(root, train_tf), folder(root, test_tf)
        tr, te = _stratified_split(np.asarray(full_train.targets), test_size, seed)
        train, test, classes = Subset(full_train, tr.tolist()), Subset(full_test, te.tolist()), full_train.classes
    info = DatasetInfo(name="imagefolder", kind="image", num_classes=len(classes), num_train=len(train),
                       num_test=len(test), mean=list(IMAGENET_DEFAULT_MEAN), std=list(IMAGENET_DEFAULT_STD),
                       in_chans=3, img_size=img_size, class_names=list(classes))
    return train, test, info


_LOADERS: dict[str, Callable[..., tuple[Dataset, Dataset, DatasetInfo]]] = {
    "digits": _load_digits,
    "digits_rows": _load_digits,
    "breast_cancer": _load_tabular,
    "wine": _load_tabular,
    "mnist": _load_idx_set,
    "fashion_mnist": _load_idx_set,
    "cifar10": _load_cifar,
    "cifar100": _load_cifar,
    "imagefolder": _load_imagefolder,
}


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset`."""
    return list(_LOADERS)


def load_dataset(name: str, *, data_dir: str | os.PathLike | None = None, seed: int = 0, test_size: float = 0.2,
                 img_size: int = 224, auto_augment: str | None = DEFAULT_AUTO_AUGMENT,
                 re_prob: float = 0.25) -> tuple[Dataset, Dataset, DatasetInfo]:
    """Load dataset ``name`` as ``(train_ds, test_ds, info)``; items are ``(x, label)`` pairs.

    Built-in sets are split (stratified, ``test_size``, ``seed``); directory sets use their own
    train/test files and split only when one of them is present. ``img_size``, ``auto_augment``
    (a timm policy string, None for none) and ``re_prob`` (random-erasing probability) apply to
    the ``imagefolder`` training images only. Shapes of x: digits (1, 8, 8); digits_rows (8, 8);
    tabular (F,); mnist (1, 28, 28); cifar (3, 32, 32); imagefolder (3, img_size, img_size).
    """
    key = name.lower().replace("-", "_")
    if key not in _LOADERS:
        raise DataError(f"unknown dataset {name!r}; expected one of {', '.join(_LOADERS)}")
    if key == "imagefolder":
        return _load_imagefolder(key, data_dir, seed, test_size, img_size, auto_augment=auto_augment,
                                 re_prob=re_prob)
    return _LOADERS[key](key, data_dir, seed, test_size, img_size)
