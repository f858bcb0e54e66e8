"""What a "machine" is for the hierarchical forms (H-ATC / H-AWC): a policy, so it lives here
and not in the transport (``syncplane.comm`` only takes a machine size)."""

from __future__ import annotations

import torch.distributed as dist

from syncplane.cluster.probe import resolve_topology
from syncplane.comm.context import local_size_from_env

MACHINE_KINDS = ("host", "rack")


def machine_size(kind: str = "host") -> int:
    """Processes per machine.

    ``host``: the processes started per host (``LOCAL_WORLD_SIZE``). ``rack``: the ranks of
    one rack of the cluster the job runs on (the launcher's profile, else a bandwidth
    probe -- a collective); racks must be equal-sized and hold consecutive ranks.
    """
    if kind == "host":
        return local_size_from_env()
    if kind != "rack":
        raise ValueError(f"unknown machine kind {kind!r}; allowed values: {', '.join(MACHINE_KINDS)}")
    racks = resolve_topology("auto").racks
    size = len(racks[0])
    expected = [list(range(k * size, (k + 1) * size)) for k in range(len(racks))]
    if [sorted(r) for r in racks] != expected or size * len(racks) != dist.get_world_size():
        raise ValueError(f"machines=rack needs equal-sized racks of consecutive ranks, got racks {racks}")
    return size
