"""What a ``replica: node`` round costs, for ``syncplane simulate``, the plan and the bench:
the shards' exchanges across nodes, DDP inside them, and the all-gather of θ_g in the node.
(The per-rank round's price is ``exchange.exchange_phases``.)"""

from __future__ import annotations

import numpy as np

from syncplane.algorithms.diloco.layout import ReplicaLayout
from syncplane.cluster.cost import FlowArray, Phase, concurrent_group_allreduces
from syncplane.comm.codecs import Codec


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
