"""A plain Lightning script (``tests/helpers/plain_script.py``: Lightning's BoringModel with a
syncplane strategy by name) gets the heartbeat as ``train.py`` does: a rank that hangs (SIGSTOP)
or dies (SIGKILL) ends every process of the job within 45 s, each live rank naming it, under
``torchrun``, under Lightning's own launcher, and under SLURM (each rank a process started with
the variables ``srun`` sets, no launcher around to end the others: the heartbeat alone must).
Real processes, 3 CPU gloo ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from syncplane.runtime.launcher import free_port
from tests.helpers.launchers import slurm_rank

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "plain_script.py"
WORLD = 3
#: the issue's bound: a hung or killed rank ends every process within this long
BOUND_S = 45.0


def run_job(tmp_path: Path, launcher: str, strategy: str, fault: str, rank: int) -> tuple[float, str]:
    """Run the script with ``rank`` failing after step 10; (seconds from the fault to the
    end of the whole job, its output)."""
    mark = tmp_path / "fault_time"
    args = [str(SCRIPT), "--strategy", strategy, "--max-steps", "100000", "--fault", fault,
            "--fault-rank", str(rank), "--fault-step", "10", "--mark", str(mark), "--out", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        commands = [([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--standalone",
                      "--max-restarts", "0", *args], env)]
    elif launcher == "srun":   # srun starts every task itself; here, one process a rank with its variables
        port = free_port()
        commands = [([sys.executable, *args, "--devices", str(WORLD)], {**env, **slurm_rank(r, WORLD, port)})
                    for r in range(WORLD)]
    else:   # Lightning's own launcher: this process is rank 0 and starts the others
        commands = [([sys.executable, *args, "--devices", str(WORLD)], env)]
    logs = [tmp_path / f"job{i}.log" for i in range(len(commands))]
    jobs = [subprocess.Popen(command, cwd=tmp_path, env=job_env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                             start_new_session=True) for (command, job_env), log in zip(commands, logs)]
    deadline = time.time() + 240
    try:
        for job in jobs:
            job.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, 9)
        pytest.fail(f"the job did not end within 240 s:\n{logs[0].read_text()[-3000:]}")
    ended = time.time()
    output = "".join(log.read_text() for log in logs)
    assert all(job.returncode != 0 for job in jobs), output[-3000:]
    assert mark.exists(), f"rank {rank} never reached its fault:\n{output[-3000:]}"
    return ended - float(mark.read_text()), output


def leftover_ranks(tmp_path: Path) -> list[str]:
    """Processes of this test's job still running (none may be left, the hung one included)."""
    found = subprocess.run(["pgrep", "-f", f"--out {tmp_path / 'run'}"], capture_output=True, text=True).stdout
    return found.split()


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "strategy", "fault", "rank"), [
    ("torchrun", "atc", "stop", 1),
    ("torchrun", "diloco", "kill", 2),
    ("lightning", "ds_sync", "stop", 1),
    ("srun", "diloco", "stop", 2),
    ("srun", "atc", "kill", 1),
])
def test_a_lost_rank_ends_every_process_naming_it(tmp_path, launcher, strategy, fault, rank):
    seconds, output = run_job(tmp_path, launcher, strategy, fault, rank)
    print(f"{launcher} {strategy} {fault} rank {rank}: the job ended {seconds:.1f} s after the fault")
    verdicts = [line for line in output.splitlines() if line.startswith("syncplane: ")]
    if launcher == "torchrun" and fault == "kill":
        # torchrun sees a dead rank itself and names it in its summary; it SIGTERMs the others
        # at once, which wait until they have said whom the job lost (``sigterm_waits``)
        assert re.search(rf"exitcode: -9\) local_rank: {rank}\b", output), output[-4000:]
    # every live rank says why it stops, and names the lost rank, and only it
    assert len(verdicts) >= WORLD - 1, output[-4000:]
    others = [r for r in range(WORLD) if r != rank]
    assert all(re.search(rf"\brank {rank} stopped sending heartbeats", v) for v in verdicts), "\n".join(verdicts)
    assert not any(re.search(rf"\brank {r} (and rank \d+ )?stopped", v) for v in verdicts for r in others), \
        "\n".join(verdicts)
    assert seconds < BOUND_S, f"{seconds:.1f} s:\n{output[-3000:]}"
    assert not leftover_ranks(tmp_path)
