"""Decentralized neighbour averaging (BlueFog §V): ATC, AWC and their hierarchical forms.

Files: ``schedule.py`` (static and one-peer mixing schedules, by formula), ``engine.py``
(``NeighborAverager``: fused buckets mixed without blocking), ``machines.py`` (what a
machine is for H-ATC/H-AWC), ``config.py`` (the validated settings), ``cost.py`` (α-β
patterns), ``bench.py`` (the bench step). Glue: ``strategies/decentralized.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from syncplane.algorithms.decentralized.bench import NeighborAveragingStep
from syncplane.algorithms.decentralized.cost import hierarchical_one_peer_steps, one_peer_steps
from syncplane.algorithms.decentralized.machines import HIERARCHIES, machines_for, mixes_racks
from syncplane.job import JobContext
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions
from syncplane.cluster.cost import Phase
from syncplane.cluster.profile import ClusterProfile


def _hierarchical(name: str) -> bool:
    return name.startswith("h_")


def decentralized_cost(name: str, profile: ClusterProfile, payload_bytes: float,
                       options: CostOptions) -> list[list[Phase]]:
    """One period of the one-peer schedule, over ranks or over racks (``h_*``, and ``atc``/``awc``
    where ``hierarchy``, ``options.pattern`` here, mixes racks on this profile)."""
    racks = _hierarchical(name) or mixes_racks(_hierarchy({"hierarchy": options.pattern}), profile)
    pattern = hierarchical_one_peer_steps if racks else one_peer_steps
    return pattern(profile, payload_bytes, options)


def _check_job(name: str, kwargs: Mapping[str, Any], job: JobContext) -> None:
    """An explicit machine size must divide the job's ranks (the rest is decided on the ranks)."""
    if _hierarchical(name) and kwargs.get("ranks_per_machine"):
        machines_for(job, "auto", kwargs["ranks_per_machine"], job.world_size)


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> NeighborAveragingStep:
    if not _hierarchical(name) and mixes_racks(_hierarchy(options), job.profile):
        return NeighborAveragingStep({**options, "machines": "rack"}, job, hierarchical=True)
    return NeighborAveragingStep(options, job, hierarchical=_hierarchical(name))


def _hierarchy(options: Mapping[str, Any]) -> str:
    """``hierarchy`` of a bench row or variant (``atc[hierarchy=none]``); a value that is not
    one (another family's ``exchange`` shared through the cost options) means the default."""
    value = str(options.get("hierarchy") or "auto")
    return value if value in HIERARCHIES else "auto"


SPEC = AlgorithmSpec(
    family="decentralized",
    strategies={
        "atc": "decentralized adapt-then-combine: local step, then neighbour averaging (overlapped)",
        "awc": "decentralized adapt-while-combine: neighbour averaging overlapped with forward+backward",
        "h_atc": "hierarchical ATC: average inside each machine, neighbour averaging across machines",
        "h_awc": "hierarchical AWC: machine-level neighbour averaging overlapped with forward+backward",
    },
    bench_step=_step,
    cost=decentralized_cost,
    # ATC's exchange runs behind the next forward (each module waits for its own buckets),
    # AWC's behind forward and backward (combined before the update).
    overlap={"atc": "forward", "h_atc": "forward", "awc": "step", "h_awc": "step"},
    pattern=_hierarchy,     # atc/awc: whether they mix racks on a profile with racks
    check_job=_check_job,
)
