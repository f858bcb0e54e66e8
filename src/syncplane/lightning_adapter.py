"""Every use of Lightning's private API, in one module.

Why: a name with a leading underscore can change in any Lightning release without notice, and
a strategy that reads one breaks silently (a hook that is no longer called, an attribute that
no longer exists, an override that is no longer an override). Gathered here, each access has a
test (``tests/unit/test_lightning_adapter.py``) that fails naming the installed Lightning
version when Lightning moves it, and ``tests/unit/test_lightning_private_api.py`` fails when a
private Lightning name is used anywhere else in syncplane.

What syncplane needs that Lightning has no public way for:

- ``skip_per_step_sigterm_broadcast``: Lightning 2.6 broadcasts rank 0's SIGTERM flag before
  every training step (``_TrainingEpochLoop._broadcast_sigterm_tensor``), a collective that
  makes every rank wait for the slowest at every step;
- ``current_hook``: the Lightning hook a module is inside (``LightningModule._current_fx_name``):
  ``self.log`` is allowed only there;
- ``sync_module_states``: broadcast rank 0's parameters and buffers
  (``lightning.pytorch.overrides.distributed._sync_module_states``);
- ``lightning_precisions``: the ``precision`` strings the Trainer accepts
  (``_PRECISION_INPUT_STR`` and its aliases);
- ``UnwrappedModel``: a ``DDPStrategy`` whose model is never wrapped (``_setup_model``, which
  ``Strategy.setup`` calls outside fitting too);
- ``TimedModelCheckpoint``: a ``ModelCheckpoint`` whose saves are timed, and the step it last
  saved (``_save_checkpoint``, ``_last_global_step_saved``).
- ``loaded_checkpoint``: the checkpoint a resuming fit loaded, for a callback a strategy adds
  at its ``setup``, after Lightning restored the callbacks it had
  (``Trainer._checkpoint_connector._loaded_checkpoint``).

Where Lightning has a public way, syncplane uses it (``module.trainer``, ``trainer.train_dataloader``,
``DDPStrategy.configure_ddp`` and torch's ``register_comm_hook`` for comm hooks on any device).
This module imports Lightning: modules that must stay light (the launcher's settings) import it
inside a function.
"""

from __future__ import annotations

import logging
import time
import typing
from importlib.metadata import version
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

log = logging.getLogger(__name__)

#: The installed Lightning's version (named in every error below).
LIGHTNING_VERSION = version("lightning")

#: The Lightning release every access here was checked against.
CHECKED_WITH = "2.6"


class LightningChanged(RuntimeError):
    """Lightning's private API is not what syncplane was written against."""


def changed(what: str, detail: str = "") -> LightningChanged:
    """The error for a private Lightning name that moved: names the version and what broke."""
    extra = f" ({detail})" if detail else ""
    return LightningChanged(f"Lightning {LIGHTNING_VERSION} changed {what}{extra}; syncplane was checked with "
                            f"Lightning {CHECKED_WITH}: syncplane.lightning_adapter needs updating")


def epoch_loop_class() -> type:
    """Lightning's training epoch loop class."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    return _TrainingEpochLoop


def extend_max_steps(trainer: pl.Trainer, extra: int) -> None:
    """Let ``trainer`` run ``extra`` more steps than ``trainer.max_steps`` (when it has a step
    limit): an elastic replica that trained on while late must still reach the job's last round.
    Lightning keeps the limit on its epoch loop (``max_steps``; the fit loop's is read-only)."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "max_steps"):
        raise changed("where the training step limit lives (fit_loop.epoch_loop.max_steps)")
    if extra > 0 and loop.max_steps > 0:
        loop.max_steps += int(extra)


_warned_no_sigterm_broadcast = False


def skip_per_step_sigterm_broadcast(trainer: pl.Trainer) -> bool:
    """Drop Lightning's broadcast of rank 0's SIGTERM flag before every training step (for
    strategies whose ranks may run apart). Returns whether there was one to drop; a Lightning
    without it needs nothing dropped (said once in the log)."""
    global _warned_no_sigterm_broadcast
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        if not _warned_no_sigterm_broadcast:
            log.info("Lightning %s has no per-step SIGTERM broadcast (_broadcast_sigterm_tensor): nothing to skip",
                     LIGHTNING_VERSION)
            _warned_no_sigterm_broadcast = True
        return False
    loop._broadcast_sigterm_tensor = lambda: None
    return True


def current_hook(module: pl.LightningModule) -> str | None:
    """The Lightning hook ``module`` is running in (``training_step``, ...), None outside one:
    ``module.log`` raises outside Lightning's hooks."""
    try:
        return module._current_fx_name
    except AttributeError:
        raise changed("LightningModule._current_fx_name", "the hook a module is running in") from None


def attached_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, None when it is not (public: ``module.trainer``
    raises then)."""
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:
        return None


def loaded_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The checkpoint ``trainer``'s fit resumes from, as Lightning loaded it (it holds it from
    before the strategy's ``setup`` until the training state is restored); empty when the fit
    does not resume, or no longer holds it."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    loaded = getattr(connector, "_loaded_checkpoint", None)
    if not isinstance(loaded, dict):
        raise changed("Trainer._checkpoint_connector._loaded_checkpoint", "the checkpoint a resuming fit loaded")
    return loaded


def sync_module_states(module: torch.nn.Module) -> None:
    """Collective: broadcast rank 0's parameters and buffers into every rank's ``module``."""
    try:
        from lightning.pytorch.overrides.distributed import _sync_module_states
    except ImportError:
        raise changed("lightning.pytorch.overrides.distributed._sync_module_states") from None
    _sync_module_states(module)


def lightning_precisions() -> tuple[str, ...]:
    """The ``precision`` strings Lightning's Trainer accepts (its own list, aliases included)."""
    try:
        from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS
    except ImportError:
        raise changed("lightning.fabric.plugins.precision.precision._PRECISION_INPUT_STR(_ALIAS)") from None
    names = (*typing.get_args(_PRECISION_INPUT_STR), *typing.get_args(_PRECISION_INPUT_STR_ALIAS))
    if not names or not all(isinstance(n, str) for n in names):
        raise changed("_PRECISION_INPUT_STR", f"no longer a Literal of strings: {names!r}")
    return names


class UnwrappedModel:
    """Mixin before ``DDPStrategy``: the model is never wrapped in ``DistributedDataParallel``
    (``Strategy.setup``, which a strategy calls outside fitting, and ``configure_ddp`` call
    ``_setup_model``)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


class TimedModelCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, with every save on this rank timed (``saves``: start and
    seconds, ``time.perf_counter``) and the step it last saved (``last_saved_step``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saves: list[tuple[float, float]] = []

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        start = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)
        self.saves.append((start, time.perf_counter() - start))

    @property
    def last_saved_step(self) -> int:
        """The global step of this callback's last save (0 before any, as Lightning keeps it)."""
        try:
            return int(self._last_global_step_saved)
        except AttributeError:
            raise changed("ModelCheckpoint._last_global_step_saved") from None
