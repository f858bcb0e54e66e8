"""``resnet50_imagenet``: torchvision's ResNet-50 on an ImageNet-style folder, Goyal et al.'s recipe.

"Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (Goyal et al., 2017) is
the default: SGD with momentum 0.9, weight decay 1e-4 on conv/linear weights only,
LR 0.1 × global_batch / 256 reached by a 5-epoch linear warm-up from 0.1, ×0.1 at
epochs 30, 60 and 80 of 90 (or cosine), optional label smoothing. The standard
pipeline: RandomResizedCrop + flip for training, resize + center crop for
validation, ImageNet normalization; channels-last on GPU (mixed precision comes from
``trainer.precision``, e.g. ``bf16-mixed``). No pretrained weights, no download.

``size=tiny`` keeps the code path (torchvision's ResNet with Bottleneck blocks, the
same pipeline, schedule and optimizer) at one block per stage, narrow bottlenecks and
32-pixel crops, so it trains on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

from lightning.pytorch import LightningDataModule
from torch import nn
from torch.utils.data import DataLoader

from syncplane.config import ConfigError
from syncplane.recipes import Recipe
from syncplane.recipes.classifier import ImageClassifier

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# the file types torchvision's ImageFolder loads
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
LAYOUT = "<data_root>/train/<class>/<image>.JPEG and <data_root>/val/<class>/<image>.JPEG (same class folders)"


@dataclass
class ResNetSettings:
    data_root: str = "/data/imagenet"
    size: Literal["full", "tiny"] = "full"
    batch_size: int = 32            # per rank
    lr: float = 0.1                 # per reference_batch samples of global batch (linear scaling rule)
    reference_batch: int = 256
    momentum: float = 0.9
    weight_decay: float = 1e-4      # never on batch-norm parameters or biases
    warmup_epochs: float = 5.0
    schedule: Literal["step", "cosine"] = "step"
    milestones: list[int] = field(default_factory=lambda: [30, 60, 80])  # epochs, for schedule=step
    label_smoothing: float = 0.0    # 0.1 is the common choice
    zero_init_residual: bool = True  # Goyal et al. §5.1: gamma = 0 in each block's last BN
    image_size: int | None = None   # training crop; null: 224 (full), 32 (tiny)
    num_classes: int | None = None  # null: the number of class folders under train/
    num_workers: int = 8            # data-loading processes per rank
    channels_last: bool = True      # on GPU only

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be at least 1, got {self.batch_size}")
        if self.lr <= 0 or self.reference_batch < 1:
            raise ConfigError(f"lr and reference_batch: must be positive, got {self.lr} and {self.reference_batch}")
        if self.warmup_epochs < 0:
            raise ConfigError(f"warmup_epochs: must be >= 0, got {self.warmup_epochs}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing: must be in [0, 1), got {self.label_smoothing}")
        if self.image_size is not None and self.image_size < 16:
            raise ConfigError(f"image_size: must be at least 16 (or null), got {self.image_size}")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers: must be >= 0, got {self.num_workers}")
        classes = image_folder_classes(self.data_root)
        if self.num_classes is not None and self.num_classes != len(classes):
            raise ConfigError(f"num_classes: {self.num_classes}, but {self.data_root}/train has {len(classes)} "
                              "class folders (set null to take the folder count)")

    def crop(self) -> int:
        return self.image_size or (224 if self.size == "full" else 32)


def _entries(path: Path) -> tuple[list[str], list[str]]:
    """(sub-folder names, image file names) directly inside ``path``."""
    folders, images = [], []
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_dir():
                folders.append(entry.name)
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                images.append(entry.name)
    return sorted(folders), images


def _has_image(path: Path) -> bool:
    with os.scandir(path) as it:
        return any(e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS) for e in it)


def image_folder_classes(data_root: str) -> list[str]:
    """Check the ImageNet folder layout cheaply (no full walk); returns the class names.

    Raises a ConfigError that says what was expected and what was found instead.
    """
    root = Path(data_root)
    if not root.is_dir():
        raise ConfigError(f"data_root: {data_root!r} is not a directory; expected {LAYOUT}")
    found: dict[str, list[str]] = {}
    for split in ("train", "val"):
        path = root / split
        if not path.is_dir():
            raise ConfigError(f"data_root: {data_root!r} has no {split}/ folder; expected {LAYOUT}")
        folders, images = _entries(path)
        if images and not folders:
            hint = (" (ImageNet's val/ ships flat: sort it into class folders with the ILSVRC2012 validation "
                    "labels first)" if split == "val" else "")
            raise ConfigError(f"data_root: {path} holds {len(images)} images directly but no class folders; "
                              f"expected {LAYOUT}{hint}")
        if not folders:
            raise ConfigError(f"data_root: {path} has no class folders; expected {LAYOUT}")
        if not _has_image(path / folders[0]):
            raise ConfigError(f"data_root: class folder {path / folders[0]} holds no image files "
                              f"({', '.join(IMAGE_EXTENSIONS)}); expected {LAYOUT}")
        found[split] = folders
    if found["train"] != found["val"]:
        only_train = sorted(set(found["train"]) - set(found["val"]))[:5]
        only_val = sorted(set(found["val"]) - set(found["train"]))[:5]
        raise ConfigError(f"data_root: train/ and val/ must hold the same class folders; only in train: "
                          f"{only_train or '-'}, only in val: {only_val or '-'}")
    return found["train"]


class ImageFolderData(LightningDataModule):
    """train/ and val/ ImageFolders with the standard ImageNet transforms.

    Lightning's DistributedSampler (added to both loaders) shards them over ranks.
    """

    def __init__(self, settings: ResNetSettings) -> None:
        super().__init__()
        self.settings = settings
        self.train_set = self.val_set = None

    def setup(self, stage: str) -> None:
        from torchvision import datasets, transforms

        crop = self.settings.crop()
        normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        train_tf = transforms.Compose([transforms.RandomResizedCrop(crop), transforms.RandomHorizontalFlip(),
                                       transforms.ToTensor(), normalize])
        val_tf = transforms.Compose([transforms.Resize(round(crop * 256 / 224)), transforms.CenterCrop(crop),
                                     transforms.ToTensor(), normalize])
        root = Path(self.settings.data_root)
        self.train_set = datasets.ImageFolder(str(root / "train"), transform=train_tf)
        self.val_set = datasets.ImageFolder(str(root / "val"), transform=val_tf)

    def _loader(self, dataset: object, train: bool) -> DataLoader:
        workers = self.settings.num_workers
        on_gpu = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(dataset, batch_size=self.settings.batch_size,  # type: ignore[arg-type]
                          shuffle=train, drop_last=train, num_workers=workers, pin_memory=on_gpu,
                          persistent_workers=workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)


def resnet50(size: Literal["full", "tiny"], num_classes: int, zero_init_residual: bool = False) -> nn.Module:
    """torchvision's ResNet-50 (random init), or its tiny sibling: [1, 1, 1, 1] Bottleneck blocks, width 16."""
    from torchvision.models import resnet

    if size == "full":
        return resnet.resnet50(weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual)
    return resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=num_classes, width_per_group=16,
                         zero_init_residual=zero_init_residual)


def build(settings: ResNetSettings) -> tuple[ImageClassifier, ImageFolderData]:
    num_classes = settings.num_classes or len(image_folder_classes(settings.data_root))
    make = partial(resnet50, settings.size, num_classes, settings.zero_init_residual)
    model = ImageClassifier(
        make(), settings.lr, settings.momentum, settings.weight_decay, settings.schedule,
        warmup_epochs=settings.warmup_epochs, milestones=settings.milestones,
        reference_batch=settings.reference_batch, batch_size=settings.batch_size,
        label_smoothing=settings.label_smoothing, decay_norm_and_bias=False,
        channels_last=settings.channels_last, flops_model=(make, (3, settings.crop(), settings.crop())))
    return model, ImageFolderData(settings)


RECIPE = Recipe(name="resnet50_imagenet", settings=ResNetSettings, build=build,
                description="torchvision ResNet-50 on an ImageNet folder, Goyal et al. (GPU; size=tiny on CPU)")
