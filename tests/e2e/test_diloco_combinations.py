"""The DiLoCo jobs users run, through ``train.py`` on the emulated ``multi_nic`` (2 hosts of 2
ranks): node replicas with FSDP2 inside, a codec, fragments on several streams and overlap in
one job; and the time-paced rounds of ``replica: auto`` (node on this cluster). Each trains
``digits`` to the end, near DDP's accuracy, on the streams it was given."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from syncplane.cluster import emulator
from tests.helpers.emulation import requires_emulation

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [requires_emulation, pytest.mark.slow]


@pytest.mark.parametrize("kwargs", [
    {"replica": "node", "inner": "fsdp", "compression": "int8", "fragments": 2, "overlap_steps": 1, "streams": 2},
    {"replica": "auto", "inner_steps": "time"},
], ids=["node-fsdp-int8-fragments-overlap-streams", "auto-time"])
def test_a_combination_trains_to_the_end_on_node_replicas(tmp_path: Path, kwargs: dict) -> None:
    overrides = [f"strategy.kwargs.{k}={v}" for k, v in kwargs.items()]
    argv = [sys.executable, "train.py", "recipe=digits", "strategy=diloco", "cluster=multi_nic", "trainer.devices=4",
            "trainer.max_epochs=2", *overrides, f"hydra.run.dir={tmp_path}"]
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        emulator.down()
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    details = summary["strategy_details"]
    assert details["replica"] == "node" and details["ranks_per_replica"] == [2, 2]
    assert details["streams"] == kwargs.get("streams", 1)
    assert summary["metrics"]["val_acc"] > 0.9     # DDP: 0.99 on this job
