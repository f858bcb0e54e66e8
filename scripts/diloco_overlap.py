"""How much of DiLoCo's outer exchange the training loop still waits for, on node replicas.

Trains ``tiny_lm`` on the emulated ``multi_nic`` (2 hosts of 2 ranks, one node replica each,
DDP inside) with a fixed emulated accelerator step, once with blocking rounds (``overlap_steps:
0``) and once with the exchange overlapping the next inner step (``overlap_steps: 1``), and
reads ``sync_exposed_s`` (rank 0's seconds spent in the outer rounds' launch and merge) from
each run's ``summary.json``. Writes ``docs/results/diloco_overlap.json`` (rendered on the
results page). Needs root (network namespaces); about 4 minutes on 2 cores.

    python scripts/diloco_overlap.py [--steps 60] [--step-s 0.5] [--out docs/results/diloco_overlap.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("diloco_overlap")


def command(tau: int, steps: int, step_s: float, sync_every: int) -> list[str]:
    """The ``train.py`` command of one row."""
    return ["python", "train.py", "recipe=tiny_lm", "strategy=diloco", "cluster=multi_nic", "trainer.devices=4",
            "strategy.kwargs.replica=node", f"strategy.kwargs.overlap_steps={tau}",
            f"strategy.kwargs.sync_every={sync_every}", f"trainer.emulated_step_s={step_s}",
            f"trainer.max_steps={steps}"]


def run(tau: int, steps: int, step_s: float, sync_every: int, work: Path) -> dict:
    """One run; its summary."""
    out = work / f"tau{tau}"
    argv = [sys.executable, *command(tau, steps, step_s, sync_every)[1:], f"hydra.run.dir={out}"]
    log.info("overlap_steps=%d: %s", tau, " ".join(argv[1:]))
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "diloco_overlap.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("SYNCPLANE_EMULATOR_PREFIX", "ovl-")
    rows, exposed = [], {}
    with tempfile.TemporaryDirectory() as work:
        for tau in (0, 1):
            summary = run(tau, args.steps, args.step_s, args.sync_every, Path(work))
            rounds = args.steps // args.sync_every
            exposed[tau] = summary["strategy_details"]["sync_exposed_s"]
            rows.append([str(tau), str(rounds), f"{exposed[tau]:.3f}", f"{exposed[tau] / rounds:.3f}",
                         f"{summary['train_seconds']:.1f}", f"{exposed[tau] / exposed[0]:.3f}"])
            log.info("overlap_steps=%d: %.3f s exposed in %d rounds", tau, exposed[tau], rounds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unrecorded"
    data = {"title": "DiLoCo on node replicas: the outer exchange's exposed time, blocking vs overlapped",
            "created": datetime.date.today().isoformat(), "commit": commit,
            "command": "python scripts/diloco_overlap.py",
            "about": (f"tiny_lm on the emulated multi_nic (2 nodes of 2 ranks, replica=node, DDP inside), "
                      f"H={args.sync_every}, emulated step {args.step_s} s, {args.steps} steps, one run each; "
                      "exposed = rank 0's seconds in the outer rounds' launch and merge. Timings here move "
                      "5-40 % between runs."),
            "columns": ["overlap_steps", "rounds", "exposed s", "exposed s / round", "train s", "vs blocking"],
            "rows": rows}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
