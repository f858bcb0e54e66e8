"""``python train.py strategy=auto``: the job picks a strategy by the plan, runs it as if named
(re-planning as it trains), and its summary says what it chose and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from syncplane.algorithms.plan import BASELINE_MARGIN
from syncplane.exchanges.cpu import ADD

ROOT = Path(__file__).resolve().parents[2]


def test_auto_trains_digits_and_explains_its_choice(tmp_path: Path) -> None:
    network = tmp_path / "pair.yaml"     # the network the plan is for (this job runs on this machine)
    network.write_text(yaml.safe_dump({"name": "pair", "racks": [
        {"name": "r0", "hosts": [{"name": "a", "nic_mbit": 100}, {"name": "b", "nic_mbit": 100}]}]}))
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", "strategy=auto", f"strategy.kwargs.cluster={network}",
                             "trainer.devices=2", "trainer.max_epochs=1", "strategy.kwargs.replan_every_s=0.2",
                             f"hydra.run.dir={run}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    auto = summary["strategy_details"]["auto"]
    assert auto["accept"] == "exact"
    assert summary["strategy"] == auto["choice"]["strategy"] in {"ddp", "flexreduce"}   # exact only
    assert all(c["exact"] for c in auto["candidates"] if c["strategy"] == auto["choice"]["strategy"])
    # the fastest, or DDP kept within the plan's margin of it
    assert auto["runner_up"] is not None
    assert auto["runner_up"]["step_s"] >= auto["choice"]["step_s"] * (1 - BASELINE_MARGIN)
    assert auto["inputs"]["cluster"] == "pair" and auto["inputs"]["world_size"] == 2
    assert auto["inputs"]["payload_bytes"] > 0 and auto["inputs"]["compute_s"] > 0   # timed real steps
    # the candidates' CPU work priced at this machine's rates, the job's two ranks sharing its cores
    assert auto["inputs"]["cpu"]["sharing"] == 2 / len(os.sched_getaffinity(0)) and auto["inputs"]["tcp"] == "emulated"
    assert auto["inputs"]["cpu"]["per_element"][ADD] > 0
    assert summary["steps"] > 0 and summary["metrics"]["val_acc"] > 0.3
    # re-planned on a re-probe (loopback) while it trained: an exact choice may switch to the other exact hook
    assert auto["replan"]["refused"] is None and auto["replan"]["strategies"] == ["ddp", "flexreduce"]   # exact only
    assert auto["replan"]["checks"] > 0
    assert all(r["best"]["strategy"] in {"ddp", "flexreduce"} for r in auto["replans"])
    switches = "".join(f", {r['best']['label']} from step {r['step']}" for r in auto["replans"])
    assert f"chose {auto['choice']['label']}{switches}" in result.stdout     # the run's table says what ran
    log = (run / "logs" / "rank0.log").read_text()
    assert f"strategy=auto (accept=exact): {auto['choice']['label']}, predicted" in log and "runner-up" in log
