"""Canary's per-step exchange on a flat payload, for ``syncplane bench``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from syncplane.algorithms.canary.config import CanaryConfig
from syncplane.algorithms.canary.engine import CanaryEngine
from syncplane.cluster.probe import CLUSTER_ENV
from syncplane.cluster.profile import ClusterProfile, load_profile
from syncplane.comm import DEFAULT_BUCKET_BYTES, CommMeter, CubeAllReduce, ShardedAllReduce, shard_bounds
from syncplane.comm.sharded import interfaces_from_env
from syncplane.config import ConfigError

log = logging.getLogger(__name__)


def nic_count(nics: int | str) -> int:
    """``auto``: one gloo group per NIC named in ``GLOO_SOCKET_IFNAME`` (1 if none)."""
    if nics == "auto":
        return len(interfaces_from_env() or [None])
    return int(nics)


def cube_shape(profile: ClusterProfile | None = None) -> tuple[int, int] | None:
    """(α, β) when the job runs on a BCube profile (default: the one the cluster launcher
    named in ``SYNCPLANE_CLUSTER``), else None. The cube exchange needs what BCube's
    addressing gives it -- β NICs on every host (the profile checks that) and one rank per
    host (checked here, naming the field)."""
    if profile is None:
        path = os.environ.get(CLUSTER_ENV)
        if not path:
            return None
        profile = load_profile(path)
    if profile.bcube is None:
        return None
    for h, host in enumerate(profile.hosts):
        if host.spec.ranks != 1:
            raise ConfigError(f"cluster.racks[0].hosts[{h}].ranks: canary's cube exchange on "
                              f"BCube({profile.bcube.alpha}, {profile.bcube.beta}) runs one rank per host, "
                              f"host {host.name!r} has {host.spec.ranks}")
    return profile.bcube.alpha, profile.bcube.beta


def make_transport(config: CanaryConfig) -> ShardedAllReduce:
    """The exchange (a collective): on a BCube profile the paper's two-stage cube all-reduce
    (one gloo group per level, i.e. per NIC; ``config.nics`` must then be auto or β),
    elsewhere the piece-level mesh exchange, one gloo group per NIC."""
    shape = cube_shape()
    if shape is not None:
        alpha, beta = shape
        if config.nics != "auto" and config.nics != beta:
            raise ConfigError(f"nics: BCube({alpha}, {beta}) gives every host {beta} NICs and the cube exchange "
                              f"uses one per level; set nics=auto or {beta}, got {config.nics}")
        log.info("canary: two-stage cube exchange on BCube(%d, %d)", alpha, beta)
        return CubeAllReduce(alpha, beta, codec=config.codec(), timeout_s=config.sync_timeout_s)
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
        layout = (f"cube exchange on BCube({self.transport.alpha}, {self.transport.beta})"
                  if isinstance(self.transport, CubeAllReduce) else "piece layout")
        return f"canary: {self.config.compression}, {self.transport.shards} gloo group(s), {layout}"

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
