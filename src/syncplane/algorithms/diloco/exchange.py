"""Which all-reduce carries DiLoCo's pseudo-gradient: the owner exchange or FlexReduce's tree.

The owner exchange (``syncplane.comm.sharded``) sends every rank's segment j to rank j and
the mean back: 2(n−1)/n·M per rank, wherever the ranks are. On racks or sites that puts
about (n/racks)·M across each slow uplink per round; a hierarchical pattern puts M. So on a
cluster with a hierarchy the exchange is FlexReduce (``syncplane.algorithms.flexreduce``:
reduce inside the host/rack, cross the slow link with the rack's share, gather back),
run by ``ShardedAllReduce`` on its S streams -- one shard per gloo group, the same
deadline and commit/discard -- so there is one tree executor for FlexReduce and DiLoCo.

``exchange``:
- ``owner``: the owner exchange (any codec).
- ``tree``: FlexReduce's plan on the job's tree (exact fp32 only: its all-gather forwards
  the root's sums, which an int8 codec would have to carry re-encoded at every hop).
- ``auto`` (default): ``tree`` when the job's tree has more than one level -- ranks grouped
  into hosts, racks or sites (the launcher's cluster profile, ``SYNCPLANE_CLUSTER``, else
  hosts of ``LOCAL_WORLD_SIZE`` ranks) -- and the payload is fp32; otherwise ``owner``. A
  single-host job (every local run) keeps the owner exchange.

``shards: auto``: S from the job's cluster profile (``topology`` when it names one, else
the launcher's): the fewest of 1, 2, 4, 8, 16 streams whose bound in the cost model is
within 10 % of the best -- as many TCP connections as a per-flow-capped link needs, one per
NIC where hosts have several. The bound scales with the payload (α = 0), so the choice does
not depend on the model's size. Without a profile: 1 stream, and the log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch.distributed as dist

from syncplane.algorithms.flexreduce.cost import flexreduce_phases
from syncplane.algorithms.flexreduce.executor import FlexReduce
from syncplane.algorithms.flexreduce.tree import FlexTree, from_profile, job_profile, job_tree
from syncplane.cluster.cost import CostModel, FlowArray, Phase, columns_of, owner_exchange
from syncplane.cluster.profile import ClusterProfile
from syncplane.comm import ShardedAllReduce, make_codec

log = logging.getLogger(__name__)

EXCHANGES = ("auto", "owner", "tree")
STREAM_CHOICES = (1, 2, 4, 8, 16)   # ``shards: auto`` tries these (each stream is 2 gloo groups)


def check_exchange(exchange: str, compression: str) -> None:
    """Refuse an unknown exchange, or the tree with a lossy codec (clear errors, before any step)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: allowed values: {', '.join(EXCHANGES)}; got {exchange!r}")
    if exchange == "tree" and compression != "none":
        raise ValueError(f"exchange='tree' carries exact fp32 only; compression={compression!r} needs "
                         "exchange='owner' (or 'auto', which picks it)")


def choose_exchange(exchange: str, compression: str, levels: int) -> str:
    """``owner`` or ``tree`` for a job whose tree has ``levels`` levels (see the module doc)."""
    check_exchange(exchange, compression)
    if exchange != "auto":
        return exchange
    return "tree" if levels > 1 and compression == "none" else "owner"


def tree_exchange(profile: ClusterProfile, payload_bytes: float, streams: int = 1) -> list[Phase]:
    """FlexReduce's pipelined pattern on S streams, as ``ShardedAllReduce`` runs it with the
    tree: each stream all-reduces 1/S of the payload with its own plan, and the streams'
    wavefronts advance in lockstep -- every flow of one stream's tick, S times, at 1/S of
    the bytes (the same link loads; S flows where a per-flow cap limits one), stream s on
    NIC s mod k of its host (one stream: one NIC, however many flows)."""
    phases = flexreduce_phases(from_profile(profile), payload_bytes / streams)
    made: dict[int, FlowArray] = {}   # the steady-state tick is one object: keep it one
    for phase in phases:
        if id(phase) not in made:
            src, dst, nbytes, copies = columns_of(phase)
            made[id(phase)] = FlowArray(src, dst, nbytes, copies * streams, pinned=True)
    return [made[id(phase)] for phase in phases]


def exchange_phases(profile: ClusterProfile, payload_bytes: float, streams: int, exchange: str = "auto",
                    compression: str = "none") -> list[Phase]:
    """One all-reduce of Δ on ``streams`` streams, as the pattern ``exchange`` resolves to on
    this cluster (``choose_exchange``): the owner exchange or FlexReduce's tree."""
    levels = from_profile(profile).num_levels if profile.world_size > 1 else 1
    if choose_exchange(exchange, compression, levels) == "tree" and profile.world_size > 1:
        return tree_exchange(profile, payload_bytes, streams)
    return owner_exchange(profile.world_size, payload_bytes, streams)


def auto_streams(profile: ClusterProfile, exchange: str = "auto", compression: str = "none",
                 within: float = 1.1) -> tuple[int, dict[int, float]]:
    """``shards: auto`` on ``profile`` (module doc): S, and the bound in seconds per GB of each
    candidate (what the log shows)."""
    model = CostModel(profile, alpha_s=0.0)
    bounds = {s: model.bound(exchange_phases(profile, 1e9, s, exchange, compression)) for s in STREAM_CHOICES}
    best = min(bounds.values())
    return next(s for s in STREAM_CHOICES if bounds[s] <= best * within), bounds


def resolve_shards(shards: int | str, topology: str | Sequence[int], world_size: int, exchange: str = "auto",
                   compression: str = "none") -> int:
    """The stream count for ``shards`` (an int, or ``auto``: see the module doc); logs the
    choice. The same on every rank: a pure function of the settings and the profile."""
    if shards != "auto":
        return int(shards)
    profile = job_profile(topology)
    if profile is None:
        log.info("diloco: shards auto -> 1 stream (no cluster profile: set topology to one, or shards)")
        return 1
    if profile.world_size != world_size:
        log.warning("diloco: shards auto -> 1 stream (profile %s has %d ranks, the job %d)",
                    profile.name, profile.world_size, world_size)
        return 1
    streams, bounds = auto_streams(profile, exchange, compression)
    log.info("diloco: shards auto -> %d stream(s) on %s (bound per GB: %s)", streams, profile.name,
             ", ".join(f"S={s} {b:.2f} s" for s, b in bounds.items()))
    return streams


def build_exchange(shards: int, compression: str = "none", block_size: int = 256, timeout_s: float = 600.0,
                   exchange: str = "auto", topology: str | Sequence[int] = "auto") -> tuple[ShardedAllReduce, str]:
    """DiLoCo's exchange for this job (a collective: it builds the S gloo groups) and the
    pattern chosen. ``topology`` as FlexReduce's (``auto``, a profile, or ranks per host)."""
    check_exchange(exchange, compression)
    codec = make_codec(compression, block_size)
    tree: FlexTree | None = None
    if exchange != "owner" and dist.get_world_size() > 1:
        tree = job_tree(topology, dist.get_world_size())
    chosen = choose_exchange(exchange, compression, tree.num_levels if tree is not None else 1)
    pattern = None
    if chosen == "tree" and tree is not None:
        pattern = FlexReduce(tree, timeout_s=timeout_s, own_group=False)
    why = "" if exchange != "auto" else (
        " (auto: int8 needs the owner exchange)" if compression != "none" and tree is not None and tree.num_levels > 1
        else f" (auto: {'a' if chosen == 'tree' else 'no'} host/rack hierarchy)")
    log.info("diloco: exchange %s%s, %d stream(s)%s", chosen, why, shards,
             f", tree {tree.describe()}" if pattern is not None and tree is not None else "")
    return ShardedAllReduce(shards, codec=codec, timeout_s=timeout_s, pattern=pattern), chosen
