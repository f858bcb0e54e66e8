"""Which all-reduce carries DiLoCo's pseudo-gradient, on S streams (``comm.StreamRunner``: one
deadline, commit or discard): the ``mesh`` (every rank owns 1/n; any codec), the ``tree``
(FlexReduce's plan; exact fp32) or the ``gather`` (every rank decodes every piece: the one for
``compression: sparse``, whose sums would be dense). ``auto``: the gather for sparse, the tree
when the job's tree has several levels and Δ is fp32, else the mesh. Their price: ``cost``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from syncplane.comm import ChunkedTopK, StreamRunner, make_codec
from syncplane.comm.codecs import Codec
from syncplane.exchanges import GatherExchange, JobShape, MeshExchange, TreeExchange, choose, normalize
from syncplane.exchanges import gather
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
    """DiLoCo's exchange for this job and the pattern's name (a collective: it builds the streams'
    groups). ``codec``: default ``make_codec(compression, block_size)``; ``exact_from``: the gather
    sends the values from there on (the floating buffers) as fp32; ``make``: a ``Transport``'s runner."""
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
