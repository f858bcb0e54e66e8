"""What a "machine" is for the hierarchical forms (H-ATC / H-AWC): a policy, so it lives here
and not in the transport (``syncplane.comm`` only takes a machine size)."""

from __future__ import annotations

import torch.distributed as dist

from syncplane.cluster.probe import resolve_topology
from syncplane.comm.context import local_size_from_env
from syncplane.comm.process_groups import control_group

MACHINE_KINDS = ("auto", "host", "rack")


def resolve_machines(kind: str = "auto") -> str:
    """``auto`` -> ``host`` when hosts run several ranks (a machine is then what the word
    says: the ranks sharing a host's NIC), else ``rack`` (one rank per host, as on the
    emulated ``two_racks``: a machine is a rack behind its uplink). Other kinds unchanged."""
    if kind not in MACHINE_KINDS:
        raise ValueError(f"unknown machine kind {kind!r}; allowed values: {', '.join(MACHINE_KINDS)}")
    if kind != "auto":
        return kind
    return "host" if local_size_from_env() > 1 else "rack"


def machines_for(kind: str, ranks_per_machine: int | None = None) -> tuple[str, int]:
    """(what a machine is, ranks per machine) for the hierarchical forms: an explicit size
    wins over ``kind``. The first is reported in the run's summary."""
    if ranks_per_machine:
        return "explicit", ranks_per_machine
    return resolve_machines(kind), machine_size(kind)


def machine_size(kind: str = "auto") -> int:
    """Processes per machine.

    ``host``: the processes started per host (``LOCAL_WORLD_SIZE``). ``rack``: the ranks of
    one rack of the cluster the job runs on (the launcher's profile, else a bandwidth
    probe -- a collective); racks must be equal-sized and hold consecutive ranks.
    ``auto``: see ``resolve_machines``.
    """
    kind = resolve_machines(kind)
    if kind == "host":
        return local_size_from_env()
    racks = resolve_topology("auto", group=control_group()).racks
    size = len(racks[0])
    expected = [list(range(k * size, (k + 1) * size)) for k in range(len(racks))]
    if [sorted(r) for r in racks] != expected or size * len(racks) != dist.get_world_size():
        raise ValueError(f"machines=rack needs equal-sized racks of consecutive ranks, got racks {racks}")
    return size
