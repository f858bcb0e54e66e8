"""Group averaging: every rank averages its tensors with the members of its current group.

The groups of one step partition the ranks, so each rank runs exactly one all-reduce
and the groups proceed concurrently, independently of each other -- no global barrier
(DS-Sync's point: a slow group delays only its own members).

Process groups are created once, up front, for every group a pattern can use:
``dist.new_group`` is a collective over *all* ranks, called in the same order
everywhere, so creating one inside the training loop would stall every rank on the
slowest and could deadlock if ranks disagreed about the order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.distributed as dist

from syncplane.comm.buckets import Bucket
from syncplane.comm.collectives import allreduce_mean_
from syncplane.comm.meter import CommMeter

Group = tuple[int, ...]


class GroupSet:
    """Process groups for a fixed set of rank groups (a collective: call on every rank)."""

    def __init__(self, groups: Iterable[Sequence[int]]) -> None:
        world = dist.get_world_size()
        wanted = sorted({tuple(sorted(g)) for g in groups if len(g) > 1})
        bad = [g for g in wanted if g[0] < 0 or g[-1] >= world]
        if bad:
            raise ValueError(f"groups {bad} name ranks outside 0..{world - 1}")
        me = dist.get_rank()
        self._groups: dict[Group, dist.ProcessGroup | None] = {}
        for g in wanted:
            pg = dist.new_group(list(g))
            self._groups[g] = pg if me in g else None
        self.rank = me

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
        allreduce_mean_(buckets, group=self.process_group(group), meter=meter)
