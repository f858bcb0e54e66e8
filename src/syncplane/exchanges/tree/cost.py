"""FlexReduce's cost: the paper's Eq. 4–6 as phases of flows for ``syncplane.cluster.cost``.

The paper models level l of the reduce-scatter as T_l = max over the levels k ≤ l of the
slowest reduce-scatter of (n / Π degrees between k and l) items over the links of level
k (Eq. 5/6): the traffic of level l also crosses every lower link, and the slowest link
decides. Eq. 6 sums those levels, twice (the all-gather). As a pattern that is one
phase per level and direction, carrying the level's actual flows (holder → owner, from
the plan, so uneven hosts, rounding and the NIC/uplink sharing of the cost model are all
in it): ``CostModel`` charges each phase its busiest link -- Eq. 5's max over k -- plus
α, and sums the phases -- Eq. 6's sum.

Pipelined (what ``executor.FlexReduce`` runs by default), the same flows are cut into K
chunks and run as a wavefront: tick s carries 1/K of phase s − k of every chunk k in
flight, so the phases' loads on different links overlap and only the busiest link's
total remains, plus (2L − 1) ticks of fill and drain.

As the executor runs it: a root of two children is one swap phase (the reduce-scatter's
and the all-gather's flows at once: 2L − 1 phases), and what one rank sends another in a
phase or tick is one flow -- one connection per direction and stream, whatever number of
calls or chunks it carries -- so a per-flow cap (a WAN) applies to their sum.
"""

from __future__ import annotations

import math

from syncplane.exchanges.tree.executor import DEFAULT_CHUNK_BYTES
from syncplane.exchanges.tree.plan import Plan, pairwise_root, plan_for
from syncplane.exchanges.tree.tree import FlexTree
from syncplane.cluster.cost import FlowArray, Phase, columns_of, per_connection

ELEMENT_SIZE = 4   # the bench's payload is float32


def level_phases(plan: Plan, element_size: int = ELEMENT_SIZE, scale: float = 1.0,
                 swap_root: bool = False) -> list[Phase]:
    """The phases of one all-reduce: reduce-scatter levels up, all-gather levels down (2L);
    with ``swap_root`` the root's two phases are one (2L − 1)."""
    up = [plan.flows(level, element_size) for level in range(plan.num_levels)]
    down = [plan.flows(level, element_size, gather=True) for level in reversed(range(plan.num_levels))]
    phases = up[:-1] + [up[-1] + down[0]] + down[1:] if swap_root and up else up + down
    return [per_connection([columns_of(phase)], plan.world_size, scale) for phase in phases]


def flexreduce_phases(tree: FlexTree, payload_bytes: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                      element_size: int = ELEMENT_SIZE, swap_root: bool = True) -> list[Phase]:
    """FlexReduce of ``payload_bytes`` on ``tree``: level by level (``chunk_bytes=0``, the
    paper's schedule) or as the executor's wavefront over chunks; the root a swap where the
    executor makes it one (``swap_root=False``: the paper's root)."""
    numel = max(1, int(payload_bytes // element_size))
    phases = level_phases(plan_for(tree, numel), element_size, swap_root=swap_root and pairwise_root(tree))
    chunks = max(1, math.ceil(numel * element_size / chunk_bytes)) if chunk_bytes else 1
    if chunks == 1 or not phases:
        return phases
    # as columns: at 1,024 ranks a tick holds thousands of flows and there are ~100 ticks;
    # the steady state (every phase active) is one object, so the cost model prices it once
    columns = [columns_of(phase) for phase in phases]
    made: dict[tuple[int, ...], FlowArray] = {}
    ticks: list[Phase] = []
    for tick in range(chunks + len(phases) - 1):
        active = tuple(tick - k for k in range(chunks) if 0 <= tick - k < len(phases))
        if active not in made:
            made[active] = per_connection([columns[p] for p in active], tree.world_size, 1.0 / chunks, chunked=True)
        ticks.append(made[active])
    return ticks
