"""DiLoCo's price (``SPEC.cost``, ``SPEC.cpu``: ``syncplane simulate``, the plan, the bench's
bound): a replica per rank, one exchange of Δ per round (``exchange_phases``); ``replica: node``,
DDP inside each node every step and at the round's end the shards' exchanges across nodes and
θ_g's all-gather in each node (``node_cost``).

``streams: auto``: on the job's cluster profile (or ``topology``'s), the fewest of
``STREAM_CHOICES`` within 10 % of the best bound (as many TCP connections as a per-flow-capped
link needs; the bound scales with the payload, so the model does not matter); 1 without one."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from syncplane.algorithms.diloco.exchange import EXCHANGES, STREAM_CHOICES, carried, delta_codec
from syncplane.algorithms.diloco.layout import ReplicaLayout, check_replica, node_layout
from syncplane.algorithms.spec import CostOptions
from syncplane.cluster.cost import CostModel, FlowArray, Phase, concurrent_group_allreduces
from syncplane.cluster.profile import ClusterProfile
from syncplane.comm import ChunkedTopK
from syncplane.comm.codecs import Codec
from syncplane.config import ConfigError
from syncplane.exchanges import Choice, JobShape, choose
from syncplane.exchanges import gather, mesh
from syncplane.exchanges.cpu import CpuWork, runner_work
from syncplane.exchanges.tree import exchange as tree
from syncplane.job import JobContext

log = logging.getLogger(__name__)


def diloco_cost(name: str, profile: ClusterProfile, payload_bytes: float,
                options: CostOptions) -> list[list[Phase]]:
    """One round of ``period`` steps: ``node_cost`` where ``options.replica`` is node on this cluster
    (a ConfigError naming it where it cannot run), else one ``exchange_phases`` at its start."""
    try:
        check_replica(options.replica, "ddp")
        layout = node_layout(options.replica, "ddp", JobContext.planned(profile.world_size, profile))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if layout is not None:
        codec = _codec(options, options.compression)
        return node_cost(layout, payload_bytes, options.period, options.streams, codec, options.compression == "sparse")
    exchange = exchange_phases(profile, payload_bytes, options.streams, options.pattern, options.compression,
                               _codec(options, carried(options.pattern, options.compression)))
    return [exchange] + [[] for _ in range(options.period - 1)]


def _codec(options: CostOptions, compression: str) -> Codec:
    return delta_codec(compression, density=options.density, bits=options.bits)


def exchange_phases(profile: ClusterProfile, payload_bytes: float, streams: int, exchange: str = "auto",
                    compression: str = "none", codec: Codec | None = None) -> list[Phase]:
    """One all-reduce of Δ (``payload_bytes`` of fp32) on ``streams`` streams, as ``exchange``
    resolves on this cluster. The gather is priced with its pieces' size: ``codec``'s, else
    the sparse codec's at DiLoCo's default density, bits and chunk (``--exchange gather``)."""
    compression = carried(exchange, compression)
    chosen = _priced_choice(profile, exchange, compression)
    if chosen.name == "gather":
        sparse = codec if codec is not None else ChunkedTopK()
        return gather.cost(profile.world_size, sparse.nbytes(int(payload_bytes // 4)), streams,
                           gather.groups_of(profile))
    if chosen.name == "tree" and profile.world_size > 1:
        return tree.cost(profile, payload_bytes, streams)
    if codec is not None:   # the mesh carries coded shards both ways (int8: about a quarter)
        numel = max(int(payload_bytes // 4), 1)
        payload_bytes = payload_bytes * codec.nbytes(numel) / (4 * numel)
    return mesh.cost(profile.world_size, payload_bytes, streams)


def _priced_choice(profile: ClusterProfile, exchange: str, compression: str) -> Choice:
    """The exchange the price assumes on ``profile`` (``compression`` as ``carried`` says)."""
    return choose(exchange, JobShape.of_profile(profile), allowed=EXCHANGES, exact=compression == "none",
                  strict=False, sparse=compression == "sparse")


#: fp32 passes over the model per round around the exchange: the copy in, Δ = θ_g − θ_local,
#: the outer Nesterov step (momentum scaled and added, the Nesterov gradient, the update),
#: θ_g back into the buffer and the buffer back into the model (``DiLoCoStep``, ``OuterOptimizer``)
OUTER_PASSES = 8


def diloco_cpu(name: str, profile: ClusterProfile, payload_bytes: float, options: CostOptions) -> CpuWork:
    """One rank's CPU work in one round at ``options``' codec (``syncplane.exchanges.cpu``): the outer
    step's passes and the runner's copies, plus the chosen exchange's coding and sums (the tree's
    sums are not modelled: it carries fp32 and reduces inside gloo's sends)."""
    compression = carried(options.pattern, options.compression)
    codec = _codec(options, compression)
    numel = max(int(payload_bytes // 4), 1)
    chosen = _priced_choice(profile, options.pattern, compression)
    work = CpuWork.adds(OUTER_PASSES * numel)
    n = profile.world_size
    if chosen.name == "gather":
        return work + gather.cpu_work(n, numel, codec) + runner_work(numel)
    if chosen.name == "tree":
        return work + runner_work(numel)
    return work + mesh.cpu_work(n, numel, codec)       # decoded into place: no runner's copy


def auto_streams(profile: ClusterProfile, exchange: str = "auto", compression: str = "none",
                 within: float = 1.1) -> tuple[int, dict[int, float]]:
    """``streams: auto`` on ``profile`` (module doc): S, and the bound in seconds per GB of each
    candidate (what the log shows)."""
    model = CostModel(profile, alpha_s=0.0)
    bounds = {s: model.bound(exchange_phases(profile, 1e9, s, exchange, compression)) for s in STREAM_CHOICES}
    best = min(bounds.values())
    return next(s for s in STREAM_CHOICES if bounds[s] <= best * within), bounds


def resolve_streams(streams: int | str, job: JobContext, topology: str | Sequence[int] = "auto",
                   exchange: str = "auto", compression: str = "none") -> int:
    """The stream count for ``streams`` (an int, or ``auto``: see the module doc); logs the
    choice. The same on every rank: a pure function of the settings and the profile."""
    if streams != "auto":
        return int(streams)
    profile = job.profile_for(topology)
    if profile is None:
        log.info("diloco: streams auto -> 1 stream (no cluster profile: set topology to one, or streams)")
        return 1
    if profile.world_size != job.world_size:
        log.warning("diloco: streams auto -> 1 stream (profile %s has %d ranks, the job %d)",
                    profile.name, profile.world_size, job.world_size)
        return 1
    chosen, bounds = auto_streams(profile, exchange, compression)
    log.info("diloco: streams auto -> %d stream(s) on %s (bound per GB: %s)", chosen, profile.name,
             ", ".join(f"S={s} {b:.2f} s" for s, b in bounds.items()))
    return chosen


def node_cost(layout: ReplicaLayout, payload_bytes: float, period: int, streams: int, codec: Codec,
              gather: bool = False) -> list[list[Phase]]:
    """One round of ``period`` steps of ``replica: node`` (inner DDP) as the cost model's flows: every
    step DDP's all-reduce inside each node (a ring on loopback); at the round's end the shards'
    exchanges across nodes (``shard_exchange_cost``) and the all-gather of θ_g in each node."""
    inner = concurrent_group_allreduces(layout.nodes, payload_bytes)
    across = shard_exchange_cost(layout, payload_bytes, streams, codec, gather)
    return [inner + across + gather_cost(layout, payload_bytes)] + [list(inner) for _ in range(period - 1)]


def shard_exchange_cost(layout: ReplicaLayout, payload_bytes: float, streams: int, codec: Codec,
                        gather: bool = False) -> list[Phase]:
    """The S shard groups' meshes at once: two phases in which every node sends every other node M/N
    (at ``codec``'s size: 2(N−1)/N·M per direction) over S x ``streams`` flows pinned to its NICs;
    or their gathers (``gather``): one phase of all of M's encoded pieces to every other node."""
    n = len(layout.nodes)
    if n < 2:
        return []
    numel = max(int(payload_bytes // 4), 1)
    flows = layout.shards * streams
    if gather:
        coded = sum(codec.nbytes(b - a) for a, b in layout.bounds(numel))
    else:
        coded = payload_bytes * codec.nbytes(numel) / (4 * numel) / n
    pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
    src = np.array([layout.nodes[a][0] for a, _ in pairs], dtype=np.int64)
    dst = np.array([layout.nodes[b][0] for _, b in pairs], dtype=np.int64)
    step = FlowArray(src, dst, np.full(len(pairs), coded / flows), np.full(len(pairs), flows, dtype=np.int64),
                     pinned=True)
    return [step] if gather else [step, step]


def gather_cost(layout: ReplicaLayout, payload_bytes: float) -> list[Phase]:
    """``DiLoCoEngine._gather`` (a node replica): every rank of a node sends its span of θ_g (fp32) to the others."""
    numel = max(int(payload_bytes // 4), 1)
    bounds = layout.bounds(numel)
    flows = [(rank, other, 4.0 * (bounds[layout.owned(rank)[-1]][1] - bounds[layout.owned(rank)[0]][0]))
             for node in layout.nodes for rank in node for other in node if other != rank]
    return [flows] if flows else []
