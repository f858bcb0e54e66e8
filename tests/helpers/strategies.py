"""Test-only strategies that exercise ``SyncplaneStrategy``'s extension points.

Not shipped: the product strategies live in ``strategies/``. These are the smallest
subclasses that show the base works -- averaging everything every step (which must
equal DDP), and never synchronizing (replicas drift; consensus must still be exact).
"""

from __future__ import annotations

from typing import Any, Mapping

from torch.optim import Optimizer

from syncplane.strategies import SyncplaneStrategy


class EveryStepAveraging(SyncplaneStrategy):
    """Average all parameters over all ranks after every optimizer step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rounds = 0

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        self.average_replicas_()
        self.rounds += 1

    def sync_state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rounds = int(state["rounds"])


class NoSync(SyncplaneStrategy):
    """Purely local training: every replica follows its own data."""


def fit_digits(name: str, kwargs: Mapping[str, Any], tmp_dir: str, **trainer: Any) -> tuple[Any, Any]:
    """Five steps of the small digits model under strategy ``name`` (``ddp``: Lightning's
    own DDPStrategy), seed 7, inside a ``run_distributed`` rank; returns (strategy, model)."""
    import torch
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    from syncplane.recipes.digits import DigitsSettings, build
    from syncplane.strategies import strategy_class
    from tests.helpers.models import trainer_for

    torch.manual_seed(7)
    model, data = build(DigitsSettings(batch_size=16, width=8))
    env = TorchElasticEnvironment()
    strategy = DDPStrategy(cluster_environment=env) if name == "ddp" else strategy_class(name)(
        cluster_environment=env, **kwargs)
    trainer_for(strategy, tmp_dir, max_steps=5, limit_val_batches=0, **trainer).fit(model, data)
    return strategy, model
