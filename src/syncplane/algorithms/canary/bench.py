"""Canary's per-step exchange on a flat payload, for ``syncplane bench``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from syncplane.algorithms.canary.config import CanaryConfig
from syncplane.algorithms.canary.engine import CanaryEngine
from syncplane.algorithms.canary.exchange import EXCHANGES, make_transport
from syncplane.comm import CommMeter, PhaseProfile, flat_bucket_sizes, shard_bounds
from syncplane.exchanges import CubeExchange, NestedExchange, offered
from syncplane.job import JobContext

log = logging.getLogger(__name__)


class CanaryStep:
    """Canary's exchange of the payload as colayers of ``bucket_cap_mb`` (the first of
    ``first_bucket_cap_mb``, as training cuts a model's), every step, after
    the backward (it does not overlap it), ``colayers_in_flight`` of them at once (each the
    training default, or ``options[...]``, as the cost model reads them), always with the
    gradient sketch (the bench's ``compression`` option is DiLoCo's). ``options["shards"]`` > 1
    sets the gloo groups; otherwise one per NIC the job names. ``options["exchange"]``: ``mesh``, ``nested``, ``cube``,
    or ``auto`` (what training would pick); a name Canary does not run counts as ``auto``."""

    def __init__(self, options: Mapping[str, Any], job: JobContext) -> None:
        shards = int(options.get("shards") or 1)
        self.config = dataclasses.replace(colayer_config(options), compression="sketch",
                                          nics=shards if shards > 1 else "auto",
                                          exchange=offered(options.get("exchange"), EXCHANGES))
        self.transport = make_transport(self.config, job)
        self.engine: CanaryEngine | None = None
        # ``syncplane bench --profile``: each phase of every lane's rounds timed (lanes run at
        # once, so the phases of a step add up to more than its wall time)
        self.profile = PhaseProfile() if options.get("profile") else None
        if self.profile is not None:
            self.transport.profile = self.profile

    def describe(self) -> str:
        pattern = self.transport.exchange
        if isinstance(pattern, CubeExchange):
            layout = f"cube exchange on BCube({pattern.alpha}, {pattern.beta})"
        elif isinstance(pattern, NestedExchange):
            exact = sorted(pattern.exact_levels)
            layout = f"nested exchange, levels {pattern.radices}" + (f", exact level(s) {exact}" if exact else "")
        else:
            layout = "piece mesh"
        return (f"canary: {self.config.compression}, {self.transport.streams} stream(s), {layout}, "
                f"{self.transport.lanes} colayer(s) in flight")

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        colayers = list(payload.split(flat_bucket_sizes(payload.numel(), payload.element_size(),
                                                        self.config.bucket_bytes, self.config.first_bucket_bytes)))
        if self.engine is None or self.engine.total != payload.numel():
            self.engine = CanaryEngine([c.numel() for c in colayers], dist.get_world_size(), self.transport)
        self.engine.exchange_all_(colayers, meter)


def colayer_config(options: Mapping[str, Any]) -> CanaryConfig:
    """The colayer settings the bench's ``options`` name (``colayers_in_flight``,
    ``bucket_cap_mb``, ``first_bucket_cap_mb``; the training defaults where absent), as the
    bench runs them and the cost model prices them."""
    return CanaryConfig(colayers_in_flight=int(options.get("colayers_in_flight") or CanaryConfig.colayers_in_flight),
                        **{name: float(options.get(name) or getattr(CanaryConfig, name))
                           for name in ("bucket_cap_mb", "first_bucket_cap_mb")})


def sketch_ratio(numel: int, pieces: int, config: CanaryConfig = CanaryConfig()) -> float:
    """Bytes of a sketched colayer of ``numel`` values cut in ``pieces``, over its fp32 bytes."""
    codec = config.codec()
    return sum(codec.nbytes(hi - lo) for lo, hi in shard_bounds(numel, pieces)) / max(1, 4 * numel)
