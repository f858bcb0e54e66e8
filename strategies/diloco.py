"""DiLoCo: H local steps of the user's optimizer, then one outer step on the averaged
pseudo-gradient, outer state on CPU, exchange on gloo groups of its own (so the training may
use NCCL); the Lightning glue of ``DiLoCoEngine`` (the rounds, the state, both layouts).

Overridden hooks (see ``SyncplaneStrategy``), and why:

- ``setup_sync``: build the engine; with ``replica: node`` train the module it wraps.
- ``after_optimizer_step``: the rounds, counted from ``trainer.global_step`` (a resume stays
  aligned); with ``inner_steps=time`` steps timed and the next round's inner steps agreed.
- ``training_step``: with ``inner_steps=time`` a replica whose budget is spent skips its batch,
  so every rank stays on the same step and checkpoint.
- ``process_dataloader``: with ``time_samples=share`` the training loader is dealt (``dealing``).
- the state dicts (``rank_state_dict``: error feedback): a resume is bit-identical.

``DiLoCo(..., elastic=True)`` constructs ``ElasticDiLoCo`` (``strategies/diloco_elastic.py``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal, Mapping

import torch
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.algorithms import sharded
from syncplane.algorithms.diloco import dealing
from syncplane.algorithms.diloco.adaptive import TimedRounds, check_weighting, gather_floats, skipped_step_output
from syncplane.algorithms.diloco.config import DiLoCoConfig, check_exchange_resumed, check_mode, check_resumed
from syncplane.algorithms.diloco.engine import DiLoCoEngine
from syncplane.algorithms.diloco.layout import job_layout
from syncplane.algorithms.diloco.streaming import Round
from syncplane.algorithms.diloco.transport import GLOO, Transport
from syncplane.config import takes_fields_of
from syncplane.job import JobContext
from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import register


@register("diloco")
class DiLoCo(SyncplaneStrategy):
    """Args: ``DiLoCoConfig``'s fields; the elastic settings (``elastic``; ``round_timeout_s``: a
    round's average, vote and heal give up after it; ``quorum_timeout_s``: a replica's wait for a
    quorum; ``heartbeat_timeout_s`` / ``join_timeout_s``: the Lighthouse's, read by the launcher;
    ``lighthouse_host``: the address it and the replicas bind); then ``SyncplaneStrategy``'s."""

    #: True on the elastic class, which ``__new__`` picks for ``elastic=True``.
    ELASTIC = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "DiLoCo":
        # one strategy name for both modes (ElasticDiLoCo is imported with ``syncplane.strategies``)
        if kwargs.get("elastic") and cls is DiLoCo:
            cls = next((sub for sub in DiLoCo.__subclasses__() if sub.ELASTIC), cls)
        return super().__new__(cls)

    @takes_fields_of(DiLoCoConfig)
    def __init__(self, elastic: bool = False, round_timeout_s: float = 30.0, quorum_timeout_s: float = 120.0,
                 heartbeat_timeout_s: float = 5.0, join_timeout_s: float = 60.0, lighthouse_host: str = "127.0.0.1",
                 shards: int | Literal["auto"] | None = None, **kwargs: Any) -> None:
        settings = {key: kwargs.pop(key) for key in DiLoCoConfig.names() & kwargs.keys()}
        super().__init__(**kwargs)
        self.config = DiLoCoConfig.pick({**settings, "shards": shards})
        # the elastic settings are read by ElasticDiLoCo (and heartbeat/join by the launcher)
        self.elastic_timeouts = {"round_timeout_s": round_timeout_s, "quorum_timeout_s": quorum_timeout_s,
                                 "heartbeat_timeout_s": heartbeat_timeout_s, "join_timeout_s": join_timeout_s}
        check_mode(self.config, bool(elastic), self.elastic_timeouts, lighthouse_host)
        self.sync_every, self.fragments, self.overlap_steps = (self.config.sync_every, self.config.fragments,
                                                               self.config.overlap_steps)
        self._timed: TimedRounds | None = None
        self._dealer: dealing.DealtBatches | None = None   # time_samples=share: the training loader's deal
        self._resumed_deal: Mapping[str, Any] | None = None
        self._step_end: float | None = None   # when this rank's last step (and its sync) ended
        self.mix_alpha = self.config.alpha
        self.rounds = 0     # committed outer steps (one per fragment round)
        self.skipped = 0    # discarded rounds
        self._engine: DiLoCoEngine | None = None
        if bool(elastic) != self.ELASTIC:
            raise ValueError(f"elastic={elastic!r} on {type(self).__name__}: construct DiLoCo(..., elastic=...), "
                             "which picks the class for the mode")
        self.elastic, self.lighthouse_host = self.ELASTIC, lighthouse_host

    # ------------------------------------------------------------ extension points

    @override
    def setup_sync(self, job: JobContext) -> None:
        if self._engine is not None:
            self._engine.close()
        # a model built on the meta device (``configure_model``): each rank makes only its FSDP shards
        layout = job_layout(self.config.replica, self.config.inner, job)
        init = sharded.reset_init(self.model) if sharded.on_meta(self.model) else None
        device_ids = None if layout.per_rank else self.determine_ddp_device_ids()
        self._engine = DiLoCoEngine(self.model, self.config, job, layout, device_ids, init, self._transport(job))
        self.model = self._engine.module
        self.details.update(layout.describe(), streams=self._engine.streams, exchange=self._engine.exchange_name)
        if self.config.inner_steps == "time":
            check_weighting(self.config.time_weighting,
                            sum(b.is_floating_point() for b in self.lightning_module.buffers()))
            self._timed = self._timed_rounds(self.world_size, self.global_rank, self.engine.layout.nodes)

    def _timed_rounds(self, replicas: int, rank: int, nodes: Any = None) -> TimedRounds:
        """``inner_steps=time``'s plan over ``replicas`` (this one ``rank``); ``nodes``: each node replica's ranks."""
        pace = "fastest" if self.config.time_samples == "share" else "median"   # share: nobody idles
        return TimedRounds(self.sync_every, replicas, rank, self.config.round_budget_s, self.config.time_weighting,
                           pace, replicas=nodes)

    def _decide(self, timed: TimedRounds, done: int) -> None:
        """The next round's inner steps, from every rank's step times (a collective)."""
        self.details["round_steps"] = timed.decide(gather_floats(self.world_size, self.global_rank),
                                                   done // self.sync_every)

    def _transport(self, job: JobContext) -> Transport:
        """Where the engine's exchanges run: the job's gloo ranks (elastic mode: the quorum's)."""
        return GLOO

    @property
    def round_step(self) -> int:
        """The step the round schedule counts (an elastic joiner's is offset to the job's)."""
        return self.step

    @override
    def makes_meta_models(self) -> bool:
        return self.config.inner == "fsdp"     # each rank makes its FSDP shards (the engine's init)

    @override
    def consensus_group(self) -> Any:
        return getattr(self.engine, "consensus_group", None)   # inner=fsdp: the ranks holding this rank's shard

    @override
    def average_replicas_(self, tensors: list[torch.Tensor] | None = None) -> None:
        engine = self._engine
        if tensors is None and engine is not None and engine.sharded and len(set(engine.layout.sizes)) > 1:
            engine.average_model_(self.model_tensors())   # FSDP2 on uneven nodes: no one group holds a shard
            return
        super().average_replicas_(tensors)

    @property
    def engine(self) -> DiLoCoEngine:
        if self._engine is None:
            raise RuntimeError("diloco is not set up yet (setup_sync runs when fitting starts)")
        return self._engine

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.config.inner_steps == "time":   # replicas run apart within a round
            self.skip_per_step_sigterm_broadcast(trainer)
        if self._dealer is not None:
            dealing.check_schedulers([config.interval for config in self.lr_scheduler_configs])

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module.trainer
        if (self._timed is None or self.config.time_samples != "share" or not trainer.training
                or trainer.sanity_checking or trainer.train_dataloader is not None):
            return dataloader    # only the training loader, when fitting starts, is dealt
        if trainer.reload_dataloaders_every_n_epochs:
            raise ValueError("time_samples=share deals one training loader for the whole fit; "
                             "reload_dataloaders_every_n_epochs must be 0 (or use time_samples=drop)")
        loader = dealing.dealt_loader(dataloader, self.world_size, self.global_rank, self.sync_every,
                                      self._timed.counts_for, lambda: (trainer.current_epoch, self.round_step))
        self._dealer = loader.batch_sampler
        if self._resumed_deal is not None:
            self._dealer.load_state_dict(self._resumed_deal)
        return loader

    def _computes(self) -> bool:
        """Whether this replica computes on the current step's batch (``inner_steps=time``)."""
        if self._dealer is not None:
            return self._dealer.computes(self.round_step)
        return self._timed is None or self._timed.computes(self.round_step % self.sync_every)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._computes():
            return skipped_step_output()   # this replica's round budget is spent: the batch is skipped
        return super().training_step(*args, **kwargs)

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        engine = self.engine
        done = self.round_step + 1   # self.step (trainer.global_step) counts the steps before this one
        timed = self._timed
        if timed is not None and self._step_end is not None and self._computes():
            timed.record(time.perf_counter() - self._step_end)
        start = time.perf_counter()
        for fragment in engine.starting(done):
            if self.overlap_steps == 0:
                self.outer_sync(fragment)
            else:
                self._launch(fragment, done, background=True)
        for round_ in engine.pop_due(done):
            self._merge(round_)
        # the outer rounds' time the training loop waited for (blocking rounds: all of it; with
        # overlap only the launch, and the merge of an exchange not yet done)
        self.details["sync_exposed_s"] = self.details.get("sync_exposed_s", 0.0) + time.perf_counter() - start
        if timed is not None and done % self.sync_every == 0:
            self._decide(timed, done)
        self._step_end = time.perf_counter()

    def outer_sync(self, fragment: int = 0) -> bool:
        """One blocking round of a fragment (the whole model when P = 1); True if committed."""
        self._launch(fragment, self.round_step + 1, background=False)
        round_ = self.engine.pop(fragment)
        self._merge(round_)
        return bool(round_.committed)

    @property
    def outer_params(self) -> torch.Tensor:
        """θ_g, the global parameters (a flat copy)."""
        return self.engine.params

    @override
    def finish_pending_sync(self) -> None:
        if self._engine is not None:
            self._engine.wait()

    def switch_settings(self, changes: Mapping[str, Any]) -> None:
        """Collective, at a round boundary (a re-plan's switch: ``SPEC.switch``): the exchange rebuilt
        with ``changes`` (``DiLoCoConfig`` fields), the outer optimizer's state carried over."""
        self.finish_pending_sync()
        outer = self.engine.state_dict()
        self.config = dataclasses.replace(self.config, **changes)
        self.setup_sync(self.job)          # closes the old exchange, builds the new one
        self.engine.load_state_dict(outer)

    def _launch(self, fragment: int, done: int, background: bool) -> None:
        """Start a round of ``fragment`` after step ``done``; it merges ``overlap_steps`` later."""
        scale = None   # the replica's rank count; inner_steps=time: the batches it processed (time_weighting)
        if self._timed is not None:
            dealt = self._dealer
            scale = self._timed.scale(None if dealt is None else dealt.round_counts(done // self.sync_every - 1))
        self.engine.launch(self.model_tensors(), fragment, done + self.overlap_steps, background, self.comm_meter,
                           scale=scale)

    def _merge(self, round_: Round) -> None:
        if self.engine.merge(self.model_tensors(), round_, self.mix_alpha):
            self.rounds += 1
        else:
            self.skipped += 1
        self.details["outer_state_bytes_per_rank"] = self.engine.outer_state_bytes()   # rank 0's in summary.json

    def _round_settings(self) -> dict[str, Any]:
        return {key: getattr(self.config, key) for key in ("sync_every", "fragments", "overlap_steps", "inner_steps")}

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        state = {**self.engine.state_dict(), **self._round_settings(), "rounds": self.rounds, "skipped": self.skipped,
                 "exchange_ran": self.engine.exchange_ran}
        if self._timed is not None:
            state["timed"] = self._timed.state_dict()
        if self._dealer is not None:
            state["dealt"] = self._dealer.state_dict(self.round_step)
        return state

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        check_resumed(state, self._round_settings())
        check_exchange_resumed(state, self.engine.exchange_ran)
        self.engine.load_state_dict(state)
        self.rounds, self.skipped = int(state["rounds"]), int(state["skipped"])
        if self._timed is not None:
            self._timed.load_state_dict(state["timed"])   # the counts agreed for the round in progress
            dealing.check_resumed(state, self.config.time_samples)
            self._resumed_deal = state.get("dealt")   # the loader is dealt when fitting starts
            if self._dealer is not None and self._resumed_deal is not None:
                self._dealer.load_state_dict(self._resumed_deal)
        self._step_end = None

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals (int8 and sparse: SparseLoCo's accumulator)."""
        return self.engine.rank_state_dict()

    @override
    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        self.engine.load_rank_state_dict(state)

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.close()   # its state stays readable for a checkpoint after fit
        super().teardown()
