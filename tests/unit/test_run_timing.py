"""``summary.json``'s ``timing``: where the wall time outside the training steps goes.

A run's training clock (``train_seconds``) is longer than the sum of its epochs
(``epoch_s``); the difference was reported unexplained ("setup s") although most of it
was the checkpoints saved between epochs. The summary now names it: ``checkpoint_s``
counts the saves inside the training clock, and they must fit in the time outside the
epochs (saves run after each epoch's validation, before the next epoch starts).
"""

from __future__ import annotations

import json

from lightning.pytorch import Trainer

from syncplane.runtime.checkpoint_io import AtomicCheckpointIO, LastCheckpoint
from syncplane.runtime.report import RunReport
from tests.helpers.models import RegressionData, TinyRegressor


def test_summary_accounts_for_the_checkpoints_between_epochs(tmp_path):
    checkpoints = LastCheckpoint(tmp_path / "checkpoints")
    report = RunReport(tmp_path, "single", "regression", seed=0)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=[report, checkpoints],
                      plugins=[AtomicCheckpointIO()], default_root_dir=tmp_path)
    trainer.fit(TinyRegressor(), RegressionData(n=32))
    summary = json.loads((tmp_path / "summary.json").read_text())
    timing = summary["timing"]
    epochs = [json.loads(line)["epoch_s"] for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(epochs) == 3 and timing["checkpoints"] == 3 == len(checkpoints.saves)
    assert timing["outside_epochs_s"] == summary["train_seconds"] - sum(epochs)
    # the saves are disjoint from the epochs' clock and inside the training clock
    assert 0.0 < timing["checkpoint_s"] <= timing["outside_epochs_s"] + 1e-3
    assert 0.0 <= timing["before_first_epoch_s"] <= timing["outside_epochs_s"] - timing["checkpoint_s"] + 1e-3
    assert timing["setup_s"] > 0.0 and timing["before_train_s"] >= 0.0
    assert timing["phases"] is None   # a plain Lightning strategy has no breakdown of its own
