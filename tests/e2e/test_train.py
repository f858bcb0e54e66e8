"""``train.py`` end to end, in a subprocess, exactly as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def train(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_default_job_trains_digits_to_95_percent(tmp_path):
    result = train(f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] >= 2
    assert summary["strategy"] == "atc" and summary["recipe"] == "digits"   # the default strategy
    assert summary["metrics"]["val_acc"] >= 0.95
    assert summary["steps"] > 0 and summary["throughput"]["samples_per_s"] > 0
    assert summary["comm"]["bytes_sent_per_rank"] > 0
    # atc's replicas differ, so validation shows their average: counted apart from the sync
    assert summary["comm"]["evaluation_bytes_per_rank"] > 0
    assert f"summary written to {tmp_path / 'summary.json'}" in result.stdout
    assert "val accuracy" in result.stdout               # the rich table
    assert (tmp_path / "csv" / "metrics.csv").exists()     # the CSV record
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == summary["steps"] // 22
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {"rank0.log", "rank1.log"}


def test_two_job_multirun_with_wandb_offline(tmp_path):
    result = train("-m", "seed=1,2", "trainer.max_epochs=1", "logger=wandb", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and (p / "summary.json").exists())
    assert [p.name for p in jobs] == ["0-atc", "1-atc"]
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 22
        offline_runs = list((job / "wandb").glob("offline-run-*"))
        assert len(offline_runs) == 1, "one offline W&B run per job"
    # the sweep ends with a comparison report beside its runs
    report = json.loads((tmp_path / "comparison.json").read_text())
    assert [Path(r["run_dir"]).name for r in report["runs"]] == ["0-atc", "1-atc"]
    assert (tmp_path / "comparison.png").stat().st_size > 1000
    assert "| atc |" in (tmp_path / "comparison.md").read_text()
    # and scripts/compare.py rebuilds it from the run directories
    rebuilt = subprocess.run([sys.executable, "scripts/compare.py", str(jobs[0]), str(jobs[1]), "--out",
                              str(tmp_path / "rebuilt")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert json.loads((tmp_path / "rebuilt" / "comparison.json").read_text())["runs"] == report["runs"]


@pytest.mark.parametrize("overrides,message", [
    (["strategy=nope"], "Could not find 'strategy/nope'"),
    (["recipe=nope"], "Could not find 'recipe/nope'"),
    (["+strategy.kwargs.bucket_capp=1"], "strategy.kwargs: unknown key(s) bucket_capp; allowed keys:"),
])
def test_bad_config_fails_before_any_worker_starts(tmp_path, overrides, message):
    """Hydra's own refusals, and one of ours end to end (a launcher costs ~15 s of start-up
    here: every other bad value of every key is ``tests/unit/test_launch_checks.py``, through
    the same ``launch_job``, in-process)."""
    result = train(*overrides, f"hydra.run.dir={tmp_path}", timeout=180)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "logs").exists(), "no worker may start on a bad config"


@pytest.mark.parametrize("overrides,message", [
    (["strategy=diloco", "strategy.kwargs.sync_every=0"], "strategy.kwargs: sync_every must be at least 1, got 0"),
])
def test_every_strategy_setting_is_checked_in_the_launching_process(tmp_path, overrides, message):
    """A bad strategy setting exits with 2 and names the key before any worker starts (it
    used to pass the check and fail inside every worker ~20 s later). One setting end to end;
    one bad value of every key of every strategy: ``tests/unit/test_launch_checks.py``."""
    result = train(*overrides, f"hydra.run.dir={tmp_path}", timeout=180)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "logs").exists(), "no worker may start on a bad config"


@pytest.mark.parametrize("overrides,message", [
    (["strategy=canary", "strategy.kwargs.exchange=nested"], "strategy.kwargs: exchange: nested needs the ranks grouped"),
])
def test_values_checked_against_the_jobs_ranks_fail_before_launch(tmp_path, overrides, message):
    """A value that depends on the job's ranks used to reach the workers (a traceback on every
    rank, exit 1 after ~11 s); it now stops in the launching process. The other two found with
    it (``fault.rank``, ``seed``) and the rest of the table: ``tests/unit/test_launch_checks.py``,
    in-process."""
    result = train(*overrides, f"hydra.run.dir={tmp_path}", timeout=180)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "logs").exists(), "no worker may start on a bad config"


def test_hydra_lists_the_allowed_strategies():
    result = train("strategy=nope", timeout=60)
    assert "Available options in 'strategy'" in result.stderr and "ddp" in result.stderr


def test_info_reports_extension_and_strategies():
    result = subprocess.run([sys.executable, "-m", "syncplane", "info", "--json"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["extension"]["built"] is True
    cuda = info["extension"]["cuda_kernels"]   # reported built only where nvcc could build them
    assert cuda is False or (cuda is True and info["extension"]["nvcc"] is True), info["extension"]
    assert "ddp" in info["strategies"]
    assert info["backends"]["gloo"] is True


@pytest.mark.slow
def test_torchs_own_hooks_train_from_train_py_and_count_what_they_send(tmp_path):
    """``strategy=torch_fp16`` / ``torch_powersgd`` through train.py, as a user compares them
    (they failed to start before: the run report registered a second comm hook on their DDP).
    Their bytes are what the hooks send: fp16 half of DDP's ring all-reduce of the model
    every step; PowerSGD the whole model for its ``start_powerSGD_iter`` = 2 steps, then the
    low-rank factors (matrices) and the vectors."""
    from syncplane.algorithms.torch_hooks import HookConfig
    from syncplane.comm import ring_allreduce_bytes
    from syncplane.recipes.digits import DigitsSettings, build

    result = train("-m", "strategy=torch_fp16,torch_powersgd", "trainer.max_epochs=1", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shapes = [tuple(p.shape) for p in build(DigitsSettings())[0].parameters()]
    numel = sum(torch.Size(s).numel() for s in shapes)
    fp16 = json.loads((tmp_path / "0-torch_fp16" / "summary.json").read_text())
    powersgd = json.loads((tmp_path / "1-torch_powersgd" / "summary.json").read_text())
    steps = fp16["steps"]
    assert steps == powersgd["steps"] == 22 and fp16["metrics"]["val_acc"] > 0.5
    assert fp16["comm"]["bytes_sent_per_rank"] == steps * ring_allreduce_bytes(numel * 2, 2)
    compressed = sum(HookConfig(name="torch_powersgd").compressed_elements(s) for s in shapes)
    assert powersgd["comm"]["bytes_sent_per_rank"] == (2 * ring_allreduce_bytes(numel * 4, 2)
                                                       + (steps - 2) * ring_allreduce_bytes(compressed * 4, 2))
