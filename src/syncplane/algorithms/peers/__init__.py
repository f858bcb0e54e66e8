"""Peers from torch itself, benchmarked beside ours: ``PeriodicModelAverager`` (what
``PostLocalSGDOptimizer`` runs) and ``HierarchicalModelAverager``. No syncplane strategy
trains with them; they answer "what would I get from torch alone?"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from syncplane.algorithms.peers.bench import TorchHierarchicalAveraging, TorchPeriodicAveraging
from syncplane.job import JobContext
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions, SyncStep
from syncplane.cluster.cost import Phase, ring_allreduce
from syncplane.cluster.profile import ClusterProfile


#: torch's averagers take a period and have no default: the one they are benchmarked at
PERIOD = 4


def periodic_allreduce_cost(name: str, profile: ClusterProfile, payload_bytes: float,
                            options: CostOptions) -> list[list[Phase]]:
    """One ring all-reduce of the parameters every ``period`` steps, nothing in between."""
    return [ring_allreduce(profile.world_size, payload_bytes)] + [[] for _ in range(options.period - 1)]


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> SyncStep:
    period = int(options.get("period", PERIOD))
    return TorchPeriodicAveraging(period) if name == "torch_periodic" else TorchHierarchicalAveraging(period, job)


SPEC = AlgorithmSpec(
    family="peers",
    strategies={"torch_periodic": "torch's PeriodicModelAverager: all-reduce the parameters every period steps",
                "torch_hierarchical": "torch's HierarchicalModelAverager: average in the host, then globally"},
    bench_step=_step,
    cost=periodic_allreduce_cost,   # torch_hierarchical: its global round only (its in-host rounds come on top)
    periodic=True,
    default_period={"torch_periodic": PERIOD, "torch_hierarchical": PERIOD},
    peer=True,
)
