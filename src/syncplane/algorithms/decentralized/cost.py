"""α-β patterns of the decentralized family (``syncplane simulate``, the bench's bound)."""

from __future__ import annotations

import math

from syncplane.algorithms.decentralized.engine import NEIGHBOR_BUCKET_BYTES
from syncplane.algorithms.decentralized.schedule import OnePeerSchedule
from syncplane.algorithms.spec import CostOptions
from syncplane.cluster.cost import Phase, columns_of, neighbor_exchange, per_connection
from syncplane.cluster.profile import ClusterProfile


def one_peer_steps(profile: ClusterProfile, payload_bytes: float, options: CostOptions) -> list[list[Phase]]:
    """ATC/AWC's dynamic one-peer exponential schedule: step t, rank r sends to r + 2^t. The
    buckets (``NEIGHBOR_BUCKET_BYTES``), all in flight at once, take a host's NICs in turn
    (bucket i's tag is i, on gloo's device i mod k, k = ``gloo_nics``): priced as
    min(buckets, k) pinned streams -- an odd count's busier NIC carries one bucket more than
    priced (13 of 25 at the ResNet-50 payload)."""
    schedule = OnePeerSchedule(profile.world_size)
    streams = min(math.ceil(payload_bytes / NEIGHBOR_BUCKET_BYTES), profile.gloo_nics)
    return [neighbor_exchange({r: list(schedule.plan(t, r).dst_weights) for r in range(profile.world_size)},
                              payload_bytes, streams) for t in range(schedule.period)]


def rack_machines(profile: ClusterProfile) -> list[list[int]]:
    """The ranks of each rack: the "machines" of H-ATC/H-AWC when they group by rack."""
    return [[r for h in profile.hosts if h.rack == k for r in h.ranks] for k in range(len(profile.racks))]


def hierarchical_one_peer_steps(profile: ClusterProfile, payload_bytes: float,
                                options: CostOptions) -> list[list[Phase]]:
    """H-ATC/H-AWC with racks as machines, as ``hierarchical_neighbor_allreduce_tensors`` runs
    it on the strategies' 4 MB buckets. Per bucket: the reduce-scatter inside every rack (each
    member sends every other the rows it owns: an all-to-all of B/L per pair, waited for; each
    message tagged by its pair, so a host's spread over its ``gloo_nics``),
    then the all-gather inside the rack (gloo's ring: L − 1 steps of B/L), while the exchange
    between racks runs asynchronously beside them (each owner sends its shards to the owners
    of the same shards on the neighbour rack: one-peer schedule over racks), spread evenly
    over those L phases and waited for only at the step's end (``FlowArray.beside``); in each
    phase the bytes between two ranks are one flow. The payload is cut into L_max shards (the
    largest rack's size); shard s of a rack of L ranks is owned by its local rank s mod L.
    Priced as one overlapped phase per step (2026-11-26), it was 21–52 % optimistic on the
    one-rack profiles of the 8 MB matrix, where the step is the all-to-all and the ring alone."""
    machines = rack_machines(profile)
    shards = max(len(m) for m in machines)
    schedule = OnePeerSchedule(len(machines))
    buckets = max(1, math.ceil(payload_bytes / NEIGHBOR_BUCKET_BYTES))
    bucket = payload_bytes / buckets
    scatter = [(a, b, bucket / len(m)) for m in machines for a in m for b in m if a != b]
    ring = [(m[i], m[(i + 1) % len(m)], bucket / len(m)) for m in machines if len(m) > 1 for i in range(len(m))]
    ring_steps = shards - 1 if ring else 0
    steps = []
    for t in range(schedule.period):
        # bucket i's exchange runs while bucket i − 1 is gathered and bucket i + 1 scattered:
        # spread over the bucket's 1 + (L − 1) phases, on links of its own where racks differ
        exchange = [(m[s % len(m)], machines[k][s % len(machines[k])], bucket / shards / (1 + ring_steps))
                    for mi, m in enumerate(machines) for s in range(shards) for k in schedule.plan(t, mi).dst_weights]
        aside = [columns_of(exchange)] if exchange else []
        scattered = per_connection([columns_of(scatter)], profile.world_size,
                                   streams=profile.gloo_nics, beside=aside)
        gathered = per_connection([columns_of(ring)], profile.world_size, beside=aside) if ring_steps else None
        # one object per repeated phase: the cost model evaluates consecutive repeats once
        steps.append([scattered, *[gathered] * ring_steps] * buckets)
    return steps
