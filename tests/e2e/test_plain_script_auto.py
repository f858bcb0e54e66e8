"""The planner as a strategy object in a plain Lightning script (``syncplane.Auto``), under
``torchrun`` with 2 CPU gloo ranks: it decides the same on every rank, trains as the chosen
strategy, and records its choice in the run report's ``summary.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "plain_script.py"
PROFILE = """name: two_slow_hosts
racks:
  - name: r0
    hosts:
      - {name: h0, nic_mbit: 5, ranks: 1}
      - {name: h1, nic_mbit: 5, ranks: 1}
"""


@pytest.mark.slow
def test_auto_chooses_alike_on_every_rank_trains_and_records_its_choice(tmp_path):
    profile = tmp_path / "two_slow_hosts.yaml"
    profile.write_text(PROFILE)
    report = tmp_path / "report"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(SCRIPT), "--strategy", f"auto:{profile}", "--accept", "approximate", "--candidates",
               "diloco,atc", "--max-steps", "30", "--report", str(report), "--out", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((report / "summary.json").read_text())
    auto = summary["strategy_details"]["auto"]
    chosen = auto["choice"]["strategy"]
    assert chosen in ("diloco", "atc") and auto["inputs"]["cluster"] == "two_slow_hosts"
    assert auto["runner_up"] is not None and auto["runner_up"]["strategy"] != chosen
    ran = {"diloco": "DiLoCo", "atc": "ATC"}[chosen]
    # rank 0 prints what ran; every rank ran the same (or the job, all collectives, would hang)
    assert f"(Auto chose {chosen}, ran {ran})" in done.stdout, done.stdout[-2000:]
    assert "trained 30 steps" in done.stdout


def test_auto_refuses_bad_settings_and_a_missing_network(monkeypatch):
    import lightning.pytorch as pl

    from syncplane import Auto
    from syncplane.config import ConfigError
    from syncplane.launch import CLUSTER_ENV

    with pytest.raises(ConfigError, match="accept"):
        Auto(cluster="two_racks", accept="sometimes")
    monkeypatch.delenv(CLUSTER_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"Auto\(cluster="):
        Auto().network()
    assert isinstance(Auto(cluster="two_racks"), pl.strategies.DDPStrategy)
