"""Horovod's gloo all-reduce on an emulated cluster, next to syncplane's numbers.

    scripts/setup_horovod.sh                       # once: Horovod 0.28.1 + torch 2.0.1 in its own venv
    python scripts/bench_horovod.py --cluster two_racks --payload-mb resnet50 [--steps 4] [--json out.json]

Every rank runs in its emulated host (same namespaces and shaping as ``syncplane
bench``) with Horovod's own gloo rendezvous (its HTTP rendezvous server runs inside
rank 0's host; ``syncplane.experiments.peers.horovod_job``). Needs root. The result is Horovod itself, measured -- not an imitation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from syncplane.bench.runner import parse_payload
from syncplane.cluster import load_profile
from syncplane.algorithms import strategy_time
from syncplane.cluster.cost import CostModel
from syncplane.runtime.launcher import launch
from syncplane.experiments.peers import HOROVOD_VENV, horovod_job

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--payload-mb", default="resnet50")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--venv", type=Path, default=HOROVOD_VENV)
    parser.add_argument("--json")
    args = parser.parse_args()
    python = args.venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no Horovod venv at {args.venv}: run scripts/setup_horovod.sh first")
    profile = load_profile(args.cluster)
    payload = parse_payload(args.payload_mb)
    out_dir = Path("outputs") / "horovod" / time.strftime("%Y%m%d-%H%M%S")
    with horovod_job(python, profile, profile.world_size, out_dir) as ranks:
        launch([str(python), str(HERE / "horovod_worker.py"), str(payload), str(args.steps), str(args.warmup)],
               ranks, out_dir / "logs", env=dict(os.environ), echo_rank0=False)
    line = next(l for l in (out_dir / "logs" / "rank0.log").read_text().splitlines() if l.startswith("HOROVOD_RESULT"))
    result = json.loads(line.split(" ", 1)[1])
    median = statistics.median(result["step_s"])
    _, bound = strategy_time(CostModel(profile), "ddp", payload)   # Horovod's gloo all-reduce is a ring too
    report = {"cluster": profile.name, "world_size": profile.world_size, "payload_bytes": payload,
              "results": [{"strategy": "horovod_allreduce", "sync_s_median": median, "step_s": result["step_s"],
                           "bound_s": bound, "bound_ratio": bound / median}]}
    print(json.dumps(report["results"][0], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
