"""Canary's colayers: the model's trainable parameters, in backward order, cut into buckets of
``bucket_cap_mb`` (DDP's buckets, the first of ``first_bucket_cap_mb``); a colayer's
gradients are packed into one flat buffer for the exchange and the decoded mean unpacked back
into the gradients (compiled kernels)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from syncplane import kernels
from syncplane.algorithms.canary.config import CanaryConfig
from syncplane.algorithms.canary.gei import GEI
from syncplane.comm import Bucket, make_buckets
from syncplane.comm.board import StoreBoard


class Colayers:
    """The colayers of ``params`` (trainable parameters, in the order the model lists them)."""

    def __init__(self, params: Sequence[torch.Tensor], bucket_bytes: int,
                 first_bucket_bytes: int | None = None) -> None:
        self.params = list(params)
        self.buckets: list[Bucket] = make_buckets(list(reversed(self.params)), bucket_bytes, first_bucket_bytes)
        self._index = {id(p): i for i, c in enumerate(self.buckets) for p in c.tensors}

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def sizes(self) -> list[int]:
        """Values per colayer."""
        return [c.buffer.numel() for c in self.buckets]

    def counts(self) -> list[int]:
        """Parameters per colayer (how many gradients a colayer waits for)."""
        return [len(c.tensors) for c in self.buckets]

    def index_of(self, param: torch.Tensor) -> int:
        return self._index[id(param)]

    def pack(self, index: int) -> torch.Tensor:
        """Colayer ``index``'s gradients as one flat fp32 host buffer (zeros for a missing one)."""
        colayer = self.buckets[index]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in colayer.tensors]
        kernels.pack(grads, colayer.buffer)
        return colayer.buffer.to("cpu", torch.float32)

    def unpack(self, index: int, host: torch.Tensor | None) -> None:
        """Colayer ``index``'s gradients set from ``host`` (its flat mean); ``None``: nothing is
        due for these parameters, so their gradients are cleared (the optimizer then skips them
        on every rank alike)."""
        colayer = self.buckets[index]
        if host is None:
            for p in colayer.tensors:
                p.grad = None
            return
        if host is not colayer.buffer:
            colayer.buffer.copy_(host)
        for p in colayer.tensors:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        kernels.unpack(colayer.buffer, [p.grad for p in colayer.tensors])


def make_gei(config: CanaryConfig, colayers: int, rank: int, world_size: int) -> GEI | None:
    """The bounded-staleness gate (``gei``) when ``config.staleness`` > 0, on a store board of
    its own; None for synchronous Canary."""
    if config.staleness <= 0:
        return None
    return GEI(colayers, config.staleness, config.proportion, StoreBoard(rank, world_size), config.sync_timeout_s,
               warmup_steps=config.warmup_steps)
