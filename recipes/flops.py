"""Model FLOPs of one training step, counted on the meta device (no memory, no compute).

MFU needs the FLOPs a step *must* do; counting the real forward and backward with
torch's ``FlopCounterMode`` (through Lightning's ``measure_flops``) stays right when a
recipe changes its model, where a hand formula would silently drift.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def train_flops_per_sample(build: Callable[[], nn.Module], example: Callable[[int], Any],
                           loss: Callable[[nn.Module, Any], torch.Tensor], batch: int = 2) -> float:
    """FLOPs of forward + backward for one sample.

    ``build()`` makes the network and ``example(n)`` a batch of ``n`` samples; both run
    under ``torch.device("meta")``. ``loss(model, batch)`` is the training forward. The
    count uses ``batch`` samples (2 by default: batch norm needs more than one value per
    channel) and divides.
    """
    from lightning.fabric.utilities.throughput import measure_flops

    with torch.device("meta"):
        model = build()
        inputs = example(batch)
    model.train()
    return measure_flops(model, lambda: loss(model, inputs), lambda out: out) / batch
