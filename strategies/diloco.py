"""DiLoCo: H local steps of the user's optimizer, then one outer step on the averaged
pseudo-gradient, with the outer state on CPU and the exchange over gloo.

Overridden hooks (see ``SyncplaneStrategy``), and why:

- ``setup_sync``: with ``replica: node`` (``syncplane.algorithms.diloco.node``), wrap the model in
  torch's DDP over the node's ranks (``inner: fsdp``: FSDP2 in place) and shard the outer state
  over them; ``consensus_group``: with FSDP2, the ranks holding this rank's shard in every node
  (validation's consensus); otherwise lay the model (parameters, then floating buffers) out in one flat
  fp32 host buffer, create the outer optimizer over the parameters' part (``θ_g`` on
  CPU; one per fragment) and the sharded gloo exchange -- separate gloo groups, so this
  works when the training itself uses NCCL; its pattern (``exchange``: the mesh, or
  FlexReduce's tree on a cluster with hosts/racks/sites) is chosen here, on every rank.
- ``after_optimizer_step``: every ``sync_every`` real steps, counted from
  ``trainer.global_step`` (so a resume stays aligned): ``Δ = θ_g − θ_local`` on CPU,
  averaged over all ranks, one outer step, ``θ_g`` copied back into the model; floating
  buffers (BatchNorm statistics) are averaged in the same exchange. If the exchange is
  discarded (a rank failed or timed out), every rank skips the outer step and keeps its
  local replica: the next round's ``Δ`` then covers both rounds, nothing is lost.
  Streaming (``fragments`` P > 1, ``overlap_steps`` τ > 0; ``syncplane.algorithms.diloco.streaming``):
  the same round per fragment at that fragment's offset, its exchange on a background
  thread for τ steps, its result mixed in as ``α·θ_local + (1 − α)·θ_g``.
  ``inner_steps=time`` (``syncplane.algorithms.diloco.adaptive``): times this replica's
  computed steps, weights its Δ by the samples it processed, and at each round boundary
  makes the agreed decision of every replica's inner steps for the next round.
- ``training_step``: with ``inner_steps=time``, a replica whose round budget is spent skips
  the rest of the round's batches (no forward; a zero loss that reaches no parameter, so no
  update; Lightning refuses a None step in distributed training), so every rank stays on the
  same step, epoch and checkpoint.
- ``finish_pending_sync``: completes the exchanges in flight and their outer steps; the
  merges stay at their scheduled step, so a checkpoint or a validation in between does
  not change the trajectory.
- ``sync_state_dict`` / ``load_sync_state_dict``: outer parameters, outer optimizer
  state (per fragment), error-feedback residuals, the rounds waiting to be merged and the
  position within the round, so a resume is bit-identical (the base restores each rank's
  own replica after the initial broadcast).

Elastic mode (``elastic=true``) is ``ElasticDiLoCo`` in ``syncplane.strategies.diloco_elastic``:
``DiLoCo(..., elastic=True)`` constructs one, so configs keep naming ``strategy=diloco``.

The state and the rounds are ``syncplane.algorithms.diloco.engine.DiLoCoEngine``'s; host<->device
copies run on a side CUDA stream when the model is on a GPU, plain copies on CPU.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Mapping

import torch
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.algorithms.diloco.adaptive import TimedRounds, gather_floats, skipped_step_output
from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.engine import DiLoCoEngine
from syncplane.algorithms.diloco.layout import check_replica, node_layout
from syncplane.algorithms.diloco.node import NodeEngine
from syncplane.algorithms import sharded
from syncplane.algorithms.diloco.streaming import Round
from syncplane.job import JobContext
from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import register


@register("diloco")
class DiLoCo(SyncplaneStrategy):
    """Args: those of ``DiLoCoConfig`` (sync_every, outer_optimizer, outer_kwargs, shards,
    compression, block_size, density, bits, chunk, error_feedback_beta, outer, sync_timeout_s,
    fragments, overlap_steps, mix_alpha, exchange, topology, replica, inner, inner_steps, round_budget_s), the elastic settings (``elastic``, ``round_timeout_s``: a round's average, vote
    and heal give up after it; ``quorum_timeout_s``: how long a replica waits for a quorum;
    ``heartbeat_timeout_s`` / ``join_timeout_s``: the Lighthouse's, read by the launcher;
    ``lighthouse_host``: the address it and the replicas bind, loopback by default), then
    ``SyncplaneStrategy``'s."""

    #: True on ``ElasticDiLoCo``; ``__new__`` picks that class for ``elastic=True``.
    ELASTIC = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "DiLoCo":
        # one strategy name for both modes: the registry (and Hydra) construct ``DiLoCo``
        # (ElasticDiLoCo is imported with the package: ``syncplane.strategies.__init__``)
        if kwargs.get("elastic") and cls is DiLoCo:
            cls = next(sub for sub in DiLoCo.__subclasses__() if sub.ELASTIC)
        return super().__new__(cls)

    def __init__(self, sync_every: int = 10, outer_optimizer: str = "torch.optim.SGD",
                 outer_kwargs: dict[str, Any] | None = None, shards: int | Literal["auto"] = 1,
                 compression: Literal["none", "int8", "sparse"] = "none", block_size: int = 256,
                 density: float = 0.02, bits: int = 2, chunk: int = 4096, error_feedback_beta: float = 0.95,
                 outer: Literal["nesterov", "sparseloco"] = "nesterov", sync_timeout_s: float = 600.0, fragments: int = 1, overlap_steps: int = 0,
                 mix_alpha: float | None = None, exchange: Literal["auto", "mesh", "tree", "gather", "owner"] = "auto",
                 topology: str | list[int] = "auto", inner_steps: Literal["fixed", "time"] = "fixed",
                 round_budget_s: float | None = None, elastic: bool = False, round_timeout_s: float = 30.0,
                 quorum_timeout_s: float = 120.0, heartbeat_timeout_s: float = 5.0, join_timeout_s: float = 60.0,
                 lighthouse_host: str = "127.0.0.1", replica: Literal["rank", "node", "auto"] = "rank",
                 inner: Literal["ddp", "fsdp"] = "ddp", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = DiLoCoConfig(sync_every=sync_every, outer_optimizer=outer_optimizer, outer_kwargs=outer_kwargs,
                                   shards=shards, compression=compression, block_size=block_size,
                                   density=density, bits=bits, chunk=chunk, error_feedback_beta=error_feedback_beta,
                                   outer=outer,
                                   sync_timeout_s=sync_timeout_s, fragments=fragments, overlap_steps=overlap_steps,
                                   mix_alpha=mix_alpha, exchange=exchange, topology=topology, replica=replica,
                                   inner=inner, inner_steps=inner_steps, round_budget_s=round_budget_s)
        check_replica(replica, inner, elastic=bool(elastic))
        if elastic and inner_steps == "time":
            raise ValueError("inner_steps=time is not supported with elastic=true (its replicas come and go "
                             "between rounds; the step counts are agreed by a fixed set of ranks)")
        self.sync_every, self.fragments, self.overlap_steps = sync_every, fragments, overlap_steps
        self.inner_steps = inner_steps
        self._timed: TimedRounds | None = None
        self._step_end: float | None = None   # when this rank's last step (and its sync) ended
        self.mix_alpha = self.config.alpha
        self.rounds = 0     # committed outer steps (one per fragment round)
        self.skipped = 0    # discarded rounds
        self._engine: DiLoCoEngine | NodeEngine | None = None
        if bool(elastic) != self.ELASTIC:
            raise ValueError(f"elastic={elastic!r} on {type(self).__name__}: construct DiLoCo(..., elastic=...), "
                             "which picks the class for the mode")
        self.elastic = self.ELASTIC
        # the elastic settings are read by ElasticDiLoCo (and heartbeat/join by the launcher)
        self.elastic_timeouts = {"round_timeout_s": round_timeout_s, "quorum_timeout_s": quorum_timeout_s,
                                 "heartbeat_timeout_s": heartbeat_timeout_s, "join_timeout_s": join_timeout_s}
        for key, value in self.elastic_timeouts.items():   # checked in either mode: a bad value is a typo
            if value <= 0:
                raise ValueError(f"{key} must be positive, got {value}")
        if not lighthouse_host or any(c.isspace() for c in lighthouse_host):
            raise ValueError(f"lighthouse_host must be an address or host name, got {lighthouse_host!r}")
        self.lighthouse_host = lighthouse_host

    # ------------------------------------------------------------ extension points

    @override
    def setup_sync(self, job: JobContext) -> None:
        n_params = sum(p.numel() for p in self.lightning_module.parameters())
        if self._engine is not None:
            self._engine.close()
        layout = node_layout(self.config.replica, self.config.inner, job)
        if layout is None:
            self._engine = engine = DiLoCoEngine(self.model_tensors(), n_params, self.config, job)
            self.details.update(replica="rank", replicas=job.world_size, ranks_per_replica=[1] * job.world_size)
        else:
            init = sharded.reset_init(self.model) if sharded.on_meta(self.model) else None   # built in configure_model
            self._engine = engine = NodeEngine(self.model, self.config, job, layout, self.determine_ddp_device_ids(),
                                               init)
            self.model = engine.module
            self.details.update(layout.describe())
        self.details["shards"], self.details["exchange"] = engine.shards, engine.exchange_name
        if self.inner_steps == "time":
            self._timed = TimedRounds(self.sync_every, self.world_size, self.global_rank, self.config.round_budget_s)

    @override
    def makes_meta_models(self) -> bool:
        return self.config.inner == "fsdp"     # each rank makes its FSDP shards (NodeEngine's init)

    @override
    def consensus_group(self) -> Any:
        return getattr(self.engine, "consensus_group", None)   # inner=fsdp: the ranks holding this rank's shard

    @property
    def engine(self) -> DiLoCoEngine | NodeEngine:
        if self._engine is None:
            raise RuntimeError("diloco is not set up yet (setup_sync runs when fitting starts)")
        return self._engine

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.inner_steps == "time":   # replicas run apart within a round
            self.skip_per_step_sigterm_broadcast(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._timed is not None and not self._timed.computes(self.step % self.sync_every):
            return skipped_step_output()   # this replica's round budget is spent: the batch is skipped
        return super().training_step(*args, **kwargs)

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        outer = self.engine.outer
        done = self.step + 1   # self.step (trainer.global_step) counts the steps before this one
        timed = self._timed
        if timed is not None and self._step_end is not None and timed.computes(self.step % self.sync_every):
            timed.record(time.perf_counter() - self._step_end)
        for fragment in outer.starting(done):
            if self.overlap_steps == 0:
                self.outer_sync(fragment)
            else:
                self._launch(fragment, done, background=True)
        for round_ in outer.pop_due(done):
            self._merge(round_)
        if timed is not None and done % self.sync_every == 0:
            self.details["round_steps"] = timed.decide(gather_floats(self.world_size, self.global_rank))
        self._step_end = time.perf_counter()

    def outer_sync(self, fragment: int = 0) -> bool:
        """One blocking round of a fragment (the whole model when P = 1): average Δ (and
        the floating buffers), outer step, copy back. True if committed."""
        self._launch(fragment, self.step + 1, background=False)
        round_ = self.engine.outer.pop(fragment)
        self._merge(round_)
        return bool(round_.committed)

    @property
    def outer_params(self) -> torch.Tensor:
        """θ_g, the global parameters (a flat copy)."""
        return self.engine.outer.params

    @override
    def finish_pending_sync(self) -> None:
        if self._engine is not None:
            self._engine.outer.wait()

    def _launch(self, fragment: int, done: int, background: bool) -> None:
        """Start a round of ``fragment`` after step ``done``; it merges ``overlap_steps`` later."""
        scale = self._timed.scale if self._timed is not None else 1.0   # Δ weighted by the samples processed
        self.engine.launch(self.model_tensors(), fragment, done + self.overlap_steps, background, self.comm_meter,
                           scale=scale)

    def _merge(self, round_: Round) -> None:
        if self.engine.merge(self.model_tensors(), round_, self.mix_alpha):
            self.rounds += 1
        else:
            self.skipped += 1
        self.details["outer_state_bytes_per_rank"] = self.engine.outer_state_bytes()   # rank 0's in summary.json

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        return {**self.engine.outer.state_dict(), "sync_every": self.sync_every, "fragments": self.fragments,
                "overlap_steps": self.overlap_steps, "rounds": self.rounds, "skipped": self.skipped,
                "inner_steps": self.inner_steps,
                **({"timed": self._timed.state_dict()} if self._timed is not None else {})}

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        before_streaming = {"fragments": 1, "overlap_steps": 0, "inner_steps": "fixed"}   # what older checkpoints imply
        for key in ("sync_every", *before_streaming):
            saved, ours = state.get(key, before_streaming.get(key)), getattr(self, key)
            if saved != ours:
                raise ValueError(f"the checkpoint was written with {key}={saved}, this run has "
                                 f"{key}={ours}: rounds would not line up")
        self.engine.outer.load_state_dict(state)
        self.rounds, self.skipped = int(state["rounds"]), int(state["skipped"])
        if self._timed is not None:
            self._timed.load_state_dict(state["timed"])   # the counts agreed for the round in progress
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
