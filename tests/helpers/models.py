"""Tiny models and data for strategy tests (fast on 2 CPU cores)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(LightningModule):
    def __init__(self, lr: float = 0.1, momentum: float = 0.9, width: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))
        self.lr, self.momentum = lr, momentum

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class RegressionData(LightningDataModule):
    """A fixed random regression set; Lightning's DistributedSampler shards it by rank."""

    def __init__(self, n: int = 80, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 4, generator=g)
        self.data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def trainer_for(strategy, tmp_dir: str, **kwargs):
    """A quiet CPU Trainer for ``strategy`` on the already-initialized process group."""
    import os

    from lightning.pytorch import Trainer

    from syncplane.runtime.checkpoint_io import AtomicCheckpointIO

    defaults = dict(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, default_root_dir=tmp_dir, plugins=[AtomicCheckpointIO()])
    defaults.update(kwargs)
    return Trainer(strategy=strategy, **defaults)


def colayer_grads(world: int, seed: int, sizes: list[int], step: int = 0) -> list[list[torch.Tensor]]:
    """[rank][colayer] gradients of one step for the exchange tests, fresh for each seed and
    heavy-tailed (1 value in 500 scaled by 300) so that a sketch's exact values matter; rank
    r's are scaled by r + 1 so that a mean that mixes ranks up shows."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    out = []
    for r in range(world):
        colayers = []
        for size in sizes:
            x = torch.randn(size, generator=g) * (r + 1)
            x[torch.randint(0, size, (max(1, size // 500),), generator=g)] *= 300.0
            colayers.append(x)
        out.append(colayers)
    return out


def assert_fp32_mean(got: torch.Tensor, inputs: list[torch.Tensor], msg: object = None) -> None:
    """``got`` is the mean of the fp32 ``inputs`` summed in fp32 in some order: within the
    summation's rounding bound of the float64 mean, n·eps·mean|x| per element (twice the
    worst case), not a fixed tolerance, which heavy-tailed inputs that cancel can exceed
    without any bug. A missing or doubled input is off by |x|/n, far outside the bound."""
    stacked = torch.stack([x.double() for x in inputs])
    dense = stacked.mean(0)
    bound = len(inputs) * torch.finfo(torch.float32).eps * stacked.abs().mean(0) + 1e-12
    err = (got.double() - dense).abs()
    worst = int(torch.argmax(err / bound))
    assert bool((err <= bound).all()), (f"{msg}: " if msg is not None else "") + (
        f"element {worst}: {float(got.flatten()[worst])} against the mean {float(dense.flatten()[worst])}, "
        f"off by {float(err.flatten()[worst]):.3g} > the fp32 bound {float(bound.flatten()[worst]):.3g}")
