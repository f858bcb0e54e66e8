"""DiLoCo's sync on a flat payload, for ``syncplane bench``."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.algorithms.diloco.exchange import EXCHANGES, build_exchange, carried, delta_codec
from syncplane.comm import CommMeter, PhaseProfile
from syncplane.exchanges import offered
from syncplane.job import JobContext


class DiLoCoStep:
    """DiLoCo's sync on the payload (the strategy's own pieces): every ``period`` (= H)
    steps, Δ = θ_g − θ_local on CPU, its mean over ranks on ``options["shards"]`` concurrent
    gloo streams (``options["compression"]``: none | int8 | sparse, at ``options["density"]``
    and ``["bits"]``; ``options["exchange"]``: auto | mesh | tree | gather,
    ``syncplane.algorithms.diloco.exchange``; a name DiLoCo does not run counts as auto; the
    gather always carries the sparse codec), an outer step, θ_local ← θ_g; nothing on the other steps. ``period``
    makes the worker report the mean per step over whole rounds."""

    def __init__(self, options: Mapping[str, Any], job: JobContext) -> None:
        self.period = int(options.get("period", DiLoCoConfig.sync_every))
        exchange = offered(options.get("exchange"), EXCHANGES)
        compression = carried(exchange, str(options.get("compression", "none")))
        codec = delta_codec(compression, density=float(options.get("density", DiLoCoConfig.density)),
                            bits=int(options.get("bits", DiLoCoConfig.bits)))
        self.allreduce, self.exchange = build_exchange(
            job, int(options.get("shards", 1)), compression, exchange=exchange, codec=codec,
            error_feedback_beta=DiLoCoConfig.error_feedback_beta if compression == "sparse" else 1.0)
        self.outer: OuterOptimizer | None = None
        self.flat = torch.empty(0)
        # ``syncplane bench --profile``: each phase timed (the worker resets it after the warmup)
        self.profile = PhaseProfile() if options.get("profile") else None
        self.allreduce.profile = self.profile

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        if self.outer is None or self.flat.numel() != payload.numel():
            self.outer, self.flat = OuterOptimizer(payload), torch.empty_like(payload)
        if (step + 1) % self.period:
            return
        with self._phase("copy-in"):
            self.flat.copy_(payload)
        with self._phase("outer-delta"):       # ``OuterOptimizer.round_``, each half timed
            self.outer.begin_round_(self.flat)
        if self.allreduce.allreduce_mean_(self.flat, meter):
            with self._phase("outer-step"):
                self.outer.finish_round_(self.flat)
            with self._phase("copy-back"):
                payload.copy_(self.flat)

    def _phase(self, name: str) -> AbstractContextManager[None]:
        return self.profile.time(name) if self.profile is not None else nullcontext()
