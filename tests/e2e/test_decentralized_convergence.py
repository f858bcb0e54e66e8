"""Convergence: every decentralized strategy trains ``digits`` on 4 ranks to within 1.5
points of DDP's validation accuracy (same recipe, epochs and seed), through ``train.py``."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.test_train import train

EPOCHS = 10


def _accuracies(sweep: Path) -> dict[str, float]:
    out = {}
    for summary_path in sweep.glob("*/summary.json"):
        summary = json.loads(summary_path.read_text())
        assert summary["world_size"] == 4
        out[summary["strategy"]] = summary["metrics"]["val_acc"]
    return out


def test_decentralized_strategies_reach_ddp_accuracy_on_digits(tmp_path):
    common = ["trainer.devices=4", f"trainer.max_epochs={EPOCHS}", "seed=3"]
    flat = train("-m", "strategy=ddp,atc,awc", *common, f"hydra.sweep.dir={tmp_path / 'flat'}", timeout=900)
    assert flat.returncode == 0, flat.stdout[-3000:] + flat.stderr[-3000:]
    # two "machines" of two ranks each, so the hierarchical path really mixes across machines
    hier = train("-m", "strategy=h_atc,h_awc", "++strategy.kwargs.ranks_per_machine=2", *common,
                 f"hydra.sweep.dir={tmp_path / 'hier'}", timeout=900)
    assert hier.returncode == 0, hier.stdout[-3000:] + hier.stderr[-3000:]
    accuracy = {**_accuracies(tmp_path / "flat"), **_accuracies(tmp_path / "hier")}
    assert set(accuracy) == {"ddp", "atc", "awc", "h_atc", "h_awc"}
    assert accuracy["ddp"] > 0.9, accuracy
    for name, value in accuracy.items():
        assert value >= accuracy["ddp"] - 0.015, accuracy
