"""Comparison reports across training runs (one run per strategy, same recipe and seed).

Reads each run directory's ``summary.json`` and ``history.jsonl`` and writes, into the
output directory: ``comparison.json``, ``comparison.md`` (a table) and
``comparison.png`` (throughput, communication time per step, and validation accuracy
against wall-clock time). ``train.py -m ...`` writes one beside its runs when the
sweep ends; ``scripts/compare.py`` rebuilds it from any set of run directories.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_run(run_dir: Path) -> dict[str, Any]:
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{run_dir} has no summary.json (did the run finish?)")
    summary = json.loads(summary_path.read_text())
    history_path = run_dir / "history.jsonl"
    history = [json.loads(line) for line in history_path.read_text().splitlines()] if history_path.exists() else []
    return {"run_dir": str(run_dir), "summary": summary, "history": history}


def build_comparison(run_dirs: Sequence[Path], out_dir: Path) -> dict[str, Any]:
    runs = [load_run(Path(d)) for d in run_dirs]
    if not runs:
        raise ValueError("no runs to compare")
    out_dir.mkdir(parents=True, exist_ok=True)
    baseline = next((r for r in runs if r["summary"]["strategy"] == "ddp"), None)
    rows = []
    for run in runs:
        s = run["summary"]
        steps = max(s["steps"], 1)
        row = {
            "run_dir": run["run_dir"], "strategy": s["strategy"], "recipe": s["recipe"], "world_size": s["world_size"],
            "val_acc": s["metrics"]["val_acc"], "val_loss": s["metrics"]["val_loss"],
            "samples_per_s": s["throughput"]["samples_per_s"], "step_s_median": s["throughput"]["step_s_median"],
            "comm_s_per_step": s["comm"]["seconds"] / steps, "bytes_sent_per_step": s["comm"]["bytes_sent_per_rank"] / steps,
            "consensus_distance": s["consensus_distance"],
        }
        if baseline is not None:
            b = baseline["summary"]
            row["throughput_vs_ddp"] = s["throughput"]["samples_per_s"] / b["throughput"]["samples_per_s"]
            if s["metrics"]["val_acc"] is not None and b["metrics"]["val_acc"] is not None:
                row["val_acc_minus_ddp"] = s["metrics"]["val_acc"] - b["metrics"]["val_acc"]
        rows.append(row)
    report = {"runs": rows}
    (out_dir / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "comparison.md").write_text(_markdown(rows))
    _plot(runs, out_dir / "comparison.png")
    return report


def _markdown(rows: list[dict[str, Any]]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = ["| strategy | ranks | val acc | Δ acc vs ddp | samples/s | vs ddp | step s | comm s/step | MB/step | consensus |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(" | ".join([
            f"| {r['strategy']}", str(r["world_size"]), fmt(r["val_acc"], ".4f"), fmt(r.get("val_acc_minus_ddp"), "+.4f"),
            fmt(r["samples_per_s"], ",.0f"), fmt(r.get("throughput_vs_ddp"), ".2f") + "x",
            fmt(r["step_s_median"], ".4f"), fmt(r["comm_s_per_step"], ".4f"),
            fmt(r["bytes_sent_per_step"] / 2**20, ".2f"), fmt(r["consensus_distance"], ".1e") + " |"]))
    return "\n".join(lines) + "\n"


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['summary']['strategy']}\n{Path(r['run_dir']).name}" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].bar(labels, [r["summary"]["throughput"]["samples_per_s"] for r in runs], color="C0")
    axes[0].set_title("throughput (samples/s, all ranks)")
    axes[1].bar(labels, [r["summary"]["comm"]["seconds"] / max(r["summary"]["steps"], 1) for r in runs], color="C1")
    axes[1].set_title("communication time per step (s)")
    for run, label in zip(runs, labels):
        clock, points = 0.0, []
        for record in run["history"]:
            clock += record.get("epoch_s", 0.0)
            if record.get("val_acc") is not None:
                points.append((clock, record["val_acc"]))
        if points:
            axes[2].plot(*zip(*points), marker="o", label=label.replace("\n", " "))
    axes[2].set_title("validation accuracy vs wall-clock")
    axes[2].set_xlabel("seconds")
    axes[2].legend(fontsize=7)
    for ax in axes[:2]:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def runs_under(root: Path) -> list[Path]:
    """Run directories (those holding a summary.json) below ``root``, in name order."""
    return sorted(p.parent for p in root.glob("*/summary.json"))
