"""A plain Lightning script that trains with a syncplane strategy -- no train.py, no Hydra.

    python scripts/lightning_example.py --strategy atc --devices 2 --out /tmp/run

Lightning starts the other ranks itself (its subprocess launcher re-runs this script);
under ``torchrun`` it joins the ranks torchrun started. What syncplane adds is only the
strategy (by name, or as an object with settings) and, optionally, the report callback
that writes ``summary.json`` / ``history.jsonl``. ``docs/lightning.md`` walks through it.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import syncplane.strategies  # noqa: F401  (registers atc, awc, h_atc, h_awc, ds_sync, diloco, flexreduce)
from syncplane.strategies.decentralized import ATC
from syncplane.runtime.report import RunReport


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(n: int = 512) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(1))                  # learnable: the class is the largest of 4 features
    return DataLoader(TensorDataset(x, y), batch_size=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="atc", help="a registered name (syncplane info lists them), "
                                                           "or atc-object for ATC(...) with settings")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="lightning_example_run", help="where the report writes summary.json")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    strategy = ATC(schedule="static", topology="RingGraph") if args.strategy == "atc-object" else args.strategy
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
                         callbacks=[RunReport(args.out, str(args.strategy), "lightning_example")],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Classifier(), data(), data(128))


if __name__ == "__main__":
    main()
