"""Group averaging: every rank averages its tensors with the members of its current group.

The groups of one step partition the ranks, so each rank runs exactly one all-reduce
and the groups proceed concurrently, independently of each other -- no global barrier
(a slow group delays only its own members).

Process groups are created once, up front, for every group a pattern can use:
``dist.new_group`` is a collective over *all* ranks, called in the same order
everywhere, so creating one inside the training loop would stall every rank on the
slowest and could deadlock if ranks disagreed about the order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist

from syncplane.comm.buckets import Bucket
from syncplane.comm.collectives import allreduce_mean_
from syncplane.comm.meter import CommMeter
from syncplane.comm.process_groups import new_group

Group = tuple[int, ...]


class GroupSet:
    """Process groups for a fixed set of rank groups (a collective: call on every rank).

    ``max_pair_streams``: a group of two can swap its payload over up to this many TCP
    connections per direction (each a process group of its own); ``pair_streams`` says how
    many it uses now. On a link shared with other traffic TCP gives every connection about
    the same share, so k streams next to one foreign flow get k/(k+1) of the link instead
    of ½ (NCCL's ``NCCL_NSOCKS_PERTHREAD`` idea), and they fill paths that cap each flow
    (WAN). On a link of its own, one stream is faster (measured): hence a choice, made by
    measurement by the caller.
    """

    def __init__(self, groups: Iterable[Sequence[int]], max_pair_streams: int = 1) -> None:
        if max_pair_streams < 1:
            raise ValueError(f"pair_streams must be >= 1, got {max_pair_streams}")
        world = dist.get_world_size()
        wanted = sorted({tuple(sorted(g)) for g in groups if len(g) > 1})
        bad = [g for g in wanted if g[0] < 0 or g[-1] >= world]
        if bad:
            raise ValueError(f"groups {bad} name ranks outside 0..{world - 1}")
        me = dist.get_rank()
        self._groups: dict[Group, dist.ProcessGroup | None] = {}
        self._pair_links: dict[Group, tuple[list[dist.ProcessGroup], list[dist.ProcessGroup]]] = {}
        for g in wanted:
            if len(g) == 2:       # one connection per direction and stream (_pair_average_)
                upward = [new_group(g) for _ in range(max_pair_streams)]
                downward = [new_group(g) for _ in range(max_pair_streams)]
                self._groups[g] = upward[0] if me in g else None
                if me in g:
                    self._pair_links[g] = (upward, downward)
            else:
                pg = new_group(g)
                self._groups[g] = pg if me in g else None
        self.rank = me
        self.max_pair_streams = max_pair_streams
        self._pair_streams = max_pair_streams
        self._buffers: dict[int, torch.Tensor] = {}

    @property
    def pair_streams(self) -> int:
        """Connections per direction a pair uses now (at most ``max_pair_streams``)."""
        return self._pair_streams

    @pair_streams.setter
    def pair_streams(self, streams: int) -> None:
        if not 1 <= streams <= self.max_pair_streams:
            raise ValueError(f"pair_streams must be in 1..{self.max_pair_streams} (connections created), got {streams}")
        self._pair_streams = streams

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group: Sequence[int]) -> bool:
        return tuple(sorted(group)) in self._groups

    def process_group(self, group: Sequence[int]) -> dist.ProcessGroup:
        key = tuple(sorted(group))
        if key not in self._groups:
            raise KeyError(f"no process group was created for ranks {list(key)} (created: {len(self)} groups)")
        pg = self._groups[key]
        if pg is None:
            raise ValueError(f"rank {self.rank} is not a member of group {list(key)}")
        return pg

    def group_average_(self, buckets: Sequence[Bucket], group: Sequence[int], meter: CommMeter | None = None) -> None:
        """Replace the buckets' tensors by their mean over ``group`` (which must contain this rank).

        A group of one is a no-op: the rank keeps its own parameters this step.
        """
        if self.rank not in group:
            raise ValueError(f"rank {self.rank} is not in group {list(group)}")
        if len(group) < 2:
            return
        pg = self.process_group(group)
        if len(group) == 2:
            self._pair_average_(buckets, tuple(sorted(group)), meter)   # type: ignore[arg-type]
        else:
            allreduce_mean_(buckets, group=pg, meter=meter)

    def _pair_average_(self, buckets: Sequence[Bucket], pair: Group, meter: CommMeter | None) -> None:
        """Two ranks: swap the whole buckets at once and average locally.

        The same bytes as a two-rank ring (the payload each way) but one exchange with no
        reduce-scatter -> all-gather dependency, so the (usually slow, inter-rack) link
        stays busy in both directions the whole time. Each direction has its own TCP
        connections (process groups): bulk data both ways on one connection queues its
        ACKs behind the other direction's data on a shaped link. Every bucket is cut into
        ``pair_streams`` pieces, piece s on stream s; each piece of the swap has a tag of its own
        (its index: under gloo, NIC index mod k of a host with k, so a swap spreads over a
        host's NICs whatever its stream count). ``a + b == b + a`` in floating point:
        both ranks end bit-identical, whatever the number of streams.
        """
        low = self.rank == pair[0]
        peer = pair[1] if low else pair[0]
        upward, downward = self._pair_links[pair]
        send_pgs, recv_pgs = (upward, downward) if low else (downward, upward)
        received = [self._scratch(b) for b in buckets]
        context = meter.measure(sum(b.nbytes for b in buckets)) if meter is not None else nullcontext()
        with context:
            works = []
            for bucket, other in zip(buckets, received):
                bucket.pack()
                pieces = zip(bucket.buffer.tensor_split(self.pair_streams), other.tensor_split(self.pair_streams),
                             send_pgs, recv_pgs)
                for mine, theirs, send_pg, recv_pg in pieces:
                    if mine.numel():
                        tag = len(works) // 2
                        works += [dist.irecv(theirs, peer, group=recv_pg, tag=tag),
                                  dist.isend(mine, peer, group=send_pg, tag=tag)]
            for work in works:
                work.wait()
            for bucket, other in zip(buckets, received):
                bucket.buffer.add_(other)
                bucket.unpack(scale=0.5)

    def _scratch(self, bucket: Bucket) -> torch.Tensor:
        """A receive buffer shaped like ``bucket``'s, reused across steps."""
        key = id(bucket.buffer)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != bucket.buffer.shape or buf.dtype != bucket.buffer.dtype:
            buf = self._buffers[key] = torch.empty_like(bucket.buffer)
        return buf
