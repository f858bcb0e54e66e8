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
    connections per direction a pair swaps over; ``auto``'s trial runs in the warm-up;
    ``options["max_staleness"]`` and ``options["late_after_s"]`` (the strategy's defaults) run
    the late-peer clique exchange, drained by ``finish`` after the timed steps."""

    def __init__(self, options: Mapping[str, Any], job: JobContext) -> None:
        config = DSSyncConfig(adjust_every=int(options.get("adjust_every", 0)),
                              pair_streams=options.get("pair_streams", "auto"),
                              max_staleness=int(options.get("max_staleness", DSSyncConfig.max_staleness)),
                              late_after_s=float(options.get("late_after_s", DSSyncConfig.late_after_s)))
        self.runtime = ds_sync_for_job(job, config)[0]
        self.warmup = self.runtime.streams.trial_length if self.runtime.streams.trial_from is not None else 0
        self._buckets: tuple[int, list[Bucket]] | None = None

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        if self._buckets is None or self._buckets[0] != payload.data_ptr():
            per_bucket = DEFAULT_BUCKET_BYTES // payload.element_size()
            self._buckets = (payload.data_ptr(), make_buckets(payload.split(per_bucket), DEFAULT_BUCKET_BYTES))
        self.runtime.sync_(self._buckets[1], meter)

    def finish(self) -> None:
        """Every message still in flight (``max_staleness``), then the watcher threads: every
        rank has run the same steps, so each posted message has its match."""
        self.runtime.drain()
        self.runtime.close()

    def describe(self) -> str:
        late = self.runtime.late
        return f"ds_sync {self.runtime.streams.describe()}" + (
            f", late peers {late.summary()}" if late is not None else "")
