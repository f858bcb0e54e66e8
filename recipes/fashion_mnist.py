"""``fashion_mnist``: Zalando's Fashion-MNIST read from its IDX files, with a small CNN.

The mid-sized real-data check for strategy convergence: 60,000 training images,
harder than digits (a broken synchronization costs visible accuracy), still trainable
on CPU. Nothing is downloaded: the files come from Debian's ``dataset-fashion-mnist``
package (``/usr/share/datasets/fashion-mnist``, what ``make setup`` installs when apt
is available) or any folder given as ``recipe.data_dir``.
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from syncplane.config import ConfigError
from syncplane.recipes import Recipe
from syncplane.recipes.classifier import ImageClassifier
from syncplane.recipes.optim import check_schedule

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "val_images": "t10k-images-idx3-ubyte",
    "val_labels": "t10k-labels-idx1-ubyte",
}
MEAN, STD = 0.2860, 0.3530  # of the training images, scaled to [0, 1]


@dataclass
class FashionMnistSettings:
    data_dir: str = DEBIAN_DIR     # holds the four IDX files, plain or .gz
    size: Literal["full", "tiny"] = "full"
    batch_size: int = 64           # per rank
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    width: int | None = None       # channels of the first conv; null: 32 (full), 4 (tiny)
    train_limit: int | None = None  # use the first N training images; null: all (full), 1024 (tiny)
    val_limit: int | None = None    # likewise for the 10,000 test images; null: all (full), 256 (tiny)
    model: Literal["cnn", "mlp"] = "cnn"   # mlp: a wide MLP, many bytes per FLOP (sync-bound on slow links)
    hidden: int = 1024              # mlp only: width of its two hidden layers
    schedule: Literal["constant", "cosine", "step", "linear"] = "cosine"   # the LR over the run's steps

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be at least 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ConfigError(f"lr: must be positive, got {self.lr}")
        if self.model not in ("cnn", "mlp"):
            raise ConfigError(f"model: cnn or mlp, got {self.model!r}")
        check_schedule(self.schedule)
        if self.hidden < 1:
            raise ConfigError(f"hidden: must be at least 1, got {self.hidden}")
        for key in ("width", "train_limit", "val_limit"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{key}: must be at least 1 (or null), got {value}")
        idx_paths(self.data_dir)

    def resolved_width(self) -> int:
        return self.width or (32 if self.size == "full" else 4)

    def limits(self) -> tuple[int | None, int | None]:
        tiny = self.size == "tiny"
        return (self.train_limit or (1024 if tiny else None), self.val_limit or (256 if tiny else None))


def idx_paths(data_dir: str) -> dict[str, Path]:
    """The four IDX files in ``data_dir`` (plain or gzipped), or a ConfigError saying what is missing."""
    root = Path(data_dir)
    found: dict[str, Path] = {}
    missing = []
    for key, name in FILES.items():
        for candidate in (root / name, root / f"{name}.gz"):
            if candidate.is_file():
                found[key] = candidate
                break
        else:
            missing.append(name)
    if missing:
        where = "does not exist" if not root.is_dir() else f"lacks {', '.join(missing)} (plain or .gz)"
        raise ConfigError(
            f"data_dir: {data_dir!r} {where}; expected the Fashion-MNIST IDX files {', '.join(FILES.values())}. "
            f"Install Debian's dataset-fashion-mnist (files in {DEBIAN_DIR}) or set recipe.data_dir to a folder "
            "holding them; nothing is downloaded at run time")
    return found


def read_idx(path: Path, ndim: int, limit: int | None = None) -> np.ndarray:
    """Read an unsigned-byte IDX array (LeCun's MNIST format) with ``ndim`` dimensions."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:  # type: ignore[operator]
        header = f.read(4)
        if len(header) < 4 or header[:2] != b"\0\0" or header[2] != 0x08 or header[3] != ndim:
            raise ValueError(f"{path}: not an unsigned-byte IDX file with {ndim} dimension(s) "
                             f"(magic {header.hex() or 'missing'}, expected 000008{ndim:02x})")
        shape = struct.unpack(f">{ndim}I", f.read(4 * ndim))
        count = shape[0] if limit is None else min(limit, shape[0])
        item = int(np.prod(shape[1:], dtype=np.int64))
        data = f.read(count * item)
    if len(data) != count * item:
        raise ValueError(f"{path}: truncated, header says {shape} but the file holds {len(data)} bytes of data")
    return np.frombuffer(data, dtype=np.uint8).reshape(count, *shape[1:])


def load_split(paths: dict[str, Path], split: str, limit: int | None) -> TensorDataset:
    images = read_idx(paths[f"{split}_images"], 3, limit)
    labels = read_idx(paths[f"{split}_labels"], 1, limit)
    if len(images) != len(labels):
        raise ValueError(f"{split}: {len(images)} images but {len(labels)} labels in {paths[f'{split}_images'].parent}")
    x = (torch.from_numpy(images.copy()).float().unsqueeze(1) / 255.0 - MEAN) / STD
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


class FashionMnistData(LightningDataModule):
    """IDX files -> tensors in memory; Lightning adds the DistributedSampler."""

    def __init__(self, settings: FashionMnistSettings) -> None:
        super().__init__()
        self.settings = settings
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        paths = idx_paths(self.settings.data_dir)
        train_limit, val_limit = self.settings.limits()
        self.train_set = load_split(paths, "train", train_limit)
        self.val_set = load_split(paths, "val", val_limit)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.settings.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=512)


def fashion_cnn(width: int, classes: int = 10) -> nn.Module:
    """Two conv blocks (28 -> 14 -> 7) and a two-layer head: ~0.4 M parameters at width 32."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.25), nn.Linear(2 * width * 49, 128), nn.ReLU(), nn.Linear(128, classes),
    )


def wide_mlp(hidden: int, classes: int = 10) -> nn.Module:
    """Two hidden layers of ``hidden`` units: ~1.9 M parameters (7.4 MB) at 1024 for ~3.7 MFLOP
    per sample forward -- about 80x fewer FLOPs per gradient byte than the CNN, so on a
    100 Mbit link its gradient exchange takes several times its compute (what
    ``syncplane compare`` needs to show where synchronization matters)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def build(settings: FashionMnistSettings) -> tuple[ImageClassifier, FashionMnistData]:
    if settings.model == "mlp":
        network, make = wide_mlp(settings.hidden), partial(wide_mlp, settings.hidden)
    else:
        width = settings.resolved_width()
        network, make = fashion_cnn(width), partial(fashion_cnn, width)
    model = ImageClassifier(network, settings.lr, settings.momentum, settings.weight_decay, settings.schedule,
                            flops_model=(make, (1, 28, 28)))
    return model, FashionMnistData(settings)


RECIPE = Recipe(name="fashion_mnist", settings=FashionMnistSettings, build=build,
                description="Fashion-MNIST from local IDX files, small CNN (CPU)")
