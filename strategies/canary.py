"""Canary (Zhou et al.; docs/strategies/canary.md): every step, the gradients are averaged
through Canary's piece-level exchange of gradient sketches, then the recipe's optimizer
steps on the same averaged gradient on every rank (replicas stay bit-identical).

Colayers are the gradients grouped in backward order (reverse parameter order) into
buckets of ``bucket_cap_mb`` (``syncplane.comm.make_buckets``). A colayer is exchanged as
soon as the backward has produced all its gradients (a post-accumulate-grad hook per
parameter counts them), on one worker thread, in colayer order on every rank
(``BackwardPipeline``) -- so the exchange overlaps the rest of the backward, as DDP's
buckets do. With gradient accumulation the hooks would fire on every micro-batch, so there
the colayers are exchanged after the last backward instead (same result, no overlap).

Overridden hooks (see ``SyncplaneStrategy``), and why:

- ``setup_sync``: lay out the colayers and build the engine and its transport, one gloo
  group per NIC (a collective, the same order on every rank), so that a model too small
  for one piece per rank fails here, on every rank, before the first step; register the
  gradient hooks.
- ``before_parameter_update``: after the backward, wait for every colayer's exchange (the
  ones no hook started -- unused parameters, accumulation -- start now; missing gradients
  count as zeros) and unpack the averaged gradients. With ``staleness: s`` > 0 it waits
  only for the aggregate of step k - s (``algorithms/canary/gei.py``) and leaves this
  step's exchanges running; parameters with nothing due get no gradient (skipped).
- ``before_optimizer_step``: the step starts (with ``staleness`` > 0 it is published on the
  store, the GEI's step counters). The first one tells the GEI the global step it starts
  at (the synchronous warm-up counts global steps: a resume does not warm up again) and
  logs the staleness schedule with the optimizer's momentum before and while stale.
- ``before_parameter_update`` (stale steps, ``momentum_compensation``): the param groups'
  momentum is lowered for this update only (``algorithms/canary/compensation.py``) and
  ``after_optimizer_step`` puts the recipe's value back, so schedulers, logs and
  checkpoints never see the compensated one.
- ``rank_state_dict`` / ``load_rank_state_dict``: this rank's error-feedback residuals (what
  its own pieces and the pieces it owns have not delivered yet) and what it sent in dropped
  colayers (re-sent with their next exchange), so a resume loses nothing.
- ``finish_pending_sync`` / ``sync_state_dict`` / ``load_sync_state_dict`` (staleness): before
  a checkpoint the exchanges in flight complete, and the aggregates of the last s steps,
  exchanged but not applied yet, are saved (the same on every rank); a resume applies them
  at the steps the interrupted run would have, so it continues bit-identically.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.algorithms.canary import GEI, BackwardPipeline, CanaryConfig, CanaryEngine
from syncplane.algorithms.canary.exchange import make_transport
from syncplane.algorithms.canary.compensation import MomentumCompensation, implicit_momentum
from syncplane.algorithms.canary.colayers import Colayers, make_gei
from syncplane.job import JobContext
from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import register


@register("canary")
class CanaryStrategy(SyncplaneStrategy):
    """Args: those of ``CanaryConfig`` (compression, exact_fraction, quantile_weight, nics,
    exchange, compress_in_host, colayers_in_flight, bucket_cap_mb, first_bucket_cap_mb,
    sync_timeout_s, staleness, proportion, warmup_steps, momentum_compensation), then
    ``SyncplaneStrategy``'s."""

    replicas_identical = True   # every rank applies the same decoded mean gradient (of the same step)

    def __init__(self, compression: str = "sketch", exact_fraction: float = 0.01, quantile_weight: float = 0.3,
                 nics: int | str = "auto", exchange: str = "auto", compress_in_host: bool = False,
                 colayers_in_flight: int = 2, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 4.0,
                 sync_timeout_s: float = 600.0,
                 staleness: int = 0, proportion: float | None = None, warmup_steps: int = 100,
                 momentum_compensation: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = CanaryConfig(compression=compression, exact_fraction=exact_fraction,
                                   quantile_weight=quantile_weight, nics=nics, exchange=exchange,
                                   compress_in_host=compress_in_host, colayers_in_flight=colayers_in_flight,
                                   bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
                                   sync_timeout_s=sync_timeout_s, staleness=staleness, proportion=proportion,
                                   warmup_steps=warmup_steps, momentum_compensation=momentum_compensation)
        self._colayers: Colayers | None = None
        self._engine: CanaryEngine | None = None
        self._pipeline: BackwardPipeline | None = None
        self.gei: GEI | None = None
        self._hooks: list[Any] = []
        self._missing: list[int] = []
        self._lock = threading.Lock()
        self._early_before = 0
        self._compensation = MomentumCompensation(self.config.staleness)
        self._started = False      # the first step since setup_sync (the GEI learns the global step)

    @override
    def setup_sync(self, job: JobContext) -> None:
        self._release()
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        colayers = self._colayers = Colayers(params, self.config.bucket_bytes, self.config.first_bucket_bytes)
        self._engine = CanaryEngine(colayers.sizes, self.world_size, make_transport(self.config, job))
        self.gei = make_gei(self.config, len(colayers), self.global_rank, self.world_size)
        self._started = False
        self._pipeline = BackwardPipeline(self._engine, colayers.pack, self.comm_meter, self.gei)
        self._missing = colayers.counts()
        overlap = self.lightning_module.trainer.accumulate_grad_batches == 1
        if overlap:
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        rank_zero_info(f"canary: {len(self._colayers)} colayer(s) of {self._engine.total} gradient values, "
                       f"{self.world_size} pieces each, {self.config.compression}, "
                       f"{self._engine.exchange} over {self._engine.transport.streams} stream(s), "
                       f"{self._engine.lanes} colayer(s) in flight, "
                       + ("exchanged during the backward" if overlap else "exchanged after the backward (accumulation)")
                       + (f", staleness {self.config.staleness}, proportion {self.config.proportion}" if self.gei else ""))

    def _grad_ready(self, param: torch.Tensor) -> None:
        assert self._colayers is not None
        index = self._colayers.index_of(param)
        with self._lock:
            self._missing[index] -= 1
            complete = self._missing[index] == 0
        if complete:
            assert self._pipeline is not None
            self._pipeline.ready(index)

    @property
    def overlapped_colayers(self) -> int:
        """Colayer exchanges started during a backward so far (0 without overlap)."""
        return self._pipeline.early if self._pipeline is not None else self._early_before

    @property
    def engine(self) -> CanaryEngine:
        if self._engine is None:
            raise RuntimeError("canary is not set up yet (setup_sync runs when fitting starts)")
        return self._engine

    @override
    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        assert self._pipeline is not None, "canary is not set up yet"
        if not self._started:
            self._started = True
            if self.gei is not None:
                self.gei.resume_at(self.step)
                self._log_schedule(optimizer)
        self._pipeline.begin()

    def _log_schedule(self, optimizer: Optimizer) -> None:
        """Rank 0: when the staleness starts and what the momentum is while stale."""
        assert self.gei is not None
        config, left = self.config, self.gei.sync_until
        plan = self._compensation.plan(optimizer.param_groups)
        if not config.momentum_compensation:
            momentum = "momentum not compensated (momentum_compensation: false)"
        elif all(p is None for p in plan):
            momentum = "no param group has a momentum to compensate (e.g. Adam's betas are left as they are)"
        else:
            momentum = "momentum while stale " + ", ".join(
                "-" if p is None else f"{p[0]:g} -> {p[1]:.3f}" for p in plan) + " (per param group; " \
                f"minus the {implicit_momentum(config.staleness):.3f} the delay adds, Mitliagkas et al. 2016)"
        self.details["staleness"] = {"s": config.staleness, "warmup_steps": config.warmup_steps,
                                     "stale_from_step": self.step + left,
                                     "momentum_while_stale": [None if p is None or not config.momentum_compensation
                                                              else p[1] for p in plan],
                                     "compensated_updates": 0}
        rank_zero_info(f"canary: staleness {config.staleness} from global step {self.step + left} "
                       f"({left} synchronous warm-up step(s) first, warmup_steps={config.warmup_steps}); {momentum}")

    @override
    def before_parameter_update(self, optimizer: Optimizer) -> None:
        assert self._pipeline is not None, "canary is not set up yet"
        if self.gei is None:
            results: dict[int, torch.Tensor] = dict(enumerate(self._pipeline.finish()))
        else:
            # bounded staleness: this step's exchanges go on; apply the aggregate of step k - s
            self._pipeline.end_backward()
            settled = self._pipeline.settle()
            results = settled[1] if settled is not None else {}
        assert self._colayers is not None
        with self._lock:
            self._missing = self._colayers.counts()
        for index in range(len(self._colayers)):
            # nothing due (the first s steps, a dropped colayer): its gradients are cleared
            self._colayers.unpack(index, results.get(index))
        if results and self.gei is not None and self.config.momentum_compensation and self.gei.stale_at():
            self._compensation.apply(optimizer.param_groups)   # for this update only

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        self._compensation.restore()
        if "staleness" in self.details:   # summary.json's strategy_details
            self.details["staleness"]["compensated_updates"] = self._compensation.updates

    @override
    def finish_pending_sync(self) -> None:
        if self._pipeline is not None and self.gei is not None:
            self._pipeline.drain()   # stale: the exchanges in flight complete; nothing is applied early

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        if self._pipeline is None or self.gei is None:
            return {}
        return {"unsettled": self._pipeline.unsettled(), "dropped": self.gei.dropped, "max_lag": self.gei.max_lag,
                "compensated_updates": self._compensation.updates}

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._pipeline is None or self.gei is None or not state:
            return
        self._pipeline.restore_unsettled(state.get("unsettled", {}))
        self.gei.dropped, self.gei.max_lag = int(state.get("dropped", 0)), int(state.get("max_lag", 0))
        self._compensation.updates = int(state.get("compensated_updates", 0))

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        if self._engine is None:
            return {}
        carry = self._pipeline.carry if self._pipeline is not None else {}
        return {"canary": self.engine.state_dict(), "carry": {i: t.clone() for i, t in carry.items()}}

    @override
    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        if "canary" in state:
            self.engine.load_state_dict(state["canary"])
        if self._pipeline is not None:
            self._pipeline.carry = {int(i): t for i, t in state.get("carry", {}).items()}

    def _release(self) -> None:
        self._compensation.restore()   # an update that failed half-way leaves the recipe's momentum
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._pipeline is not None:
            self._pipeline.close()
            self._early_before = self._pipeline.early
            self._pipeline = None
        if self._engine is not None:
            self._engine.transport.close()

    @override
    def teardown(self) -> None:
        self._release()
        super().teardown()
