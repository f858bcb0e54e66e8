"""The gather exchange: every rank receives every rank's encoded piece and decodes them itself.

Why a gather: a sum of top-k vectors is denser than each, so a sparse payload
(``ChunkedTopK``) cannot be summed on the way as the mesh (on each owner) and the tree (at
every level) do without re-encoding it. Here each rank encodes its piece once (with its
error feedback), the pieces are forwarded unchanged, and every rank decodes-and-accumulates
all n pieces **in rank order** into zeros, then divides once: every rank holds the same
pieces, so the mean is bit-identical on every rank. The codec's payload size depends on the
element count only, so no size exchange is needed.

Routes (``routes``), given the job's hosts (or racks: ``groups_of``): (1) each rank sends its piece to the other ranks
of its host; (2) for every pair of hosts (h, g), one rank of h sends h's block (its ranks'
pieces, concatenated in rank order) to one rank of g -- the pair's ends are spread over the
hosts' ranks (rank ``g mod |h|`` of h to rank ``h mod |g|`` of g) so several ranks (and
their NICs) share the slow links; (3) that rank forwards the block to the rest of g. A
piece crosses the slow link once per remote *host*, not once per remote rank. Without hosts
(or one rank per host) it is the flat all-gather: step 2 between every pair of ranks.

Per stream, the buffer is cut into S contiguous segments (``shard_bounds``); segment s travels
on stream s. Values at logical positions ``>= exact_from`` travel as raw fp32 in the same
piece (a caller's averaged-as-values tail, e.g. BatchNorm statistics, which a top-k would
zero out).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import torch
import torch.distributed as dist

from syncplane.cluster.cost import FlowArray, Phase
from syncplane.cluster.profile import ClusterProfile
from syncplane.comm.codecs import Codec
from syncplane.exchanges.cpu import CpuWork, coded, feedback_encoded
from syncplane.comm.streams import Round, shard_bounds
from syncplane.exchanges.mesh import all_pairs

_TAG_GATHER = 3


@dataclass(frozen=True)
class GatherExchange:
    """The all-gather of encoded pieces on ``shards`` streams (module doc).

    ``exact_from``: logical positions from here on travel as exact fp32 (None: none do);
    ``groups``: the ranks of each host or rack (``groups_of``; None: flat)."""

    shards: int = 1
    exact_from: int | None = None
    groups: tuple[tuple[int, ...], ...] | None = None
    feedback_slots: int = 1            # what this rank sends (nothing is re-encoded on the way)

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be at least 1, got {self.shards}")
        if self.exact_from is not None and self.exact_from < 0:
            raise ValueError(f"exact_from must be non-negative, got {self.exact_from}")

    @property
    def streams(self) -> int:
        return self.shards

    def check(self, size: int) -> None:
        """Any number of ranks; the groups, when given, hold each of them once."""
        if self.groups is not None and sorted(r for group in self.groups for r in group) != list(range(size)):
            raise ValueError(f"groups {self.groups} do not hold each of the {size} ranks once")

    def routes(self, size: int) -> list[list[Message]]:
        """The messages of each step (module doc), the same list on every rank."""
        return routes(self.groups if self.groups is not None else tuple((r,) for r in range(size)))

    def _cut(self, lo: int, hi: int, offset: int) -> int:
        """Where ``[lo, hi)`` (positions in a slice starting at ``offset``) stops being encoded."""
        if self.exact_from is None:
            return hi
        return max(lo, min(hi, self.exact_from - offset))

    @staticmethod
    def _head(codec: Codec, lo: int, cut: int, hi: int) -> int:
        """Bytes before the exact tail: the encoded part, padded to 4 so the tail reads as fp32."""
        encoded = codec.nbytes(cut - lo) if cut > lo else 0
        return -(-encoded // 4) * 4 if hi > cut else encoded

    def _nbytes(self, codec: Codec, lo: int, cut: int, hi: int) -> int:
        return self._head(codec, lo, cut, hi) + 4 * (hi - cut)

    def bytes_per_round(self, numel: int, codec: Codec, rank: int, size: int, offset: int = 0) -> int:
        """Bytes ``rank`` sends in one round of ``numel`` values (its own piece and what it forwards)."""
        carried = sum(len(m.carries) for step in self.routes(size) for m in step if m.src == rank)
        return sum(carried * self._nbytes(codec, lo, self._cut(lo, hi, offset), hi)
                   for lo, hi in shard_bounds(numel, self.shards) if hi > lo)

    def run(self, round: Round) -> tuple[torch.Tensor, int]:
        flat, codec, offset, me, n = round.flat, round.codec, round.offset, round.rank, round.size
        (feedback,) = round.feedback
        keep, steps = round.keep, self.routes(n)
        out = round.kept("out", flat.numel(), flat.dtype).zero_()
        sent = 0
        bounds = [(s, lo, hi) for s, (lo, hi) in enumerate(shard_bounds(flat.numel(), self.shards)) if hi > lo]
        have: dict[int, dict[int, torch.Tensor]] = {}       # stream -> rank -> its piece
        size: dict[int, int] = {}
        posting = time.perf_counter()
        for s, lo, hi in bounds:
            size[s] = self._nbytes(codec, lo, self._cut(lo, hi, offset), hi)
        # every receive up front, before the encodes (gloo's TCP transport sends a message only
        # once its receiver has posted the receive and said so): (step, stream) -> [(work,
        # buffer, ranks it carries)]
        recvs: dict[tuple[int, int], list[tuple[dist.Work, torch.Tensor, tuple[int, ...]]]] = {}
        for t, step in enumerate(steps):
            for m in step:
                if m.dst != me:
                    continue
                for s, _, _ in bounds:
                    buffer = round.kept(("recv", t, s, m.src), len(m.carries) * size[s])
                    work = round.link(s, m.src, me).recv([buffer], m.src, m.tag(t, n))
                    recvs.setdefault((t, s), []).append((work, buffer, m.carries))
                    keep.extend([buffer, work])
        if round.profile is not None:
            round.profile.add("post", time.perf_counter() - posting)
        for s, lo, hi in bounds:
            cut = self._cut(lo, hi, offset)
            mine = round.kept(("mine", s), size[s]).zero_()
            if cut > lo:
                feedback.compress(flat[lo:cut], offset + lo, out=mine[:codec.nbytes(cut - lo)])
            if hi > cut:
                mine[self._head(codec, lo, cut, hi):].view(torch.float32).copy_(flat[cut:hi])
            have[s] = {me: mine}
            keep.append(mine)
        sends: list[dist.Work] = []
        for t, step in enumerate(steps):
            for s, _, _ in bounds:
                if t > 0:      # what this step forwards arrived in the steps before
                    self._arrive(round, recvs.get((t - 1, s), []), have[s], size[s], f"wait/s{s}/step{t - 1}")
                for m in step:
                    if m.src == me:
                        parts = [have[s][r] for r in m.carries]
                        block = (torch.cat(parts, out=round.kept(("send", t, s, m.dst), sum(p.numel() for p in parts)))
                                 if len(parts) > 1 else parts[0])
                        sends.append(round.link(s, me, m.dst).send([block], m.dst, m.tag(t, n)))
                        keep.extend([block, sends[-1]])
                        sent += block.numel()
        for s, _, _ in bounds:
            self._arrive(round, recvs.get((len(steps) - 1, s), []), have[s], size[s], f"wait/s{s}/step{len(steps) - 1}")
        for s, lo, hi in bounds:
            with round.phase("sum"):
                pieces = [have[s][r] for r in range(n)]
                cut = self._cut(lo, hi, offset)
                if cut > lo:
                    encoded = codec.nbytes(cut - lo)
                    _decode_add(codec, [p[:encoded] for p in pieces], out[lo:cut])
                head = self._head(codec, lo, cut, hi)
                for p in pieces:     # the exact tail, in rank order
                    if hi > cut:
                        out[cut:hi] += p[head:].view(torch.float32)
                out[lo:hi] /= n
        with round.phase("wait/send"):
            round.wait(sends)
        return out, sent

    @staticmethod
    def _arrive(round: Round, arrivals: list[tuple[dist.Work, torch.Tensor, tuple[int, ...]]],
                have: dict[int, torch.Tensor], size: int, phase: str) -> None:
        """Wait for a step's receives and file the pieces each carries under their ranks."""
        with round.phase(phase):
            round.wait([work for work, _, _ in arrivals])
        for _, buffer, carries in arrivals:
            for j, r in enumerate(carries):
                have[r] = buffer[j * size:(j + 1) * size]


@dataclass(frozen=True)
class Message:
    """One message of a gather step: ``src`` sends ``dst`` the pieces of ``carries`` (in order)."""

    src: int
    dst: int
    carries: tuple[int, ...]

    def tag(self, step: int, size: int) -> int:
        """Unique per (step, first piece): two blocks between one pair in a step never mix."""
        return _TAG_GATHER + step * size + self.carries[0]


def routes(hosts: Sequence[Sequence[int]]) -> list[list[Message]]:
    """The three steps of the gather on ``hosts`` (module doc): within each host, host to host
    (one message per ordered pair of hosts), and the forward of each arrived block within the
    receiving host. Empty steps are left out (the flat gather is one step)."""
    groups = [tuple(sorted(h)) for h in hosts]
    inside = [Message(a, b, (a,)) for g in groups for a in g for b in g if a != b]
    across, forward = [], []
    for h, mine in enumerate(groups):
        for g, theirs in enumerate(groups):
            if h == g:
                continue
            receiver = theirs[h % len(theirs)]
            across.append(Message(mine[g % len(mine)], receiver, mine))
            forward.extend(Message(receiver, b, mine) for b in theirs if b != receiver)
    return [step for step in (inside, across, forward) if step]


def _decode_add(codec: Codec, payloads: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out += decode(p)`` for each payload in order (the codec's own kernel when it has one)."""
    decode_add = getattr(codec, "decode_add", None)
    if decode_add is not None:
        decode_add(payloads, out)
        return
    for p in payloads:
        out += codec.extract(p, out.numel())


def groups_of(profile: ClusterProfile) -> tuple[tuple[int, ...], ...]:
    """The ranks the gather groups on a profile: its racks when it has several (their uplinks
    are the slow links), else its hosts."""
    if len(profile.racks) > 1:
        return tuple(tuple(r for h in profile.hosts if h.rack == rack for r in h.ranks)
                     for rack in range(len(profile.racks)))
    return tuple(tuple(h.ranks) for h in profile.hosts)


def cost(world_size: int, piece_bytes: float, streams: int = 1,
         hosts: Sequence[Sequence[int]] | None = None) -> list[Phase]:
    """The gather's flows, one phase per step of ``routes`` (flat: n(n−1) flows of one piece,
    ``mesh.all_pairs``); each flow is ``streams`` flows of 1/streams of its pieces, pinned to
    NICs round-robin. ``piece_bytes``: one rank's encoded payload (``codec.nbytes``)."""
    if world_size < 2:
        return []
    if hosts is None or all(len(h) == 1 for h in hosts):
        return [all_pairs(world_size, piece_bytes, streams)]
    phases: list[Phase] = []
    for step in routes(hosts):
        phases.append(FlowArray(np.array([m.src for m in step], dtype=np.int64),
                                np.array([m.dst for m in step], dtype=np.int64),
                                np.array([len(m.carries) * piece_bytes / streams for m in step]),
                                np.full(len(step), streams, dtype=np.int64), pinned=True))
    return phases


def cpu_work(world_size: int, numel: float, codec: Codec) -> CpuWork:
    """One rank's CPU work in one round of ``GatherExchange.run`` (``syncplane.exchanges.cpu``):
    its piece encoded with error feedback, then all n pieces decoded into one dense buffer
    (each a pass over the buffer) and divided once. Forwarding a block costs no coding."""
    n, m = world_size, float(numel)
    if n < 2:
        return CpuWork()
    return feedback_encoded(codec, m) + coded(codec, decoded=n * m) + CpuWork.adds(m)

