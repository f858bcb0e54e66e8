"""``syncplane bench --matrix`` for real, CI-sized: one small two-rack profile, two
strategies, a tiny payload. Checks that the command runs and writes well-formed output
(timings are the bench's business, not a test's), and that a second run resumes: nothing left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from syncplane.cluster import emulator
from tests.helpers.emulation import requires_emulation

pytestmark = requires_emulation

ROOT = Path(__file__).resolve().parents[2]

SMALL = {"name": "matrix_racks", "racks": [
    {"name": "r0", "uplink_mbit": 100, "hosts": [{"name": "a0", "nic_mbit": 400}, {"name": "a1", "nic_mbit": 400}]},
    {"name": "r1", "uplink_mbit": 100, "hosts": [{"name": "b0", "nic_mbit": 400}]}]}


def matrix(profile: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "syncplane", "bench", "--matrix", "--clusters", str(profile),
                           "--strategies", "ddp,atc", "--payload-mb", "0.25", "--steps", "1", "--warmup", "0",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_matrix_command_writes_one_json_and_table_per_profile_and_resumes(tmp_path):
    profile = tmp_path / "matrix_racks.yaml"
    profile.write_text(yaml.safe_dump(SMALL))
    out = tmp_path / "scoreboard"
    try:
        first = matrix(profile, out)
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        report = json.loads((out / "matrix_racks.json").read_text())
        assert report["cluster"] == "matrix_racks" and report["world_size"] == 3
        assert report["meta"]["command"].startswith("syncplane bench --matrix")
        rows = {r["strategy"]: r for r in report["results"]}
        assert list(rows) == ["ddp", "atc"]
        for row in rows.values():
            assert row["status"] == "ok"
            for key in ("sync_s_median", "speedup_vs_ddp", "bound_ratio", "network_bound_ratio", "model_error",
                        "nic_bytes_per_rank"):
                assert isinstance(row[key], float), key
            assert row["uplink_drops"] >= 0 and set(row["switch_drops"]) >= {"upl0r", "upl0c", "upl1r", "upl1c"}
            # the CPU the timed steps took: the ranks' own, and the machine's cores (shares of them)
            assert row["rank_cpu_s"] > 0 and row["machine_cpu"]["cores"] >= 1
            # (a one-step window of a tiny payload may be shorter than one clock tick of /proc/stat: 0)
            assert 0 <= row["machine_cpu"]["busy"] <= 1 and row["machine_cpu"]["user"] + row["machine_cpu"]["kernel"] \
                <= row["machine_cpu"]["busy"] + 1e-9
        table = [line for line in (out / "matrix_racks.md").read_text().splitlines() if line.startswith("|")]
        assert len(table) == 4 and len({line.count("|") for line in table}) == 1
        assert (out / "matrix_racks.png").stat().st_size > 0

        second = matrix(profile, out)                      # every cell is in the JSON: nothing runs
        assert second.returncode == 0, second.stderr[-2000:]
        assert "every cell already in" in second.stdout
        assert json.loads((out / "matrix_racks.json").read_text())["results"] == report["results"]
    finally:
        emulator.down()
