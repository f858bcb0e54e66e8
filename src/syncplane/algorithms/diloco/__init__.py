"""DiLoCo (Douillard et al.): H local steps, then an outer step on the averaged pseudo-gradient.

Files: ``outer.py`` (the CPU outer optimizer and one round: Δ, average, step, commit or
discard), ``streaming.py`` (Streaming DiLoCo's fragments, overlap τ and mixing α),
``config.py`` (the validated settings), ``exchange.py`` (which all-reduce carries Δ: the
transport's sharded owner exchange, ``syncplane.comm.streams``, or FlexReduce's tree run on
the same S streams; their cost, and ``shards: auto``), ``bench.py``; the cost of a round
is declared below.
Glue: ``strategies/diloco.py`` (elastic mode: ``strategies/diloco_elastic.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from syncplane.algorithms.diloco.bench import DiLoCoStep
from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.exchange import EXCHANGES, STREAM_CHOICES, exchange_phases
from syncplane.exchanges.tree.tree import check_topology
from syncplane.job import JobContext
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions
from syncplane.cluster.cost import Phase
from syncplane.cluster.profile import ClusterProfile


def diloco_cost(name: str, profile: ClusterProfile, payload_bytes: float,
                options: CostOptions) -> list[list[Phase]]:
    """One exchange of Δ over ``streams`` shards, once per round of ``period`` steps: the
    mesh (every rank sends shard j to its owner j, owners send the mean back), the tree, or
    the gather of sparse pieces (``gather``: priced at the sparse codec's defaults, by racks
    else hosts) -- ``options.pattern`` as ``syncplane.exchanges.choose`` resolves it on this
    cluster (auto: the tree when ranks form hosts or racks)."""
    exchange = exchange_phases(profile, payload_bytes, options.streams, options.pattern)
    return [exchange] + [[] for _ in range(options.period - 1)]


def _pattern(options: Mapping[str, Any]) -> str:
    """The bench's exchange: int8 runs the mesh whatever auto would pick."""
    exchange = str(options.get("exchange", "auto"))
    return "mesh" if exchange == "auto" and options.get("compression", "none") != "none" else exchange


def _check_job(name: str, kwargs: Mapping[str, Any], job: JobContext) -> None:
    """A topology the job names must load and cover its ranks (an elastic replica is a job
    of one: it has no tree)."""
    topology = kwargs.get("topology", "auto")
    if topology != "auto" and not kwargs.get("elastic", False):
        check_topology(topology, job)


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> DiLoCoStep:
    return DiLoCoStep(options, job)


SPEC = AlgorithmSpec(
    family="diloco",
    strategies={"diloco": "DiLoCo: H local steps, then an outer Nesterov step on the gloo-averaged "
                          "pseudo-gradient (CPU outer state, sharded multi-stream sync)"},
    bench_step=_step,
    cost=diloco_cost,
    periodic=True,
    default_period={"diloco": DiLoCoConfig.sync_every},   # H as train.py's strategy=diloco runs it
    streams=lambda options: int(options.get("shards", 1)),
    pattern=_pattern,
    check_job=_check_job,
    # the plan's candidates: S streams x the exchange of Δ (the gather carries the sparse codec)
    variants={"diloco": tuple({"shards": s, "exchange": e, **({"compression": "sparse"} if e == "gather" else {})}
                              for e in EXCHANGES for s in STREAM_CHOICES)},
    period_key="sync_every",
)
