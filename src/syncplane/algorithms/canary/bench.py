"""Canary's per-step exchange on a flat payload, for ``syncplane bench``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from syncplane.algorithms.canary.config import CanaryConfig
from syncplane.algorithms.canary.engine import CanaryEngine
from syncplane.comm import DEFAULT_BUCKET_BYTES, CommMeter, ShardedAllReduce, shard_bounds
from syncplane.comm.sharded import interfaces_from_env


def nic_count(nics: int | str) -> int:
    """``auto``: one gloo group per NIC named in ``GLOO_SOCKET_IFNAME`` (1 if none)."""
    if nics == "auto":
        return len(interfaces_from_env() or [None])
    return int(nics)


def make_transport(config: CanaryConfig) -> ShardedAllReduce:
    """The piece-level mesh exchange: one gloo group per NIC (a collective)."""
    return ShardedAllReduce(nic_count(config.nics), codec=config.codec(), timeout_s=config.sync_timeout_s,
                            layout="pieces")


class CanaryStep:
    """Canary's exchange of the payload as DDP-sized colayers (25 MiB), every step, after
    the backward (it does not overlap it), always with the gradient sketch (the bench's
    ``compression`` option is DiLoCo's). ``options["shards"]`` > 1 sets the gloo groups;
    otherwise one per NIC named in ``GLOO_SOCKET_IFNAME``."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        shards = int(options.get("shards") or 1)
        self.config = CanaryConfig(compression="sketch", nics=shards if shards > 1 else "auto")
        self.transport = make_transport(self.config)
        self.engine: CanaryEngine | None = None

    def describe(self) -> str:
        return f"canary: {self.config.compression}, {self.transport.shards} gloo group(s), piece layout"

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        per_colayer = DEFAULT_BUCKET_BYTES // payload.element_size()
        colayers = list(payload.split(per_colayer))
        if self.engine is None or self.engine.total != payload.numel():
            self.engine = CanaryEngine([c.numel() for c in colayers], dist.get_world_size(), self.transport)
        self.engine.exchange_all_(colayers, meter)


def sketch_ratio(numel: int, pieces: int, config: CanaryConfig = CanaryConfig()) -> float:
    """Bytes of a sketched colayer of ``numel`` values cut in ``pieces``, over its fp32 bytes."""
    codec = config.codec()
    return sum(codec.nbytes(hi - lo) for lo, hi in shard_bounds(numel, pieces)) / max(1, 4 * numel)
