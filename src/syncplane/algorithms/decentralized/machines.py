"""What a "machine" is for the hierarchical forms (H-ATC / H-AWC): a policy, so it lives here
and not in the transport (``syncplane.comm`` takes each machine's ranks).

Machines may differ in size and hold non-consecutive ranks (``hierarchical_neighbor_allreduce``
shards by the largest machine); every rank must be in exactly one machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from syncplane.cluster.probe import resolve_topology
from syncplane.cluster.profile import ClusterProfile
from syncplane.comm.context import check_machines, consecutive_machines
from syncplane.comm.process_groups import control_group
from syncplane.job import JobContext

MACHINE_KINDS = ("auto", "host", "rack")
#: what the flat forms (``atc``/``awc``) mix on a profile with racks (``DecentralizedConfig.hierarchy``)
HIERARCHIES = ("auto", "none")


def mixes_racks(hierarchy: str, profile: ClusterProfile | None, max_staleness: int = 0) -> bool:
    """Whether ``atc``/``awc`` mix racks as ``h_atc``/``h_awc`` do (average inside each rack,
    one-peer schedule over racks) instead of ranks: ``auto`` does where the job's cluster
    profile has several racks and some rack holds several ranks. Flat gossip over the ranks
    puts 1, 2, 4, ... flows of the whole payload on an uplink at once and was measured slower
    than DDP on ``two_racks``, the rack mixing faster (docs/design-notes.md: the command).
    ``max_staleness`` keeps the flat form (the rack mixing cannot go on without a late
    machine). Pure: every rank, and the launcher, decide alike from the same profile."""
    if hierarchy not in HIERARCHIES:
        raise ValueError(f"unknown hierarchy {hierarchy!r}; allowed values: {', '.join(HIERARCHIES)}")
    if hierarchy == "none" or max_staleness or profile is None or len(profile.racks) < 2:
        return False
    return any(sum(len(h.ranks) for h in profile.hosts if h.rack == r) > 1 for r in range(len(profile.racks)))


def resolve_machines(kind: str = "auto", largest_host: int = 1) -> str:
    """``auto`` -> ``host`` when some host runs several ranks (a machine is then what the word
    says: the ranks sharing a host's NIC), else ``rack`` (one rank per host, as on the
    emulated ``two_racks``: a machine is a rack behind its uplink). Other kinds unchanged.

    ``largest_host``: the most ranks any host runs -- every rank must pass the same value, or
    ranks of a one-rank host and of a two-rank host would choose differently (``machines_for``
    gathers it)."""
    if kind not in MACHINE_KINDS:
        raise ValueError(f"unknown machine kind {kind!r}; allowed values: {', '.join(MACHINE_KINDS)}")
    if kind != "auto":
        return kind
    return "host" if largest_host > 1 else "rack"


def machines_for(job: JobContext, kind: str, ranks_per_machine: int | None = None,
                 world_size: int | None = None) -> tuple[str, list[list[int]]]:
    """(what a machine is, each machine's ranks) for the hierarchical forms: an explicit size
    (``ranks_per_machine`` consecutive ranks) wins over ``kind``. The first is reported in
    the run's summary. Collective for ``host``/``rack``/``auto`` (over the control group);
    call it on every rank."""
    world = dist.get_world_size() if world_size is None else world_size
    if ranks_per_machine:
        if world % ranks_per_machine:
            raise ValueError(f"world size {world} is not a multiple of ranks_per_machine {ranks_per_machine}")
        return "explicit", consecutive_machines(world, ranks_per_machine)
    if kind not in MACHINE_KINDS:
        resolve_machines(kind)                       # the error names the allowed values
    launched = _gather_launch(job)
    kind = resolve_machines(kind, largest_host=max(size for _, size in launched))
    if kind == "host":
        return "host", host_machines(launched)
    racks = resolve_topology(job, "auto", group=control_group()).racks
    return "rack", check_machines(racks, world)


def _gather_launch(job: JobContext) -> list[tuple[str | None, int]]:
    """Every rank's (node id, ``LOCAL_WORLD_SIZE``) as launched (``job.node_rank``: the
    launcher's ``GROUP_RANK`` or ``NODE_RANK``, None without either)."""
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (job.node_rank, job.local_world_size or 1), group=control_group())
    return [(None if n is None else str(n), int(s)) for n, s in gathered]  # type: ignore[misc]


def host_machines(launched: Sequence[tuple[str | None, int]]) -> list[list[int]]:
    """Machines = hosts, from every rank's (node id, ``LOCAL_WORLD_SIZE``): the ranks of one node
    id form a machine (hosts of different sizes, any rank order); without node ids, blocks of
    ``LOCAL_WORLD_SIZE`` consecutive ranks, which must then be one size."""
    world = len(launched)
    if all(node is not None for node, _ in launched):
        machines: dict[str, list[int]] = {}
        for rank, (node, _) in enumerate(launched):
            machines.setdefault(str(node), []).append(rank)
        for ranks in machines.values():
            declared = {launched[r][1] for r in ranks}
            if declared != {len(ranks)}:
                raise ValueError(f"machines=host: the ranks {ranks} of one node (GROUP_RANK) declare "
                                 f"LOCAL_WORLD_SIZE {sorted(declared)}, but the node runs {len(ranks)}")
        return list(machines.values())
    sizes = sorted({size for _, size in launched})
    if len(sizes) > 1:
        raise ValueError(f"machines=host: hosts run different numbers of ranks (LOCAL_WORLD_SIZE {sizes}) "
                         "but GROUP_RANK (the launcher's node rank) is not set on every rank; set it, or "
                         "use machines=rack or ranks_per_machine")
    return consecutive_machines(world, sizes[0])
