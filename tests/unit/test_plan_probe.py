"""``syncplane plan --probe``: the errors it gives before it measures anything."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.distributed import free_port


def plan_probe(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "syncplane", "plan", "--probe", "--mb", "10", "--compute-ms", "100",
                           *extra], env=env, capture_output=True, text=True, timeout=120)


def test_without_a_launcher_or_a_cluster_it_says_how_to_run_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "SLURM", "TORCHELASTIC"))}
    done = plan_probe(env)
    assert done.returncode == 2
    assert "under torchrun or srun" in done.stderr and "--cluster" in done.stderr


def test_a_rank_that_never_comes_is_named(tmp_path) -> None:
    """Rank 0 of 3 started by a torchrun-like environment, ranks 1 and 2 never start: the
    probe stops after its timeout and names them (instead of waiting for gloo's 30 minutes)."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TORCHELASTIC_RUN_ID="probe-test")
    done = plan_probe(env, "--probe-timeout-s", "2", "--probe-out", str(tmp_path / "p.yaml"))
    assert done.returncode == 1, done.stderr
    assert "rank(s) 1, 2" in done.stderr and "never joined" in done.stderr
