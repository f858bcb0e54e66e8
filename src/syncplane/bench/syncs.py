"""The communication each strategy performs per training step, on a flat payload.

Benchmarks call these instead of training so that a 100 MB model's sync can be timed
on 2 CPU cores. Each entry is exactly the comm-layer call its strategy makes; a
strategy that has not landed has no entry and is reported as not implemented.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from syncplane.algorithms.flexreduce import bench as flexreduce_bench
from syncplane.comm import CommMeter, ring_allreduce_bytes
from syncplane.comm.averaging import NEIGHBOR_BUCKET_BYTES

DDP_BUCKET_BYTES = 25 * 2**20   # torch DDP's default bucket_cap_mb

SyncFn = Callable[[torch.Tensor, int, CommMeter], None]


class DDPStep:
    """DDP's gradient all-reduce: 25 MB buckets, launched asynchronously, averaged.
    ``launch``/``wait`` let the worker run the backward pass in between (``OVERLAP``)."""

    def __init__(self, spec: dict) -> None:
        self._pending: tuple[torch.Tensor, list, float, CommMeter] | None = None

    def launch(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        per_bucket = DDP_BUCKET_BYTES // payload.element_size()
        start = time.perf_counter()
        self._pending = (payload, [dist.all_reduce(c, async_op=True) for c in payload.split(per_bucket)], start, meter)

    def wait(self) -> None:
        assert self._pending is not None, "wait() without launch()"
        payload, works, start, meter = self._pending
        self._pending = None
        for work in works:
            work.wait()
        n = dist.get_world_size()
        payload.div_(n)
        meter.record(start, time.perf_counter(), ring_allreduce_bytes(payload.numel() * payload.element_size(), n))

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        self.launch(payload, step, meter)
        self.wait()


class TorchPeriodicAveraging:
    """torch's own ``PeriodicModelAverager`` (what ``PostLocalSGDOptimizer`` runs after
    each local step): the parameters are all-reduced every ``period`` steps. A real peer
    for local-SGD-style strategies, timed through the same bench."""

    def __init__(self, period: int) -> None:
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        self.period = period
        self.averager = PeriodicModelAverager(period=period, warmup_steps=0)

    @staticmethod
    def as_parameter(payload: torch.Tensor) -> torch.nn.Parameter:
        """torch's averagers take parameters that have a gradient; a zero-stride view
        stands in for the gradient so the payload is not duplicated in memory."""
        param = torch.nn.Parameter(payload, requires_grad=True)
        param.grad = torch.zeros(1, dtype=payload.dtype).expand_as(payload)
        return param

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        averaging = self.averager.step % self.period == 0
        start = time.perf_counter()
        self.averager.average_parameters([self.as_parameter(payload)])
        if averaging:
            meter.record(start, time.perf_counter(),
                         ring_allreduce_bytes(payload.numel() * payload.element_size(), dist.get_world_size()))


class TorchHierarchicalAveraging(TorchPeriodicAveraging):
    """torch's ``HierarchicalModelAverager``: average inside each host every step's
    ``period // 2`` and across all ranks every ``period`` (hosts = LOCAL_WORLD_SIZE ranks)."""

    def __init__(self, period: int) -> None:
        import os

        from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
            HierarchicalModelAverager,
        )

        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        world = dist.get_world_size()
        if local <= 1 or world % local or local == world:
            raise ValueError("torch_hierarchical needs several hosts with the same number (>1) of ranks each")
        self.period = period
        inner = max(1, period // 2)
        self.averager = HierarchicalModelAverager(period_group_size_dict={inner: local, period: world},
                                                  warmup_steps=0)

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        start = time.perf_counter()
        self.averager.average_parameters([self.as_parameter(payload)])
        meter.record(start, time.perf_counter(), 0)   # bytes: see the NIC counters


class DSSyncStep:
    """DS-Sync's per-step sync: the strategy's own runtime (``syncplane.comm.ds_sync``) on the
    topology the ranks run on (the launcher's cluster profile, else a probe); the payload
    travels in DDP-sized buckets, one group all-reduce per step, all groups concurrently.
    ``spec["adjust_every"]`` (default 0) turns the contention check on; ``spec["pair_streams"]``
    (default ``"auto"``, as the strategy) is the number of connections per direction a pair
    swaps over; ``auto``'s trial runs in the warm-up (``warmup`` steps at least)."""

    def __init__(self, spec: dict) -> None:
        from syncplane.cluster import probe

        topo = probe.resolve_topology("auto")
        self.runtime = probe.ds_sync_for(topo, adjust_every=int(spec.get("adjust_every", 0)),
                                         pair_streams=spec.get("pair_streams", "auto"))
        self.warmup = self.runtime.streams.trial_length if self.runtime.streams.trial_from is not None else 0
        self._buckets: tuple[int, list] | None = None

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        from syncplane.comm import make_buckets

        if self._buckets is None or self._buckets[0] != payload.data_ptr():
            per_bucket = DDP_BUCKET_BYTES // payload.element_size()
            self._buckets = (payload.data_ptr(), make_buckets(payload.split(per_bucket), DDP_BUCKET_BYTES))
        self.runtime.sync_(self._buckets[1], meter)

    def describe(self) -> str:
        return f"ds_sync {self.runtime.streams.describe()}"


class NeighborAveragingStep:
    """ATC/AWC's per-step exchange: the strategies' own ``NeighborAverager`` on buckets of the
    payload, all launched, then all waited for. ``spec["schedule"]``:
    ``one_peer`` (default) or ``static`` (``spec["topology"]``, default ExponentialTwoGraph).
    Buckets: the strategies' default (``NEIGHBOR_BUCKET_BYTES``). Hierarchical: machines are
    the racks of the launched profile (``spec["machines"]="rack"``, the default) or the
    hosts (``"host"``). Steps of the one-peer schedule differ in cost
    (2^t flows cross a rack uplink at step t), so ``period`` makes the worker report the
    mean over whole periods."""

    def __init__(self, spec: dict, hierarchical: bool = False) -> None:
        from syncplane.comm import topology
        from syncplane.comm.context import machine_size
        from syncplane.comm.schedule import build_schedule

        self.hierarchical = hierarchical
        self.bucket_mb = float(spec.get("bucket_mb", NEIGHBOR_BUCKET_BYTES / 2**20))
        self.local = machine_size(spec.get("machines", "rack")) if hierarchical else 1
        graph = getattr(topology, spec.get("topology", "ExponentialTwoGraph"))(dist.get_world_size() // self.local)
        self.schedule = build_schedule(spec.get("schedule", "one_peer"), graph)
        self.period = self.schedule.period
        self.averager = None
        self.payload_ptr = -1

    def launch(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        from syncplane.comm.averaging import NeighborAverager

        if self.averager is None or self.payload_ptr != payload.data_ptr():
            bucket_bytes = int(self.bucket_mb * 2**20)
            per_bucket = bucket_bytes // payload.element_size()
            self.averager = NeighborAverager(payload.split(per_bucket), self.schedule, hierarchical=self.hierarchical,
                                             local_size=self.local, bucket_bytes=bucket_bytes)
            self.payload_ptr = payload.data_ptr()
        self.averager.meter = meter
        self.averager.launch(step)

    def wait(self) -> None:
        assert self.averager is not None, "wait() without launch()"
        self.averager.wait()

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        self.launch(payload, step, meter)
        self.wait()


class DiLoCoStep:
    """DiLoCo's sync on the payload (the strategy's own comm pieces): every ``period`` (= H)
    steps, Δ = θ_g − θ_local on CPU, its mean over ranks on ``spec["shards"]`` concurrent gloo
    streams (``spec["compression"]``: none | int8), an outer step, θ_local ← θ_g; nothing on
    the other steps. ``period`` makes the worker report the mean per step over whole rounds."""

    def __init__(self, spec: dict) -> None:
        from syncplane.comm.codecs import make_codec
        from syncplane.comm.sharded import ShardedAllReduce

        self.period = int(spec.get("period", 4))
        self.allreduce = ShardedAllReduce(int(spec.get("shards", 1)), codec=make_codec(spec.get("compression", "none")))
        self.outer = None
        self.flat = torch.empty(0)

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        from syncplane.comm.outer import OuterOptimizer

        if self.outer is None or self.flat.numel() != payload.numel():
            self.outer, self.flat = OuterOptimizer(payload), torch.empty_like(payload)
        if (step + 1) % self.period:
            return
        self.flat.copy_(payload)
        if self.outer.round_(self.flat, lambda flat: self.allreduce.allreduce_mean_(flat, meter)):
            payload.copy_(self.flat)


#: name -> factory(spec) -> sync function. Peers (torch's own algorithms) sit beside ours.
SYNCS: dict[str, Callable[[dict], SyncFn]] = {
    "ddp": DDPStep,
    "torch_periodic": lambda spec: TorchPeriodicAveraging(spec.get("period", 4)),
    "torch_hierarchical": lambda spec: TorchHierarchicalAveraging(spec.get("period", 4)),
    "ds_sync": DSSyncStep,
    "atc": NeighborAveragingStep,
    "awc": NeighborAveragingStep,          # the same exchange, started before the forward instead of after
    "h_atc": lambda spec: NeighborAveragingStep(spec, hierarchical=True),
    "h_awc": lambda spec: NeighborAveragingStep(spec, hierarchical=True),
    "diloco": DiLoCoStep,
    "flexreduce": flexreduce_bench.FlexReduceStep,
    "flexreduce_levelwise": lambda spec: flexreduce_bench.FlexReduceStep(spec, chunk_bytes=0),
    "hier_allreduce": flexreduce_bench.HierAllReduceStep,
}

#: The part of a training step each strategy's sync runs behind, as its strategy schedules
#: it: DDP's buckets during the backward (generous to DDP: all of them from its start),
#: ATC's exchange during the next forward (each module waits for its own buckets),
#: AWC's during forward and backward (combined before the update). The rest block.
#: The worker splits ``compute_ms`` 1 : 2 into forward and backward (their FLOP ratio).
OVERLAP: dict[str, str] = {"ddp": "backward", "flexreduce": "backward", "atc": "forward", "h_atc": "forward", "awc": "step", "h_awc": "step"}


def compute_split(window: str | None, compute_s: float) -> tuple[float, float, float]:
    """(before launch, between launch and wait, after wait) seconds of one step's compute,
    forward : backward = 1 : 2, for a sync that runs behind ``window``."""
    forward, backward = compute_s / 3, 2 * compute_s / 3
    return {None: (compute_s, 0.0, 0.0), "backward": (forward, backward, 0.0),
            "forward": (0.0, forward, backward), "step": (0.0, compute_s, 0.0)}[window]


#: Real peers from other projects, benchmarked next to our strategies.
PEERS = ("torch_periodic", "torch_hierarchical", "hier_allreduce",
         "flexreduce_levelwise")   # FlexReduce run as the paper does, one level after the other

#: Every product strategy name (design.md §3), implemented or not.
ALL_STRATEGIES = ("ddp", "atc", "awc", "h_atc", "h_awc", "ds_sync", "diloco", "flexreduce", "canary")

#: Payload presets: the real parameter bytes of the reference models (float32).
PRESETS_BYTES = {"resnet50": 25_557_032 * 4, "bert_large": 335_141_888 * 4}
