"""A user's own Lightning program (``scripts/lightning_features.py``: Lightning's ``BoringModel``
with accumulation, clipping, its scheduler, validation, a checkpoint callback and one of the
user's, then validate/test/predict, resume from ``last.ckpt``, manual optimization and
``bf16-mixed``) passes with every strategy a user can name -- Lightning's ``ddp``, each
syncplane strategy, and ``syncplane.Auto`` -- under ``torchrun`` and under Lightning's own
launcher. One job per launcher runs every strategy in turn (2 CPU gloo ranks, about 25-50 s
a job on 2 cores); ``--matrix`` runs one job a cell for the results page."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
features = load_script("lightning_features")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "lightning"])
def test_every_strategy_passes_lightning_features_in_a_plain_script(tmp_path, launcher):
    out = tmp_path / "features"
    code, seconds, output = features.launch(launcher, ",".join(features.STRATEGIES), out, devices=2, timeout=500)
    print(f"{launcher}: every strategy, every scenario in {seconds:.0f} s")
    ranks = sorted(out.glob("rank*.json"))
    assert [p.name for p in ranks] == ["rank0.json", "rank1.json"], output
    for path in ranks:
        results = json.loads(path.read_text())
        failed = {name: {s: r for s, r in results.get(name, {}).items() if s in features.SCENARIOS and r != "ok"}
                  or "not run" for name in features.STRATEGIES
                  if any(results.get(name, {}).get(s) != "ok" for s in features.SCENARIOS)}
        assert not failed, f"{path.name}: {failed}\n{output}"
        assert results["auto"]["ran"] != "Auto"          # the planner became the strategy it chose
    assert code == 0, output


def test_a_failing_scenario_is_reported_and_ends_the_job(tmp_path, monkeypatch):
    """The worker's bookkeeping, in one process: a scenario that raises is recorded with its
    error, the later ones are not run, and the job exits 1 (its peers could not follow)."""
    monkeypatch.setattr(features, "SCENARIOS", ("fit", "evaluate"))
    monkeypatch.setattr(features, "EPOCHS", 1)
    monkeypatch.setattr(features, "ACCUMULATE", 3)   # 8 batches do not make whole steps of 3
    monkeypatch.setenv("RANK", "0")
    args = features.argparse.Namespace(strategies="ddp", devices=1, out=tmp_path)
    assert features.worker(args) == 1
    results = json.loads((tmp_path / "rank0.json").read_text())["ddp"]
    assert results["fit"] == "AssertionError: 3 optimizer steps, not 2 (accumulation)", results
    assert "evaluate" not in results
    assert "fit: AssertionError" in features.cell(tmp_path, "ddp", 1, 3.0)
