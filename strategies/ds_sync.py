"""DS-Sync: divide-and-shuffle group synchronization (Wang et al., arXiv:2007.03298).

After every local optimizer step each rank averages its parameters with the members of
its current group only; the groups partition the ranks, run concurrently, and are
reshuffled every step so that one period mixes everybody (Pseudo Code 1). The pattern
comes from the detected topology (``syncplane.cluster.probe``: the launcher's cluster
profile, or a probe); the runtime -- schedule, process groups, adjustment under
contention -- is ``syncplane.algorithms.ds_sync``. Optional EMA ensemble (the paper's
"SWA"): a per-rank exponential moving average of the parameters, averaged over all ranks
once at the end.

Overridden hooks, and why:

- ``setup_sync``: resolve the topology, build the pattern and create every process
  group it can use (a collective, once).
- ``after_optimizer_step``: one group average per step, then the EMA update.
- ``evaluation_tensors``: with ``ema``, validation and checkpoints show the ensemble.
- ``on_train_end``: with ``ema``, the final model is the global mean of the EMA models.
- ``setup`` (with ``max_staleness``): no per-step SIGTERM broadcast, so a late group
  member does not hold every rank up through Lightning's own collective.
- ``finish_pending_sync`` / ``teardown`` (with ``max_staleness``): every message still in
  flight, then the mixer's watcher threads; summary.json gets the late-peer counts.
- ``sync_state_dict`` / ``load_sync_state_dict``: schedule position, adopted pattern,
  bandwidth estimate; ``rank_state_dict`` / ``load_rank_state_dict``: this rank's EMA
  model and, with ``max_staleness``, its late-peer mixer (drained at the checkpoint: message
  counters, each group mate's newest message) -- a resume continues exactly.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.algorithms.ds_sync.config import DSSyncConfig
from syncplane.algorithms.ds_sync.engine import DSSync
from syncplane.algorithms.ds_sync.pair_streams import PairStreams
from syncplane.algorithms.ds_sync.runtime import ds_sync_for_job
from syncplane.job import JobContext
from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import register

log = logging.getLogger(__name__)


@register("ds_sync")
class DSSyncStrategy(SyncplaneStrategy):
    """Args: those of ``DSSyncConfig`` (topology, adjust_every, imbalance, slow_factor,
    probe_mb, ema, ema_decay, pair_streams, max_staleness, late_after_s), then ``SyncplaneStrategy``'s."""

    def __init__(self, topology: str = "auto", adjust_every: int = 100, imbalance: float = 1.5,
                 slow_factor: float = 0.5, probe_mb: float = 1.0, ema: bool = False, ema_decay: float = 0.99,
                 pair_streams: PairStreams = "auto", max_staleness: int = 0, late_after_s: float = 0.05,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = DSSyncConfig(topology=topology, adjust_every=adjust_every, imbalance=imbalance,
                                   slow_factor=slow_factor, probe_mb=probe_mb, ema=ema, ema_decay=ema_decay,
                                   pair_streams=pair_streams, max_staleness=max_staleness,
                                   late_after_s=late_after_s)
        self._runtime: DSSync | None = None
        self._ema_model: list[torch.Tensor] | None = None

    @override
    def setup_sync(self, job: JobContext) -> None:
        self._runtime, table = ds_sync_for_job(job, self.config)
        if self.is_global_zero:
            log.info("ds_sync topology:\n%s", table)
            log.info("ds_sync: %s", self._runtime.streams.describe())
        if self.config.ema:
            self._ema_model = [t.detach().clone() for t in self.model_tensors()]

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.config.max_staleness:   # ranks may run up to max_staleness messages apart
            self.skip_per_step_sigterm_broadcast(trainer)

    @property
    def runtime(self) -> DSSync:
        if self._runtime is None:
            raise RuntimeError("ds_sync is not set up yet (setup_sync runs when fitting starts)")
        return self._runtime

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        self.runtime.sync_(self.model_replicas().buckets, self.comm_meter)
        if self._ema_model is not None:
            torch._foreach_lerp_(self._ema_model, self.model_tensors(), 1.0 - self.config.ema_decay)

    @override
    def evaluation_tensors(self) -> list[torch.Tensor] | None:
        """With ``ema``, validation and checkpoints show the ensemble (the mean of the EMAs),
        so the last validation, ``last.ckpt`` and the summary hold the model the run delivers."""
        return self._ema_model

    @override
    def on_train_end(self) -> None:
        self.finish_pending_sync()            # late-peer mode: no message in flight under the collective
        if self._ema_model is not None:
            with torch.no_grad():
                for live, avg in zip(self.model_tensors(), self._ema_model):
                    live.copy_(avg)
            self.average_replicas_()          # the ensemble: global mean of the EMA models
        super().on_train_end()

    @override
    def finish_pending_sync(self) -> None:
        if self._runtime is None or self._runtime.late is None:
            return
        self._runtime.drain()
        self.details["late_peers"] = self._runtime.late.summary()

    @override
    def teardown(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
        super().teardown()

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        return {"schedule": self.runtime.state_dict()}

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        self.runtime.load_state_dict(state["schedule"])

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self._ema_model is not None:
            state["ema"] = [t.detach().cpu().clone() for t in self._ema_model]
        if self._runtime is not None and self._runtime.late is not None:   # drained by save_checkpoint
            state["late_peers"] = self._runtime.late.state_dict()
        return state

    @override
    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._runtime is not None and self._runtime.late is not None and "late_peers" in state:
            self._runtime.late.load_state_dict(state["late_peers"])
        if self._ema_model is not None and "ema" in state:
            with torch.no_grad():
                for t, saved in zip(self._ema_model, state["ema"]):
                    t.copy_(saved)
