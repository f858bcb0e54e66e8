"""A LightningModule for image classification shared by the small recipes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn


class ImageClassifier(LightningModule):
    """Cross-entropy classifier with SGD + momentum and a cosine learning-rate schedule.

    Validation metrics are logged with ``sync_dist=True`` (every rank logs the same keys),
    so the numbers in ``summary.json`` cover the whole validation set.
    """

    def __init__(self, network: nn.Module, lr: float, momentum: float, weight_decay: float,
                 cosine_schedule: bool = True) -> None:
        super().__init__()
        self.network = network
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.cosine_schedule = cosine_schedule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):  # type: ignore[override]
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum,
                                    weight_decay=self.weight_decay)
        if not self.cosine_schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
