"""Canary (Zhou et al.; docs/strategies/canary.md): every step, the gradients are averaged
through Canary's piece-level exchange of gradient sketches, then the recipe's optimizer
steps on the same averaged gradient on every rank (replicas stay bit-identical).

Colayers are the gradients grouped in backward order (reverse parameter order) into
buckets of ``bucket_cap_mb`` (``syncplane.comm.make_buckets``). A colayer is exchanged as
soon as the backward has produced all its gradients (a post-accumulate-grad hook per
parameter counts them), on one worker thread, in colayer order on every rank
(``BackwardPipeline``) -- so the exchange overlaps the rest of the backward, as DDP's
buckets do. With gradient accumulation the hooks would fire on every micro-batch, so there
the colayers are exchanged after the last backward instead (same result, no overlap).

Overridden hooks (see ``SyncplaneStrategy``), and why:

- ``setup_sync``: lay out the colayers and build the engine and its transport, one gloo
  group per NIC (a collective, the same order on every rank), so that a model too small
  for one piece per rank fails here, on every rank, before the first step; register the
  gradient hooks.
- ``before_parameter_update``: after the backward, wait for every colayer's exchange (the
  ones no hook started -- unused parameters, accumulation -- start now; missing gradients
  count as zeros) and unpack the averaged gradients.
- ``rank_state_dict`` / ``load_rank_state_dict``: this rank's error-feedback residuals (what
  its own pieces and the pieces it owns have not delivered yet), so a resume loses nothing.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from syncplane import kernels
from syncplane.algorithms.canary import BackwardPipeline, CanaryConfig, CanaryEngine
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
        self._pipeline: BackwardPipeline | None = None
        self._hooks: list[Any] = []
        self._colayer_of: dict[int, int] = {}
        self._missing: list[int] = []
        self._lock = threading.Lock()
        self._early_before = 0

    @override
    def setup_sync(self) -> None:
        self._release()
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        self._colayers = make_buckets(list(reversed(params)), self.config.bucket_bytes)
        self._transport = make_transport(self.config)
        self._engine = CanaryEngine([c.buffer.numel() for c in self._colayers], self.world_size, self._transport)
        self._pipeline = BackwardPipeline(self._engine, self._pack, self.comm_meter)
        self._colayer_of = {id(p): i for i, c in enumerate(self._colayers) for p in c.tensors}
        self._missing = [len(c.tensors) for c in self._colayers]
        overlap = self.lightning_module.trainer.accumulate_grad_batches == 1
        if overlap:
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        rank_zero_info(f"canary: {len(self._colayers)} colayer(s) of {self._engine.total} gradient values, "
                       f"{self.world_size} pieces each, {self.config.compression}, "
                       f"{self._transport.shards} gloo group(s), "
                       + ("exchanged during the backward" if overlap else "exchanged after the backward (accumulation)"))

    def _grad_ready(self, param: torch.Tensor) -> None:
        index = self._colayer_of[id(param)]
        with self._lock:
            self._missing[index] -= 1
            complete = self._missing[index] == 0
        if complete:
            assert self._pipeline is not None
            self._pipeline.ready(index)

    def _pack(self, index: int) -> torch.Tensor:
        """Colayer ``index``'s gradients as one flat fp32 host buffer (worker thread)."""
        colayer = self._colayers[index]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in colayer.tensors]
        kernels.pack(grads, colayer.buffer)
        return colayer.buffer.to("cpu", torch.float32)

    @property
    def overlapped_colayers(self) -> int:
        """Colayer exchanges started during a backward so far (0 without overlap)."""
        return self._pipeline.early if self._pipeline is not None else self._early_before

    @property
    def engine(self) -> CanaryEngine:
        if self._engine is None:
            raise RuntimeError("canary is not set up yet (setup_sync runs when fitting starts)")
        return self._engine

    @override
    def before_parameter_update(self, optimizer: Optimizer) -> None:
        assert self._pipeline is not None, "canary is not set up yet"
        results = self._pipeline.finish()
        with self._lock:
            self._missing = [len(c.tensors) for c in self._colayers]
        for colayer, host in zip(self._colayers, results):
            if host is not colayer.buffer:
                colayer.buffer.copy_(host)
            for p in colayer.tensors:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            kernels.unpack(colayer.buffer, [p.grad for p in colayer.tensors])

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return {"canary": self.engine.state_dict()} if self._engine is not None else {}

    @override
    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        if "canary" in state:
            self.engine.load_state_dict(state["canary"])

    def _release(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._pipeline is not None:
            self._pipeline.close()
            self._early_before = self._pipeline.early
            self._pipeline = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    @override
    def teardown(self) -> None:
        self._release()
        super().teardown()
