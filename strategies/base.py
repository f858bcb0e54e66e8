"""``SyncplaneStrategy``: Lightning's DDP plumbing without the DDP wrapper.

Subclassing ``DDPStrategy`` keeps what we want from it -- the cluster environment,
process-group setup, DistributedSampler injection, ``reduce``/``barrier`` -- while the
synchronization itself becomes ours. Overridden hooks, and why:

- ``setup`` / ``_setup_model`` (``lightning_adapter.UnwrappedModel``): never wrap; outside fitting, do not broadcast rank 0's
  weights over the other replicas (Lightning's DDP does, before validate/test).
- ``configure_ddp``: do not wrap in DDP (there is no gradient all-reduce); create the
  gloo control group (``syncplane.algorithms.replicas``: CPU-side collectives never ride
  the NCCL default group); broadcast
  rank 0's initial module state so every replica starts equal; call ``setup_sync``,
  where subclasses create process groups (a collective: same order on every rank).
- ``optimizer_step``: the whole step (closure = forward + backward) runs inside
  ``super().optimizer_step``. Three sync points: ``before_optimizer_step`` (before the
  closure's forward), ``before_parameter_update`` (after the backward, before the
  optimizer applies the update -- the closure is wrapped, so this holds with AMP's
  GradScaler and with manual optimization too) and ``after_optimizer_step``. Then the
  step's sync metrics are logged (``sync/comm_s``, ``sync/bytes``, and every
  ``consensus_every`` steps ``sync/consensus_distance``).
- ``finish_pending_sync``: strategies that leave communication in flight across the step
  boundary finish it here; the base calls it before validation, checkpoints, consensus
  metrics and at the end of training, so those never see half-mixed parameters.
- ``on_validation_start`` / ``on_validation_end``: evaluate the consensus model (the
  average of all replicas) and put each rank's own replica back afterwards.
- ``lightning_module_state_dict``: checkpoints hold the consensus model, not rank 0's
  replica (Lightning writes from rank 0 only).
- ``restore_checkpoint_after_setup``: True, so a resumed replica is loaded after the
  initial broadcast of ``configure_ddp``, not overwritten by it.
- ``save_checkpoint`` / ``load_checkpoint`` / ``load_model_state_dict`` /
  ``load_optimizer_state_dict`` / ``remove_checkpoint``: the checkpoint's ``"syncplane"``
  entry carries the strategy's extra state (``sync_state_dict``); every rank writes its
  own replica and optimizer state beside it (``replicas``: a local write per rank, not a
  gather through rank 0's links) and reads it back, so a resume on the same world size
  continues exactly where each replica was.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.algorithms import replicas as replica_ops
from syncplane.algorithms import sharded
from syncplane.algorithms.replicas import DEFAULT_BUCKET_BYTES, DEFAULT_CONSENSUS_SKETCH, CommMeter, ModelReplicas, PhaseProfile
from syncplane import lightning_adapter
from syncplane.cluster.profile import ClusterProfile
from syncplane.config import ConfigError
from syncplane.job import JobContext
from syncplane.lightning_adapter import UnwrappedModel
from syncplane.runtime import heartbeat_callback
from syncplane.strategies import replicas


class JobAware:
    """A strategy that knows the job's shape (``job``), and the cluster it runs on.

    In a plain Lightning script the cluster is the strategy's ``cluster`` argument (a shipped
    profile name, a YAML path or a ``ClusterProfile``: ``DiLoCo(cluster="two_racks")``); the
    environment variable ``SYNCPLANE_CLUSTER`` is only the fallback when none is given."""

    _job: JobContext | None = None
    _cluster: JobContext | None = None    # the job placed on the ``cluster`` argument (``use_cluster``)
    global_rank: int
    world_size: int

    def use_cluster(self, cluster: str | Path | ClusterProfile | None) -> None:
        """Run on ``cluster`` (None: the launcher's, if any). Loaded now: a bad profile fails here."""
        self._cluster = JobContext().on_cluster(cluster) if cluster is not None else None

    @property
    def job(self) -> JobContext:
        """The job's shape: what the runtime handed over, else (a plain Lightning script) the
        launcher's (``JobContext.from_environment``), on the ``cluster`` argument if one was
        given, seen from this rank."""
        if self._job is None:
            self._job = JobContext.from_environment()
            placed = self._cluster
            if placed is not None:   # the argument's profile, already loaded
                self._job = dataclasses.replace(self._job, cluster=placed.cluster)
                self._job.__dict__["profile"] = placed.profile
        return self._job.with_size(self.global_rank, self.world_size)


class Watched:
    """Mixin before Lightning's strategy: the heartbeat (``syncplane.runtime.heartbeat_callback``)
    runs for the whole fit, installed at ``setup`` -- before the strategy's first collective --
    when the Trainer has no ``HeartbeatCallback`` of its own (``train.py``'s worker adds one).
    So a plain Lightning script gets it too: a rank dead, hung or cut off stops every rank,
    naming it, under Lightning's launcher, ``torchrun`` or SLURM."""

    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            heartbeat_callback.install(trainer)
        super().setup(trainer)  # type: ignore[misc]


class SyncplaneStrategy(JobAware, Watched, UnwrappedModel, DDPStrategy):
    """Base for our strategies; subclasses implement the sync extension points.

    Args:
        consensus_eval: validate and checkpoint the average of all replicas (costs one
            all-reduce of the model per validation); when False each rank evaluates its
            own replica and checkpoints hold rank 0's.
        bucket_mb: tensor-fusion bucket size for model-wide collectives.
        consensus_every: log the consensus distance ``mean_i ‖xᵢ − x̄‖/‖x̄‖`` every this
            many steps (0 = never); a collective, so every rank waits for the others there.
        consensus_sketch: estimate that logged distance from a count sketch of this many
            float64 buckets (relative error about ``1/sqrt(consensus_sketch)``), all-reduced
            instead of the whole model: exact all-reduces of a large model over a slow link
            cost more than the training they watch. 0, or a model no larger: exact.
            ``summary.json``'s final distance is always exact.
        cluster: the cluster the job runs on (a shipped profile name, a YAML path or a
            ``ClusterProfile``), for the strategies that read its racks and hosts; None: the
            launcher's (``SYNCPLANE_CLUSTER``), else none.
    """

    #: Subclasses whose replicas stay bit-identical (e.g. exact global averaging every
    #: step) set this True to skip consensus work.
    replicas_identical: bool = False

    def __init__(self, consensus_eval: bool = True, bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
                 consensus_every: int = 0, consensus_sketch: int = DEFAULT_CONSENSUS_SKETCH,
                 job: JobContext | None = None, cluster: str | Path | ClusterProfile | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._job = job
        self.use_cluster(cluster)
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if consensus_every < 0:
            raise ValueError(f"consensus_every must be >= 0 (0 = never), got {consensus_every}")
        if consensus_sketch < 0:
            raise ValueError(f"consensus_sketch must be >= 0 (0 = exact), got {consensus_sketch}")
        self.consensus_eval = consensus_eval
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.consensus_every = consensus_every
        self.consensus_sketch = consensus_sketch
        self.comm_meter = CommMeter()
        #: what showing validation the consensus model costs (an evaluation choice, not the
        #: algorithm's sync: DDP's identical replicas need none); ``summary.json`` reports it apart
        self.evaluation_meter = CommMeter()
        self._metered = (0.0, 0)   # comm meter totals at the last logged step
        self._stashed_replica: list[torch.Tensor] | None = None
        #: (step, this rank's replica, the consensus shown) of the last validation, until the
        #: next optimizer step: the checkpoint saved right after each epoch's validation
        #: shows that consensus again instead of averaging the model over the network anew.
        self._validated: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._model_replicas: ModelReplicas | None = None   # built once: the model's tensors do not move
        #: What the strategy decided at setup that a reader of the summary needs (e.g. what
        #: H-ATC took as a machine); written to ``summary.json`` as ``strategy_details``.
        self.details: dict[str, Any] = {}
        #: Wall seconds of the one-time and per-checkpoint work outside the training steps
        #: (``setup/*``: control group, initial broadcast, ``setup_sync``; ``checkpoint/*``:
        #: the consensus model, the per-rank replicas), so a run's time outside its epochs is
        #: accounted for in ``summary.json`` (``timing.phases``) instead of left unexplained.
        self.phases = PhaseProfile()

    # ------------------------------------------------------------ extension points

    def setup_sync(self, job: JobContext) -> None:
        """Create process groups and buffers; runs once on every rank after the model is placed.
        ``job``: the job's shape (hosts, racks, the cluster profile, NICs)."""

    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        """At the start of a real step, before the closure's forward and backward."""

    def before_parameter_update(self, optimizer: Optimizer) -> None:
        """After the backward, right before the optimizer applies the gradients."""

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Synchronize after the local optimizer step (once per real step)."""

    def finish_pending_sync(self) -> None:
        """Complete communication still in flight, so the parameters are final."""

    def sync_state_dict(self) -> dict[str, Any]:
        """Extra state a resume needs (schedule position, outer optimizer, ...)."""
        return {}

    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``sync_state_dict`` returned."""

    def rank_state_dict(self) -> dict[str, Any]:
        """State that differs per rank (an EMA of this rank's parameters, error-feedback
        residuals). The checkpoint holds every rank's (gathered with the replicas); a resume
        on the same world size hands each rank its own to ``load_rank_state_dict``. Not a
        collective: the base does the gathering."""
        return {}

    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's ``rank_state_dict`` (called after ``load_sync_state_dict``)."""

    # ------------------------------------------------------------ helpers

    @property
    def step(self) -> int:
        """Index of the optimizer step in progress (``trainer.global_step``: resumes aligned)."""
        module = self.lightning_module
        trainer = lightning_adapter.attached_trainer(module)
        return trainer.global_step if trainer is not None else 0

    def model_parameters(self) -> list[torch.Tensor]:
        """This rank's values of the parameters (its shard of each, where FSDP2 shards them)."""
        module = self.lightning_module
        assert module is not None
        return [sharded.local(p.data) for p in module.parameters()]

    def model_buffers(self) -> list[torch.Tensor]:
        """Floating-point buffers (BatchNorm statistics), not step counters."""
        module = self.lightning_module
        assert module is not None
        return [b for b in module.buffers() if b.is_floating_point()]

    def model_tensors(self) -> list[torch.Tensor]:
        """Parameters, then floating-point buffers: what replicas average."""
        return self.model_parameters() + self.model_buffers()

    def average_replicas_(self, tensors: list[torch.Tensor] | None = None) -> None:
        """Replace ``tensors`` (default: the whole model) by their mean over all ranks."""
        if tensors is None:
            self.model_replicas().average_(self.comm_meter)
        else:
            replica_ops.average_(tensors, self.bucket_bytes, self.comm_meter)

    def model_replicas(self) -> ModelReplicas:
        """The model's tensors fused into buckets, built on first use."""
        if self._model_replicas is None:
            self._model_replicas = ModelReplicas(self.model_tensors(), self.bucket_bytes, self.consensus_group())
        return self._model_replicas

    def consensus_group(self) -> Any:
        """The ranks whose ``model_tensors`` the consensus averages: None, all of them; a
        strategy whose ranks hold different shards of one replica names the group that holds
        this rank's shard in every replica."""
        return None

    # ------------------------------------------------------------ Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._model_replicas = None   # a new fit/validate may bring a different module
        self._validated = None
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)
        else:
            # DDPStrategy.setup broadcasts rank 0's weights before validate/test/predict,
            # which would silently replace every other replica. Skip that: evaluation
            # runs on the consensus instead (on_validation_start).
            Strategy.setup(self, trainer)

    @staticmethod
    def skip_per_step_sigterm_broadcast(trainer: pl.Trainer) -> None:
        """Drop Lightning 2.6's SIGTERM flag broadcast from rank 0 before every training step
        (``_TrainingEpochLoop._broadcast_sigterm_tensor``): a collective per step, which makes
        every rank wait for the slowest at every step. For strategies whose ranks may run
        apart (time-budgeted DiLoCo rounds, late-peer mixing); our launcher stops every rank
        on SIGTERM itself."""
        lightning_adapter.skip_per_step_sigterm_broadcast(trainer)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore the model *after* configure_ddp: its initial broadcast of rank 0's weights
        # would otherwise overwrite the per-rank replica a resume has just loaded.
        return True

    def makes_meta_models(self) -> bool:
        """Whether this strategy gives values to a model built on the meta device (in the
        LightningModule's ``configure_model``): only one that shards it, each rank making its
        own shards (DiLoCo with ``replica: node``, ``inner: fsdp``)."""
        return False

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if sharded.on_meta(self.model):
            if self.makes_meta_models():
                return    # no values yet: the strategy makes each rank's shards (setup_sync)
            raise ValueError(f"the model has parameters on the meta device (built so in configure_model?): "
                             f"{type(self).__name__} cannot give them values; only strategy=diloco with "
                             "strategy.kwargs.replica=node and strategy.kwargs.inner=fsdp makes each rank's "
                             "shards. Build the model on a real device, or use those settings")
        super().model_to_device()

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        with self.phases.time("setup/control_group"):
            replica_ops.start_control()   # the gloo group for CPU-side collectives, before any strategy makes groups
        with self.phases.time("setup/broadcast"):
            if not sharded.on_meta(self.model):
                self._broadcast_start(self.model)
        with self.phases.time("setup/setup_sync"):
            self.setup_sync(self.job)

    def _broadcast_start(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers into every rank's; on several hosts of several ranks
        one copy crosses into each host (``broadcast_by_host_``), else Lightning's broadcast."""
        try:
            hosts = self.job.hosts() if self.job.elastic is None else []
        except ConfigError:   # no hosts to read (LOCAL_WORLD_SIZE does not divide): a strategy's own check says so
            hosts = []
        if len(hosts) > 1 and max(len(h) for h in hosts) > 1:
            replica_ops.broadcast_by_host_(replica_ops.module_states(model), hosts)
        else:
            lightning_adapter.sync_module_states(model)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        self._validated = None   # the replicas move on: the last validation's consensus is stale
        self.before_optimizer_step(optimizer)

        def closure_then_sync() -> Any:
            result = closure()
            self.before_parameter_update(optimizer)
            return result

        output = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        self.after_optimizer_step(optimizer)
        self._log_sync_metrics()
        return output

    def _log_sync_metrics(self) -> None:
        """This rank's communication time and bytes for the step; the consensus distance
        every ``consensus_every`` steps (a collective: every rank reaches it at the same step)."""
        module = self.lightning_module
        if module is None or lightning_adapter.current_hook(module) is None:
            return   # not inside a training loop hook (e.g. a direct optimizer call): nothing to log
        seconds, sent = self.comm_meter.seconds, self.comm_meter.bytes_sent
        module.log("sync/comm_s", seconds - self._metered[0], on_step=True, on_epoch=False)
        module.log("sync/bytes", float(sent - self._metered[1]), on_step=True, on_epoch=False)
        self._metered = (seconds, sent)
        if self.consensus_every and self.world_size > 1 and (self.step + 1) % self.consensus_every == 0:
            self.finish_pending_sync()
            distance = replica_ops.consensus_distance(self.model_tensors(), self.consensus_group(),
                                                      self.consensus_sketch)
            module.log("sync/consensus_distance", distance, on_step=True, on_epoch=False)

    def evaluation_tensors(self) -> list[torch.Tensor] | None:
        """This rank's model to show in validation and checkpoints, before the average over
        ranks, when it is not the live replica (DS-Sync's EMA ensemble); None: the replica."""
        return None

    def _shows_another_model(self) -> bool:
        averaged = self.consensus_eval and not self.replicas_identical and self.world_size > 1
        return averaged or self.evaluation_tensors() is not None

    def _show_evaluation_model(self) -> None:
        """Stash this rank's replica; put the evaluation model (the consensus of every rank's
        ``evaluation_tensors``, or of the replicas) in its place until ``_restore_replica``."""
        self._stashed_replica = [t.detach().clone() for t in self.model_tensors()]
        source = self.evaluation_tensors()
        if source is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.model_tensors(), source)
        if self.consensus_eval and not self.replicas_identical and self.world_size > 1:
            self.average_replicas_()

    def _show_validated_model(self) -> bool:
        """Collective: put the last validation's consensus back in place of the replica (as
        ``_show_evaluation_model`` would, without its all-reduce) when it is still the
        consensus: no step since, and every rank's replica bitwise unchanged (a callback may
        have edited it). False, showing nothing, otherwise."""
        validated = self._validated
        current = (validated is not None and validated[0] == self.step
                   and all(torch.equal(a, b) for a, b in zip(self.model_tensors(), validated[1])))
        if not replica_ops.every_rank(current):
            return False
        assert validated is not None
        self._stashed_replica = validated[1]
        with torch.no_grad():
            torch._foreach_copy_(self.model_tensors(), validated[2])
        return True

    def _restore_replica(self) -> None:
        if self._stashed_replica is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.model_tensors(), self._stashed_replica)
            self._stashed_replica = None

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.finish_pending_sync()
        if self._shows_another_model():
            meter, self.comm_meter = self.comm_meter, self.evaluation_meter
            try:
                self._show_evaluation_model()
            finally:
                self.comm_meter = meter

    @override
    def on_validation_end(self) -> None:
        sharded.reshard(self.lightning_module)   # FSDP2: the shards again, not the whole parameters
        if self._stashed_replica is not None and self.evaluation_tensors() is None:
            # the consensus of the replicas (not of other tensors, e.g. DS-Sync's EMA models,
            # which the replica check of _show_validated_model would not cover)
            self._validated = (self.step, self._stashed_replica, [t.detach().clone() for t in self.model_tensors()])
        self._restore_replica()
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        self.finish_pending_sync()   # before callbacks read the final replicas (on_fit_end)
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The evaluation model (the consensus, or DS-Sync's EMA ensemble), not rank 0's
        replica: Lightning writes checkpoints from rank 0 only. A collective."""
        self.finish_pending_sync()
        if self._stashed_replica is not None or not self._shows_another_model():
            return sharded.whole(super().lightning_module_state_dict())   # inside validation it is shown already
        # Not metered: the comm meter reports what training's sync (and validation) costs,
        # compared with DDP, whose checkpoints need no averaging; nothing is in flight here.
        meter, self.comm_meter = self.comm_meter, CommMeter()
        try:
            start = time.perf_counter()
            reused = self._show_validated_model()
            if not reused:
                self._show_evaluation_model()
            self.phases.add("checkpoint/consensus_reused" if reused else "checkpoint/consensus",
                            time.perf_counter() - start)
            return {k: v.detach().clone() for k, v in sharded.whole(super().lightning_module_state_dict()).items()}
        finally:
            self._restore_replica()
            self.comm_meter = meter

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.finish_pending_sync()
        extra: dict[str, Any] = {"strategy": type(self).__name__, "state": self.sync_state_dict()}
        rank_state = self.rank_state_dict()
        per_rank = self.world_size > 1 and (not self.replicas_identical or rank_state)
        if per_rank:
            # a collective (every rank saves): each rank writes its replica and rank state
            with self.phases.time("checkpoint/replicas"):
                state = replicas.replica_state(self.lightning_module, self.optimizers, self._stash_by_tensor(),
                                               rank_state)
                extra["replica_shards"] = replicas.save_own_replica(self.checkpoint_io, filepath, state,
                                                                    self.global_rank, self.world_size)
        elif rank_state:   # a job of one rank (an elastic replica's): its own state goes inside the checkpoint
            extra["rank_state"] = rank_state
        checkpoint["syncplane"] = extra
        with self.phases.time("checkpoint/write"):
            super().save_checkpoint(checkpoint, filepath, storage_options)   # rank 0 writes it
        if per_rank:
            replica_ops.control_barrier()   # the new checkpoint is in place: older replicas can go
            replicas.prune_replicas(filepath, self.global_rank, keep=extra["replica_shards"]["tag"])

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        replicas.attach_own_replica(self.checkpoint_io, checkpoint_path, checkpoint, self.global_rank,
                                    self.world_size)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        replicas.prune_replicas(filepath, self.global_rank)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return sharded.plain(super().optimizer_state(optimizer))   # FSDP2: this rank's shard, plain tensors

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        sharded.load_module_state(self.lightning_module, checkpoint["state_dict"], strict)
        own = replicas.own_replica(checkpoint, self.global_rank, self.world_size)
        if own is not None:
            sharded.load_module_state(self.lightning_module, own["model"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        own = replicas.own_replica(checkpoint, self.global_rank, self.world_size)
        if own is None:
            super().load_optimizer_state_dict(checkpoint)
        else:
            states = [sharded.optimizer_state_like(state, [p for g in opt.param_groups for p in g["params"]])
                      for opt, state in zip(self.optimizers, own["optimizers"])]
            super().load_optimizer_state_dict({"optimizer_states": states})
        extra = checkpoint.get("syncplane")
        if extra is not None:
            self.load_sync_state_dict(extra.get("state", {}))
        if own is not None:
            self.load_rank_state_dict(own.get("rank_state", {}))
        elif extra is not None and self.world_size == 1:
            self.load_rank_state_dict(extra.get("rank_state", {}))

    def _stash_by_tensor(self) -> dict[int, torch.Tensor]:
        """Live tensor storage -> this rank's own values, while validation shows the consensus."""
        if self._stashed_replica is None:
            return {}
        return {t.data_ptr(): own for t, own in zip(self.model_tensors(), self._stashed_replica)}
