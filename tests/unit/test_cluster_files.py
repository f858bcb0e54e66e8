"""``cluster=PATH``: a user's own profile file works wherever a shipped name does (issue 36)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from syncplane.cluster import load_profile, parse_profile
from syncplane.config import ConfigError
from syncplane.experiments.comparison import compose_job
from syncplane.runtime.cluster_files import is_profile_path, rewrite_cluster_overrides

ROOT = Path(__file__).resolve().parents[2]
MINE = {"name": "mine", "racks": [
    {"name": "r0", "uplink_mbit": 50, "hosts": [{"name": "m0", "nic_mbit": 300}, {"name": "m1", "nic_mbit": 300}]},
    {"name": "r1", "uplink_mbit": 50, "hosts": [{"name": "m2", "nic_mbit": 300, "ranks": 2}]}]}


@pytest.fixture
def mine(tmp_path: Path) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(MINE))
    return path


def test_a_profile_file_composes_into_the_job_as_its_content(mine: Path) -> None:
    container = compose_job(["strategy=ddp", f"cluster={mine}"], "the job")
    assert parse_profile(container["cluster"]) == load_profile(mine)
    assert parse_profile(container["cluster"]).world_size == 4


def test_a_relative_path_and_a_shipped_name_in_one_sweep(mine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(mine.parent)
    rewritten = rewrite_cluster_overrides(["strategy=ddp", "cluster=./mine.yaml,two_racks", "seed=1"])
    assert rewritten[0] == "strategy=ddp" and rewritten[2] == "seed=1"
    option, shipped = rewritten[1].removeprefix("cluster=").split(",")
    assert shipped == "two_racks" and not is_profile_path(option)
    assert compose_job([f"cluster={option}"], "the job")["cluster"]["name"] == "mine"
    assert rewrite_cluster_overrides(["cluster=two_racks"]) == ["cluster=two_racks"]


def test_missing_or_invalid_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cluster: no profile file at .*nope.yaml"):
        rewrite_cluster_overrides([f"cluster={tmp_path / 'nope.yaml'}"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**MINE, "racks": [{"name": "r0", "hosts": [{"name": "x", "nic_mbit": -1}]}]}))
    with pytest.raises(ConfigError, match=r"cluster\(bad.yaml\)\.racks\[0\]\.hosts\[0\]\.nic_mbit: must be positive"):
        compose_job([f"cluster={bad}"], "the job")


def test_train_py_takes_a_profile_path(mine: Path, tmp_path: Path) -> None:
    """As a user types it: the file is found and checked (4 ranks in it, 2 asked: a clear
    error before any worker starts, so no emulated cluster is built here)."""
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", "strategy=ddp", f"cluster={mine}", "trainer.devices=2",
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "cluster profile 'mine' has 4 ranks (set trainer.devices=4)" in result.stderr, result.stderr
    missing = subprocess.run([sys.executable, "train.py", f"cluster={tmp_path / 'gone.yaml'}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=180)
    assert missing.returncode == 2 and "cluster: no profile file at" in missing.stderr, missing.stderr
    assert not (run_dir / "logs").exists()
