"""DS-Sync: divide-and-shuffle group synchronization (Wang et al., arXiv:2007.03298).

After every local optimizer step each rank averages its parameters with the members of
its current group only; the groups partition the ranks, run concurrently, and are
reshuffled every step so that one period mixes everybody (Pseudo Code 1). The pattern
comes from the detected topology (``syncplane.cluster.probe``: the launcher's cluster
profile, or a probe), the runtime -- schedule, process groups, adjustment under
contention -- from ``syncplane.comm.ds_sync``. Optional SWA ensemble: a per-rank
exponential moving average of the parameters, averaged over all ranks once at the end.

Overridden hooks, and why:

- ``setup_sync``: resolve the topology, build the pattern and create every process
  group it can use (a collective, once).
- ``after_optimizer_step``: one group average per step, then the SWA update.
- ``on_train_end``: with SWA, the final model is the global mean of the SWA models.
- ``sync_state_dict`` / ``load_sync_state_dict``: schedule position, adopted pattern,
  bandwidth estimate and every rank's SWA model -- a resume continues exactly.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.cluster import probe
from syncplane.comm import make_buckets
from syncplane.comm.ds_sync import DSSync
from syncplane.comm.pair_streams import PairStreams, check_pair_streams
from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import register
from syncplane.comm.process_groups import control_group


@register("ds_sync", "DS-Sync: concurrent topology-aware group averaging, groups reshuffled every step")
class DSSyncStrategy(SyncplaneStrategy):
    """Args:
        topology: ``auto`` (the launcher's cluster profile, else a probe), ``probe``, or a
            cluster profile name / YAML path.
        adjust_every: steps between contention checks (0: never adjust).
        imbalance: a group this many times slower than its peers (relative to the
            bandwidth estimate) is a bottleneck.
        slow_factor: a NIC or uplink below this fraction of the median is slow.
        probe_mb: bytes each pair exchanges per probe.
        swa: keep a per-rank EMA of the parameters; the final model is their global mean.
        swa_decay: EMA factor (``swa ← decay·swa + (1 − decay)·params`` every step).
        pair_streams: TCP connections per direction for a group of two (the inter-rack
            group with two racks): k streams take k/(k+1) of an uplink shared with one
            foreign flow instead of half, but one stream is faster on a link of its own;
            ``auto`` tries both on the first syncs (and after every re-probe), keeps the faster.
    """

    def __init__(self, topology: str = "auto", adjust_every: int = 100, imbalance: float = 1.5,
                 slow_factor: float = 0.5, probe_mb: float = 1.0, swa: bool = False, swa_decay: float = 0.99,
                 pair_streams: PairStreams = "auto", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if adjust_every < 0:
            raise ValueError(f"adjust_every must be >= 0 (0 = never), got {adjust_every}")
        if imbalance <= 1:
            raise ValueError(f"imbalance must be > 1, got {imbalance}")
        if not 0 < slow_factor < 1:
            raise ValueError(f"slow_factor must be in (0, 1), got {slow_factor}")
        if probe_mb <= 0:
            raise ValueError(f"probe_mb must be positive, got {probe_mb}")
        if not 0 <= swa_decay < 1:
            raise ValueError(f"swa_decay must be in [0, 1), got {swa_decay}")
        check_pair_streams(pair_streams)
        self.topology, self.adjust_every, self.imbalance = topology, adjust_every, imbalance
        self.slow_factor, self.probe_bytes = slow_factor, int(probe_mb * 2**20)
        self.swa, self.swa_decay, self.pair_streams = swa, swa_decay, pair_streams
        self._runtime: DSSync | None = None
        self._swa_model: list[torch.Tensor] | None = None
        self._pending: Mapping[str, Any] | None = None

    @override
    def setup_sync(self) -> None:
        topo = probe.resolve_topology(self.topology, self.probe_bytes, group=control_group())
        if self.is_global_zero:
            probe.print_table(topo, self.slow_factor)
        self._runtime = probe.ds_sync_for(topo, adjust_every=self.adjust_every, imbalance=self.imbalance,
                                          slow_factor=self.slow_factor, probe_bytes=self.probe_bytes,
                                          pair_streams=self.pair_streams, group=control_group())
        if self.is_global_zero:
            print(f"ds_sync: {self._runtime.streams.describe()}", flush=True)
        if self.swa:
            self._swa_model = [t.detach().clone() for t in self.model_tensors()]
        if self._pending is not None:
            self.load_sync_state_dict(self._pending)

    @property
    def runtime(self) -> DSSync:
        if self._runtime is None:
            raise RuntimeError("ds_sync is not set up yet (setup_sync runs when fitting starts)")
        return self._runtime

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if self._model_buckets is None:
            self._model_buckets = make_buckets(self.model_tensors(), self.bucket_bytes)
        self.runtime.sync_(self._model_buckets, self.comm_meter)
        if self._swa_model is not None:
            torch._foreach_lerp_(self._swa_model, self.model_tensors(), 1.0 - self.swa_decay)

    @override
    def on_train_end(self) -> None:
        if self._swa_model is not None:
            with torch.no_grad():
                for live, avg in zip(self.model_tensors(), self._swa_model):
                    live.copy_(avg)
            self.average_replicas_()          # the ensemble: global mean of the SWA models
        super().on_train_end()

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"schedule": self.runtime.state_dict()}
        if self._swa_model is not None:       # every rank's own SWA model (a collective)
            flat = torch.cat([t.reshape(-1) for t in self._swa_model]).cpu()
            gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
            dist.all_gather(gathered, flat, group=control_group())   # CPU copies: control plane
            state["swa"] = torch.stack(gathered)
        return state

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._runtime is None:             # restored before setup: apply in setup_sync
            self._pending = state
            return
        self._pending = None
        self.runtime.load_state_dict(state["schedule"])
        if self._swa_model is not None and "swa" in state:
            saved = state["swa"]
            if saved.shape[0] != self.world_size:
                raise ValueError(f"the checkpoint holds SWA models of {saved.shape[0]} ranks but this run has "
                                 f"{self.world_size}")
            offset = 0
            for t in self._swa_model:
                t.copy_(saved[self.global_rank, offset:offset + t.numel()].view_as(t))
                offset += t.numel()
