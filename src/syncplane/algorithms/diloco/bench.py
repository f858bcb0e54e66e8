"""DiLoCo's sync on a flat payload, for ``syncplane bench``."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import time

import torch
import torch.distributed as dist

from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.layout import node_layout
from syncplane.algorithms.diloco.engine import DiLoCoEngine, parameter_module
from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.algorithms.diloco.exchange import EXCHANGES, build_exchange, carried, delta_codec
from syncplane.comm import DEFAULT_BUCKET_BYTES, CommMeter, PhaseProfile, ring_allreduce_bytes
from syncplane.exchanges import offered
from syncplane.job import JobContext


def stream_count(options: Mapping[str, Any]) -> int:
    """S of a bench or cost row: its own ``streams`` (``diloco[streams=4]``), else the command's
    ``--streams`` (the spec's ``shards``, its old name), else 1: the timed and the priced S alike."""
    return int(options.get("streams", options.get("shards", 1)))


class DiLoCoStep:
    """DiLoCo's sync on the payload (the strategy's own pieces): every ``period`` (= H) steps,
    Δ = θ_g − θ_local on CPU, its mean on ``stream_count(options)`` gloo streams (``compression``,
    ``density``, ``bits``; ``exchange`` as ``exchange.build_exchange`` takes it, a name DiLoCo does
    not run counting as auto), an outer step, θ_local ← θ_g; nothing on the other steps."""

    def __init__(self, options: Mapping[str, Any], job: JobContext) -> None:
        self.period = int(options.get("period", DiLoCoConfig.sync_every))
        exchange = offered(options.get("exchange"), EXCHANGES)
        compression = carried(exchange, str(options.get("compression", "none")))
        codec = delta_codec(compression, density=float(options.get("density", DiLoCoConfig.density)),
                            bits=int(options.get("bits", DiLoCoConfig.bits)))
        self.allreduce, self.exchange = build_exchange(
            job, stream_count(options), compression, exchange=exchange, codec=codec,
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


class NodeStep:
    """``replica: node``'s sync on the payload, by the engine training runs (``DiLoCoEngine``, inner
    DDP): every step DDP's all-reduce of the gradient in its buckets on the node's group; every
    ``period`` steps the engine's round (each rank's shards exchanged with the other nodes', then
    θ_g all-gathered in the node). The engine is built on the first step: a collective, in the warm-up."""

    warmup = 1

    def __init__(self, options: Mapping[str, Any], job: JobContext) -> None:
        self.period = int(options.get("period", DiLoCoConfig.sync_every))
        self.config = DiLoCoConfig(sync_every=self.period, streams=stream_count(options),
                                   compression=str(options.get("compression", "none")), replica="node",
                                   density=float(options.get("density", DiLoCoConfig.density)),
                                   bits=int(options.get("bits", DiLoCoConfig.bits)))
        layout = node_layout("node", "ddp", job)
        assert layout is not None          # node_layout refuses a job of one rank per host
        self.layout, self.job = layout, job
        self.engine: DiLoCoEngine | None = None

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        if self.engine is None:
            self.engine = DiLoCoEngine(parameter_module([payload]), self.config, self.job, self.layout)
        self._inner(payload, meter)
        if (step + 1) % self.period:
            return
        self.engine.launch([payload], 0, step + 1, False, meter)
        self.engine.merge([payload], self.engine.pop(0), alpha=0.0)

    def _inner(self, payload: torch.Tensor, meter: CommMeter) -> None:
        """DDP inside the node: the mean of the payload over the node's ranks, in buckets."""
        assert self.engine is not None
        group, size = self.engine.inner_group, len(self.layout.nodes[self.layout.replica_of(self.job.rank)])
        start = time.perf_counter()
        works = [dist.all_reduce(c, group=group, async_op=True)
                 for c in payload.split(DEFAULT_BUCKET_BYTES // payload.element_size())]
        for work in works:
            work.wait()
        payload.div_(size)
        meter.record(start, time.perf_counter(), ring_allreduce_bytes(payload.numel() * payload.element_size(), size))

    def describe(self) -> str:
        return (f"diloco replica=node: nodes of {self.layout.sizes} ranks, {self.layout.shards} shard group(s) "
                f"of {self.config.streams} stream(s)")
