"""Canary (Zhou et al.; docs/strategies/canary.md): every step, the gradients are averaged
through Canary's piece-level exchange of gradient sketches, then the recipe's optimizer
steps on the same averaged gradient on every rank (replicas stay bit-identical).

Colayers are the gradients grouped in backward order (reverse parameter order) into
buckets of ``bucket_cap_mb`` (``syncplane.comm.make_buckets``); the exchange runs after
the backward, colayer by colayer (it does not overlap the backward).

Overridden hooks (see ``SyncplaneStrategy``), and why:

- ``setup_sync``: lay out the colayers and build the engine and its transport, one gloo
  group per NIC (a collective, the same order on every rank), so that a model too small
  for one piece per rank fails here, on every rank, before the first step.
- ``before_parameter_update``: after the backward, pack each colayer's gradients (missing
  ones as zeros), average it through the engine on the host, unpack the result.
- ``rank_state_dict`` / ``load_rank_state_dict``: this rank's error-feedback residuals (what
  its own pieces and the pieces it owns have not delivered yet), so a resume loses nothing.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from syncplane import kernels
from syncplane.algorithms.canary import CanaryConfig, CanaryEngine
from syncplane.algorithms.canary.bench import make_transport
from syncplane.comm import Bucket, make_buckets
from syncplane.comm.sharded import ShardedAllReduce
from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import register


@register("canary")
class CanaryStrategy(SyncplaneStrategy):
    """Args: those of ``CanaryConfig`` (compression, exact_fraction, quantile_weight, nics,
    bucket_cap_mb, sync_timeout_s), then ``SyncplaneStrategy``'s."""

    replicas_identical = True   # every rank applies the same decoded mean gradient

    def __init__(self, compression: str = "sketch", exact_fraction: float = 0.01, quantile_weight: float = 0.3,
                 nics: int | str = "auto", bucket_cap_mb: float = 25.0, sync_timeout_s: float = 600.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = CanaryConfig(compression=compression, exact_fraction=exact_fraction,
                                   quantile_weight=quantile_weight, nics=nics, bucket_cap_mb=bucket_cap_mb,
                                   sync_timeout_s=sync_timeout_s)
        self._colayers: list[Bucket] = []
        self._engine: CanaryEngine | None = None
        self._transport: ShardedAllReduce | None = None

    @override
    def setup_sync(self) -> None:
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        self._colayers = make_buckets(list(reversed(params)), self.config.bucket_bytes)
        if self._transport is not None:
            self._transport.close()
        self._transport = make_transport(self.config)
        self._engine = CanaryEngine([c.buffer.numel() for c in self._colayers], self.world_size, self._transport)
        rank_zero_info(f"canary: {len(self._colayers)} colayer(s) of {self._engine.total} gradient values, "
                       f"{self.world_size} pieces each, {self.config.compression}, "
                       f"{self._transport.shards} gloo group(s)")

    @property
    def engine(self) -> CanaryEngine:
        if self._engine is None:
            raise RuntimeError("canary is not set up yet (setup_sync runs when fitting starts)")
        return self._engine

    @override
    def before_parameter_update(self, optimizer: Optimizer) -> None:
        engine = self.engine
        for index, colayer in enumerate(self._colayers):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in colayer.tensors]
            kernels.pack(grads, colayer.buffer)
            host = colayer.buffer.to("cpu", torch.float32)
            engine.exchange_(index, host, self.comm_meter)
            colayer.buffer.copy_(host)
            kernels.unpack(colayer.buffer, grads)
            for p, g in zip(colayer.tensors, grads):
                if p.grad is None:
                    p.grad = g

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return {"canary": self.engine.state_dict()} if self._engine is not None else {}

    @override
    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        if "canary" in state:
            self.engine.load_state_dict(state["canary"])

    @override
    def teardown(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        super().teardown()
