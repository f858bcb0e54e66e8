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


def test_the_matrix_writes_one_row_a_strategy_naming_the_failures(tmp_path, monkeypatch):
    """``--matrix``'s report from its jobs (their launch replaced: each writes the rank files a
    job would), in the generic results shape that ``scripts/results.py`` renders."""
    def launch(launcher, strategies, out, devices, timeout):
        good = {s: "ok" for s in features.SCENARIOS}
        broken = {"fit": "ok", "evaluate": "AssertionError: predict gave 3 batches"}
        for rank in range(devices):
            result = broken if (launcher, strategies) == ("lightning", "canary") else {**good, "ran": "DiLoCo"}
            (out / f"rank{rank}.json").write_text(json.dumps({strategies: result}))
        return (1 if (launcher, strategies) == ("lightning", "canary") else 0), 12.0, "output"

    monkeypatch.setattr(features, "launch", launch)
    report = tmp_path / "lightning_features.json"
    args = features.argparse.Namespace(strategies="diloco,canary,auto", devices=2, out=report, timeout=60.0)
    assert features.matrix(args) == 1                       # a failing cell fails the command
    data = json.loads(report.read_text())
    assert {"title", "created", "commit", "command", "columns", "rows"} <= set(data)
    assert data["rows"][0] == ["`diloco`", "5/5 (12 s)", "5/5 (12 s)"]
    assert data["rows"][1][2] == "1/5 (12 s) — evaluate: AssertionError: predict gave 3 batches"
    assert data["rows"][2][1] == "5/5 (12 s, ran DiLoCo)"   # what the planner chose
    assert len(features.SCENARIOS) == 5
