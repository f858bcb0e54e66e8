"""DiLoCo (Douillard et al.): H local steps, then an outer step on the averaged pseudo-gradient.

Files: ``outer.py`` (the CPU outer optimizer and one round: Δ, average, step, commit or
discard), ``streaming.py`` (Streaming DiLoCo's fragments, overlap τ and mixing α),
``config.py`` (the validated settings), ``bench.py``; its exchange is the transport's sharded
owner all-reduce (``syncplane.comm.sharded``), whose cost is declared below.
Glue: ``strategies/diloco.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from syncplane.algorithms.diloco.bench import DiLoCoStep
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions
from syncplane.cluster.cost import Phase, owner_exchange
from syncplane.cluster.profile import ClusterProfile


def diloco_cost(name: str, profile: ClusterProfile, payload_bytes: float,
                options: CostOptions) -> list[list[Phase]]:
    """One owner exchange of Δ (every rank sends shard j to its owner j, owners send the
    mean back) over ``streams`` shards, once per round of ``period`` steps."""
    exchange = owner_exchange(profile.world_size, payload_bytes, options.streams)
    return [exchange] + [[] for _ in range(options.period - 1)]


def _step(name: str, options: Mapping[str, Any]) -> DiLoCoStep:
    return DiLoCoStep(options)


SPEC = AlgorithmSpec(
    family="diloco",
    strategies={"diloco": "DiLoCo: H local steps, then an outer Nesterov step on the gloo-averaged "
                          "pseudo-gradient (CPU outer state, sharded multi-stream sync)"},
    bench_step=_step,
    cost=diloco_cost,
    periodic=True,
    streams=lambda options: int(options.get("shards", 1)),
)
