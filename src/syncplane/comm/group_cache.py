"""Process groups created once per purpose and reused: a cache keyed by the default group.

``dist.new_group`` is a collective over every rank, called in the same order everywhere;
an algorithm that needs its own connections (so its point-to-point messages never match
another component's, and its traffic does not queue behind theirs) asks for them here
once, up front, instead of creating them inside a training step. A new default group
(a test that re-initializes torch.distributed) gets new entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from syncplane.comm.process_groups import new_group

#: Keyed by the default group object itself: an ``id()`` could be reused by a later group.
_groups: dict[tuple[object, str, tuple[int, ...]], dist.ProcessGroup] = {}


def cached_group(purpose: str, ranks: Sequence[int] | None = None) -> dist.ProcessGroup:
    """The process group for ``purpose`` over ``ranks`` (default: every rank).

    A collective the first time a (purpose, ranks) pair is asked for: every rank must ask for
    the same pairs in the same order; later calls return the same group without communicating.
    """
    members = tuple(range(dist.get_world_size())) if ranks is None else tuple(sorted(ranks))
    key = (dist.group.WORLD, purpose, members)
    group = _groups.get(key)
    if group is None:
        group = _groups[key] = new_group(members)
    return group


def clear() -> None:
    """Forget every cached group (when leaving the job; see ``basics.release_groups``)."""
    _groups.clear()
