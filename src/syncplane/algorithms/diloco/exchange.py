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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch.distributed as dist

from syncplane.algorithms.flexreduce.executor import FlexReduce
from syncplane.algorithms.flexreduce.tree import FlexTree, job_tree
from syncplane.comm import ShardedAllReduce, make_codec

log = logging.getLogger(__name__)

EXCHANGES = ("auto", "owner", "tree")


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
