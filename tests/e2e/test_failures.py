"""A lost rank ends the job quickly and cleanly, and the launcher never leaves a rank behind.

ddp trains digits on 4 local ranks; rank 2 hangs (SIGSTOP) after step 15 (``fault.*``) --
the case that hung for good before the heartbeat: every survivor must be gone within 30 s
of the fault with default settings, the launcher must exit non-zero naming rank 2, no
process of the job may be left, and the checkpoint written before the fault must resume.
SIGTERM and SIGKILL to the launcher must end every rank. Every strategy under every fault
kind: ``test_failure_matrix.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from syncplane.experiments.chaos import job_processes
from tests.e2e.test_train import ROOT, train

#: the issue's target, with default settings
DEADLINE_S = 30.0


def _job_processes(run_dir: Path) -> list[int]:
    """Pids of processes whose command line names this run's job file (its ranks)."""
    return sorted(job_processes(run_dir / "job.yaml"))


@pytest.fixture
def run_dir(tmp_path):
    """The run's directory; whatever the test's outcome, no rank of it outlives the test."""
    path = tmp_path / "run"
    yield path
    for pid in _job_processes(path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(path: Path, text: str, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path} within {timeout_s:.0f} s")


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "train.py", "trainer.devices=4", "trainer.max_epochs=3", "seed=3",
                             f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _fail_and_end(run_dir: Path, *overrides: str) -> str:
    """Run a job whose rank 2 fails (``overrides`` say how); check that it ended non-zero
    within the deadline of the fault, leaving no process; return its output."""
    job = _start(run_dir, *overrides)
    try:
        faulted = _wait_for(run_dir / "logs" / "rank2.log", "fault: rank 2 fails", timeout_s=400)
        out, _ = job.communicate(timeout=120)
        ended = time.monotonic() - faulted
        print(f"job ended {ended:.1f} s after the fault")
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0, out[-3000:]
    assert ended < DEADLINE_S, f"the job ended {ended:.1f} s after the fault\n{out[-3000:]}"
    assert _job_processes(run_dir) == []
    return out


@pytest.mark.slow
def test_ddp_with_a_hung_rank_ends_in_30_s_and_its_checkpoint_resumes(run_dir, tmp_path):
    """ddp is the case that hung for good before: gloo's all-reduce waits for the stopped rank."""
    out = _fail_and_end(run_dir, "strategy=ddp", "fault={kind:stop,rank:2,step:15}")
    assert "rank 2 stopped sending heartbeats" in out, out[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_file(), "the checkpoint of epoch 1 (step 11) was not kept"
    resumed = train("strategy=ddp", "trainer.devices=4", "trainer.max_epochs=2", "seed=3", f"resume={last}",
                    f"hydra.run.dir={tmp_path / 'resumed'}", timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "epoch 2/2" in resumed.stdout and "epoch 1/2" not in resumed.stdout


@pytest.mark.slow
def test_sigterm_to_the_launcher_ends_every_rank(run_dir):
    job = _start(run_dir, "strategy=atc", "trainer.max_epochs=50")
    try:
        _wait_for(run_dir / "logs" / "rank0.log", "epoch 1/50", timeout_s=400)
        assert len(_job_processes(run_dir)) == 4
        job.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "stopped by SIGTERM" in out, out[-3000:]
    assert _job_processes(run_dir) == []


@pytest.mark.slow
def test_sigkill_to_the_launcher_ends_every_rank(run_dir):
    """Nothing can run in a launcher killed outright: the ranks' parent-death signal must."""
    job = _start(run_dir, "strategy=ddp", "trainer.max_epochs=50")
    try:
        _wait_for(run_dir / "logs" / "rank0.log", "epoch 1/50", timeout_s=400)
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _job_processes(run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if job.poll() is None:
            job.kill()
    assert _job_processes(run_dir) == []
