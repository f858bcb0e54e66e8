"""The gather exchange: every rank receives every rank's encoded piece and decodes them itself.

Why a gather: a sum of top-k vectors is denser than each, so a sparse payload
(``ChunkedTopK``) cannot be summed on the way as the mesh (on each owner) and the tree (at
every level) do without re-encoding it. Here each rank encodes its piece once (with its
error feedback), sends the same bytes to every other rank, and decodes-and-accumulates all n
pieces **in rank order** into zeros, then divides once: every rank holds the same pieces, so
the mean is bit-identical on every rank. The codec's payload size depends on the element
count only, so no size exchange is needed.

Per stream, the buffer is cut into S contiguous segments (``shard_bounds``); segment s travels
on stream s. Values at logical positions ``>= exact_from`` travel as raw fp32 in the same
message (a caller's averaged-as-values tail, e.g. BatchNorm statistics, which a top-k would
zero out).

Flat, not hierarchical: each rank sends (n − 1) copies of its piece, so a slow link between
hosts carries a piece once per remote *rank*; a host-level forwarding step would carry it
once per remote *host*. With pieces 50-200× smaller than fp32 the flat gather is still far
below the mesh's 2(n−1)/n·M (``cost``); the hierarchical version is future work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from syncplane.cluster.cost import Phase
from syncplane.comm.codecs import Codec
from syncplane.comm.streams import Round, shard_bounds
from syncplane.exchanges.mesh import all_pairs

_TAG_GATHER = 3


@dataclass(frozen=True)
class GatherExchange:
    """The all-gather of encoded pieces on ``shards`` streams (module doc).

    ``exact_from``: logical positions from here on travel as exact fp32 (None: none do)."""

    shards: int = 1
    exact_from: int | None = None
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
        """Any number of ranks."""

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
        """Bytes ``rank`` sends in one round of ``numel`` values: (n − 1) copies of its pieces."""
        total = 0
        for lo, hi in shard_bounds(numel, self.shards):
            if hi > lo:
                total += (size - 1) * self._nbytes(codec, lo, self._cut(lo, hi, offset), hi)
        return total

    def run(self, round: Round) -> tuple[torch.Tensor, int]:
        flat, codec, offset, me, n = round.flat, round.codec, round.offset, round.rank, round.size
        (feedback,) = round.feedback
        keep = round.keep
        out = torch.zeros_like(flat)
        sent = 0
        sends: list[dist.Work] = []
        recvs: list[list[dist.Work]] = []
        pieces: list[list[torch.Tensor]] = []
        bounds = shard_bounds(flat.numel(), self.shards)
        posting = time.perf_counter()
        for s, (lo, hi) in enumerate(bounds):
            cut = self._cut(lo, hi, offset)
            mine = torch.zeros(self._nbytes(codec, lo, cut, hi), dtype=torch.uint8)
            head = self._head(codec, lo, cut, hi)
            if cut > lo:
                encoded = feedback.compress(flat[lo:cut], offset + lo)
                mine[:encoded.numel()] = encoded
            if hi > cut:
                mine[head:].view(torch.float32).copy_(flat[cut:hi])
            stream_pieces, stream_recvs = [], []
            for src in range(n):
                if src == me:
                    stream_pieces.append(mine)
                    continue
                if hi == lo:
                    stream_pieces.append(mine)      # nothing travels on an empty segment
                    continue
                piece = torch.empty(mine.numel(), dtype=torch.uint8)
                stream_recvs.append(round.link(s, src, me).recv([piece], src, _TAG_GATHER))
                stream_pieces.append(piece)
            if hi > lo:
                for dst in range(n):
                    if dst != me:
                        sends.append(round.link(s, me, dst).send([mine], dst, _TAG_GATHER))
                        sent += mine.numel()
            keep.extend([mine, *stream_pieces, *stream_recvs])
            pieces.append(stream_pieces)
            recvs.append(stream_recvs)
        keep.extend(sends)
        if round.profile is not None:
            round.profile.add("post", time.perf_counter() - posting)

        for s, (lo, hi) in enumerate(bounds):
            if hi == lo:
                continue
            with round.phase(f"wait/s{s}/gather"):
                round.wait(recvs[s])
            with round.phase("sum"):
                cut = self._cut(lo, hi, offset)
                if cut > lo:
                    encoded = codec.nbytes(cut - lo)
                    _decode_add(codec, [p[:encoded] for p in pieces[s]], out[lo:cut])
                head = self._head(codec, lo, cut, hi)
                for p in pieces[s]:     # the exact tail, in rank order
                    if hi > cut:
                        out[cut:hi] += p[head:].view(torch.float32)
                out[lo:hi] /= n
        with round.phase("wait/send"):
            round.wait(sends)
        return out, sent


def _decode_add(codec: Codec, payloads: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out += decode(p)`` for each payload in order (the codec's own kernel when it has one)."""
    decode_add = getattr(codec, "decode_add", None)
    if decode_add is not None:
        decode_add(payloads, out)
        return
    for p in payloads:
        out += codec.extract(p, out.numel())


def cost(world_size: int, piece_bytes: float, streams: int = 1) -> list[Phase]:
    """The gather's flows: one phase of n(n−1) concurrent flows of one rank's encoded piece
    (``piece_bytes``, what ``codec.nbytes`` gives; ``mesh.all_pairs``): each rank sends
    (n − 1)·piece."""
    if world_size < 2:
        return []
    return [all_pairs(world_size, piece_bytes, streams)]
