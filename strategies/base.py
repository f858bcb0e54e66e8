"""``SyncplaneStrategy``: Lightning's DDP plumbing without the DDP wrapper.

Subclassing ``DDPStrategy`` keeps what we want from it -- the cluster environment,
process-group setup, DistributedSampler injection, ``reduce``/``barrier`` -- while the
synchronization itself becomes ours. Overridden hooks, and why:

- ``setup`` / ``_setup_model``: never wrap; outside fitting, do not broadcast rank 0's
  weights over the other replicas (Lightning's DDP does, before validate/test).
- ``configure_ddp``: do not wrap in DDP (there is no gradient all-reduce); create the
  gloo control group (``syncplane.comm.process_groups``: CPU-side collectives never ride
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
- ``save_checkpoint`` / ``load_model_state_dict`` / ``load_optimizer_state_dict``: the
  checkpoint's ``"syncplane"`` entry carries the strategy's extra state
  (``sync_state_dict``) and every rank's own replica and optimizer state, so a resume
  on the same world size continues exactly where each replica was.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from lightning.pytorch.overrides.distributed import _sync_module_states
import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.comm import DEFAULT_BUCKET_BYTES, Bucket, CommMeter, allreduce_mean_, make_buckets, mean_and_distance
from syncplane.comm.process_groups import control_group
from syncplane.strategies import replicas


class SyncplaneStrategy(DDPStrategy):
    """Base for our strategies; subclasses implement the sync extension points.

    Args:
        consensus_eval: validate and checkpoint the average of all replicas (costs one
            all-reduce of the model per validation); when False each rank evaluates its
            own replica and checkpoints hold rank 0's.
        bucket_mb: tensor-fusion bucket size for model-wide collectives.
        consensus_every: log the consensus distance ``mean_i ‖xᵢ − x̄‖/‖x̄‖`` every this
            many steps (0 = never); it costs one all-reduce of the model in float64.
    """

    #: Subclasses whose replicas stay bit-identical (e.g. exact global averaging every
    #: step) set this True to skip consensus work.
    replicas_identical: bool = False

    def __init__(self, consensus_eval: bool = True, bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
                 consensus_every: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if consensus_every < 0:
            raise ValueError(f"consensus_every must be >= 0 (0 = never), got {consensus_every}")
        self.consensus_eval = consensus_eval
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.consensus_every = consensus_every
        self.comm_meter = CommMeter()
        self._metered = (0.0, 0)   # comm meter totals at the last logged step
        self._stashed_replica: list[torch.Tensor] | None = None
        self._model_buckets: list[Bucket] | None = None   # built once: the model's tensors do not move

    # ------------------------------------------------------------ extension points

    def setup_sync(self) -> None:
        """Create process groups and buffers; runs once on every rank after the model is placed."""

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

    # ------------------------------------------------------------ helpers

    @property
    def step(self) -> int:
        """Index of the optimizer step in progress (``trainer.global_step``: resumes aligned)."""
        module = self.lightning_module
        return module.trainer.global_step if module is not None and module._trainer is not None else 0

    def model_tensors(self) -> list[torch.Tensor]:
        """Parameters and floating-point buffers: what replicas average (not step counters)."""
        module = self.lightning_module
        assert module is not None
        params = [p.data for p in module.parameters()]
        buffers = [b for b in module.buffers() if b.is_floating_point()]
        return params + buffers

    def average_replicas_(self, tensors: list[torch.Tensor] | None = None) -> None:
        """Replace ``tensors`` (default: the whole model) by their mean over all ranks."""
        if tensors is None:
            if self._model_buckets is None:
                self._model_buckets = make_buckets(self.model_tensors(), self.bucket_bytes)
            buckets = self._model_buckets
        else:
            buckets = make_buckets(tensors, self.bucket_bytes)
        allreduce_mean_(buckets, meter=self.comm_meter)

    # ------------------------------------------------------------ Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._model_buckets = None   # a new fit/validate may bring a different module
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)
        else:
            # DDPStrategy.setup broadcasts rank 0's weights before validate/test/predict,
            # which would silently replace every other replica. Skip that: evaluation
            # runs on the consensus instead (on_validation_start).
            Strategy.setup(self, trainer)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore the model *after* configure_ddp: its initial broadcast of rank 0's weights
        # would otherwise overwrite the per-rank replica a resume has just loaded.
        return True

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # never wrapped in DistributedDataParallel

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        control_group()   # the gloo group for CPU-side collectives, before any strategy makes groups
        _sync_module_states(self.model)
        self.setup_sync()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
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
        if module is None or module._current_fx_name is None:
            return   # not inside a training loop hook (e.g. a direct optimizer call): nothing to log
        seconds, sent = self.comm_meter.seconds, self.comm_meter.bytes_sent
        module.log("sync/comm_s", seconds - self._metered[0], on_step=True, on_epoch=False)
        module.log("sync/bytes", float(sent - self._metered[1]), on_step=True, on_epoch=False)
        self._metered = (seconds, sent)
        if self.consensus_every and self.world_size > 1 and (self.step + 1) % self.consensus_every == 0:
            self.finish_pending_sync()
            distance = mean_and_distance(self.model_tensors())
            module.log("sync/consensus_distance", distance, on_step=True, on_epoch=False)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.finish_pending_sync()
        if not self.consensus_eval or self.replicas_identical or self.world_size == 1:
            return
        self._stashed_replica = [t.detach().clone() for t in self.model_tensors()]
        self.average_replicas_()

    @override
    def on_validation_end(self) -> None:
        if self._stashed_replica is not None:
            with torch.no_grad():
                for live, own in zip(self.model_tensors(), self._stashed_replica):
                    live.copy_(own)
            self._stashed_replica = None
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        self.finish_pending_sync()   # before callbacks read the final replicas (on_fit_end)
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.finish_pending_sync()
        state = super().lightning_module_state_dict()
        if not self.consensus_eval or self.replicas_identical or self.world_size == 1 \
                or self._stashed_replica is not None:  # already the consensus (inside validation)
            return state
        averaged = {k: v.detach().clone() for k, v in state.items()}
        floating = [v for v in averaged.values() if v.is_floating_point()]
        allreduce_mean_(make_buckets(floating, self.bucket_bytes))
        return averaged

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.finish_pending_sync()
        extra: dict[str, Any] = {"strategy": type(self).__name__, "state": self.sync_state_dict()}
        if self.world_size > 1 and not self.replicas_identical:
            # a collective (every rank saves): rank 0 receives every replica
            extra["replicas"] = replicas.gather_replicas(self.lightning_module, self.optimizers,
                                                         self._stash_by_tensor(), self.is_global_zero)
        checkpoint["syncplane"] = extra
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict)
        own = replicas.own_replica(checkpoint, self.global_rank, self.world_size)
        if own is not None:
            self.lightning_module.load_state_dict(own["model"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        own = replicas.own_replica(checkpoint, self.global_rank, self.world_size)
        if own is None:
            super().load_optimizer_state_dict(checkpoint)
        else:
            super().load_optimizer_state_dict({"optimizer_states": own["optimizers"]})
        extra = checkpoint.get("syncplane")
        if extra is not None:
            self.load_sync_state_dict(extra.get("state", {}))

    def _stash_by_tensor(self) -> dict[int, torch.Tensor]:
        """Live tensor storage -> this rank's own values, while validation shows the consensus."""
        if self._stashed_replica is None:
            return {}
        return {t.data_ptr(): own for t, own in zip(self.model_tensors(), self._stashed_replica)}
