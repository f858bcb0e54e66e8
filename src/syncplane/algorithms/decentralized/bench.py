"""The decentralized strategies' per-step exchange on a flat payload, for ``syncplane bench``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from syncplane.algorithms.decentralized.engine import NEIGHBOR_BUCKET_BYTES, NeighborAverager
from syncplane.algorithms.decentralized.machines import machines_for
from syncplane.job import JobContext
from syncplane.algorithms.decentralized.schedule import build_graph, build_schedule
from syncplane.comm import CommMeter
from syncplane.config import ConfigError


class NeighborAveragingStep:
    """ATC/AWC's per-step exchange: the strategies' own ``NeighborAverager`` on buckets of the
    payload, all launched, then all waited for (``options["one_way_links"]``, default on: a
    connection per direction; ``false`` or ``0`` turns it off). ``options["schedule"]``: ``one_peer``
    (default) or ``static`` (``options["topology"]``, default ExponentialTwoGraph). Buckets:
    the strategies' default. Hierarchical: machines are the racks of the launched profile
    (``options["machines"]="rack"``, the default) or the hosts (``"host"``). Steps of the
    one-peer schedule differ in cost (2^t flows cross a rack uplink at step t), so
    ``period`` makes the worker report the mean over whole periods."""

    def __init__(self, options: Mapping[str, Any], job: JobContext, hierarchical: bool = False) -> None:
        self.hierarchical = hierarchical
        self.bucket_mb = float(options.get("bucket_mb", NEIGHBOR_BUCKET_BYTES / 2**20))
        self.one_way_links = options.get("one_way_links", True)
        if self.one_way_links not in (True, False):     # 0 and 1 compare equal to them
            raise ConfigError(f"one_way_links: expected true or false (or 1, 0), got {self.one_way_links!r}")
        self.machines = machines_for(job, options.get("machines", "rack"))[1] if hierarchical else None
        participants = len(self.machines) if self.machines is not None else dist.get_world_size()
        graph = build_graph(options.get("topology", "ExponentialTwoGraph"), participants)
        self.schedule = build_schedule(options.get("schedule", "one_peer"), graph)
        self.period = self.schedule.period
        self.averager: NeighborAverager | None = None
        self.payload_ptr = -1

    def launch(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        if self.averager is None or self.payload_ptr != payload.data_ptr():
            bucket_bytes = int(self.bucket_mb * 2**20)
            per_bucket = bucket_bytes // payload.element_size()
            self.averager = NeighborAverager(payload.split(per_bucket), self.schedule, hierarchical=self.hierarchical,
                                             machines=self.machines, bucket_bytes=bucket_bytes,
                                             one_way_links=self.one_way_links)
            self.payload_ptr = payload.data_ptr()
        self.averager.meter = meter
        self.averager.launch(step)

    def wait(self) -> None:
        if self.averager is None:
            raise RuntimeError("wait() without launch()")
        self.averager.wait()

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        self.launch(payload, step, meter)
        self.wait()
