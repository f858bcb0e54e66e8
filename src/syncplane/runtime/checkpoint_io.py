"""Checkpoints written atomically and read without unpickling code.

A crash mid-write must never leave a truncated ``last.ckpt`` that a resume would
trust: the file is written beside its target, fsynced, then renamed over it (rename
is atomic on POSIX filesystems). Loading uses ``weights_only=True`` -- checkpoints
hold tensors and plain containers, never pickled objects.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from typing_extensions import override

from syncplane.lightning_adapter import TimedModelCheckpoint


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO: atomic local writes, ``weights_only`` reads."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, path)

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if not Path(path).exists():
            raise FileNotFoundError(f"checkpoint not found: {path}")
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


class LastCheckpoint(TimedModelCheckpoint):
    """``<dirpath>/last.ckpt``, rewritten after every epoch's validation and at the end of
    training, and nothing else.

    Why not ``ModelCheckpoint(save_last=True, save_top_k=0)``: since Lightning 2.x that
    writes ``last.ckpt`` only when a top-k checkpoint was written in the same step, so with
    ``save_top_k=0`` a run kept no checkpoint at all until it ended -- a failure on day two
    of a three-day run lost everything. Here the single top-k checkpoint of a monitor-less
    run (the newest) is itself named ``last``."""

    def __init__(self, dirpath: str | os.PathLike[str]) -> None:
        # ``saves``: (start, seconds) of every save on this rank: saves run between epochs,
        # inside the training clock, and a strategy's per-rank state can make them the largest
        # part of a run's time outside its epochs (``RunReport``'s ``timing``)
        super().__init__(dirpath=dirpath, filename="last", save_top_k=1, save_last=False,
                         enable_version_counter=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a run that stops mid-epoch (max_steps) has steps no validation has saved yet
        if self.last_saved_step != trainer.global_step:
            trainer.save_checkpoint(self.format_checkpoint_name({}))
