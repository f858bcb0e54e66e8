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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from syncplane.comm.codecs import Codec, ErrorFeedback
from syncplane.comm.sharded import ShardedAllReduce, _wait_all, shard_bounds

log = logging.getLogger(__name__)

_TAG_BASE = 64


@dataclass(frozen=True)
class CubeStep:
    """One stream's part of one step, seen from one rank: on level ``level`` (group and
    NIC), to/from each cube peer, which pieces travel (sorted piece indices)."""

    stream: int
    level: int
    gather: bool                                    # all-reduce stage: forward encoded means
    sends: dict[int, list[int]]                     # peer -> pieces this rank sends it
    recvs: dict[int, list[int]]                     # peer -> pieces this rank receives from it


class CubeAllReduce(ShardedAllReduce):
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
        super().__init__(beta, codec=codec, interfaces=interfaces, timeout_s=timeout_s, layout="pieces")
        if self.interfaces is not None and len(self.interfaces) != beta:
            log.warning("cube all-reduce: %d levels but %d NIC(s) named (%s); levels share NICs",
                        beta, len(self.interfaces), ",".join(self.interfaces))

    # ------------------------------------------------------------------ the schedule

    def digit(self, x: int, level: int) -> int:
        return _digit(self.alpha, x, level)

    def steps(self, me: int) -> list[list[CubeStep]]:
        return cube_schedule(self.alpha, self.beta, me)

    def pieces(self, numel: int) -> list[list[tuple[int, int]]]:
        """``[stream][piece] -> (start, end)`` in the flat buffer."""
        return [[(a + lo, a + hi) for lo, hi in shard_bounds(b - a, self.size)]
                for a, b in shard_bounds(numel, self.beta)]

    def bytes_per_round(self, numel: int) -> int:
        """Bytes this rank sends in one round of ``numel`` values (both stages)."""
        bounds = self.pieces(numel)
        return sum(self.codec.nbytes(hi - lo) for row in self.steps(self.rank) for step in row
                   for ps in step.sends.values() for lo, hi in (bounds[step.stream][p] for p in ps) if hi > lo)

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
        me, n, codec = self.rank, self.size, self.codec
        if flat.numel() < n * self.beta:
            raise ValueError(f"pieces: the cube all-reduce cuts a buffer into beta * n = {n * self.beta} pieces, "
                             f"more than its {flat.numel()} elements")
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
                group = self._groups[step.level]
                buffers: dict[int, torch.Tensor] = {}
                works: list[dist.Work] = []
                for peer, ps in step.sends.items():
                    if step.gather:
                        parts = [encoded[step.stream][p] for p in ps]
                    else:
                        ef = local_ef if k == 0 else relay_ef
                        parts = [ef.compress(partial[step.stream][p], offset + bounds[step.stream][p][0])
                                 for p in ps]
                    data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
                    if data.numel():
                        sends.append(group.send([data], peer, _TAG_BASE + k))
                        keep.append(data)
                        sent += data.numel()
                for peer, ps in step.recvs.items():
                    nbytes = sum(codec.nbytes(size(step.stream, p)) for p in ps)
                    if nbytes:
                        buffers[peer] = torch.empty(nbytes, dtype=torch.uint8)
                        works.append(group.recv([buffers[peer]], peer, _TAG_BASE + k))
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
                mine = self.digit(me, step.level)
                sources = {self.digit(peer, step.level): peer for peer in step.recvs}
                kept = next(iter(step.recvs.values()))             # the same pieces from every peer
                decoded = {peer: list(_split(buffers.get(peer), [codec.nbytes(size(t, p)) for p in kept]))
                           for peer in step.recvs}
                summed: dict[int, torch.Tensor] = {}
                for j, p in enumerate(kept):
                    acc: torch.Tensor | None = None
                    for v in range(self.alpha):                   # in digit order, own value in its place
                        value = (partial[t][p] if v == mine
                                 else codec.extract(decoded[sources[v]][j], size(t, p)))
                        acc = value.clone() if acc is None else acc.add_(value)
                    assert acc is not None
                    summed[p] = acc
                partial[t] = summed
                if k == self.beta - 1:                            # this rank owns piece ``me``: encode the mean
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


def _digit(alpha: int, x: int, level: int) -> int:
    return (x // alpha ** level) % alpha


def _peer(alpha: int, x: int, level: int, value: int) -> int:
    """The host whose address is ``x``'s with digit ``level`` set to ``value``."""
    return x + (value - _digit(alpha, x, level)) * alpha ** level


def cube_schedule(alpha: int, beta: int, me: int) -> list[list[CubeStep]]:
    """Rank ``me``'s part of the cube all-reduce on BCube(α, β): per step (β reduce-scatter
    steps, then β all-gather steps), one ``CubeStep`` per stream (module docstring)."""
    n = alpha ** beta
    order = [[(t + i) % beta for i in range(beta)] for t in range(beta)]
    held = [list(range(n)) for _ in range(beta)]            # pieces whose partial sums this rank holds
    schedule: list[list[CubeStep]] = []
    for i in range(beta):                                   # reduce-scatter ("all-gather stage")
        row = []
        for t in range(beta):
            level, mine = order[t][i], _digit(alpha, me, order[t][i])
            sends = {_peer(alpha, me, level, v): [p for p in held[t] if _digit(alpha, p, level) == v]
                     for v in range(alpha) if v != mine}
            kept = [p for p in held[t] if _digit(alpha, p, level) == mine]
            row.append(CubeStep(t, level, False, sends, {peer: kept for peer in sends}))
            held[t] = kept
        schedule.append(row)
    for i in reversed(range(beta)):                         # all-gather ("all-reduce stage")
        row = []
        for t in range(beta):
            level, mine = order[t][i], _digit(alpha, me, order[t][i])
            recvs = {_peer(alpha, me, level, v): [_peer(alpha, p, level, v) for p in held[t]]
                     for v in range(alpha) if v != mine}
            row.append(CubeStep(t, level, True, {peer: held[t] for peer in recvs}, recvs))
            held[t] = sorted(held[t] + [p for ps in recvs.values() for p in ps])
        schedule.append(row)
    return schedule


def _split(data: torch.Tensor | None, sizes: list[int]) -> Iterator[torch.Tensor]:
    """``data`` cut into consecutive parts of ``sizes`` bytes (empty parts when ``data`` is None)."""
    start = 0
    for nbytes in sizes:
        yield data[start:start + nbytes] if data is not None else torch.empty(0, dtype=torch.uint8)
        start += nbytes


__all__ = ["CubeAllReduce", "CubeStep", "cube_schedule"]
