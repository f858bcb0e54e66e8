"""Elastic DiLoCo's goodput under failures: fixed membership against a quorum with a grace window.

Trains ``digits`` with 4 elastic replicas on the emulated ``wan_two_sites`` (one replica per
host) with an emulated accelerator step (``trainer.emulated_step_s``, so the machine's load does
not move the step time), and kills one replica (SIGKILL) every ``--every`` rounds, each a
different one, each restarted by the launcher. From the job's ``history.jsonl`` (one ``round``
event per replica per round, with the rounds of local work it put into θ_g):

- ``useful``: replica-steps that count toward the final model (H × the committed weights);
- ``goodput``: useful / (replicas × the training wall time / the step time), the fraction of the
  replicas' step capacity that ended in θ_g (waiting, restarting and lost work all count against);
- ``kept``: useful / the replica-steps computed (lost: a killed process's steps since its last
  commit).

Writes ``docs/results/diloco_goodput.json`` (rendered on the results page). Needs root (network
namespaces); about 15 minutes on 2 cores with the defaults.

    python scripts/diloco_goodput.py [--repeats 2] [--rounds 24] [--every 6] [--step-s 1.0]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("diloco_goodput")
REPLICAS = 4


def kills(rounds: int, every: int, sync_every: int) -> list[dict[str, int]]:
    """One kill every ``every`` rounds, mid-round, replicas 1, 2, 3, 0 in turn (a restarted
    process is not killed again: ``fault`` happens once per job and replica)."""
    out, k = [], 1
    while k * every < rounds - 2 and k <= REPLICAS:
        out.append({"kind": "kill", "rank": k % REPLICAS, "step": k * every * sync_every + sync_every // 2})
        k += 1
    return out


def command(membership: str, faults: list[dict[str, int]], args: argparse.Namespace) -> list[str]:
    """The ``train.py`` command of one run."""
    fault = "[" + ",".join("{kind:%s,rank:%d,step:%d}" % (f["kind"], f["rank"], f["step"]) for f in faults) + "]"
    argv = ["python", "train.py", "recipe=digits", "strategy=diloco", "cluster=wan_two_sites",
            f"trainer.devices={REPLICAS}", "strategy.kwargs.elastic=true", f"strategy.kwargs.membership={membership}",
            f"strategy.kwargs.sync_every={args.sync_every}", f"strategy.kwargs.grace_s={args.grace_s}",
            "strategy.kwargs.min_replicas=2", f"trainer.emulated_step_s={args.step_s}",
            f"trainer.max_steps={args.rounds * args.sync_every}", "trainer.max_epochs=100000",
            "trainer.check_val_every_n_epoch=100000", "trainer.max_restarts=1", "trainer.restart_delay_s=1",
            "seed=5"]
    return argv + ([f"+fault={fault}"] if faults else [])


def goodput(events: list[dict[str, Any]], faults: list[dict[str, int]], sync_every: int,
            step_s: float) -> dict[str, float]:
    """The run's numbers from its history (see the module's docstring)."""
    starts = [e["time"] for e in events if e.get("event") == "start" and e.get("restart") == 0]
    done = [e["time"] for e in events if e.get("event") == "done"]
    wall = max(done) - max(starts)
    useful = sum(e["weight"] for e in events if e.get("event") == "round") * sync_every
    # a killed process's steps: its fault step; those of them that counted are its rounds' weights
    lost = 0.0
    for fault in faults:
        mine = [e for e in events if e.get("replica") == fault["rank"]]
        restart = next((e["time"] for e in mine if e.get("event") == "start" and e.get("restart") == 1), float("inf"))
        counted = sum(e["weight"] for e in mine if e.get("event") == "round" and e["time"] < restart) * sync_every
        lost += max(fault["step"] - counted, 0.0)
    capacity = REPLICAS * wall / step_s
    return {"wall_s": round(wall, 1), "useful": useful, "lost": lost, "goodput": round(useful / capacity, 4),
            "kept": round(useful / (useful + lost), 4),
            "carried": sum(1 for e in events if e.get("event") == "carried"),
            "discarded": sum(1 for e in events if e.get("event") == "round" and not e["committed"]),
            "heals": sum(1 for e in events if e.get("event") == "heal")}


def run(membership: str, faults: list[dict[str, int]], args: argparse.Namespace, out: Path) -> dict[str, float]:
    argv = [sys.executable, *command(membership, faults, args)[1:], f"hydra.run.dir={out}"]
    log.info("%s: %s", membership, " ".join(argv[1:]))
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout_s)
    events = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    numbers = goodput(events, faults, args.sync_every, args.step_s)
    log.info("%s: %s", membership, numbers)
    return numbers


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--every", type=int, default=6, help="rounds between kills")
    parser.add_argument("--sync-every", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--grace-s", type=float, default=3.0)
    parser.add_argument("--run-timeout-s", type=float, default=600)
    parser.add_argument("--modes", default="fixed,quorum")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="also one quorum run without a fault (the same machine's ceiling)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "diloco_goodput.json")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' folders here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("SYNCPLANE_EMULATOR_PREFIX", "gdp-")
    faults = kills(args.rounds, args.every, args.sync_every)
    if not faults:
        parser.error(f"--rounds {args.rounds} --every {args.every}: no kill fits")
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = args.keep or scratch
        if args.reference:
            results["no fault (quorum)"] = [run("quorum", [], args, Path(work) / "nofault")]
        for repeat in range(args.repeats):
            for membership in args.modes.split(","):
                numbers = run(membership, faults, args, Path(work) / f"{membership}{repeat}")
                results.setdefault(membership, []).append(numbers)
    rows = []
    for membership, runs in results.items():   # the reference first
        rows.append([membership, str(len(runs)), f"{statistics.median(r['goodput'] for r in runs):.3f}",
                     spread([r["goodput"] for r in runs]), f"{statistics.median(r['kept'] for r in runs):.3f}",
                     f"{statistics.median(r['wall_s'] for r in runs):.1f}",
                     str(sum(r["carried"] for r in runs)), str(sum(r["discarded"] for r in runs))])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    doc = {"title": "Elastic DiLoCo goodput under failures: fixed membership vs a quorum with a grace window",
           "created": datetime.date.today().isoformat(), "commit": commit,
           "command": " ".join(["python scripts/diloco_goodput.py", *sys.argv[1:]]),
           "about": (f"digits, {REPLICAS} elastic replicas on the emulated wan_two_sites, H={args.sync_every}, emulated step "
                     f"{args.step_s} s, {args.rounds} rounds; a replica killed mid-round every {args.every} rounds "
                     f"({len(faults)} kills, each restarted after 1 s); quorum: grace {args.grace_s} s, min_replicas 2. "
                     "goodput = replica-steps that count toward the final model / (replicas x training wall / step "
                     "time); kept = those steps / the steps computed. Spread: min-max over the repeats on a shared "
                     "2-core machine (timings move 5-40 % between runs). The no-fault row is the same job without "
                     "kills: this machine's ceiling."),
           "columns": ["membership", "runs", "goodput", "goodput spread", "kept", "train wall s", "carried",
                       "discarded replica-rounds"],
           "rows": rows, "runs": results}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
