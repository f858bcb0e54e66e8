"""DiLoCo (Douillard et al.): H local steps, then an outer step on the averaged pseudo-gradient.

``config`` (the settings), ``engine`` (the one round engine), ``outer`` / ``streaming`` (the
outer optimizer, Streaming DiLoCo's fragments), ``exchange`` / ``transport`` (the wire),
``layout`` (``replica: node``), ``adaptive`` / ``dealing`` (``inner_steps: time``), ``cost`` (the
price, ``streams: auto``), ``bench``, ``elastic`` / ``ft`` (elastic mode); the spec below. Glue:
``strategies/diloco.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from syncplane.algorithms.diloco.bench import DiLoCoStep, NodeStep, stream_count
from syncplane.algorithms.diloco.config import EXCHANGE_KEYS, DiLoCoConfig
from syncplane.algorithms.diloco.cost import diloco_cost, diloco_cpu
from syncplane.algorithms.diloco.exchange import EXCHANGES, STREAM_CHOICES
from syncplane.algorithms.diloco.layout import check_elastic_nodes, elastic_nodes, node_layout
from syncplane.algorithms.spec import AlgorithmSpec, ElasticLaunch, LaunchSettings, QuorumService, Switch
from syncplane.config import ConfigError
from syncplane.exchanges.tree.tree import check_topology
from syncplane.job import JobContext


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> DiLoCoStep | NodeStep:
    """``replica: node`` (or ``auto`` where it is node) times ``NodeStep``, else ``DiLoCoStep``."""
    if node_layout(str(options.get("replica", "rank")), "ddp", job) is not None:
        return NodeStep(options, job)
    return DiLoCoStep(options, job)


def _pattern(options: Mapping[str, Any]) -> str:
    """The bench's exchange: auto is the gather for sparse and the mesh for int8 (the tree is fp32 only)."""
    exchange, compression = str(options.get("exchange", "auto")), options.get("compression", "none")
    if exchange != "auto" or compression == "none":
        return exchange
    return "gather" if compression == "sparse" else "mesh"


def _check_job(name: str, kwargs: Mapping[str, Any], job: JobContext) -> None:
    """A topology the job names loads and covers its ranks (not an elastic replica's: it has no
    tree); ``replica: node``'s hosts divide the job (elastic: where the job is planned)."""
    replica = str(kwargs.get("replica", "rank"))
    if job.elastic is None:
        layout = node_layout(replica, str(kwargs.get("inner", "ddp")), job)
        if _elastic(kwargs):
            check_elastic_nodes(replica, layout.sizes if layout is not None else [1] * job.world_size)
    topology = kwargs.get("topology", "auto")
    if topology != "auto" and not kwargs.get("elastic", False):
        check_topology(topology, job)


def _elastic(kwargs: Mapping[str, Any]) -> bool:
    return bool(kwargs.get("elastic", False))


def _check_launch(name: str, kwargs: Mapping[str, Any], launch: LaunchSettings) -> None:
    """On an emulated cluster, an elastic job's quorum service binds host 0's first NIC."""
    if _elastic(kwargs) and launch.emulated and kwargs.get("lighthouse_host", "127.0.0.1") != "127.0.0.1":
        raise ConfigError(f"strategy.kwargs.lighthouse_host={kwargs['lighthouse_host']}: on an emulated cluster the "
                          "quorum service runs on host 0 and binds its first NIC; leave lighthouse_host unset")


def lighthouse_options(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The Lighthouse's settings for ``membership``: ``fixed`` waits ``join_timeout_s`` for every
    live replica (one is enough to start); ``quorum`` opens a window of ``grace_s`` (torchft's join
    timeout, counted from the first replica in) once ``min_replicas`` are in."""
    quorum = kwargs.get("membership", DiLoCoConfig.membership) == "quorum"
    return {"min_replicas": int(kwargs.get("min_replicas", DiLoCoConfig.min_replicas)) if quorum else 1,
            "join_timeout_s": float(kwargs.get("grace_s", DiLoCoConfig.grace_s) if quorum
                                    else kwargs.get("join_timeout_s", 60.0)),
            "heartbeat_timeout_s": float(kwargs.get("heartbeat_timeout_s", 5.0))}


def _start_lighthouse(host: str, **options: Any) -> QuorumService:
    """torchft's Lighthouse in this process (``ft.start_lighthouse``; imported here, when a job needs it)."""
    from syncplane.algorithms.diloco import ft

    return ft.start_lighthouse(host, **options)


#: elastic mode (``elastic=true``): replicas around torchft's Lighthouse (``ft``, ``elastic``)
ELASTIC = ElasticLaunch(
    enabled=_elastic,
    setting="strategy.kwargs.elastic=true",
    start=_start_lighthouse,
    timeouts=lighthouse_options,
    bind=lambda kwargs: str(kwargs.get("lighthouse_host", "127.0.0.1")),
    per_host=lambda kwargs, sizes: elastic_nodes(str(kwargs.get("replica", "rank")), sizes),
)

SWITCH_KEYS = EXCHANGE_KEYS   #: what a re-plan switches, on one rank per replica: how Δ travels


def _switch(strategy: Any, kwargs: Mapping[str, Any]) -> None:
    """Collective, at a round boundary: ``SWITCH_KEYS`` set to ``kwargs``' (defaults where absent).
    The outer state does not depend on them: it is carried over (sparse residuals start at zero)."""
    defaults = {f.name: f.default for f in dataclasses.fields(DiLoCoConfig)}
    strategy.switch_settings({key: kwargs.get(key, defaults[key]) for key in SWITCH_KEYS})


def _not_switched(kwargs: Mapping[str, Any]) -> str | None:
    if kwargs.get("replica", "rank") != "rank":
        return "diloco with replica=node holds its outer state sharded over a node; only replica=rank switches"
    return None


SPEC = AlgorithmSpec(
    family="diloco",
    strategies={"diloco": "DiLoCo: H local steps, then an outer Nesterov step on the gloo-averaged "
                          "pseudo-gradient (CPU outer state, sharded multi-stream sync)"},
    bench_step=_step,
    cost=diloco_cost,
    periodic=True,
    default_period={"diloco": DiLoCoConfig.sync_every},   # H as train.py's strategy=diloco runs it
    streams=stream_count,
    pattern=_pattern,
    check_job=_check_job,
    # the plan's candidates: S streams x the exchange of Δ (the gather carries the sparse codec), and a node
    # as one replica on S streams per shard (excluded, with the reason, where hosts run one rank each)
    variants={"diloco": (*({"streams": s, "exchange": e, **({"compression": "sparse"} if e == "gather" else {})}
                           for e in EXCHANGES for s in STREAM_CHOICES),
                         *({"replica": "node", "streams": s} for s in STREAM_CHOICES))},
    period_key="sync_every",
    cpu=diloco_cpu,
    check_launch=_check_launch,
    elastic=ELASTIC,
    switch=Switch(keys=SWITCH_KEYS, apply=_switch, refuse=_not_switched),
)
