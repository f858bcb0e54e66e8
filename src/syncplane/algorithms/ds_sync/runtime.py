"""DS-Sync's runtime for a detected topology: the pattern from its racks and bottlenecks,
re-measured under contention by probing the pairs again (``syncplane.cluster.probe``)."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from syncplane.algorithms.ds_sync.engine import DSSync, Reprobe
from syncplane.algorithms.ds_sync.config import DSSyncConfig
from syncplane.cluster.probe import Topology, measure_rounds, resolve_topology, round_robin_rounds, table_text
from syncplane.comm.process_groups import control_group
from syncplane.job import JobContext


def reprober(topo: Topology, nbytes: int = 2**20, slow_factor: float = 0.5) -> Reprobe:
    """DS-Sync's re-measurement under contention: probe every pair again (racks and hosts
    stay as detected) and report the bandwidth with the bottlenecks it shows now."""
    def run() -> tuple[np.ndarray, list[int], list[int]]:
        bw, lat = measure_rounds(round_robin_rounds(dist.get_world_size()), nbytes, group=control_group())
        np.fill_diagonal(bw, np.inf)
        now = Topology(racks=topo.racks, hosts=topo.hosts, bandwidth=bw, latency=lat, source="re-probe")
        slow_ranks, slow_racks = now.bottlenecks(slow_factor)
        return bw, slow_ranks, slow_racks

    return run


def ds_sync_for(topo: Topology, config: DSSyncConfig) -> DSSync:
    """Collective: the DS-Sync runtime for ``topo`` (pattern from its racks and bottlenecks;
    pairs swap over ``config.pair_streams`` connections per direction, or ``"auto"``: timed)."""
    slow_ranks, slow_racks = topo.bottlenecks(config.slow_factor)
    return DSSync(topo.racks, topo.bandwidth, slow_ranks, slow_racks, adjust_every=config.adjust_every,
                  imbalance=config.imbalance, reprobe=reprober(topo, config.probe_bytes, config.slow_factor),
                  pair_streams=config.pair_streams, max_staleness=config.max_staleness,
                  late_after_s=config.late_after_s)


def ds_sync_for_job(job: JobContext, config: DSSyncConfig) -> tuple[DSSync, str]:
    """DS-Sync for this job (a collective: probes the network when ``config.topology`` says so,
    over the control group, then builds every group): the runtime, and the topology as a
    table for the log."""
    topo = resolve_topology(job, config.topology, config.probe_bytes, group=control_group())
    return ds_sync_for(topo, config), table_text(topo, config.slow_factor)
