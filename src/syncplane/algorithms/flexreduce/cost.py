"""FlexReduce's patterns as the catalogue declares them (``syncplane simulate``, the bench's
bound): the strategy's pipelined tree, the paper's level-by-level schedule, and the plain
2-level hierarchical all-reduce it is compared with. The tree's own cost is
``syncplane.exchanges.tree.cost``."""

from __future__ import annotations

from syncplane.algorithms.spec import CostOptions
from syncplane.cluster.cost import Phase, ring_allreduce
from syncplane.cluster.profile import ClusterProfile
from syncplane.exchanges.tree.cost import flexreduce_phases
from syncplane.exchanges.tree.tree import from_profile


def flexreduce_steps(name: str, profile: ClusterProfile, payload_bytes: float,
                     options: CostOptions) -> list[list[Phase]]:
    """The ``flexreduce`` pattern (pipelined, as the strategy runs by default)."""
    return [flexreduce_phases(from_profile(profile), payload_bytes)]


def flexreduce_levelwise_steps(name: str, profile: ClusterProfile, payload_bytes: float,
                               options: CostOptions) -> list[list[Phase]]:
    """The paper's schedule: one level after the other (Eq. 6)."""
    return [flexreduce_phases(from_profile(profile), payload_bytes, chunk_bytes=0)]


def hierarchical_allreduce_steps(name: str, profile: ClusterProfile, payload_bytes: float,
                                 options: CostOptions) -> list[list[Phase]]:
    """The 2-level hierarchical peer: reduce to each host's first rank, the leaders' ring
    all-reduce, broadcast back inside the host (three phases)."""
    leaders = [h.first_rank for h in profile.hosts]
    reduce_in = [(r, h.first_rank, payload_bytes) for h in profile.hosts for r in h.ranks if r != h.first_rank]
    ring = ring_allreduce(len(leaders), payload_bytes, ranks=leaders)
    broadcast = [(d, s, b) for s, d, b in reduce_in]
    return [[p for p in [reduce_in, *ring, broadcast] if p]]
