"""What one DiLoCo replica is: a rank (``replica: rank``) or the ranks of a node (``replica:
node``, INTELLECT-1's layout), and how a node replica's outer state is sharded over its ranks.

A node of L ranks trains as one model (DDP or FSDP2 over the node) and shards its outer state:
the flat model is cut into ``S = max L`` shards, local rank j owning shards ``[j·S//L,
(j+1)·S//L)`` (their θ_g, outer optimizer state and Δ, on CPU). Shard k is exchanged among its
owners, one per replica, so the groups line up across nodes of different sizes. Δ is weighted
by the replica's rank count: H = 1 with outer SGD lr 1 and no momentum is DDP over all ranks
whatever the node sizes. ``replica: auto`` is ``node`` when the job has several hosts and some
host runs several ranks, else ``rank``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from syncplane.comm.streams import shard_bounds
from syncplane.job import JobContext

REPLICAS = ("rank", "node", "auto")
INNERS = ("ddp", "fsdp")


def check_replica(replica: str, inner: str, *, exchange: str = "auto") -> None:
    """Check ``replica``, ``inner`` and what a node replica runs with."""
    if replica not in REPLICAS:
        raise ValueError(f"replica: allowed values: {', '.join(REPLICAS)}; got {replica!r}")
    if inner not in INNERS:
        raise ValueError(f"inner: allowed values: {', '.join(INNERS)}; got {inner!r}")
    if replica == "rank":
        check_inner(inner)
    elif exchange == "tree":
        raise ValueError(f"replica={replica!r} exchanges each outer shard among its owners, one rank per node: "
                         "the tree's inner level (a host's ranks) is the node itself, so exchange='tree' has "
                         "nothing to reduce there; use exchange='mesh' or 'auto'")


def check_inner(inner: str, nodes: Sequence[Sequence[int]] | None = None) -> None:
    """``inner`` on replicas of one rank (``replica: rank``, or ``auto`` on the job's ``nodes``): only ``ddp``."""
    if inner != "ddp":
        on = "replica='rank'" if nodes is None else (f"replica='auto', which is 'rank' on this job ({len(nodes)} "
                                                     f"host(s) of {[len(n) for n in nodes]} ranks)")
        raise ValueError(f"inner={inner!r} needs node replicas (replica='node'): with {on} a replica is one rank, "
                         "there is nothing to shard inside it")


@dataclass(frozen=True)
class ReplicaLayout:
    """Node replicas: the ranks of each (numbered node by node), and the shard owner map."""

    nodes: tuple[tuple[int, ...], ...]
    inner: str = "ddp"

    def __post_init__(self) -> None:
        flat = [r for node in self.nodes for r in node]
        if not self.nodes or any(not node for node in self.nodes) or flat != list(range(len(flat))):
            raise ValueError(f"replica='node': nodes must number the ranks 0..n-1 node by node, got {self.nodes}")

    @classmethod
    def of_sizes(cls, sizes: Sequence[int], inner: str = "ddp") -> ReplicaLayout:
        """Nodes of ``sizes`` ranks each, numbered in order (``[2, 1]``: ranks 0-1, then 2)."""
        firsts = [sum(sizes[:i]) for i in range(len(sizes))]
        return cls(tuple(tuple(range(f, f + n)) for f, n in zip(firsts, sizes)), inner)

    @property
    def per_rank(self) -> bool:
        """Every replica is one rank (``replica: rank``)."""
        return all(len(node) == 1 for node in self.nodes)

    @property
    def world_size(self) -> int:
        return sum(len(node) for node in self.nodes)

    @property
    def sizes(self) -> list[int]:
        """Ranks per replica."""
        return [len(node) for node in self.nodes]

    @property
    def shards(self) -> int:
        """S: the outer state's shard count, the largest node's rank count."""
        return max(self.sizes)

    @cached_property
    def _place(self) -> dict[int, tuple[int, int]]:
        return {rank: (r, j) for r, node in enumerate(self.nodes) for j, rank in enumerate(node)}

    def replica_of(self, rank: int) -> int:
        return self._place[rank][0]

    def owned(self, rank: int) -> range:
        """The shards ``rank`` owns: a contiguous block, ``[j·S//L, (j+1)·S//L)``."""
        r, j = self._place[rank]
        size = len(self.nodes[r])
        return range(j * self.shards // size, (j + 1) * self.shards // size)

    def shard_group(self, shard: int) -> tuple[int, ...]:
        """The ranks that exchange ``shard``: its owner in every replica, in replica order."""
        return tuple(next(rank for rank in node if shard in self.owned(rank)) for node in self.nodes)

    def fsdp_units(self, rank: int, shapes: Sequence[Sequence[int]], buffers: int
                   ) -> tuple[list[tuple[int, ...]], dict[int, list[tuple[int, int, int]]]]:
        """FSDP2 nodes: the exchange sets and this rank's spans in each. FSDP2 cuts a parameter of R
        rows into L chunks of ceil(R/L) rows, so nodes of different sizes hold row ranges that do not
        nest: each parameter is cut at every node size's row cuts, each unit exchanged among its holders
        (one rank per node). ``shapes``: the parameters' global shapes; ``buffers``: the floating
        buffers' values, held whole and exchanged with each of this rank's shard groups. Returns the
        sets (alike on every rank) and, per set this rank is in, its spans ``(lo, hi, global)`` in
        this rank's buffer ``[its shards | buffers]`` and in the whole model."""
        node = self.nodes[self.replica_of(rank)]
        mine, sizes = node.index(rank), sorted(set(self.sizes))
        sets: list[tuple[int, ...]] = []
        spans: dict[int, list[tuple[int, int, int]]] = {}

        def add(members: tuple[int, ...], lo: int, hi: int, at: int) -> None:
            if members not in sets:
                sets.append(members)
            if rank in members:
                spans.setdefault(sets.index(members), []).append((lo, hi, at))

        local = whole = 0
        for shape in shapes:
            rows, width = (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)
            if rows == 0:
                continue
            chunk = {n: -(-rows // n) for n in sizes}
            cuts = sorted({min(i * chunk[n], rows) for n in sizes for i in range(n + 1)})
            first, last = (min(i * chunk[len(node)], rows) for i in (mine, mine + 1))
            for lo, hi in zip(cuts, cuts[1:]):
                holders = tuple(nd[lo // chunk[len(nd)]] for nd in self.nodes)
                add(holders, local + (lo - first) * width, local + (hi - first) * width, whole + lo * width)
            local, whole = local + (last - first) * width, whole + rows * width
        for k in range(self.shards if buffers else 0):
            add(self.shard_group(k), local, local + buffers, whole)
        return sets, spans

    def weight(self, rank: int) -> float:
        """``rank``'s replica's factor on its Δ, so that the plain mean weighs it by its rank count (1 if even)."""
        return len(self.nodes[self.replica_of(rank)]) * len(self.nodes) / self.world_size

    def bounds(self, numel: int) -> list[tuple[int, int]]:
        """``[start, end)`` of each shard of a flat buffer of ``numel`` values."""
        return shard_bounds(numel, self.shards)

    def describe(self) -> dict[str, object]:
        """For ``summary.json``."""
        out = {"replica": "rank" if self.per_rank else "node", "replicas": len(self.nodes),
               "ranks_per_replica": self.sizes}
        return out if self.per_rank else {**out, "inner": self.inner, "outer_shards": self.shards}


def node_layout(replica: str, inner: str, job: JobContext) -> ReplicaLayout | None:
    """The job's node layout for ``replica`` (None: every rank is its own replica)."""
    if replica == "rank":
        return None
    try:
        nodes = job.hosts()
    except ValueError as exc:
        raise ValueError(f"replica={replica!r}: the job's nodes do not divide its ranks: {exc}") from None
    several = any(len(node) > 1 for node in nodes)
    if replica == "auto" and not (several and len(nodes) > 1):
        check_inner(inner, nodes)
        return None
    if replica == "node" and not several:
        raise ValueError(f"replica='node' on a job of one rank per host ({len(nodes)} hosts): every node is one "
                         "rank already; use replica='rank' (or 'auto')")
    return ReplicaLayout(tuple(map(tuple, nodes)), inner)


def job_layout(replica: str, inner: str, job: JobContext) -> ReplicaLayout:
    """The replicas the engine runs: ``node_layout``'s nodes, else one replica per rank. An elastic
    replica is a job of its own (one rank, or its node's L ranks), whose layout is that one node:
    the other nodes are the quorum's, met over the torchft replica group (``diloco.ft``)."""
    if job.elastic is not None:
        return ReplicaLayout.of_sizes([job.world_size], inner if job.world_size > 1 else "ddp")
    layout = node_layout(replica, inner, job)
    return layout if layout is not None else ReplicaLayout.of_sizes([1] * job.world_size)


def elastic_nodes(replica: str, sizes: Sequence[int]) -> bool:
    """Whether an elastic job's replica is a host's ranks, given the ranks of each host."""
    return replica == "node" or (replica == "auto" and len(sizes) > 1 and max(sizes) > 1)


def check_elastic_nodes(replica: str, sizes: Sequence[int]) -> None:
    """Refuse elastic node replicas on hosts of different sizes, before launch: on 2+1 the lone rank
    owns both shards, while a torchft replica group meets the other nodes once per local rank."""
    if elastic_nodes(replica, sizes) and len(set(sizes)) > 1:
        raise ValueError(f"replica={replica!r} with elastic=true needs hosts of one size (these run {list(sizes)} "
                         "ranks): local rank j of every node owns shard j and heals it from shard j of a live "
                         "node, so the nodes' shards must line up; use replica='rank' or hosts of one size")
