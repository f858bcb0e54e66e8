"""Canary's two-stage cube all-reduce (mean) for a BCube(α, β) network (paper 004 §4.4, Fig. 13, Table 2).

In BCube(α, β) the n = α^β hosts have β NICs; NIC ℓ of host x plugs into a switch shared
with the α − 1 hosts whose address differs from x's in digit ℓ only (x's *level-ℓ cube*).
Anything else is reached through relay hosts, which costs their NICs too. The cube
all-reduce talks to cube members only, on every NIC at once:

- the buffer is cut into β *streams* (the paper's threads τ[0..β−1]), each into n pieces,
  piece p owned by rank p;
- **all-gather stage** (the paper's name; a reduce-scatter): in step i stream t works on
  level ℓ = (t + i) mod β -- host x sends each level-ℓ cube member y the partial sums of
  the pieces whose digit ℓ is y's, and sums what it receives for the pieces whose digit ℓ
  is its own (contributions added in digit order, its own in its place). After β steps
  host x holds the sum over all hosts of its own piece of every stream; it divides by n
  and encodes the mean once;
- **all-reduce stage** (an all-gather): the same levels in reverse order, each host
  sending the encoded means it holds to its cube members, who forward them unchanged.

In every step the β streams use β different levels, so every NIC of every host carries
one stream's traffic, and per NIC that is ``2·(α−1)/α·(1 + 1/α + … + 1/α^(β−1))·M/β`` --
for β = 2 exactly the network's bound ``2(n−1)/n·M/2``.

The transport is ``ShardedAllReduce`` with β groups, group ℓ bound to NIC ℓ (the
``interfaces``, default ``GLOO_SOCKET_IFNAME``): commit or discard, deadline, abort and
rebuild are its. A lossy codec compresses a rank's own pieces once (error feedback
``local``), each relayed partial sum once (``relay``) and the owner's mean once (``owner``);
every rank decodes the same owner bytes, so replicas agree exactly. With the exact
codec the result is the mean up to fp32 rounding of the (cube-ordered) sums.

The same schedule on *mixed-radix* addresses is the **nested** exchange for ranks grouped in
hosts and racks (``NestedAllReduce``): rank r's digits are its place in its host, its host's
place in its rack, its rack (radices = ranks per host, hosts per rack, racks). Every stream
visits the levels innermost first -- reduce-scatter inside the host, then inside the rack,
then across racks, and the all-gather back out -- so the slow links carry only the last
level's share: across two racks of m ranks each rank sends M/(2m) each way, M per uplink
and direction in all (the network's bound), where the flat piece mesh sends m·M. Stream t
runs on NIC ``t mod k``. The sum order is fixed by the digits, so the exact codec gives the
same bits for any stream count.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from syncplane.comm.codecs import Codec, ErrorFeedback, Fp32
from syncplane.comm.sharded import ShardedAllReduce, _wait_all, shard_bounds

log = logging.getLogger(__name__)

_TAG_BASE = 64
_FP32 = Fp32()


@dataclass(frozen=True)
class CubeStep:
    """One stream's part of one step, seen from one rank: on level ``level`` (one address
    digit), to/from each peer differing in that digit only, which pieces travel (sorted
    piece indices)."""

    stream: int
    level: int
    gather: bool                                    # all-reduce stage: forward encoded means
    sends: dict[int, list[int]]                     # peer -> pieces this rank sends it
    recvs: dict[int, list[int]]                     # peer -> pieces this rank receives from it


class DigitAllReduce(ShardedAllReduce):
    """Mean of a flat fp32 CPU tensor over ranks addressed by mixed-radix digits, each
    stream reduce-scattering along its own order of levels (one peer set per step: the
    ranks that differ from this one in that step's digit only), then all-gathering back.

    ``CubeAllReduce`` (BCube: streams rotate over the levels, level ℓ on NIC ℓ) and
    ``NestedAllReduce`` (hosts and racks: innermost level first, stream t on NIC t) are its
    two schedules. Collective construction (every rank, same order), like
    ``ShardedAllReduce``; ``group_by`` says which of a step's indices picks its gloo group.
    """

    def __init__(self, radices: Sequence[int], orders: Sequence[Sequence[int]], *,
                 group_by: Literal["level", "stream"], codec: Codec | None = None,
                 exact_levels: Sequence[int] = (), interfaces: Sequence[str] | None = None,
                 timeout_s: float = 600.0) -> None:
        self.radices = [int(a) for a in radices]
        self.exact_levels = frozenset(int(lv) for lv in exact_levels)
        if not self.exact_levels <= set(range(len(self.radices))):
            raise ValueError(f"exact_levels: {sorted(self.exact_levels)} are not all levels of {self.radices}")
        if not self.radices or any(a < 2 for a in self.radices):
            raise ValueError(f"radices: every level groups at least 2 ranks, got {self.radices}")
        self.orders = [list(o) for o in orders]
        if not self.orders or any(sorted(o) != list(range(len(self.radices))) for o in self.orders):
            raise ValueError(f"orders: each stream visits every level once, got {self.orders} for "
                             f"{len(self.radices)} level(s)")
        self.group_by = group_by
        self._schedules: dict[int, list[list[CubeStep]]] = {}
        groups = len(self.radices) if group_by == "level" else len(self.orders)
        super().__init__(groups, codec=codec, interfaces=interfaces, timeout_s=timeout_s, layout="pieces")

    @property
    def streams(self) -> int:
        """Pieces per rank and colayer: the buffer is cut into ``streams`` parts of n pieces."""
        return len(self.orders)

    # ------------------------------------------------------------------ the schedule

    def digit(self, x: int, level: int) -> int:
        return _mixed_digit(self.radices, x, level)

    def steps(self, me: int) -> list[list[CubeStep]]:
        """Rank ``me``'s schedule, built once per rank (every colayer of every step uses it)."""
        if me not in self._schedules:
            self._schedules[me] = digit_schedule(self.radices, self.orders, me)
        return self._schedules[me]

    def pieces(self, numel: int) -> list[list[tuple[int, int]]]:
        """``[stream][piece] -> (start, end)`` in the flat buffer."""
        return [[(a + lo, a + hi) for lo, hi in shard_bounds(b - a, self.size)]
                for a, b in shard_bounds(numel, self.streams)]

    def bytes_per_round(self, numel: int) -> int:
        """Bytes this rank sends in one round of ``numel`` values (both stages)."""
        bounds = self.pieces(numel)
        return sum(self._wire(step).nbytes(hi - lo) for row in self.steps(self.rank) for step in row
                   for ps in step.sends.values() for lo, hi in (bounds[step.stream][p] for p in ps) if hi > lo)

    def _wire(self, step: CubeStep) -> Codec:
        """What a step's messages are in: the owners' encoded means in the all-gather; in the
        reduce-scatter the codec, or raw fp32 on an exact level (ranks of one host, whose
        messages never touch a wire: encoding them would cost CPU and accuracy for nothing)."""
        return _FP32 if not step.gather and step.level in self.exact_levels else self.codec

    # ------------------------------------------------------------------ the exchange

    def _error_feedback(self, numel: int) -> tuple[ErrorFeedback, ...]:
        """(this rank's own pieces, relayed partial sums, owned means) -- one residual each."""
        if self._feedback is None or self._feedback[0].residual.numel() != numel:
            self._feedback = tuple(ErrorFeedback(self.codec, numel) for _ in range(3))
        return self._feedback

    def _exchange(self, flat: torch.Tensor, feedback: tuple[ErrorFeedback, ...], offset: int = 0
                  ) -> tuple[torch.Tensor, int]:
        deadline = time.monotonic() + self.timeout_s
        local_ef, relay_ef, owner_ef = feedback
        me, n, codec, levels = self.rank, self.size, self.codec, len(self.radices)
        if flat.numel() < n * self.streams:
            raise ValueError(f"pieces: the {type(self).__name__} cuts a buffer into streams * n = "
                             f"{n * self.streams} pieces, more than its {flat.numel()} elements")
        bounds = self.pieces(flat.numel())
        partial: list[dict[int, torch.Tensor]] = [{p: flat[lo:hi] for p, (lo, hi) in enumerate(s)} for s in bounds]
        encoded: list[dict[int, torch.Tensor]] = [{} for _ in bounds]        # owner bytes, forwarded as they are
        out = torch.empty_like(flat)
        keep, sent, sends = self._inflight, 0, []

        def size(t: int, p: int) -> int:
            lo, hi = bounds[t][p]
            return hi - lo

        for k, row in enumerate(self.steps(me)):
            posted: list[tuple[CubeStep, dict[int, torch.Tensor], list[dist.Work]]] = []
            for step in row:
                index = step.level if self.group_by == "level" else step.stream
                wire = self._wire(step)
                buffers: dict[int, torch.Tensor] = {}
                works: list[dist.Work] = []
                for peer, ps in step.sends.items():
                    if step.gather:
                        parts = [encoded[step.stream][p] for p in ps]
                    elif wire is _FP32:
                        parts = [wire.compress(partial[step.stream][p]) for p in ps]
                    else:
                        ef = local_ef if k == 0 else relay_ef
                        parts = [ef.compress(partial[step.stream][p], offset + bounds[step.stream][p][0])
                                 for p in ps]
                    data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
                    if data.numel():
                        sends.append(self._link(index, me, peer).send([data], peer, _TAG_BASE + k))
                        keep.append(data)
                        sent += data.numel()
                for peer, ps in step.recvs.items():
                    nbytes = sum(wire.nbytes(size(step.stream, p)) for p in ps)
                    if nbytes:
                        buffers[peer] = torch.empty(nbytes, dtype=torch.uint8)
                        works.append(self._link(index, peer, me).recv([buffers[peer]], peer, _TAG_BASE + k))
                keep.extend(buffers.values())
                posted.append((step, buffers, works))
            keep.extend(sends)
            for step, buffers, works in posted:
                keep.extend(works)
                _wait_all(works, deadline)
                t = step.stream
                if step.gather:
                    for peer, ps in step.recvs.items():
                        for p, data in zip(ps, _split(buffers.get(peer), [codec.nbytes(size(t, p)) for p in ps])):
                            encoded[t][p] = data
                    continue
                wire = self._wire(step)
                mine = self.digit(me, step.level)
                sources = {self.digit(peer, step.level): peer for peer in step.recvs}
                kept = next(iter(step.recvs.values()))             # the same pieces from every peer
                decoded = {peer: list(_split(buffers.get(peer), [wire.nbytes(size(t, p)) for p in kept]))
                           for peer in step.recvs}
                summed: dict[int, torch.Tensor] = {}
                for j, p in enumerate(kept):
                    acc: torch.Tensor | None = None
                    for v in range(self.radices[step.level]):     # in digit order, own value in its place
                        value = (partial[t][p] if v == mine
                                 else wire.extract(decoded[sources[v]][j], size(t, p)))
                        acc = value.clone() if acc is None else acc.add_(value)
                    assert acc is not None
                    summed[p] = acc
                partial[t] = summed
                if k == levels - 1:                               # this rank owns piece ``me``: encode the mean
                    lo, hi = bounds[t][me]
                    mean = summed[me].div_(n)
                    encoded[t][me] = owner_ef.compress(mean, offset + lo)
                    keep.append(encoded[t][me])
        _wait_all(sends, deadline)
        for t, s in enumerate(bounds):
            for p, (lo, hi) in enumerate(s):
                if hi > lo:
                    out[lo:hi] = codec.extract(encoded[t][p], hi - lo)
        return out, sent


class CubeAllReduce(DigitAllReduce):
    """Mean of a flat fp32 CPU tensor over the α^β ranks of a BCube(α, β), one rank per host.

    Collective construction (every rank, same order), like ``ShardedAllReduce``.

    Args:
        alpha: ports per switch (hosts per cube).
        beta: levels (NICs per host, streams).
        codec: what travels (default exact fp32).
        interfaces: NIC names, level ℓ on ``interfaces[ℓ]`` (default ``GLOO_SOCKET_IFNAME``).
        timeout_s: a round slower than this is discarded on every rank.
    """

    def __init__(self, alpha: int, beta: int, *, codec: Codec | None = None,
                 interfaces: Sequence[str] | None = None, timeout_s: float = 600.0) -> None:
        if not dist.is_initialized():
            raise RuntimeError("CubeAllReduce needs an initialized default process group")
        if alpha < 2:
            raise ValueError(f"alpha: a BCube switch has at least 2 ports, got {alpha}")
        if beta < 1:
            raise ValueError(f"beta: a BCube has at least 1 level, got {beta}")
        if alpha ** beta != dist.get_world_size():
            raise ValueError(f"world size: BCube({alpha}, {beta}) has alpha^beta = {alpha ** beta} hosts with one "
                             f"rank each, but the job has {dist.get_world_size()} ranks")
        self.alpha, self.beta = alpha, beta
        super().__init__([alpha] * beta, _rotations(beta), group_by="level", codec=codec,
                         interfaces=interfaces, timeout_s=timeout_s)
        if self.interfaces is not None and len(self.interfaces) != beta:
            log.warning("cube all-reduce: %d levels but %d NIC(s) named (%s); levels share NICs",
                        beta, len(self.interfaces), ",".join(self.interfaces))


class NestedAllReduce(DigitAllReduce):
    """Mean of a flat fp32 CPU tensor over ranks grouped in nested groups of equal size
    (ranks in hosts, hosts in racks): reduce-scatter innermost level first, all-gather
    back out (module docstring). Rank r's digit ℓ is its place at level ℓ, so ranks must
    be numbered group by group (as ``torchrun`` and syncplane's launcher number them).

    Args:
        radices: group size per level, innermost first; their product is the world size.
        streams: concurrent streams, each carrying 1/streams of the buffer on its own gloo
            group, stream t on NIC ``t mod k`` of the ``interfaces``.
        exact_levels: levels whose reduce-scatter sends raw fp32 instead of the codec (the
            ranks of one host: memory bandwidth, no wire); the owners' encoded means still
            travel encoded.
        codec, interfaces, timeout_s: as ``ShardedAllReduce``.
    """

    def __init__(self, radices: Sequence[int], *, streams: int = 1, codec: Codec | None = None,
                 exact_levels: Sequence[int] = (), interfaces: Sequence[str] | None = None,
                 timeout_s: float = 600.0) -> None:
        if not dist.is_initialized():
            raise RuntimeError("NestedAllReduce needs an initialized default process group")
        radices = [int(a) for a in radices]
        if math.prod(radices) != dist.get_world_size():
            raise ValueError(f"radices: groups of {radices} hold {math.prod(radices)} ranks, but the job has "
                             f"{dist.get_world_size()}")
        if streams < 1:
            raise ValueError(f"streams: must be at least 1, got {streams}")
        super().__init__(radices, [list(range(len(radices)))] * streams, group_by="stream", codec=codec,
                         exact_levels=exact_levels, interfaces=interfaces, timeout_s=timeout_s)


def _mixed_digit(radices: Sequence[int], x: int, level: int) -> int:
    return (x // math.prod(radices[:level])) % radices[level]


def _mixed_peer(radices: Sequence[int], x: int, level: int, value: int) -> int:
    """The rank whose address is ``x``'s with digit ``level`` set to ``value``."""
    return x + (value - _mixed_digit(radices, x, level)) * math.prod(radices[:level])


def _rotations(beta: int) -> list[list[int]]:
    """BCube's level orders: stream t starts at level t, so every step uses every level."""
    return [[(t + i) % beta for i in range(beta)] for t in range(beta)]


def digit_schedule(radices: Sequence[int], orders: Sequence[Sequence[int]], me: int) -> list[list[CubeStep]]:
    """Rank ``me``'s part of the digit all-reduce: per step (one reduce-scatter step per
    level, then the all-gather steps in reverse), one ``CubeStep`` per stream, stream t
    taking the levels in ``orders[t]`` (``DigitAllReduce``)."""
    n, streams, depth = math.prod(radices), len(orders), len(radices)
    held = [list(range(n)) for _ in range(streams)]         # pieces whose partial sums this rank holds
    schedule: list[list[CubeStep]] = []
    for i in range(depth):                                  # reduce-scatter ("all-gather stage")
        row = []
        for t in range(streams):
            level = orders[t][i]
            mine = _mixed_digit(radices, me, level)
            sends = {_mixed_peer(radices, me, level, v): [p for p in held[t] if _mixed_digit(radices, p, level) == v]
                     for v in range(radices[level]) if v != mine}
            kept = [p for p in held[t] if _mixed_digit(radices, p, level) == mine]
            row.append(CubeStep(t, level, False, sends, {peer: kept for peer in sends}))
            held[t] = kept
        schedule.append(row)
    for i in reversed(range(depth)):                        # all-gather ("all-reduce stage")
        row = []
        for t in range(streams):
            level = orders[t][i]
            mine = _mixed_digit(radices, me, level)
            recvs = {_mixed_peer(radices, me, level, v): [_mixed_peer(radices, p, level, v) for p in held[t]]
                     for v in range(radices[level]) if v != mine}
            row.append(CubeStep(t, level, True, {peer: held[t] for peer in recvs}, recvs))
            held[t] = sorted(held[t] + [p for ps in recvs.values() for p in ps])
        schedule.append(row)
    return schedule


def cube_schedule(alpha: int, beta: int, me: int) -> list[list[CubeStep]]:
    """Rank ``me``'s part of the cube all-reduce on BCube(α, β): per step (β reduce-scatter
    steps, then β all-gather steps), one ``CubeStep`` per stream (module docstring)."""
    return digit_schedule([alpha] * beta, _rotations(beta), me)


def nested_schedule(radices: Sequence[int], me: int, streams: int = 1) -> list[list[CubeStep]]:
    """Rank ``me``'s part of the nested exchange (``NestedAllReduce``): innermost level first."""
    return digit_schedule(radices, [list(range(len(radices)))] * streams, me)


def _split(data: torch.Tensor | None, sizes: list[int]) -> Iterator[torch.Tensor]:
    """``data`` cut into consecutive parts of ``sizes`` bytes (empty parts when ``data`` is None)."""
    start = 0
    for nbytes in sizes:
        yield data[start:start + nbytes] if data is not None else torch.empty(0, dtype=torch.uint8)
        start += nbytes


__all__ = ["CubeAllReduce", "CubeStep", "DigitAllReduce", "NestedAllReduce", "cube_schedule", "digit_schedule",
           "nested_schedule"]
