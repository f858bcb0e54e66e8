"""The baseline's per-step communication on a flat payload, for ``syncplane bench``."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from syncplane.comm import DEFAULT_BUCKET_BYTES, CommMeter, ring_allreduce_bytes


class DDPStep:
    """DDP's gradient all-reduce: 25 MB buckets, launched asynchronously, averaged.
    ``launch``/``wait`` let the bench worker run the backward pass in between."""

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, list, float, CommMeter] | None = None

    def launch(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        per_bucket = DEFAULT_BUCKET_BYTES // payload.element_size()
        start = time.perf_counter()
        self._pending = (payload, [dist.all_reduce(c, async_op=True) for c in payload.split(per_bucket)], start, meter)

    def wait(self) -> None:
        if self._pending is None:
            raise RuntimeError("wait() without launch()")
        payload, works, start, meter = self._pending
        self._pending = None
        for work in works:
            work.wait()
        n = dist.get_world_size()
        payload.div_(n)
        meter.record(start, time.perf_counter(), ring_allreduce_bytes(payload.numel() * payload.element_size(), n))

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        self.launch(payload, step, meter)
        self.wait()
