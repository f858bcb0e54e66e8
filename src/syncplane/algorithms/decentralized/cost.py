"""α-β patterns of the decentralized family (``syncplane simulate``, the bench's bound)."""

from __future__ import annotations

from syncplane.algorithms.decentralized.schedule import OnePeerSchedule
from syncplane.algorithms.spec import CostOptions
from syncplane.cluster.cost import Phase, columns_of, concurrent_group_allreduces, neighbor_exchange, per_connection
from syncplane.cluster.profile import ClusterProfile


def one_peer_steps(profile: ClusterProfile, payload_bytes: float, options: CostOptions) -> list[list[Phase]]:
    """ATC/AWC's dynamic one-peer exponential schedule: step t, rank r sends to r + 2^t."""
    schedule = OnePeerSchedule(profile.world_size)
    return [neighbor_exchange({r: list(schedule.plan(t, r).dst_weights) for r in range(profile.world_size)},
                              payload_bytes) for t in range(schedule.period)]


def rack_machines(profile: ClusterProfile) -> list[list[int]]:
    """The ranks of each rack: the "machines" of H-ATC/H-AWC when they group by rack."""
    return [[r for h in profile.hosts if h.rack == k for r in h.ranks] for k in range(len(profile.racks))]


def hierarchical_one_peer_steps(profile: ClusterProfile, payload_bytes: float,
                                options: CostOptions) -> list[list[Phase]]:
    """H-ATC/H-AWC with racks as machines (``hierarchical_neighbor_allreduce``'s data path):
    a reduce-scatter inside every rack (half a ring all-reduce), each owner exchanging its
    shards with the owners of the same shards on the neighbour rack (one-peer schedule over
    racks), then an all-gather inside the rack (the other half). Buckets are pipelined, so
    the three phases overlap: one step is modelled as a single phase carrying all their
    flows (each link's total load at its rate; one latency), the bytes between two ranks as
    one flow (the steps of a ring between a pair follow each other on one connection; counted
    apart, 28 "concurrent" flows per NIC on ``homogeneous8`` priced the step 2.6x too slow
    under ``EMULATED_TCP``'s per-flow loss). The payload is cut into L_max
    shards (the largest rack's size); shard s of a rack of L ranks is owned by its local
    rank s mod L, so on equal racks local rank ℓ exchanges shard ℓ with local rank ℓ."""
    machines = rack_machines(profile)
    shards = max(len(m) for m in machines)
    schedule = OnePeerSchedule(len(machines))
    half_ring = [flow for phase in concurrent_group_allreduces(machines, payload_bytes / 2) for flow in phase]
    steps = []
    for t in range(schedule.period):
        flows = [(m[s % len(m)], machines[k][s % len(machines[k])], payload_bytes / shards)
                 for mi, m in enumerate(machines) for s in range(shards) for k in schedule.plan(t, mi).dst_weights]
        steps.append([per_connection([columns_of(half_ring + flows + half_ring)], profile.world_size)])
    return steps
