"""``summary.json``'s ``compute_utilization`` and ``time_to_target_s`` (issue 78): compute
seconds over wall seconds, validation left out of both, and the training clock at the first
validation at or below ``trainer.target_val_loss``."""

from __future__ import annotations

import json

import pytest
from lightning.pytorch import Trainer

from syncplane.config import ConfigError, parse_dataclass
from syncplane.runtime.report import RunReport, reached_loss
from syncplane.runtime.settings import TrainerSettings
from syncplane.runtime.slowdown import ComputeReport, SlowCompute, Slowdown
from tests.helpers.models import RegressionData, TinyRegressor


def fit(tmp_path, report: RunReport, callbacks=(), epochs: int = 4) -> tuple[dict, list[dict]]:
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=1,
                      callbacks=[*callbacks, report], default_root_dir=tmp_path)
    trainer.fit(TinyRegressor(), RegressionData(n=32))
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    return json.loads((tmp_path / "summary.json").read_text()), history


def test_an_emulated_accelerator_is_busy_its_nominal_steps_of_the_wall_and_the_target_is_timed(tmp_path):
    nominal = SlowCompute(Slowdown(), nominal_s=0.05)
    report = RunReport(tmp_path, "single", "regression", seed=0,
                       compute=ComputeReport(None, {}, rank=0, own=nominal, emulated_step_s=0.05),
                       target_val_loss=1e6)   # reached at the first validation
    summary, history = fit(tmp_path, report, callbacks=[nominal])
    steps = summary["compute"]["emulated_steps"]
    assert steps == 16 and nominal.busy_s == pytest.approx(16 * 0.05)
    wall = summary["train_seconds"] - summary["timing"]["validation_s"]
    assert 0.0 < summary["timing"]["validation_s"] < summary["train_seconds"]
    assert summary["compute_utilization"] == pytest.approx(16 * 0.05 / wall, rel=1e-6)
    assert 0.0 < summary["compute_utilization"] <= 1.0
    # the first validation came after one epoch: 4 emulated batches of 0.05 s at least
    assert summary["target_val_loss"] == 1e6
    assert summary["time_to_target_s"] == pytest.approx(history[0]["train_s"], abs=1e-3)
    assert 4 * 0.05 <= summary["time_to_target_s"] < wall
    # each record's clock leaves the validations out, so it grows by about an epoch's training
    clocks = [record["train_s"] for record in history]
    assert clocks == sorted(clocks) and clocks[-1] <= wall + 1e-3   # rounded to ms


def test_measured_compute_without_emulation_and_an_unreached_target(tmp_path):
    report = RunReport(tmp_path, "single", "regression", seed=0, target_val_loss=1e-12)
    summary, history = fit(tmp_path, report, epochs=2)
    assert summary["time_to_target_s"] is None and len(history) == 2
    wall = summary["train_seconds"] - summary["timing"]["validation_s"]
    assert report.measured_compute_s > 0.0
    assert summary["compute_utilization"] == pytest.approx(report.measured_compute_s / wall, rel=1e-6)
    assert summary["compute_utilization"] < 1.0   # the optimizer steps and data loading are not compute
    # no target: nothing to time
    other = RunReport(tmp_path / "b", "single", "regression", seed=0)
    assert fit(tmp_path / "b", other, epochs=1)[0]["time_to_target_s"] is None


def test_compute_seconds_by_kind_of_emulation() -> None:
    slowed = SlowCompute(Slowdown(factor=2.0), wait=lambda s: None)
    slowed.after_batch(0.1, 0)   # waits 0.1: the slower GPU's extra compute
    assert ComputeReport(None, {0: slowed.slowdown}, rank=0, own=slowed).compute_seconds(0.3) == pytest.approx(0.4)
    assert ComputeReport(None, {}, rank=0).compute_seconds(0.3) == 0.3
    emulated = SlowCompute(Slowdown(factor=2.0, from_step=1), wait=lambda s: None, nominal_s=0.2)
    emulated.emulate(0.05, 0)
    emulated.emulate(0.5, 1)   # an overrun counts its nominal time (0.4), not the CPU's 0.5
    assert ComputeReport(None, {}, rank=0, own=emulated, emulated_step_s=0.2).compute_seconds(9.0) == \
        pytest.approx(0.6)


def test_a_target_loss_is_reached_at_or_below_it_and_must_be_positive() -> None:
    assert reached_loss(4.0, 4.0) and reached_loss(3.9, 4.0)
    assert not reached_loss(4.1, 4.0) and not reached_loss(None, 4.0) and not reached_loss(3.0, None)
    with pytest.raises(ConfigError, match="trainer.target_val_loss: must be positive"):
        parse_dataclass(TrainerSettings, {"target_val_loss": 0}, "trainer")
