"""The launcher: identities per rank, logs, and fail-fast when one rank dies."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from syncplane.runtime.heartbeat import LOST_PEER_EXIT
from syncplane.runtime.launcher import LaunchError, launch, local_ranks
from syncplane.runtime.lifetime import PARENT_ENV

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


def test_a_rank_whose_launcher_is_already_gone_exits_at_once():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    script = "from syncplane.runtime.lifetime import die_with_parent; die_with_parent(); print('still here')"
    orphan = subprocess.run([sys.executable, "-c", script], env={**os.environ, PARENT_ENV: str(gone.pid)},
                            capture_output=True, text=True, timeout=60)
    assert orphan.returncode == 1 and "still here" not in orphan.stdout
    alive = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0 and "still here" in alive.stdout


def test_a_stopped_rank_gets_its_sigterm(tmp_path):
    """A SIGSTOPped rank (hung) acts on SIGTERM only once resumed: without the SIGCONT it
    would sit out the grace period and die by SIGKILL, with no chance to clean up."""
    script = ("import os, signal, sys, time\n"
              f"signal.signal(signal.SIGTERM, lambda *_: (open({str(tmp_path / 'ended')!r} + os.environ['RANK'], 'w'),"
              " os._exit(0)))\n"
              "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
              "if os.environ['RANK'] == '0':\n    time.sleep(1); sys.exit(3)\n"
              "time.sleep(600)\n")
    with pytest.raises(LaunchError, match=r"rank 0 failed \(exit code 3\)"):
        launch([sys.executable, "-c", script], local_ranks(3), tmp_path, echo_rank0=False, grace_s=0.5)
    assert (tmp_path / "ended1").exists() and (tmp_path / "ended2").exists()


def test_after_a_lost_peer_verdict_the_rank_left_running_is_killed_without_the_sigterm_wait(tmp_path):
    """Rank 0 leaves because it lost a peer; rank 1 (the lost one: cut off, or deaf to SIGTERM)
    is still running. The polite stop (SIGTERM, 5 s, SIGKILL) would only add its 5 s to the
    job's end, which the 30 s promise of a lost host cannot afford on a loaded machine."""
    script = ("import os, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"if os.environ['RANK'] == '0':\n    time.sleep(0.5); sys.exit({LOST_PEER_EXIT})\n"
              "time.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(LaunchError, match=rf"rank 0 failed \(exit code {LOST_PEER_EXIT}\)"):
        launch([sys.executable, "-c", script], local_ranks(2), tmp_path, echo_rank0=False)
    # 0.5 s + the lost-peer grace (1 s); with the SIGTERM wait it was 6.5 s or more
    assert time.monotonic() - start < 7.0
