"""Elastic DiLoCo in a plain Lightning script, the torchft way: a lighthouse (torchft's
``LighthouseServer``, what ``torchft_lighthouse`` serves), and each replica group its own
``torchrun`` job of one rank (``tests/helpers/plain_script.py --strategy diloco
--strategy-kwargs '{"elastic": true}'``) whose place is torchft's ``TORCHFT_LIGHTHOUSE``,
``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS``. Replica 1 is killed (SIGKILL) at step 15;
replica 0 goes on alone; torchrun (``--max-restarts 1``) starts replica 1 again, which joins,
heals from replica 0 and trains to the end. Both jobs exit 0 holding one θ_g.

Timing: the restarted replica asked to join 9-19 s after the kill (torchrun's notice, a fresh
interpreter, Lightning; the machine's load decides), while the job's 120 steps of 0.08 s take
≈ 12 s. So replica 0, alone from step 15, waits from step 60 on until replica 1 has started
training again (it removes the kill's mark then): the heal always meets a running job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "plain_script.py"
STEPS = 120
KWARGS = {"elastic": True, "sync_every": 5, "round_timeout_s": 5, "heartbeat_timeout_s": 3}


def _replica(tmp_path: Path, replica: int, lighthouse: str, extra: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse,
           "REPLICA_GROUP_ID": str(replica), "NUM_REPLICA_GROUPS": "2", "RUST_LOG": "warn"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone",
               "--max-restarts", "1", str(SCRIPT), "--strategy", "diloco", "--strategy-kwargs", json.dumps(KWARGS),
               "--devices", "1", "--max-steps", str(STEPS), "--step-s", "0.08", "--report",
               str(tmp_path / f"report{replica}"), "--out", str(tmp_path / f"run{replica}"), *extra]
    log = (tmp_path / f"replica{replica}.log").open("w")
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.mark.slow
def test_torchrun_replicas_on_torchfts_variables_heal_a_restarted_one(tmp_path: Path) -> None:
    from syncplane.algorithms.diloco import ft

    lighthouse = ft.start_lighthouse(min_replicas=1, join_timeout_s=3, heartbeat_timeout_s=3)
    try:
        mark = str(tmp_path / "killed")
        jobs = [_replica(tmp_path, 0, lighthouse.address, ["--hold-step", "60", "--hold-file", mark]),
                _replica(tmp_path, 1, lighthouse.address,
                         ["--fault", "kill", "--fault-rank", "0", "--fault-step", "15", "--mark", mark])]
        try:
            codes = [job.wait(timeout=150) for job in jobs]
        finally:
            for job in jobs:
                if job.poll() is None:
                    os.killpg(job.pid, 9)
                    job.wait()
    finally:
        lighthouse.shutdown()
    logs = "".join((tmp_path / f"replica{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    events = [json.loads(line) for line in (tmp_path / "syncplane_elastic" / "history.jsonl").read_text().splitlines()]
    starts = [(e["replica"], e["restart"]) for e in events if e["event"] == "start"]
    assert sorted(starts) == [(0, 0), (1, 0), (1, 1)], starts      # torchrun's restart count is the replica's
    assert {(0, 1)} <= {(e["replica"], e["replicas"]) for e in events if e["event"] == "membership"}   # went on alone
    heals = [e for e in events if e["event"] == "heal"]
    assert [h["replica"] for h in heals] == [1] and heals[0]["bytes"] > 0, heals
    details = [json.loads((tmp_path / f"report{r}" / "summary.json").read_text())["strategy_details"]["elastic"]
               for r in range(2)]
    assert details[0]["theta_sha256"] == details[1]["theta_sha256"], details   # one θ_g
    over_time = details[0]["replicas_over_time"]
    assert over_time[0] == [0, 2] and [size for _, size in over_time][-1] == 2 and 1 in [s for _, s in over_time]
