"""FlexReduce (Lee et al.): an all-reduce with uneven portions planned on the network tree.

The tree, the planner, the executor and the tree's cost are the exchange layer's
(``syncplane.exchanges.tree``: DiLoCo runs the same tree); this package declares the strategy
(``cost``: its patterns for the catalogue, ``bench``: its bench step and peers).
Glue: ``strategies/flexreduce.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from syncplane.algorithms.flexreduce.bench import FlexReduceStep, HierAllReduceStep
from syncplane.algorithms.flexreduce.cost import (
    flexreduce_levelwise_steps,
    flexreduce_steps,
    hierarchical_allreduce_steps,
)
from syncplane.exchanges.tree.tree import check_topology
from syncplane.job import JobContext
from syncplane.algorithms.spec import AlgorithmSpec, SyncStep


def _cost(name, profile, payload_bytes, options):  # type: ignore[no-untyped-def]
    pattern = {"flexreduce": flexreduce_steps, "flexreduce_levelwise": flexreduce_levelwise_steps,
               "hier_allreduce": hierarchical_allreduce_steps}[name]
    return pattern(name, profile, payload_bytes, options)


def _check_job(name: str, kwargs: Mapping[str, Any], job: JobContext) -> None:
    """The tree the all-reduce is planned on must exist and cover the job's ranks."""
    check_topology(kwargs.get("topology", "auto"), job)


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> SyncStep:
    if name == "hier_allreduce":
        return HierAllReduceStep(job)
    return FlexReduceStep(dict(options), job, chunk_bytes=0 if name == "flexreduce_levelwise" else None)


SPEC = AlgorithmSpec(
    family="flexreduce",
    strategies={"flexreduce": "DDP with FlexReduce: uneven all-reduce planned on the network tree (asymmetric hosts)"},
    bench_step=_step,
    cost=_cost,
    overlap={"flexreduce": "backward"},   # a DDP comm hook: buckets during the backward, as DDP's
    check_job=_check_job,
    exact=("flexreduce",),   # DDP's mean, summed in another order
)

#: Its peers in the bench: the paper's own schedule (levels one after the other) and the
#: plain 2-level hierarchical all-reduce (BlueConnect family) it is compared with.
PEERS = AlgorithmSpec(
    family="flexreduce",
    strategies={"flexreduce_levelwise": "FlexReduce as the paper runs it: one level after the other",
                "hier_allreduce": "2-level hierarchical all-reduce: reduce in the host, leaders' ring, broadcast"},
    bench_step=_step,
    cost=_cost,
    peer=True,
)
