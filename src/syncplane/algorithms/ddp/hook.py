"""DDP's own gradient all-reduce as a communication hook, metered: what plain DDP runs, for
the places that must hold the hook themselves (the run report's meter on Lightning's
``DDPStrategy``, and the switchable exact family of ``strategy=auto``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from syncplane.comm.meter import CommMeter, ring_allreduce_bytes


def metered_allreduce(meter: CommMeter) -> Callable[..., Any]:
    """A DDP comm hook: torch's default all-reduce (mean) of each bucket over the default
    group, recorded in ``meter`` from launch to completion with the bytes a ring sends."""
    world = dist.get_world_size()

    # Unannotated on purpose: DDP compares a hook's annotations with the real classes, and
    # this module's postponed (string) annotations would fail that check.
    def timed_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        payload = bucket.buffer().numel() * bucket.buffer().element_size()

        def done(fut):  # type: ignore[no-untyped-def]
            meter.record(start, time.perf_counter(), ring_allreduce_bytes(payload, world))
            return fut.value()

        return default_hooks.allreduce_hook(dist.group.WORLD, bucket).then(done)

    return timed_allreduce
