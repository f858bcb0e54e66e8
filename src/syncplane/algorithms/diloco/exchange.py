"""Which all-reduce carries DiLoCo's pseudo-gradient, on how many streams.

Three of the exchange layer's patterns (``syncplane.exchanges``), run by ``comm.StreamRunner``
on S streams with one deadline and commit/discard: the ``mesh`` (every rank owns 1/n; any
codec), the ``tree`` (FlexReduce's plan; exact fp32) and the ``gather`` (every rank decodes
every rank's piece: the one for ``compression: sparse``, whose sums would be dense). ``auto``:
the gather for sparse, the tree when the job's tree has several levels and Δ is fp32, else the
mesh.

``streams: auto``: from the job's cluster profile (``topology`` when it names one), the fewest
of ``STREAM_CHOICES`` whose cost-model bound is within 10 % of the best (as many TCP connections
as a per-flow-capped link needs); the bound scales with the payload, so the choice does not
depend on the model. Without a profile: 1 stream, and the log says so."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from syncplane.cluster.cost import CostModel, Phase
from syncplane.cluster.profile import ClusterProfile
from syncplane.comm import ChunkedTopK, StreamRunner, make_codec
from syncplane.comm.codecs import Codec
from syncplane.exchanges import Choice, GatherExchange, JobShape, MeshExchange, TreeExchange, choose, normalize
from syncplane.exchanges import gather, mesh
from syncplane.exchanges.cpu import CpuWork, runner_work
from syncplane.exchanges.tree import exchange as tree
from syncplane.exchanges.tree.tree import job_tree
from syncplane.job import JobContext

log = logging.getLogger(__name__)

#: The exchanges DiLoCo runs (``syncplane.exchanges.NAMES`` is the vocabulary).
EXCHANGES = ("mesh", "tree", "gather")
STREAM_CHOICES = (1, 2, 4, 8, 16)   # ``streams: auto`` tries these (each stream is 2 gloo groups)


#: (exchange, compression) pairs that cannot run, why, and the exchange that carries it.
NOT_CARRIED = {
    **{(name, "sparse"): ("it sums the pieces on the way (the mesh on each shard's owner, the tree at every level), "
                          "and a sum of top-k pieces is dense", "gather") for name in ("mesh", "tree")},
    ("tree", "int8"): ("the tree sums inside gloo's sends at every level, on exact fp32 (a coded piece would be "
                       "re-quantized at each level, its error feedback kept by no rank)", "mesh"),
}


def check_exchange(exchange: str, compression: str) -> None:
    """Refuse an exchange DiLoCo does not run, or one that cannot carry ``compression``
    (``NOT_CARRIED``: clear errors, before any step); the job's shape is checked when the
    exchange is built."""
    name = normalize(exchange, allowed=("auto", *EXCHANGES))
    if (name, compression) in NOT_CARRIED:
        why, fix = NOT_CARRIED[name, compression]
        raise ValueError(f"exchange={exchange!r} cannot carry compression={compression!r}: {why}; set "
                         f"exchange={fix!r} (or 'auto', which picks it)")


def carried(exchange: str, compression: str) -> str:
    """The codec ``exchange`` carries: the gather always carries the sparse one (that is what
    it is for, and how it is priced); the others carry ``compression``."""
    return "sparse" if exchange == "gather" else compression


def delta_codec(compression: str = "none", block_size: int = 256, density: float = 0.02, bits: int = 2,
                chunk: int = 4096) -> Codec:
    """What carries Δ on the wire: fp32, int8 (``block_size`` values per scale) or the sparse
    codec (``density``, ``bits``, ``chunk``); the strategy, the bench and the price share it."""
    if compression == "sparse":
        return ChunkedTopK(density, bits, chunk)
    return make_codec(compression, block_size)


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


def exchange_cpu_work(profile: ClusterProfile, payload_bytes: float, exchange: str = "auto",
                      compression: str = "none", codec: Codec | None = None) -> CpuWork:
    """One rank's CPU work in one round (``syncplane.exchanges.cpu``): the outer step's passes
    and the runner's copies, plus the chosen exchange's coding and sums (the tree's sums are
    not modelled: it carries fp32 and reduces inside gloo's sends)."""
    compression = carried(exchange, compression)
    codec = codec if codec is not None else delta_codec(compression)
    numel = max(int(payload_bytes // 4), 1)
    chosen = _priced_choice(profile, exchange, compression)
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


def gather_groups(job: JobContext, topology: str | Sequence[int] = "auto") -> tuple[tuple[int, ...], ...] | None:
    """What the gather groups the ranks by (``gather.groups_of``): the racks or hosts of the
    profile ``topology`` names (``auto``: the job's), else blocks of ranks per host (a list,
    or the launcher's hosts); None (flat) when that is one group or one rank per group."""
    if job.world_size < 2:
        return None
    profile = job.profile_for(topology)
    if profile is not None and profile.world_size == job.world_size:
        groups = gather.groups_of(profile)
    elif not isinstance(topology, str):
        firsts = [sum(topology[:i]) for i in range(len(topology))]
        groups = tuple(tuple(range(f, f + k)) for f, k in zip(firsts, topology))
    else:
        groups = tuple(tuple(h) for h in job.hosts())
    if len(groups) < 2 or all(len(g) == 1 for g in groups):
        return None
    return groups


def build_exchange(job: JobContext, shards: int, compression: str = "none", block_size: int = 256,
                   timeout_s: float = 600.0, exchange: str = "auto",
                   topology: str | Sequence[int] = "auto", *, codec: Codec | None = None,
                   error_feedback_beta: float = 1.0, exact_from: int | None = None,
                   make: Callable[..., Any] = StreamRunner) -> tuple[Any, str]:
    """DiLoCo's exchange for this job (a collective: it builds the S streams' gloo groups) and the
    pattern chosen. ``codec``: what travels (default ``make_codec(compression, block_size)``);
    ``error_feedback_beta``: its residuals' decay; ``exact_from``: the gather sends the values from
    there on as exact fp32 (the floating buffers); ``make``: what builds the runner from the pattern
    (``StreamRunner``; a ``Transport``'s ``runner``)."""
    check_exchange(exchange, compression)
    if codec is None:
        codec = make_codec(compression, block_size)
    shape = JobShape.of_job(job, topology) if exchange not in ("mesh", "owner", "gather") else JobShape(None)
    chosen = choose(exchange, shape, allowed=EXCHANGES, exact=compression == "none",
                    sparse=compression == "sparse")
    if chosen.name == "gather":
        groups = gather_groups(job, topology)
        pattern = GatherExchange(shards, exact_from, groups)
        log.info("diloco: exchange gather (%s), %d stream(s), by %s", chosen.reason, shards,
                 "rank (flat)" if groups is None else f"groups {[len(g) for g in groups]}")
    elif chosen.name == "tree" and job.world_size > 1:
        pattern = TreeExchange(job_tree(job, topology), shards, timeout_s=timeout_s)
        log.info("diloco: exchange tree (%s), %d stream(s), tree %s", chosen.reason, shards, pattern.tree.describe())
    else:
        pattern = MeshExchange(shards)
        log.info("diloco: exchange mesh (%s), %d stream(s)", chosen.reason, shards)
    runner = make(pattern, codec=codec, interfaces=job.interfaces, timeout_s=timeout_s,
                          error_feedback_beta=error_feedback_beta)
    return runner, chosen.name
