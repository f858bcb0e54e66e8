"""Rebuild a comparison report from run directories.

    python scripts/compare.py multirun/2026-11-22/10-00-00            # every run below it
    python scripts/compare.py outputs/a outputs/b --out reports/ab     # chosen runs
    python scripts/compare.py comparisons/x --target-acc 0.85          # time to another target
    python scripts/compare.py comparisons/lm --target-loss 3.0         # time to a validation loss

Writes comparison.json / .md / .png (see syncplane.bench.compare) into --out
(default: the single directory given, or ./comparison).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

from syncplane.bench.compare import build_comparison, runs_under
from syncplane.bench.matrix import git_commit


def kept_meta(out: Path) -> dict[str, Any] | None:
    """The ``meta`` of the comparison already in ``out`` (its title and notes for the results page,
    ``scripts/results.py``), dated and stamped with this checkout's commit again; None if none."""
    old = out / "comparison.json"
    meta = json.loads(old.read_text()).get("meta") if old.exists() else None
    if not meta:
        return None
    return {**meta, "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": git_commit(Path(__file__).resolve().parent)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="run directories, or a sweep directory holding them")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--target-acc", type=float, help="report each run's time to this validation accuracy")
    parser.add_argument("--target-loss", type=float, help="... or to this validation loss (lower is better)")
    args = parser.parse_args()
    run_dirs: list[Path] = []
    for path in args.paths:
        run_dirs += [path] if (path / "summary.json").exists() else runs_under(path)
    if not run_dirs:
        raise SystemExit(f"no run directories (with summary.json) in {', '.join(map(str, args.paths))}")
    out = args.out or (args.paths[0] if len(args.paths) == 1 else Path("comparison"))
    if args.target_acc is not None and args.target_loss is not None:
        parser.error("give --target-acc or --target-loss, not both")
    build_comparison(run_dirs, out, target_acc=args.target_acc, target_loss=args.target_loss, meta=kept_meta(out))
    print((out / "comparison.md").read_text())
    print(f"comparison written to {out}/comparison.{{json,md,png}}")


if __name__ == "__main__":
    main()
