"""The launcher: identities per rank, logs, and fail-fast when one rank dies."""

from __future__ import annotations

import sys
import time

import pytest

from syncplane.launcher import LaunchError, launch, local_ranks

PRINT_ENV = "import os; print('rank', os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'])"


def test_every_rank_gets_its_identity_and_a_log(tmp_path):
    launch([sys.executable, "-c", PRINT_ENV], local_ranks(3), tmp_path, echo_rank0=False)
    for r in range(3):
        assert (tmp_path / f"rank{r}.log").read_text().strip() == f"rank {r} 3 {r}"


def test_one_rank_dying_ends_the_job_and_names_it(tmp_path):
    script = ("import os, sys, time\n"
              "if os.environ['RANK'] == '1':\n    print('boom', flush=True); sys.exit(3)\n"
              "time.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed \(exit code 3\)") as info:
        launch([sys.executable, "-c", script], local_ranks(3), tmp_path, echo_rank0=False, grace_s=1.0)
    assert time.monotonic() - start < 60
    assert "boom" in str(info.value)


def test_timeout_names_the_stuck_ranks(tmp_path):
    with pytest.raises(LaunchError, match=r"ranks still running: 0, 1"):
        launch([sys.executable, "-c", "import time; time.sleep(600)"], local_ranks(2), tmp_path,
               echo_rank0=False, timeout_s=1.0)
