"""The mesh (owner) exchange: every rank owns 1/n of each stream's buffer.

Per stream, the buffer is split into n owner segments; each rank sends segment j to rank j
(reduce-scatter), the owner sums the n contributions **in rank order** and divides by n,
then sends the mean back to everyone (all-gather). Each rank sends 2(n−1)/n of the payload,
like a ring. Because every element is summed in the same order whatever the stream
boundaries are, the fp32 result is bit-identical for every stream count -- unlike gloo's own
ring, whose summation order depends on where an element falls in its chunking. A lossy codec
compresses each segment once on the way in (error feedback ``local``) and the owner's mean
once on the way out (``owner``); every rank, owner included, uses the decoded mean, so
replicas agree exactly.

Layout ``pieces`` (Canary's mesh): the buffer is cut into n owner pieces only (no stream
level) and piece j travels on stream ``j mod S`` -- so each NIC carries every S-th piece, and
the pieces (hence a lossy codec's per-piece encodings) are the same whatever S is: one NIC
and several give bit-identical results even with the sketch codec.

The exchange is blind to racks and sites: it puts 2(n−1)/n·M per rank across whatever link
lies between (``cost`` prices it). The tree and nested exchanges are the topology-aware ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from syncplane.cluster.cost import FlowArray, Phase
from syncplane.comm.codecs import Codec
from syncplane.exchanges.cpu import CpuWork, coded, feedback_encoded
from syncplane.comm.streams import Result, Round, shard_bounds

_TAG_SCATTER, _TAG_GATHER = 1, 2


@dataclass(frozen=True)
class MeshExchange:
    """The owner exchange on ``shards`` streams (``layout`` as in the module docstring)."""

    shards: int = 1
    layout: Literal["shards", "pieces"] = "shards"
    feedback_slots: int = 2            # (what this rank sends, what it sends as an owner)

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be at least 1, got {self.shards}")
        if self.layout not in ("shards", "pieces"):
            raise ValueError(f"layout must be 'shards' or 'pieces', got {self.layout!r}")

    @property
    def streams(self) -> int:
        return self.shards

    @property
    def parts(self) -> int:
        """Parts of n pieces a buffer is cut into: one per stream, or one in all (``pieces``)."""
        return self.shards if self.layout == "shards" else 1

    def check(self, size: int) -> None:
        """Any number of ranks."""

    def segments(self, numel: int, size: int) -> list[list[tuple[int, int]]]:
        """``[stream][owner] -> (start, end)`` in the flat buffer (empty where a stream carries
        nothing for that owner)."""
        if self.layout == "pieces":
            pieces = shard_bounds(numel, size)
            return [[(lo, hi) if owner % self.shards == s else (lo, lo) for owner, (lo, hi) in enumerate(pieces)]
                    for s in range(self.shards)]
        return [[(a + lo, a + hi) for lo, hi in shard_bounds(b - a, size)] for a, b in shard_bounds(numel, self.shards)]

    def bytes_per_round(self, numel: int, codec: Codec, rank: int, size: int) -> int:
        """Bytes ``rank`` sends in one round of ``numel`` values (both phases)."""
        total = 0
        for segments in self.segments(numel, size):
            total += sum(codec.nbytes(hi - lo) for o, (lo, hi) in enumerate(segments) if o != rank and hi > lo)
            lo, hi = segments[rank]
            if hi > lo:
                total += (size - 1) * codec.nbytes(hi - lo)
        return total

    def run(self, round: Round) -> tuple[Result, int]:
        flat, codec, offset = round.flat, round.codec, round.offset
        local_ef, owner_ef = round.feedback
        segments = self.segments(flat.numel(), round.size)
        me, n = round.rank, round.size
        sent = 0

        # Everything is posted up front: every receive first (gloo's TCP transport sends a
        # message only once its receiver has posted the receive and said so: a receive posted
        # after the encodes would hold the peers' sends back that long), then the scatter
        # sends (segment j of every stream to rank j). Each stream's gather starts as soon as
        # that stream's scatter has arrived, so streams pipeline instead of waiting for the
        # slowest one.
        sends: list[dist.Work] = []
        scatter_recvs: list[list[dist.Work]] = [[] for _ in range(self.streams)]
        gather_recvs: list[dist.Work] = []
        own: dict[int, torch.Tensor] = {}
        scattered: dict[tuple[int, int], torch.Tensor] = {}
        gathered: dict[tuple[int, int], torch.Tensor] = {}
        keep = round.keep
        keep.extend([scattered, gathered])
        posting = time.perf_counter()
        for s in range(self.streams):
            lo, hi = segments[s][me]
            for peer in range(n):
                if peer != me and hi > lo:
                    scattered[s, peer] = round.kept(("scatter", s, peer), codec.nbytes(hi - lo))
                    scatter_recvs[s].append(round.link(s, peer, me).recv([scattered[s, peer]], peer, _TAG_SCATTER))
            for owner, (lo, hi) in enumerate(segments[s]):
                if owner != me and hi > lo:
                    gathered[s, owner] = round.kept(("gather", s, owner), codec.nbytes(hi - lo))
                    gather_recvs.append(round.link(s, owner, me).recv([gathered[s, owner]], owner, _TAG_GATHER))
        keep.extend(gather_recvs + [w for ws in scatter_recvs for w in ws])
        for s in range(self.streams):
            for owner, (lo, hi) in enumerate(segments[s]):
                if hi == lo:        # nothing to send (a codec may still have a header: skip it)
                    continue
                data = local_ef.compress(flat[lo:hi], offset + lo,
                                         out=round.kept(("local", s, owner), codec.nbytes(hi - lo)))
                if owner == me:
                    own[s] = data
                else:
                    sends.append(round.link(s, me, owner).send([data], owner, _TAG_SCATTER))
                    keep.append(data)
                    sent += data.numel()
        keep.extend(sends)
        if round.profile is not None:
            round.profile.add("post", time.perf_counter() - posting)

        # owners: sum in rank order, mean, encode once, send the mean to everyone
        for s in range(self.streams):
            lo, hi = segments[s][me]
            if hi == lo:
                continue
            with round.phase(f"wait/s{s}/scatter"):
                round.wait(scatter_recvs[s])
            with round.phase("sum"):
                parts = [own[s] if r == me else scattered[s, r] for r in range(n)]
                acc = round.kept(("sum", s), hi - lo, flat.dtype)
                for r, part in enumerate(parts):
                    round.add_decoded(acc, r == 0, codec, part, ("decoded", s))
                acc /= n
                data = owner_ef.compress(acc, offset + lo, out=round.kept(("mean", s), codec.nbytes(hi - lo)))
            gathered[s, me] = data
            for dst in range(n):
                if dst != me:
                    work = round.link(s, me, dst).send([data], dst, _TAG_GATHER)
                    sends.append(work)
                    keep.append(work)
                    sent += data.numel()
        with round.phase("wait/gather"):
            round.wait(gather_recvs + sends)
        return round.decoded_later([(*segments[s][owner], data) for (s, owner), data in gathered.items()]), sent


def all_pairs(world_size: int, flow_bytes: float, streams: int = 1) -> FlowArray:
    """n(n−1) concurrent flows of ``flow_bytes``, each rank to every other, as ``streams`` flows
    of 1/streams of it (one per stream, pinned to NICs round-robin)."""
    src, dst = np.divmod(np.arange(world_size * world_size, dtype=np.int64), world_size)
    pairs = src != dst
    return FlowArray(src[pairs], dst[pairs], np.full(int(pairs.sum()), flow_bytes / streams),
                     np.full(int(pairs.sum()), streams, dtype=np.int64), pinned=True)


def cost(world_size: int, payload_bytes: float, streams: int = 1) -> list[Phase]:
    """The mesh exchange's flows: two phases of n(n−1) concurrent flows of M/n (``all_pairs``);
    each rank sends 2(n−1)/n·M, like a ring."""
    if world_size < 2:
        return []
    step = all_pairs(world_size, payload_bytes / world_size, streams)
    return [step, step]


def cpu_work(world_size: int, numel: float, codec: Codec) -> CpuWork:
    """One rank's CPU work in one round of ``MeshExchange.run`` (``syncplane.exchanges.cpu``):
    every segment encoded with error feedback; as the owner of M/n, n pieces decoded and
    summed, the mean taken, encoded and decoded once more; the other n − 1 means decoded."""
    n, m = world_size, float(numel)
    if n < 2:
        return CpuWork()
    return (feedback_encoded(codec, m) + feedback_encoded(codec, m / n)
            + coded(codec, decoded=m + m / n + m * (n - 1) / n)
            + CpuWork.adds(m * (n - 1) / n + m / n + m))      # the sum, the mean, the pieces into ``out``

