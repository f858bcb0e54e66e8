"""The communication each strategy performs per training step, on a flat payload.

Benchmarks call these instead of training so that a 100 MB model's sync can be timed
on 2 CPU cores. Each entry is exactly the comm-layer call its strategy makes; a
strategy that has not landed has no entry and is reported as not implemented.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from syncplane.comm import CommMeter, ring_allreduce_bytes

DDP_BUCKET_BYTES = 25 * 2**20   # torch DDP's default bucket_cap_mb

SyncFn = Callable[[torch.Tensor, int, CommMeter], None]


def ddp_sync(payload: torch.Tensor, step: int, meter: CommMeter) -> None:
    """DDP's gradient all-reduce: 25 MB buckets, launched asynchronously, averaged."""
    n = dist.get_world_size()
    per_bucket = DDP_BUCKET_BYTES // payload.element_size()
    start = time.perf_counter()
    works = [dist.all_reduce(chunk, async_op=True) for chunk in payload.split(per_bucket)]
    for work in works:
        work.wait()
    payload.div_(n)
    meter.record(start, time.perf_counter(), ring_allreduce_bytes(payload.numel() * payload.element_size(), n))


SYNCS: dict[str, SyncFn] = {
    "ddp": ddp_sync,
}

#: Every product strategy name (design.md §3), implemented or not.
ALL_STRATEGIES = ("ddp", "atc", "awc", "h_atc", "h_awc", "ds_sync", "diloco", "flexreduce", "canary")

#: Payload presets: the real parameter bytes of the reference models (float32).
PRESETS_BYTES = {"resnet50": 25_557_032 * 4, "bert_large": 335_141_888 * 4}
