"""``syncplane chaos`` end to end, as a user or CI runs it: a real job on 3 local ranks whose
rank 2 hangs (SIGSTOP) after step 17, just after the first epoch's checkpoint (15 steps an
epoch at 3 ranks). The report must name rank 2 as lost, show both survivors stopping with
the heartbeat's error naming it, the launcher exiting non-zero within the deadline, nothing
left running, and the step-15 checkpoint loading with ``weights_only=True``; the command
then exits 0 (the job kept the promise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from syncplane.experiments.chaos import job_processes
from tests.e2e.test_train import ROOT


@pytest.mark.slow
def test_chaos_reports_a_hung_rank_named_and_the_job_ended_clean(tmp_path: Path) -> None:
    run_dir, report_path = tmp_path / "run", tmp_path / "chaos.json"
    result = subprocess.run(
        [sys.executable, "-m", "syncplane", "chaos", "--fault", "stop:rank=2:step=17", "--out", str(run_dir),
         "--json", str(report_path), "--timeout-s", "240", "strategy=ddp", "trainer.devices=3", "trainer.max_epochs=3",
         "trainer.heartbeat_timeout_s=3", "seed=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = json.loads(report_path.read_text())
    print(json.dumps({k: report[k] for k in ("faults", "ranks", "launcher")}, indent=1))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["ok"] and report["problems"] == []
    assert report["lost_ranks"] == [2] and report["faults"][0]["fired"]
    survivors = [r for r in report["ranks"] if r["role"] == "survivor"]
    assert [r["rank"] for r in survivors] == [0, 1]
    for rank in survivors:   # each stopped with the heartbeat's error naming rank 2, before the deadline
        assert rank["names_lost_rank"] and "rank 2 stopped sending heartbeats" in rank["error"], rank
        assert 0 < rank["error_after_s"] < report["deadline_s"]
    launcher = report["launcher"]
    assert launcher["exit_code"] == 1 and launcher["error"].startswith("syncplane: training failed: rank ")
    assert launcher["names_lost_rank"] and 0 < launcher["ended_after_s"] < report["deadline_s"]
    assert report["leftover"] == [] and job_processes(run_dir / "job.yaml") == {}
    assert report["checkpoint"]["ok"] and report["checkpoint"]["global_step"] == 15
    assert "verdict: the job kept the promise" in result.stdout
