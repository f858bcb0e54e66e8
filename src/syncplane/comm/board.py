"""A step board on the rendezvous store: every rank's step counter and first-writer-wins
decisions, without a collective (so a fast rank can read a slow one's progress, and ranks
can agree on a value without waiting for each other).

An algorithm with bounded staleness keeps its per-rank counters here and posts the
decisions every rank must share (which late pieces to drop). Transport only: what the
values mean is the algorithm's.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist
from torch.distributed import distributed_c10d

_instances = itertools.count()


class StoreBoard:
    """Counters and decisions under a prefix of the default process group's store.

    Every rank must build its boards in the same order (the prefix counts instances, as
    ``StreamRunner``'s groups do), so that rank r's ``n``-th board meets the others'.
    """

    def __init__(self, rank: int, world_size: int, store: dist.Store | None = None) -> None:
        base = store if store is not None else distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"syncplane/board/{next(_instances)}", base)
        self.rank, self.world_size = rank, world_size

    def advance(self) -> int:
        """This rank entered its next step; returns how many it has entered (an atomic add,
        so a reader never sees a torn value)."""
        return int(self.store.add(f"steps/{self.rank}", 1))

    def entered(self) -> list[int]:
        """Steps entered by every rank so far (``add(key, 0)`` reads without blocking)."""
        return [int(self.store.add(f"steps/{r}", 0)) for r in range(self.world_size)]

    def agree(self, key: str, proposal: str) -> str:
        """The first proposal any rank made under ``key`` (this one if it is first)."""
        value = self.store.compare_set(f"agree/{key}", "", proposal)
        return value.decode() if isinstance(value, bytes) else str(value)
