"""A LightningModule for image classification shared by the image recipes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from syncplane.recipes.flops import train_flops_per_sample
from syncplane.recipes.optim import ScheduleKind, decay_groups, schedule_factor


class ImageClassifier(LightningModule):
    """Cross-entropy classifier trained with SGD + momentum and a per-step LR schedule.

    The defaults are the small recipes' (cosine decay, decay on every parameter). The
    ImageNet recipe turns on what Goyal et al. prescribe for large batches: the peak LR
    scaled by ``global_batch / reference_batch``, a linear warm-up over
    ``warmup_epochs`` starting from the unscaled LR, step decay at ``milestones``
    (epochs), no weight decay on batch-norm and bias terms, and label smoothing.

    Validation metrics are logged with ``sync_dist=True`` (every rank logs the same keys),
    so the numbers in ``summary.json`` cover the whole validation set.
    """

    def __init__(self, network: nn.Module, lr: float, momentum: float, weight_decay: float,
                 schedule: ScheduleKind = "cosine", *, warmup_epochs: float = 0.0,
                 milestones: Sequence[int] = (), reference_batch: int | None = None,
                 batch_size: int | None = None, label_smoothing: float = 0.0,
                 decay_norm_and_bias: bool = True, channels_last: bool = False,
                 flops_model: tuple[Callable[[], nn.Module], tuple[int, ...]] | None = None) -> None:
        """``reference_batch``/``batch_size`` (per rank) turn on linear LR scaling;
        ``channels_last`` applies on CUDA only; ``flops_model`` is ``(build, input_shape)``
        for counting the training FLOPs of one sample on the meta device (for MFU)."""
        super().__init__()
        if reference_batch is not None and batch_size is None:
            raise ValueError("reference_batch needs batch_size (per rank) to compute the global batch")
        self.network = network
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.schedule: ScheduleKind = schedule
        self.warmup_epochs, self.milestones = warmup_epochs, tuple(milestones)
        self.reference_batch, self.batch_size = reference_batch, batch_size
        self.label_smoothing = label_smoothing
        self.decay_norm_and_bias, self.channels_last = decay_norm_and_bias, channels_last
        self._flops_model = flops_model
        self._memory_format = torch.contiguous_format

    def setup(self, stage: str) -> None:
        # Before the strategy moves/wraps the model: Module.to(device) keeps the layout.
        if self.channels_last and self.trainer.strategy.root_device.type == "cuda":
            self._memory_format = torch.channels_last
            self.network.to(memory_format=torch.channels_last)
            torch.backends.cudnn.benchmark = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x.contiguous(memory_format=self._memory_format))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y, label_smoothing=self.label_smoothing)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def peak_lr(self) -> float:
        """``lr``, times ``global_batch / reference_batch`` when linear scaling is on."""
        if self.reference_batch is None:
            return self.lr
        assert self.batch_size is not None
        global_batch = self.batch_size * self.trainer.world_size * self.trainer.accumulate_grad_batches
        return self.lr * global_batch / self.reference_batch

    def train_flops_per_sample(self) -> float | None:
        """Forward + backward FLOPs of one training sample (read by the run report)."""
        if self._flops_model is None:
            return None
        build, shape = self._flops_model
        return train_flops_per_sample(
            build, lambda n: (torch.empty(n, *shape), torch.zeros(n, dtype=torch.long)),
            lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))

    def configure_optimizers(self):  # type: ignore[override]
        params = (decay_groups(self.network, self.weight_decay) if not self.decay_norm_and_bias
                  else [{"params": list(self.parameters()), "weight_decay": self.weight_decay}])
        peak = self.peak_lr()
        optimizer = torch.optim.SGD(params, lr=peak, momentum=self.momentum)
        if self.schedule == "constant" and not self.warmup_epochs:
            return optimizer
        total = max(1, int(self.trainer.estimated_stepping_batches))
        # num_training_batches is known once estimated_stepping_batches has set up the data
        batches = self.trainer.num_training_batches
        per_epoch = (max(1, math.ceil(batches / self.trainer.accumulate_grad_batches))
                     if math.isfinite(batches) else total)
        factor = schedule_factor(
            self.schedule, total_steps=total, warmup_steps=round(self.warmup_epochs * per_epoch),
            warmup_start=min(1.0, self.lr / peak),  # Goyal et al.: warm up from the unscaled LR
            milestones=[m * per_epoch for m in self.milestones])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
