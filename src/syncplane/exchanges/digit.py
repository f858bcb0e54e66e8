"""The digit exchanges: the two-stage cube all-reduce (mean) for a BCube(α, β) network (Canary's
network), and the same schedule nested by hosts and racks.

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

The runner is ``syncplane.comm.StreamRunner`` with β streams, stream ℓ bound to NIC ℓ (the
``interfaces`` its caller names): commit or discard, deadline, abort and rebuild are its. A lossy codec compresses a rank's own pieces once (error feedback
``local``), each relayed partial sum once (``relay``) and the owner's mean once (``owner``);
every rank decodes the same owner bytes, so replicas agree exactly. With the exact
codec the result is the mean up to fp32 rounding of the (cube-ordered) sums.

The same schedule on *mixed-radix* addresses is the **nested** exchange for ranks grouped in
hosts and racks (``NestedExchange``): rank r's digits are its place in its host, its host's
place in its rack, its rack (radices = ranks per host, hosts per rack, racks). Every stream
visits the levels innermost first -- reduce-scatter inside the host, then inside the rack,
then across racks, and the all-gather back out -- so the slow links carry only the last
level's share: across two racks of m ranks each rank sends M/(2m) each way, M per uplink
and direction in all (the network's bound), where the flat piece mesh sends m·M. Stream t
runs on NIC ``t mod k``. The sum order is fixed by the digits, so the exact codec gives the
same bits for any stream count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from syncplane.cluster.cost import FlowArray, Phase
from syncplane.cluster.profile import ClusterProfile
from syncplane.comm.codecs import Codec, Fp32
from syncplane.exchanges.cpu import CpuWork, coded, feedback_encoded
from syncplane.comm.streams import Result, Round, shard_bounds

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


class DigitExchange:
    """Mean of a flat fp32 CPU tensor over ranks addressed by mixed-radix digits, each
    stream reduce-scattering along its own order of levels (one peer set per step: the
    ranks that differ from this one in that step's digit only), then all-gathering back.

    ``CubeExchange`` (BCube: streams rotate over the levels, level ℓ on NIC ℓ) and
    ``NestedExchange`` (hosts and racks: innermost level first, stream t on NIC t) are its
    two schedules; ``group_by`` says which of a step's indices picks its stream group.
    """

    feedback_slots = 3     # (this rank's own pieces, relayed partial sums, owned means)

    def __init__(self, radices: Sequence[int], orders: Sequence[Sequence[int]], *,
                 group_by: Literal["level", "stream"], exact_levels: Sequence[int] = ()) -> None:
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

    @property
    def streams(self) -> int:
        """Stream groups: one per level (cube) or per stream (nested)."""
        return len(self.radices) if self.group_by == "level" else len(self.orders)

    @property
    def parts(self) -> int:
        """Pieces per rank and colayer: the buffer is cut into ``parts`` parts of n pieces."""
        return len(self.orders)

    def check(self, size: int) -> None:
        if math.prod(self.radices) != size:
            raise ValueError(f"radices: groups of {self.radices} hold {math.prod(self.radices)} ranks, but the "
                             f"job has {size}")

    # ------------------------------------------------------------------ the schedule

    def digit(self, x: int, level: int) -> int:
        return _mixed_digit(self.radices, x, level)

    def steps(self, me: int) -> list[list[CubeStep]]:
        """Rank ``me``'s schedule, built once per rank (every colayer of every step uses it)."""
        if me not in self._schedules:
            self._schedules[me] = digit_schedule(self.radices, self.orders, me)
        return self._schedules[me]

    def pieces(self, numel: int, size: int) -> list[list[tuple[int, int]]]:
        """``[part][piece] -> (start, end)`` in the flat buffer."""
        return [[(a + lo, a + hi) for lo, hi in shard_bounds(b - a, size)]
                for a, b in shard_bounds(numel, self.parts)]

    def bytes_per_round(self, numel: int, codec: Codec, rank: int, size: int) -> int:
        """Bytes ``rank`` sends in one round of ``numel`` values (both stages)."""
        bounds = self.pieces(numel, size)
        return sum(self._wire(step, codec).nbytes(hi - lo) for row in self.steps(rank) for step in row
                   for ps in step.sends.values() for lo, hi in (bounds[step.stream][p] for p in ps) if hi > lo)

    def _group(self, step: CubeStep) -> int:
        """The stream group a step's messages travel on (``group_by``)."""
        return step.level if self.group_by == "level" else step.stream

    def _wire(self, step: CubeStep, codec: Codec) -> Codec:
        """What a step's messages are in: the owners' encoded means in the all-gather; in the
        reduce-scatter the codec, or raw fp32 on an exact level (ranks of one host, whose
        messages never touch a wire: encoding them would cost CPU and accuracy for nothing)."""
        return _FP32 if not step.gather and step.level in self.exact_levels else codec

    # ------------------------------------------------------------------ the exchange

    def run(self, round: Round) -> tuple[Result, int]:
        flat, codec, offset = round.flat, round.codec, round.offset
        local_ef, relay_ef, owner_ef = round.feedback
        me, n, levels = round.rank, round.size, len(self.radices)
        if flat.numel() < n * self.parts:
            raise ValueError(f"pieces: the {type(self).__name__} cuts a buffer into parts * n = "
                             f"{n * self.parts} pieces, more than its {flat.numel()} elements")
        bounds = self.pieces(flat.numel(), n)
        partial: list[dict[int, torch.Tensor]] = [{p: flat[lo:hi] for p, (lo, hi) in enumerate(s)} for s in bounds]
        encoded: list[dict[int, torch.Tensor]] = [{} for _ in bounds]        # owner bytes, forwarded as they are
        keep, sent, sends = round.keep, 0, []

        def size(t: int, p: int) -> int:
            lo, hi = bounds[t][p]
            return hi - lo

        # every step's receives are posted up front: gloo's TCP transport sends a message only
        # once its receiver has posted the receive and said so (a message back, queued behind
        # the other direction's bulk data), so a receive posted when its step comes would idle
        # the sender's link for that message delay at every step
        schedule = self.steps(me)
        posted_recvs: list[list[tuple[CubeStep, Codec, dict[int, torch.Tensor], list[dist.Work]]]] = []
        for k, row in enumerate(schedule):
            posted_row = []
            for i, step in enumerate(row):
                index, wire = self._group(step), self._wire(step, codec)
                buffers: dict[int, torch.Tensor] = {}
                works: list[dist.Work] = []
                for peer, ps in step.recvs.items():
                    nbytes = sum(wire.nbytes(size(step.stream, p)) for p in ps)
                    if nbytes:
                        buffers[peer] = round.kept(("recv", k, i, peer), nbytes)
                        works.append(round.link(index, peer, me).recv([buffers[peer]], peer, _TAG_BASE + k))
                keep.extend(buffers.values())
                keep.extend(works)
                posted_row.append((step, wire, buffers, works))
            posted_recvs.append(posted_row)

        for k, row in enumerate(schedule):
            for i, step in enumerate(row):
                index, wire = self._group(step), self._wire(step, codec)
                t = step.stream
                for peer, ps in step.sends.items():
                    sizes = [wire.nbytes(size(t, p)) for p in ps]
                    if not sum(sizes):
                        continue
                    data = round.kept(("send", k, i, peer), sum(sizes))
                    if step.gather:
                        torch.cat([encoded[t][p] for p in ps], out=data)
                    elif wire is _FP32:
                        for p, place in zip(ps, _split(data, sizes)):
                            wire.compress(partial[t][p], out=place)
                    else:      # each piece encoded straight into its place in the message
                        ef = local_ef if k == 0 else relay_ef
                        with round.phase(f"encode/L{step.level}"):
                            for p, place in zip(ps, _split(data, sizes)):
                                ef.compress(partial[t][p], offset + bounds[t][p][0], out=place)
                    sends.append(round.link(index, me, peer).send([data], peer, _TAG_BASE + k))
                    keep.extend([data, sends[-1]])
                    sent += data.numel()
            for step, wire, buffers, works in posted_recvs[k]:
                with round.phase(f"wait/L{step.level}-{'ag' if step.gather else 'rs'}"):
                    round.wait(works)
                t = step.stream
                if step.gather:
                    for peer, ps in step.recvs.items():
                        for p, data in zip(ps, _split(buffers.get(peer), [wire.nbytes(size(t, p)) for p in ps])):
                            encoded[t][p] = data
                    continue
                mine = self.digit(me, step.level)
                sources = {self.digit(peer, step.level): peer for peer in step.recvs}
                kept = next(iter(step.recvs.values()))             # the same pieces from every peer
                decoded = {peer: list(_split(buffers.get(peer), [wire.nbytes(size(t, p)) for p in kept]))
                           for peer in step.recvs}
                summed: dict[int, torch.Tensor] = {}
                with round.phase(f"sum/L{step.level}"):
                    for j, p in enumerate(kept):
                        # in digit order, own value in its place; the first term is decoded (or
                        # copied) straight into the sum
                        acc = round.kept(("sum", k, t, p), size(t, p), flat.dtype)
                        for v in range(self.radices[step.level]):
                            if v == mine:
                                (acc.copy_ if v == 0 else acc.add_)(partial[t][p])
                            else:
                                round.add_decoded(acc, v == 0, wire, decoded[sources[v]][j], ("decoded", t))
                        summed[p] = acc
                partial[t] = summed
                if k == levels - 1:                               # this rank owns piece ``me``: encode the mean
                    lo, hi = bounds[t][me]
                    mean = summed[me].div_(n)
                    with round.phase("encode/mean"):
                        encoded[t][me] = owner_ef.compress(mean, offset + lo,
                                                           out=round.kept(("mean", t), codec.nbytes(hi - lo)))
                    keep.append(encoded[t][me])
        with round.phase("wait/send"):
            round.wait(sends)
        return round.decoded_later([(lo, hi, encoded[t][p]) for t, s in enumerate(bounds)
                                    for p, (lo, hi) in enumerate(s) if hi > lo]), sent


class CubeExchange(DigitExchange):
    """The cube all-reduce over the α^β ranks of a BCube(α, β), one rank per host: β streams,
    level ℓ on stream (and NIC) ℓ.

    Args:
        alpha: ports per switch (hosts per cube).
        beta: levels (NICs per host, streams).
    """

    def __init__(self, alpha: int, beta: int) -> None:
        if alpha < 2:
            raise ValueError(f"alpha: a BCube switch has at least 2 ports, got {alpha}")
        if beta < 1:
            raise ValueError(f"beta: a BCube has at least 1 level, got {beta}")
        self.alpha, self.beta = alpha, beta
        super().__init__([alpha] * beta, _rotations(beta), group_by="level")

    def check(self, size: int) -> None:
        if self.alpha ** self.beta != size:
            raise ValueError(f"world size: BCube({self.alpha}, {self.beta}) has alpha^beta = "
                             f"{self.alpha ** self.beta} hosts with one rank each, but the job has {size} ranks")


class NestedExchange(DigitExchange):
    """Ranks grouped in nested groups of equal size (ranks in hosts, hosts in racks):
    reduce-scatter innermost level first, all-gather back out (module docstring). Rank r's
    digit ℓ is its place at level ℓ, so ranks must be numbered group by group (as
    ``torchrun`` and syncplane's launcher number them).

    Args:
        radices: group size per level, innermost first; their product is the world size.
        streams: concurrent streams, each carrying 1/streams of the buffer on its own gloo
            group, stream t on NIC ``t mod k``.
        exact_levels: levels whose reduce-scatter sends raw fp32 instead of the codec (the
            ranks of one host: memory bandwidth, no wire); the owners' encoded means still
            travel encoded.
    """

    def __init__(self, radices: Sequence[int], *, streams: int = 1, exact_levels: Sequence[int] = ()) -> None:
        if streams < 1:
            raise ValueError(f"streams: must be at least 1, got {streams}")
        super().__init__([int(a) for a in radices], [list(range(len(radices)))] * streams, group_by="stream",
                         exact_levels=exact_levels)


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
    taking the levels in ``orders[t]`` (``DigitExchange``)."""
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
    """Rank ``me``'s part of the nested exchange (``NestedExchange``): innermost level first."""
    return digit_schedule(radices, [list(range(len(radices)))] * streams, me)


def _split(data: torch.Tensor | None, sizes: list[int]) -> Iterator[torch.Tensor]:
    """``data`` cut into consecutive parts of ``sizes`` bytes (empty parts when ``data`` is None)."""
    start = 0
    for nbytes in sizes:
        yield data[start:start + nbytes] if data is not None else torch.empty(0, dtype=torch.uint8)
        start += nbytes



# ----------------------------------------------------------------------------- cost


def nested_cost(radices: Sequence[int], payload_bytes: float, streams: int = 1,
                     exact_levels: Sequence[int] = (), exact_bytes: float | None = None) -> list[Phase]:
    """The nested exchange (``NestedExchange``): ranks grouped in levels of
    ``radices`` (innermost first); reduce-scatter level by level, each rank sending the
    part of what it holds whose level-i digit is a peer's to that peer -- M/(a₀·…·aᵢ) per
    peer, over ``streams`` flows -- then the all-gather back in reverse. Across the outermost
    level each rank sends M/n per peer each way: the network's bound for racks. The
    reduce-scatter of an ``exact_levels`` level carries ``exact_bytes`` (the raw fp32
    payload) instead of ``payload_bytes`` (the encoded one)."""
    n = int(np.prod(radices)) if radices else 1
    if n < 2:
        return []
    ranks = np.arange(n, dtype=np.int64)
    scatter: list[Phase] = []
    gather: list[Phase] = []
    stride = 1
    for level, radix in enumerate(radices):
        digit = np.repeat((ranks // stride) % radix, radix - 1)
        src = np.repeat(ranks, radix - 1)
        dst = src + (((digit + np.tile(np.arange(1, radix, dtype=np.int64), n)) % radix) - digit) * stride
        stride *= radix
        copies = np.full(len(src), streams, dtype=np.int64)
        sent = exact_bytes if level in exact_levels and exact_bytes is not None else payload_bytes
        scatter.append(FlowArray(src, dst, np.full(len(src), sent / stride / streams), copies, pinned=True))
        gather.append(FlowArray(src, dst, np.full(len(src), payload_bytes / stride / streams), copies, pinned=True))
    return scatter + gather[::-1]


def nested_cpu_work(radices: Sequence[int], numel: float, codec: Codec, exact_levels: Sequence[int] = ()) -> CpuWork:
    """One rank's CPU work in one round of ``DigitExchange.run`` (``syncplane.exchanges.cpu``)
    on mixed-radix levels ``radices``: at level i, of the H values it holds it encodes (with
    error feedback) the (a−1)/a it sends, decodes the a − 1 pieces of H/a it receives and sums
    a of them; then the mean of its M/n encoded once, and at the end every piece decoded into
    the result. An ``exact_levels`` level travels as fp32 (sums only). The β streams of the
    cube split M, so their work adds up to the same totals (``cube_cpu_work``)."""
    n = int(np.prod(radices)) if radices else 1
    if n < 2:
        return CpuWork()
    work = CpuWork()
    held = float(numel)
    for level, radix in enumerate(radices):
        wire = _FP32 if level in exact_levels else codec
        work += feedback_encoded(wire, held * (radix - 1) / radix) + coded(wire, decoded=held * (radix - 1) / radix)
        work += CpuWork.adds(held)
        held /= radix
    work += feedback_encoded(codec, held) + coded(codec, decoded=float(numel))
    work += CpuWork.adds(held + numel)                   # the mean, and every piece copied into the result
    return work


def cube_cpu_work(alpha: int, beta: int, numel: float, codec: Codec) -> CpuWork:
    """``nested_cpu_work`` of the cube all-reduce on BCube(α, β): β levels of radix α."""
    return nested_cpu_work([alpha] * beta, numel, codec)


def cube_steps(alpha: int, beta: int) -> list[list[tuple[int, int]]]:
    """The two-stage cube all-reduce on BCube(α, β) (BML's pattern): per step, ``(stream, level)`` for each of the β streams. The payload is cut
    into β streams; stream t reduce-scatters along levels t, t+1, … (mod β), one level per
    step, then all-gathers back in reverse order -- so in every step the β streams use β
    different levels, i.e. every NIC of every host at once, and only one-hop links."""
    order = [[(t + i) % beta for i in range(beta)] for t in range(beta)]
    scatter = [[(t, order[t][i]) for t in range(beta)] for i in range(beta)]
    gather = [[(t, order[t][i]) for t in range(beta)] for i in reversed(range(beta))]
    return scatter + gather


def cube_cost(profile: ClusterProfile, payload_bytes: float) -> list[Phase]:
    """The flows of ``cube_steps`` on a BCube profile (one rank per host): in step i of the
    reduce-scatter (and the matching all-gather step) every host sends 1/α^(i+1) of its
    stream's M/β to each of the α − 1 hosts of its level-ℓ cube; each NIC carries
    2·(α−1)/α·(1 + 1/α + …)·M/β in all, which for β = 2 is the network bound 2(n−1)/n·M/2."""
    cube = profile.bcube
    if cube is None:
        raise ValueError(f"profile {profile.name!r} is not a BCube network (no bcube key)")
    if profile.world_size != cube.hosts:
        raise ValueError(f"the cube all-reduce runs one rank per host: {profile.name!r} has "
                         f"{profile.world_size} ranks on {cube.hosts} hosts")
    steps = cube_steps(cube.alpha, cube.beta)
    phases: list[Phase] = []
    for k, step in enumerate(steps):
        depth = k if k < cube.beta else 2 * cube.beta - 1 - k           # i of the step, in both stages
        nbytes = payload_bytes / cube.beta / cube.alpha ** (depth + 1)
        phases.append([(x, cube.with_digit(x, level, v), nbytes) for _, level in step for x in range(cube.hosts)
                       for v in range(cube.alpha) if v != cube.digits(x)[level]])
    return phases


__all__ = ["CubeExchange", "CubeStep", "DigitExchange", "NestedExchange", "cube_cost", "cube_cpu_work", "cube_schedule", "cube_steps",
           "digit_schedule", "nested_cost", "nested_cpu_work", "nested_schedule"]
