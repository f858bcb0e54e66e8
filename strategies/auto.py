"""``Auto``: ``train.py``'s ``strategy=auto`` as a strategy object for a plain Lightning script,
``Trainer(strategy=syncplane.Auto(cluster="two_racks"))``.

(Lightning's own ``strategy="auto"`` is Lightning's choice of DDP or none, so the planner is an
object, not a name.) The plan needs the model, which a strategy first sees at ``setup``, after
Lightning has configured it: so ``Auto`` starts as a plain ``DDPStrategy`` (Lightning's launcher,
process group and sampler alike for every candidate), decides at ``setup`` the way the worker
does (``syncplane.runtime.autopilot``: rank 0's measurements broadcast, the plan a pure function
of them, one decision on every rank), then becomes the chosen strategy -- its class and its
settings, with what Lightning has set on this object kept -- and sets up as it. The choice is
logged and recorded in ``details["auto"]`` (``summary.json``'s ``strategy_details.auto`` with
``RunReport``).

With ``replan_every_s`` it re-plans while training as ``train.py`` does: it runs the choice as a
strategy that can switch (``Replanner.build``) and adds the ``syncplane.runtime.replan.Replanner``
callback to the Trainer, which re-probes the network the plan was made for and switches where
that is safe; each switch goes to ``details["auto"]["replans"]``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from syncplane import lightning_adapter
from syncplane.cluster.profile import ClusterProfile
from syncplane.algorithms.ddp import BASELINE
from syncplane.config import ConfigError, parse_dataclass
from syncplane.runtime import autopilot, heartbeat_callback
from syncplane.strategies import registry
from syncplane.strategies.base import JobAware

log = logging.getLogger(__name__)


class Auto(JobAware, DDPStrategy):
    """The planner as a strategy: picks the fastest strategy for this model on ``cluster``.

    Args:
        cluster: the network to plan for (a shipped profile name, a YAML path or a
            ``ClusterProfile``); None: the launcher's ``SYNCPLANE_CLUSTER``, else an error.
        accept, compute_ms, time_steps, strategies, period, replan_every_s: as ``strategy.kwargs`` of
            ``train.py strategy=auto`` (``configs/strategy/auto.yaml``). Without ``compute_ms``
            the compute per step is timed on a copy of the model, on one batch of the
            datamodule (or of the module's own ``train_dataloader``).
        other keywords: Lightning's ``DDPStrategy`` (given to the chosen strategy too).
    """

    def __init__(self, cluster: str | Path | ClusterProfile | None = None, accept: str = "exact",
                 compute_ms: float | None = None, time_steps: int = 3, strategies: list[str] | str | None = None,
                 period: int | None = None, replan_every_s: float | None = None, **kwargs: Any) -> None:
        self.plan_kwargs = {"accept": accept, "compute_ms": compute_ms, "time_steps": time_steps,
                            "strategies": strategies, "period": period, "replan_every_s": replan_every_s}
        parse_dataclass(autopilot.AutoSettings, self.plan_kwargs, "Auto")   # a bad setting fails here
        super().__init__(**kwargs)
        self.ddp_kwargs = {k: v for k, v in kwargs.items() if k not in registry.RESERVED_KWARGS}
        self.use_cluster(cluster)
        self.details: dict[str, Any] = {}

    def network(self) -> ClusterProfile:
        """The profile the plan is for: the ``cluster`` argument, else the launcher's."""
        profile = self.job.profile
        if profile is None:
            raise ConfigError("Auto: the planner needs the network's shape: Auto(cluster=NAME|PATH|ClusterProfile), "
                              "or SYNCPLANE_CLUSTER set by the launcher")
        return profile

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            raise ConfigError("Auto decides at fit: fit with it first, or name the strategy it chose "
                              "(details['auto']['choice']) for validate/test/predict")
        module = self.lightning_module
        assert module is not None
        heartbeat_callback.install(trainer)   # the decision is collective too; and DDP, if chosen, has none
        data = trainer.datamodule if trainer.datamodule is not None else module
        if self.plan_kwargs["compute_ms"] is None and data is module and not _has_train_loader(module):
            raise ConfigError("Auto: give compute_ms=..., or fit with a datamodule (or a module with its own "
                              "train_dataloader) for the planner to time a step on")
        on_cpu = self.root_device.type == "cpu"
        ranks_here = self.job.local_world_size or self.world_size
        sharing = ranks_here / len(os.sched_getaffinity(0)) if on_cpu else None
        broadcast = autopilot.torch_broadcast()
        auto = autopilot.choose_strategy(self.plan_kwargs, self.network(), module, data, broadcast, sharing,
                                         self.global_rank)
        name, kwargs = auto["choice"]["strategy"], dict(auto["choice"]["kwargs"])
        log.info("Auto: %s chosen (%s)", name, auto["choice"]["label"])
        replanner = autopilot.replanner(self.plan_kwargs, self.network(), auto, broadcast, self.global_rank)
        self._become(self._chosen(name, kwargs, replanner))
        details = getattr(self, "details", None)
        if not isinstance(details, dict):
            details = {}
        self.details = {**details, "auto": auto}
        self.setup(trainer)   # now the chosen strategy's
        if replanner is not None:
            _install(replanner, trainer, module)

    def _chosen(self, name: str, kwargs: dict[str, Any], replanner: Any) -> DDPStrategy:
        """The strategy to become: when a re-plan may switch the choice to another strategy, one
        that can switch (``Replanner.build``); else the choice as named."""
        switchable = None if replanner is None else replanner.build(
            self.cluster_environment, self.job, process_group_backend=self.process_group_backend, **self.ddp_kwargs)
        if switchable is not None:
            return switchable
        if name == BASELINE:   # Lightning's DDP, in a class this object can become
            return PlannedDDP(cluster_environment=self.cluster_environment,
                              process_group_backend=self.process_group_backend, **{**self.ddp_kwargs, **kwargs})
        return registry.build(name, {**self.ddp_kwargs, **kwargs}, self.cluster_environment,
                              self.process_group_backend, job=self.job)

    def _become(self, chosen: DDPStrategy) -> None:
        """Take ``chosen``'s class and settings, keeping what Lightning set on this object since
        it was built (accelerator, devices, precision, launcher, the module): the attributes whose
        value differs from a fresh ``DDPStrategy``'s."""
        fresh = vars(DDPStrategy())
        set_here = {k: v for k, v in vars(self).items() if k in fresh and not _same(v, fresh[k])}
        state = {**vars(chosen), **set_here}
        self.__dict__.clear()
        self.__dict__.update(state)
        self.__class__ = type(chosen)


def _install(replanner: Callback, trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Add ``replanner`` to the Trainer's callbacks (public: ``trainer.callbacks``) once the
    chosen strategy is set up. Lightning has run its callbacks' ``setup`` and restored their
    state from a resumed checkpoint by then (``Auto``'s ``restore_checkpoint_after_setup`` is
    DDP's False), so both happen here, the re-plan's state before the strategy's own, as in
    ``train.py`` (``Replanner.load_state_dict``; a chosen strategy that restores after its setup
    has Lightning restore the same state once more). The hooks the re-plan uses (each batch's
    end, ``state_dict``) all come later."""
    trainer.callbacks.append(replanner)
    replanner.setup(trainer, module, "fit")
    state = lightning_adapter.loaded_checkpoint(trainer).get("callbacks", {}).get(replanner.state_key)
    if state is not None:
        replanner.load_state_dict(state)


class PlannedDDP(JobAware, DDPStrategy):
    """Lightning's ``DDPStrategy``, as ``Auto`` runs it when the plan chose ``ddp`` (an object
    can take only a class of its own layout)."""


def _same(a: Any, b: Any) -> bool:
    """Whether two attribute values are the defaults alike (plain values compared, objects by identity)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (bool, int, float, str, bytes, tuple, list, dict, set, frozenset)) or \
            type(a).__module__ == "datetime":
        try:
            return bool(a == b)
        except Exception:   # an element with no plain equality: not a default
            return False
    return False


def _has_train_loader(data: Any) -> bool:
    try:
        return data.train_dataloader() is not None
    except Exception:   # Lightning's default train_dataloader raises: none defined
        return False
