"""DiLoCo's compression frontier from one ``syncplane compare`` report: per row (a strategy
or a variant such as ``diloco[compression=sparse,density=0.01]``), over its seeds, the final
validation loss, the sync's bytes per rank over the run, and how both compare with DDP and
with fp32 DiLoCo (the plain ``diloco`` row).

    syncplane compare --recipe tiny_lm --devices 4 --seeds 1,2,3 --target-loss 4.85 \\
        --strategies 'ddp,diloco,diloco[compression=int8],diloco[compression=sparse,density=0.01]' \\
        --out comparisons/frontier
    python scripts/frontier_table.py comparisons/frontier [--wan-bench wan.json ...]

``--wan-bench``: ``syncplane bench --json`` reports (one per codec, ``ddp,diloco``) whose
measured sync seconds per step, added to each row's measured compute seconds per step, give
the time the run would take on that bench's emulated network (``wan s``). Bytes are
``summary.json``'s ``comm.bytes_sent_per_rank``: the sync only (validation's consensus
average is counted apart). The table is markdown; published as ``docs/results/tiny_lm_frontier.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from syncplane.config import parse_variant


def rows_by_label(report: Mapping[str, Any]) -> dict[str, list[Mapping[str, Any]]]:
    """The report's finished runs, grouped by row label in order of appearance."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for run in report["runs"]:
        if run.get("status") == "ok":
            groups.setdefault(run["strategy"], []).append(run)
    return groups


def bench_sync_per_step(paths: Sequence[Path]) -> dict[str, float]:
    """Measured sync seconds per step, keyed by the codec the bench ran DiLoCo with
    (``none``, ``int8``, ``sparse@DENSITY``), plus ``ddp``."""
    out: dict[str, float] = {}
    for path in paths:
        bench = json.loads(path.read_text())
        codec = bench.get("compression", "none")
        key = f"sparse@{bench['density']:g}" if codec == "sparse" else codec
        for row in bench["results"]:
            if row.get("status") == "ok":
                out["ddp" if row["strategy"] == "ddp" else key] = row["sync_s_median"]
    return out


def codec_key(label: str) -> str:
    """``diloco[compression=sparse,density=0.01]`` -> ``sparse@0.01``; ``ddp`` -> ``ddp``."""
    name, pairs = parse_variant(label)
    if name != "diloco":
        return label
    options = dict(pairs)
    codec = options.get("compression", "none")
    return f"sparse@{float(options.get('density', 0.02)):g}" if codec == "sparse" else codec


def mean_sd(values: Sequence[float]) -> str:
    return f"{statistics.fmean(values):.4f} ± {statistics.pstdev(values):.4f}" if len(values) > 1 \
        else f"{values[0]:.4f}"


def frontier(report: Mapping[str, Any], wan: Mapping[str, float] | None = None) -> str:
    groups = rows_by_label(report)
    mean = {label: {key: statistics.fmean(float(r[key]) for r in runs)
                    for key in ("val_loss", "bytes_sent_per_rank", "step_s_median", "comm_s_per_step")}
            for label, runs in groups.items()}
    ddp, dense = mean.get("ddp"), mean.get("diloco")
    header = ["row", "seeds", "final val loss (mean ± sd)", "sync MB per rank", "× fewer than DDP",
              "loss vs DDP", "× fewer than fp32 DiLoCo", "loss vs fp32 DiLoCo"]
    if wan:
        header.append("wan s per step")
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for label, runs in groups.items():
        m = mean[label]
        cells = [f"`{label}`", str(len(runs)), mean_sd([float(r["val_loss"]) for r in runs]),
                 f"{m['bytes_sent_per_rank'] / 1e6:,.2f}"]
        for base in (ddp, dense):
            if base is None:
                cells += ["-", "-"]
                continue
            cells.append(f"{base['bytes_sent_per_rank'] / m['bytes_sent_per_rank']:,.0f}×")
            cells.append(f"{100 * (m['val_loss'] / base['val_loss'] - 1):+.2f} %")
        if wan:
            sync = wan.get(codec_key(label))
            compute = m["step_s_median"] - m["comm_s_per_step"]
            cells.append("-" if sync is None else f"{compute + sync:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a syncplane compare --out folder (its comparison.json)")
    parser.add_argument("--wan-bench", type=Path, nargs="*", default=[],
                        help="syncplane bench --json reports of ddp,diloco per codec")
    args = parser.parse_args()
    report = json.loads((args.report / "comparison.json").read_text())
    print(frontier(report, bench_sync_per_step(args.wan_bench) if args.wan_bench else None), end="")


if __name__ == "__main__":
    main()
