"""DS-Sync's per-step sync on a flat payload, for ``syncplane bench``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from syncplane.algorithms.ds_sync.config import DSSyncConfig
from syncplane.algorithms.ds_sync.runtime import ds_sync_for_job
from syncplane.job import JobContext
from syncplane.comm import DEFAULT_BUCKET_BYTES, Bucket, CommMeter, make_buckets


class DSSyncStep:
    """DS-Sync's per-step sync: the strategy's own runtime on the topology the ranks run on
    (the launcher's cluster profile, else a probe); the payload travels in DDP-sized
    buckets, one group all-reduce per step, all groups concurrently.
    ``options["adjust_every"]`` (default 0) turns the contention check on;
    ``options["pair_streams"]`` (default ``"auto"``, as the strategy) is the number of
    connections per direction a pair swaps over; ``auto``'s trial runs in the warm-up."""

    def __init__(self, options: Mapping[str, Any], job: JobContext) -> None:
        config = DSSyncConfig(adjust_every=int(options.get("adjust_every", 0)),
                              pair_streams=options.get("pair_streams", "auto"))
        self.runtime = ds_sync_for_job(job, config)[0]
        self.warmup = self.runtime.streams.trial_length if self.runtime.streams.trial_from is not None else 0
        self._buckets: tuple[int, list[Bucket]] | None = None

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        if self._buckets is None or self._buckets[0] != payload.data_ptr():
            per_bucket = DEFAULT_BUCKET_BYTES // payload.element_size()
            self._buckets = (payload.data_ptr(), make_buckets(payload.split(per_bucket), DEFAULT_BUCKET_BYTES))
        self.runtime.sync_(self._buckets[1], meter)

    def describe(self) -> str:
        return f"ds_sync {self.runtime.streams.describe()}"
