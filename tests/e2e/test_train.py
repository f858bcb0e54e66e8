"""``train.py`` end to end, in a subprocess, exactly as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.listeners import listeners_until_exit

ROOT = Path(__file__).resolve().parents[2]


def train(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_default_job_trains_digits_to_95_percent_listening_on_loopback_only(tmp_path):
    """``python train.py`` as a newcomer runs it. Its ranks meet through a file store: ``ss``,
    polled while it runs, shows none of its processes listening beyond loopback."""
    run = tmp_path / "run"
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as out_file, err.open("w") as err_file:
        proc = subprocess.Popen([sys.executable, "train.py", f"hydra.run.dir={run}"], cwd=ROOT, stdout=out_file,
                                stderr=err_file, text=True)
        exposed, seen = listeners_until_exit(proc)
    stdout = out.read_text()
    assert proc.returncode == 0, stdout[-3000:] + err.read_text()[-3000:]
    assert seen > 0, "never saw the job's (loopback) gloo listeners: the check would prove nothing"
    assert not exposed, exposed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] >= 2
    assert summary["strategy"] == "atc" and summary["recipe"] == "digits"   # the default strategy
    assert summary["metrics"]["val_acc"] >= 0.95
    assert summary["steps"] > 0 and summary["throughput"]["samples_per_s"] > 0
    assert summary["comm"]["bytes_sent_per_rank"] > 0
    # atc's replicas differ, so validation shows their average: counted apart from the sync
    assert summary["comm"]["evaluation_bytes_per_rank"] > 0
    assert f"summary written to {run / 'summary.json'}" in stdout
    assert "val accuracy" in stdout               # the rich table
    assert (run / "csv" / "metrics.csv").exists()     # the CSV record
    assert len((run / "history.jsonl").read_text().splitlines()) == summary["steps"] // 22
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert {p.name for p in (run / "logs").iterdir()} == {"rank0.log", "rank1.log"}


@pytest.mark.parametrize("overrides,message,code", [
    (["strategy=nope"], "Could not find 'strategy/nope'", 1),
    (["recipe=nope"], "Could not find 'recipe/nope'", 1),
    # a value that depends on the job's ranks: it used to reach the workers (a traceback on
    # every rank, exit 1 after ~11 s)
    (["strategy=canary", "strategy.kwargs.exchange=nested"], "strategy.kwargs: exchange: nested needs the ranks grouped",
     2),
])
def test_bad_config_fails_before_any_worker_starts(tmp_path, overrides, message, code):
    """Hydra's own refusals, and one of ours end to end: exit 2, the key named in one line, no
    traceback (a launcher costs ~15 s of start-up here: an unknown key, and one bad value of
    every key of every strategy and of the job, are ``tests/unit/test_launch_checks.py``,
    through the same ``launch_job``, in-process)."""
    result = train(*overrides, f"hydra.run.dir={tmp_path}", timeout=180)
    assert result.returncode == code, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "logs").exists(), "no worker may start on a bad config"


def test_hydra_lists_the_allowed_strategies():
    result = train("strategy=nope", timeout=60)
    assert "Available options in 'strategy'" in result.stderr and "ddp" in result.stderr


def test_info_reports_extension_and_strategies(capsys):
    from syncplane.cli import main

    assert main(["info", "--json"]) == 0   # in-process: ``python -m syncplane`` is run by the bench and CLI tests
    info = json.loads(capsys.readouterr().out)
    assert info["extension"]["built"] is True
    cuda = info["extension"]["cuda_kernels"]   # reported built only where nvcc could build them
    assert cuda is False or (cuda is True and info["extension"]["nvcc"] is True), info["extension"]
    assert "ddp" in info["strategies"]
    assert info["backends"]["gloo"] is True


@pytest.mark.slow
def test_a_multirun_of_torchs_own_hooks_with_wandb_offline_counts_what_they_send(tmp_path):
    """``-m strategy=torch_fp16,torch_powersgd logger=wandb``, as a user compares them: one job
    per strategy, each with its offline W&B run, and the sweep's comparison report beside them
    (``scripts/compare.py`` rebuilds it from the run directories). The hooks failed to start
    before (the run report registered a second comm hook on their DDP). Their bytes are what
    the hooks send: fp16 half of DDP's ring all-reduce of the model every step; PowerSGD the
    whole model for its ``start_powerSGD_iter`` = 2 steps, then the low-rank factors
    (matrices) and the vectors."""
    from syncplane.algorithms.torch_hooks import HookConfig
    from syncplane.comm import ring_allreduce_bytes
    from syncplane.recipes.digits import DigitsSettings, build

    result = train("-m", "strategy=torch_fp16,torch_powersgd", "trainer.max_epochs=1", "logger=wandb",
                   f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and (p / "summary.json").exists())
    assert [p.name for p in jobs] == ["0-torch_fp16", "1-torch_powersgd"]
    for job in jobs:
        assert len(list((job / "wandb").glob("offline-run-*"))) == 1, "one offline W&B run per job"
    report = json.loads((tmp_path / "comparison.json").read_text())
    assert [Path(r["run_dir"]).name for r in report["runs"]] == ["0-torch_fp16", "1-torch_powersgd"]
    assert (tmp_path / "comparison.png").stat().st_size > 1000
    assert "| torch_powersgd |" in (tmp_path / "comparison.md").read_text()
    rebuilt = subprocess.run([sys.executable, "scripts/compare.py", str(jobs[0]), str(jobs[1]), "--out",
                              str(tmp_path / "rebuilt")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert json.loads((tmp_path / "rebuilt" / "comparison.json").read_text())["runs"] == report["runs"]

    shapes = [tuple(p.shape) for p in build(DigitsSettings())[0].parameters()]
    numel = sum(torch.Size(s).numel() for s in shapes)
    fp16, powersgd = (json.loads((job / "summary.json").read_text()) for job in jobs)
    steps = fp16["steps"]
    assert fp16["world_size"] == powersgd["world_size"] == 2
    assert steps == powersgd["steps"] == 22 and fp16["metrics"]["val_acc"] > 0.5
    assert fp16["comm"]["bytes_sent_per_rank"] == steps * ring_allreduce_bytes(numel * 2, 2)
    compressed = sum(HookConfig(name="torch_powersgd").compressed_elements(s) for s in shapes)
    assert powersgd["comm"]["bytes_sent_per_rank"] == (2 * ring_allreduce_bytes(numel * 4, 2)
                                                       + (steps - 2) * ring_allreduce_bytes(compressed * 4, 2))
