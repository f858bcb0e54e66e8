"""``python train.py`` under external launchers, as one rank each: torchrun (c10d
rendezvous) and srun (SLURM's variables, set here on local processes), plus the launch
errors every rank must report. That a local job opens no port beyond loopback is checked on
the default job (``tests/e2e/test_train.py``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from syncplane.runtime.launcher import free_port
from tests.helpers.launchers import slurm_rank

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["recipe=digits", "trainer.max_epochs=1", "trainer.devices=2", "logger.csv=false"]


def start(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(args, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen[str]], timeout: float = 400) -> list[tuple[int, str]]:
    return [(p.wait(timeout=timeout), p.stdout.read() if p.stdout else "") for p in procs]


def test_srun_variables_run_each_process_as_one_rank(tmp_path):
    port = free_port()
    procs = [start([sys.executable, str(ROOT / "train.py"), "strategy=atc", *QUICK], tmp_path, slurm_rank(r, 2, port))
             for r in range(2)]
    results = finish(procs)
    for code, out in results:
        assert code == 0, out[-3000:]
    run_dir = tmp_path / "outputs" / "slurm-4242-atc"           # one run dir, from the job id
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["metrics"]["val_acc"] > 0.6, summary
    assert not (tmp_path / "outputs" / "slurm-4242-atc" / "logs").exists()   # no processes of our own started


def test_torchrun_runs_train_py_once_per_rank(tmp_path):
    port = free_port()
    proc = start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job7",
                  str(ROOT / "train.py"), "strategy=ddp", *QUICK], tmp_path, {"GLOO_SOCKET_IFNAME": "lo"})
    (code, out), = finish([proc])
    assert code == 0, out[-3000:]
    summary = json.loads((tmp_path / "outputs" / "torchrun-job7-ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["metrics"]["val_acc"] > 0.6, summary


def test_devices_disagreeing_with_the_launcher_fail_on_every_rank(tmp_path):
    port = free_port()
    overrides = ["strategy=ddp", "recipe=digits", "trainer.devices=3"]
    results = finish([start([sys.executable, str(ROOT / "train.py"), *overrides], tmp_path, slurm_rank(r, 2, port))
                      for r in range(2)], timeout=120)
    for rank, (code, out) in enumerate(results):
        assert code == 2, out[-2000:]
        assert (f"trainer.devices: 3, but slurm started 2 processes on this node (world size 2); "
                f"set trainer.devices=2 or start 3 per node (rank {rank})") in out


def test_a_rank_that_never_comes_is_named(tmp_path):
    port = free_port()
    (code, out), = finish([start([sys.executable, str(ROOT / "train.py"), "strategy=ddp", *QUICK,
                                  "trainer.rendezvous_timeout_s=3"], tmp_path, slurm_rank(0, 2, port))], timeout=120)
    assert code == 1, out[-2000:]
    assert re.search(r"rank 0: after 3 s, 1 of 2 ranks never joined the rendezvous at 127\.0\.0\.1:\d+: rank\(s\) 1\.",
                     out), out[-2000:]


def test_an_unwritable_run_dir_is_named_on_the_rank(tmp_path):
    """The job-id run dir cannot be made (a file is in the way): that rank says so, by name,
    before any rendezvous (root ignores permission bits, so a path is blocked instead)."""
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "slurm-4242-ddp").write_text("in the way")
    (code, out), = finish([start([sys.executable, str(ROOT / "train.py"), "strategy=ddp", *QUICK], tmp_path,
                                 slurm_rank(1, 2, free_port()))], timeout=120)
    assert code == 2, out[-2000:]
    assert "hydra.run.dir: rank 1 cannot write the run directory outputs/slurm-4242-ddp" in out, out[-2000:]
