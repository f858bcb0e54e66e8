"""Canary's convergence check (issue 14): ``ddp`` and ``canary`` with staleness 0 and 2 on
the same recipe, seed and world size; prints each run's final validation accuracy and its
gap to ddp in points (the acceptance: within 1).

    python scripts/canary_convergence.py --recipe digits --devices 4
    python scripts/canary_convergence.py --recipe fashion_mnist --devices 4 --epochs 1

Runs ``train.py`` (Hydra) once per setting into ``--out``/<name>, reads ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "ddp": ["strategy=ddp"],
    "canary_s0": ["strategy=canary"],
    "canary_s2": ["strategy=canary", "+strategy.kwargs.staleness=2"],   # the defaults: warm-up 100, compensation
    # staleness as before issue 14's remedy (stale from step 0, the recipe's momentum)
    "canary_s2_plain": ["strategy=canary", "+strategy.kwargs.staleness=2", "+strategy.kwargs.warmup_steps=0",
                        "+strategy.kwargs.momentum_compensation=false"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="digits")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=None, help="trainer.max_epochs (default: the trainer's)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default="outputs/canary_convergence")
    parser.add_argument("--only", default="ddp,canary_s0,canary_s2",
                        help=f"comma-separated settings to run, of: {', '.join(SETTINGS)}")
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for every run")
    args = parser.parse_args()
    root = Path(args.out) / args.recipe
    results = {}
    for name in args.only.split(","):
        run_dir = root / name
        overrides = [*SETTINGS[name], f"recipe={args.recipe}", f"trainer.devices={args.devices}", f"seed={args.seed}",
                     f"hydra.run.dir={run_dir}", *args.extra]
        if args.epochs is not None:
            overrides.append(f"trainer.max_epochs={args.epochs}")
        start = time.time()
        subprocess.run([sys.executable, "train.py", *overrides], check=True)
        summary = json.loads((run_dir / "summary.json").read_text())
        results[name] = {"val_acc": summary["metrics"]["val_acc"],
                         "wall_s": round(time.time() - start, 1)}
        print(name, results[name], flush=True)
    base = results.get("ddp", {}).get("val_acc")
    for name, row in results.items():
        gap = None if base is None or row["val_acc"] is None else round(100 * (row["val_acc"] - base), 2)
        print(f"{args.recipe:>14} {name:>10}  val_acc {row['val_acc']}  gap vs ddp {gap} points  ({row['wall_s']} s)")
    (root / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
