"""DS-Sync's α-β pattern: every step of one period of its group pattern, concurrent group
all-reduces (racks and bottlenecks as the strategy derives them from the profile); with
``max_staleness`` (cost pattern ``clique``) each group swaps as a clique instead, every member
sending the whole payload to every other one (``late_peers``): (|g|−1)·payload per member
where the ring sends 2(|g|−1)/|g|."""

from __future__ import annotations

from syncplane.algorithms.ds_sync.pattern import build_pattern
from syncplane.algorithms.spec import CostOptions, payload_bucket_streams
from syncplane.cluster.cost import Phase, concurrent_group_allreduces, neighbor_exchange
from syncplane.cluster.probe import from_profile
from syncplane.cluster.profile import ClusterProfile

#: The cost pattern of ``max_staleness`` > 0 (``SPEC.pattern``): the groups swap as cliques.
CLIQUE = "clique"


def ds_sync_steps(name: str, profile: ClusterProfile, payload_bytes: float,
                  options: CostOptions) -> list[list[Phase]]:
    """The phases of each step of one pattern period; pairs swap over ``options.streams``
    connections per direction (the ring), or every group is one clique exchange (``clique``)."""
    topo = from_profile(profile)
    pattern = build_pattern(topo.racks, *topo.bottlenecks())
    if options.pattern == CLIQUE:
        return [neighbor_exchange({r: [p for p in g if p != r] for g in groups if len(g) > 1 for r in g},
                                  payload_bytes) for groups in pattern.iterations]
    nic_streams = payload_bucket_streams(profile, payload_bytes)
    return [concurrent_group_allreduces(groups, payload_bytes, options.streams, nic_streams)
            for groups in pattern.iterations]
