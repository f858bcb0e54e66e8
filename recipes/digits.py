"""``digits``: scikit-learn's bundled 8x8 handwritten digits with a small CNN.

The default main job: real data that ships inside a package (1,797 images, no
download), big enough that a broken synchronization shows up as lost accuracy, small
enough to train across two CPU processes in well under a minute.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from lightning.pytorch import LightningDataModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from syncplane.config import ConfigError
from syncplane.recipes import Recipe
from syncplane.recipes.classifier import ImageClassifier
from syncplane.recipes.optim import ScheduleKind, check_schedule


@dataclass
class DigitsSettings:
    batch_size: int = 32          # per rank
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    val_fraction: float = 0.2
    split_seed: int = 0           # the train/val split is the same for every run and rank
    width: int = 32               # channels of the first conv layer
    schedule: ScheduleKind = "cosine"   # the LR over the run's steps: constant | cosine | step | linear

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be at least 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ConfigError(f"lr: must be positive, got {self.lr}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction: must be between 0 and 1, got {self.val_fraction}")
        if self.width < 1:
            raise ConfigError(f"width: must be at least 1, got {self.width}")
        check_schedule(self.schedule)


class DigitsData(LightningDataModule):
    """Loads ``sklearn.datasets.load_digits`` into tensors; Lightning adds the DistributedSampler."""

    def __init__(self, settings: DigitsSettings) -> None:
        super().__init__()
        self.settings = settings
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        images = (images - 0.5) / 0.5
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.settings.split_seed))
        n_val = int(round(len(labels) * self.settings.val_fraction))
        val_idx, train_idx = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(images[train_idx], labels[train_idx])
        self.val_set = TensorDataset(images[val_idx], labels[val_idx])

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.settings.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=256)


def small_cnn(width: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.MaxPool2d(2),                                   # 8x8 -> 4x4
        nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, classes),
    )


def build(settings: DigitsSettings) -> tuple[ImageClassifier, DigitsData]:
    model = ImageClassifier(small_cnn(settings.width), settings.lr, settings.momentum, settings.weight_decay,
                            settings.schedule, flops_model=(partial(small_cnn, settings.width), (1, 8, 8)))
    return model, DigitsData(settings)


RECIPE = Recipe(name="digits", settings=DigitsSettings, build=build,
                description="scikit-learn 8x8 digits, small CNN (CPU, bundled data)")
