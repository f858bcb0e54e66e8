"""DS-Sync's α-β pattern: every step of one period of its group pattern, concurrent group
all-reduces (racks and bottlenecks as the strategy derives them from the profile)."""

from __future__ import annotations

from syncplane.algorithms.ds_sync.pattern import build_pattern
from syncplane.algorithms.spec import CostOptions
from syncplane.cluster.cost import Phase, concurrent_group_allreduces
from syncplane.cluster.probe import from_profile
from syncplane.cluster.profile import ClusterProfile


def ds_sync_steps(name: str, profile: ClusterProfile, payload_bytes: float,
                  options: CostOptions) -> list[list[Phase]]:
    """The phases of each step of one pattern period; pairs swap over ``options.streams``
    connections per direction."""
    topo = from_profile(profile)
    pattern = build_pattern(topo.racks, *topo.bottlenecks())
    return [concurrent_group_allreduces(groups, payload_bytes, options.streams) for groups in pattern.iterations]
