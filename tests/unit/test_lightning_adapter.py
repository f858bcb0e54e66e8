"""Each private Lightning access of ``syncplane.lightning_adapter`` still works on the installed
Lightning; when Lightning moves one, the test fails naming the version and what moved."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, Strategy

from syncplane import lightning_adapter as adapter
from tests.helpers.models import RegressionData, TinyRegressor


def require(condition: bool, what: str, detail: str = "") -> None:
    """Fail with the adapter's own message (it names the Lightning version) unless ``condition``."""
    if not condition:
        pytest.fail(str(adapter.changed(what, detail)))


class Watch(Callback):
    """What the adapter reads during a real fit."""

    def __init__(self) -> None:
        self.hooks: list[str | None] = []
        self.trainers: list[object] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trainers.append(adapter.attached_trainer(pl_module))


class Recording(TinyRegressor):
    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch

    def training_step(self, batch, batch_idx):
        self.watch.hooks.append(adapter.current_hook(self))
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One real two-epoch fit on the CPU, with the adapter's checkpoint callback."""
    out = tmp_path_factory.mktemp("fit")
    watch = Watch()
    checkpoint = adapter.TimedModelCheckpoint(dirpath=out, filename="last", save_top_k=1)
    module = Recording(watch)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=3, limit_val_batches=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[watch, checkpoint], default_root_dir=out)
    skipped = adapter.skip_per_step_sigterm_broadcast(trainer)
    trainer.fit(module, datamodule=RegressionData(n=24))
    return trainer, module, watch, checkpoint, skipped


def test_the_epoch_loop_broadcasts_sigterm_before_each_step_and_it_can_be_skipped(fitted):
    loop_class = adapter.epoch_loop_class()
    require(hasattr(loop_class, "_broadcast_sigterm_tensor"), "_TrainingEpochLoop._broadcast_sigterm_tensor")
    require("self._broadcast_sigterm_tensor()" in inspect.getsource(loop_class.advance),
            "_TrainingEpochLoop.advance", "it no longer calls _broadcast_sigterm_tensor before each step")
    trainer, *_, skipped = fitted
    assert skipped and trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None


def test_current_hook_names_the_hook_a_module_runs_in(fitted):
    _, module, watch, *_ = fitted
    require(watch.hooks == ["training_step"] * 6, "LightningModule._current_fx_name",
            f"read {watch.hooks!r} inside training_step")
    assert adapter.current_hook(TinyRegressor()) is None   # no Trainer, no hook


def test_attached_trainer_is_the_trainer_or_none(fitted):
    trainer, _, watch, *_ = fitted
    assert watch.trainers and all(t is trainer for t in watch.trainers)
    assert adapter.attached_trainer(TinyRegressor()) is None and adapter.attached_trainer(None) is None


def test_timed_checkpoint_times_every_save_and_knows_its_last_step(fitted):
    trainer, _, _, checkpoint, _ = fitted
    require(hasattr(ModelCheckpoint, "_save_checkpoint"), "ModelCheckpoint._save_checkpoint")
    assert len(checkpoint.saves) == 2 and all(seconds >= 0 for _, seconds in checkpoint.saves)   # once an epoch
    require(checkpoint.last_saved_step == trainer.global_step == 6, "ModelCheckpoint._last_global_step_saved",
            f"{checkpoint.last_saved_step} after saving at step {trainer.global_step}")


def test_sync_module_states_runs_without_a_process_group_of_many():
    import torch.distributed as dist

    module = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in module.parameters()]
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        adapter.sync_module_states(module)   # one rank: its own values come back
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_lightning_precisions_are_its_literal_strings():
    names = adapter.lightning_precisions()
    require({"32-true", "16-mixed", "bf16-mixed", "32", "16"} <= set(names), "_PRECISION_INPUT_STR",
            f"the accepted strings are now {names!r}")


def test_unwrapped_model_overrides_what_lightning_calls():
    require("self._setup_model(" in inspect.getsource(Strategy.setup), "Strategy.setup",
            "it no longer calls _setup_model")
    require("self._setup_model(" in inspect.getsource(DDPStrategy.configure_ddp), "DDPStrategy.configure_ddp",
            "it no longer calls _setup_model")

    class Plain(adapter.UnwrappedModel, DDPStrategy):
        pass

    model = torch.nn.Linear(2, 2)
    assert Plain()._setup_model(model) is model


def test_configure_ddp_registers_only_a_hook_it_was_given():
    """The strategies that bring their own comm hook (torch_hooks, flexreduce, switching) give
    Lightning none and register theirs after ``super().configure_ddp()``: Lightning must not
    register one of its own then (it would be DDP's second, which torch refuses)."""
    source = inspect.getsource(DDPStrategy._register_ddp_hooks)
    require("self._ddp_comm_hook" in source, "DDPStrategy._register_ddp_hooks",
            "it no longer registers only the ddp_comm_hook it was given")
    assert DDPStrategy()._ddp_comm_hook is None


def test_the_error_names_the_installed_lightning():
    message = str(adapter.changed("X._y", "why"))
    assert f"Lightning {adapter.LIGHTNING_VERSION} changed X._y (why)" in message
    assert pl.__version__ == adapter.LIGHTNING_VERSION


class LoadedAtFitStart(Callback):
    """What ``loaded_checkpoint`` gives where a strategy's ``setup`` has just run."""

    def __init__(self) -> None:
        self.loaded: dict | None = None

    def on_fit_start(self, trainer, pl_module):
        self.loaded = dict(adapter.loaded_checkpoint(trainer))


@pytest.mark.parametrize("resume", [True, False])
def test_loaded_checkpoint_is_the_resumed_one_at_setup_and_empty_otherwise(fitted, tmp_path, resume):
    trainer, _, _, checkpoint, _ = fitted
    seen = LoadedAtFitStart()
    again = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, limit_train_batches=3, limit_val_batches=0,
                       logger=False, enable_progress_bar=False, enable_model_summary=False,
                       enable_checkpointing=False, callbacks=[seen], default_root_dir=tmp_path)
    again.fit(TinyRegressor(), datamodule=RegressionData(n=24), ckpt_path=checkpoint.best_model_path if resume else None)
    require(seen.loaded is not None, "Trainer._checkpoint_connector._loaded_checkpoint")
    assert seen.loaded is not None
    if resume:
        require(seen.loaded.get("global_step") == trainer.global_step, "Trainer._checkpoint_connector._loaded_checkpoint",
                "the resumed checkpoint, held until the training state is restored")
        assert "callbacks" in seen.loaded
    else:
        assert seen.loaded == {}
