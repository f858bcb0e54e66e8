"""Comparison reports across training runs (one run per strategy, same recipe and seed).

Reads each run directory's ``summary.json`` and ``history.jsonl`` and writes, into the
output directory: ``comparison.json``, ``comparison.md`` (a table) and
``comparison.png`` (per strategy, over its seeds: time to the target accuracy,
throughput, communication time per step; and validation accuracy against the training
clock). ``train.py -m ...`` writes one beside its runs when the
sweep ends; ``scripts/compare.py`` rebuilds it from any set of run directories;
``syncplane compare`` writes one for the strategies and peers it ran.

With a target -- a validation accuracy to reach (``target_acc``, higher is better) or a
validation loss to get down to (``target_loss``, lower is better: a language model's) --
each run's *time to target* is the training wall-clock (the sum of its epochs'
``epoch_s``, validation included) at the first validation reaching it -- ``None`` ("not
reached") when none did, never the run's total time. Each run also
gets its measured ``compute_comm_ratio``: (epoch time - communication time) /
communication time, per rank, so a reader can place the result on their own cluster,
and ``outside_epochs_s``: training wall time outside the epochs, which time to target
leaves out and the reader should add for short runs. Runs that record ``timing``
(``RunReport``) also get ``checkpoint_s`` (the part of it spent saving checkpoints between
epochs: for strategies whose replicas differ, every rank's replica and optimizer state)
and ``setup_s`` (the strategy's setup before training: process groups, initial broadcast).
Runs that could not happen (a peer not installed, a failed run) are rows too, with
their reason in ``status``: never silently dropped.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from syncplane.bench.runner import save_figure


@dataclass(frozen=True)
class Target:
    """A validation metric and the value a run must reach: at least ``value`` for
    ``val_acc``, at most ``value`` for ``val_loss`` (lower is better)."""

    metric: Literal["val_acc", "val_loss"]
    value: float

    def reached(self, measured: float | None) -> bool:
        if measured is None:
            return False
        return measured >= self.value if self.metric == "val_acc" else measured <= self.value

    @property
    def label(self) -> str:
        return f"{self.metric.replace('_', ' ')} {self.value:g}"


def make_target(target_acc: float | None = None, target_loss: float | None = None) -> Target | None:
    """The comparison's target from its two spellings (at most one may be given)."""
    if target_acc is not None and target_loss is not None:
        raise ValueError(f"give a target accuracy or a target loss, not both (got {target_acc} and {target_loss})")
    if target_loss is not None:
        return Target("val_loss", target_loss)
    return None if target_acc is None else Target("val_acc", target_acc)


def load_run(run_dir: Path) -> dict[str, Any]:
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{run_dir} has no summary.json (did the run finish?)")
    summary = json.loads(summary_path.read_text())
    history_path = run_dir / "history.jsonl"
    history = [json.loads(line) for line in history_path.read_text().splitlines()] if history_path.exists() else []
    return {"run_dir": str(run_dir), "summary": summary, "history": history}


def run_label(summary: Mapping[str, Any]) -> str:
    """A run's name in the report: its ``label`` (a variant such as ``diloco[compression=int8]``),
    else its strategy's name (summaries written before labels existed)."""
    return str(summary.get("label") or summary["strategy"])


def time_to_target(history: Sequence[Mapping[str, Any]], target: float | Target) -> float | None:
    """Training seconds until the first validation reaching ``target`` (a number: a
    ``val_acc`` to reach); None if never."""
    if not isinstance(target, Target):
        target = Target("val_acc", target)
    clock = 0.0
    for record in history:
        clock += float(record.get("epoch_s", 0.0))
        if target.reached(record.get(target.metric)):
            return clock
    return None


def epochs_seconds(history: Sequence[Mapping[str, Any]]) -> float:
    """The epoch clock: the sum of the epochs' ``epoch_s`` (training and validation)."""
    return sum(float(record.get("epoch_s", 0.0)) for record in history)


def compute_comm_ratio(summary: Mapping[str, Any], history: Sequence[Mapping[str, Any]] = ()) -> float | None:
    """(time - communication time) / communication time, per rank; None without comm.

    The time is the epoch clock when there is a history (so a strategy's one-time setup
    outside the epochs does not count as compute), else the training wall time."""
    comm = float(summary["comm"]["seconds"])
    train = epochs_seconds(history) if history else float(summary.get("train_seconds") or 0.0)
    if comm <= 0 or train <= 0:
        return None
    return max(train - comm, 0.0) / comm


def build_comparison(run_dirs: Sequence[Path], out_dir: Path, *, target_acc: float | None = None,
                     target_loss: float | None = None, missing: Sequence[Mapping[str, Any]] = (),
                     meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``comparison.{json,md,png}`` for ``run_dirs`` into ``out_dir``.

    ``target_acc`` / ``target_loss``: at most one, the target of time to target;
    ``missing``: rows for runs that did not happen (``{"strategy", "status", ...}``);
    ``meta``: what was compared (recipe, cluster, command), copied into the JSON."""
    target = make_target(target_acc, target_loss)
    runs = [load_run(Path(d)) for d in run_dirs]
    if not runs and not missing:
        raise ValueError("no runs to compare")
    out_dir.mkdir(parents=True, exist_ok=True)
    ddp_runs = [r for r in runs if run_label(r["summary"]) == "ddp"]
    rows = []
    for run in runs:
        s = run["summary"]
        # the baseline of a run is DDP with the same seed when there is one
        baseline = next((r for r in ddp_runs if r["summary"].get("seed") == s.get("seed")),
                        ddp_runs[0] if ddp_runs else None)
        steps = max(s["steps"], 1)
        row = {
            "run_dir": run["run_dir"], "strategy": run_label(s), "recipe": s["recipe"], "world_size": s["world_size"],
            "val_acc": s["metrics"]["val_acc"], "val_loss": s["metrics"]["val_loss"],
            "samples_per_s": s["throughput"]["samples_per_s"], "step_s_median": s["throughput"]["step_s_median"],
            "comm_s_per_step": s["comm"]["seconds"] / steps, "bytes_sent_per_step": s["comm"]["bytes_sent_per_rank"] / steps,
            "consensus_distance": s["consensus_distance"], "status": "ok", "seed": s.get("seed"),
            "train_seconds": s.get("train_seconds"), "bytes_sent_per_rank": s["comm"]["bytes_sent_per_rank"],
            "comm_seconds": s["comm"]["seconds"], "compute_comm_ratio": compute_comm_ratio(s, run["history"]),
            # training wall time outside the epoch clock (mostly the checkpoints saved between
            # epochs), which time to target does not include
            "outside_epochs_s": (max(float(s["train_seconds"]) - epochs_seconds(run["history"]), 0.0)
                                 if s.get("train_seconds") and run["history"] else None),
            "checkpoint_s": (s.get("timing") or {}).get("checkpoint_s"),
            "setup_s": (s.get("timing") or {}).get("setup_s"),
        }
        if target is not None:
            row["time_to_target_s"] = time_to_target(run["history"], target)
        if baseline is not None:
            b = baseline["summary"]
            row["throughput_vs_ddp"] = s["throughput"]["samples_per_s"] / b["throughput"]["samples_per_s"]
            for metric in ("val_acc", "val_loss"):
                if s["metrics"][metric] is not None and b["metrics"][metric] is not None:
                    row[f"{metric}_minus_ddp"] = s["metrics"][metric] - b["metrics"][metric]
        rows.append(row)
    rows += [{"strategy": m["strategy"], "status": m["status"], **{k: v for k, v in m.items() if k != "status"}}
             for m in missing]
    report: dict[str, Any] = {**({"meta": dict(meta)} if meta else {}), "runs": rows}
    if target is not None:
        report["target"] = {"metric": target.metric, "value": target.value}
        report[target.metric.replace("val_", "target_")] = target.value   # target_acc | target_loss
        report["by_strategy"] = aggregate(rows)
    (out_dir / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "comparison.md").write_text(_markdown(rows, target, report.get("by_strategy")))
    if runs:
        save_figure(chart(runs, target), out_dir / "comparison.png")
    return report


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per strategy, over its seeds: how many runs reached the target, the mean and spread
    (population std, min, max) of time to target over those that did, and mean throughput."""
    out = []
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == name]
        done = [r for r in mine if r["status"] == "ok"]
        times = [r["time_to_target_s"] for r in done if r.get("time_to_target_s") is not None]
        out.append({
            "strategy": name, "runs": len(done), "reached": len(times),
            "status": "ok" if done else mine[0]["status"],
            "time_to_target_mean_s": statistics.fmean(times) if times else None,
            "time_to_target_std_s": statistics.pstdev(times) if len(times) > 1 else (0.0 if times else None),
            "time_to_target_min_s": min(times) if times else None,
            "time_to_target_max_s": max(times) if times else None,
            "samples_per_s_mean": statistics.fmean(r["samples_per_s"] for r in done) if done else None,
            **{f"{metric}_mean": statistics.fmean(r[metric] for r in done if r[metric] is not None)
               if any(r[metric] is not None for r in done) else None for metric in ("val_acc", "val_loss")},
            "compute_comm_ratio_mean": statistics.fmean(c for r in done if (c := r["compute_comm_ratio"]) is not None)
            if any(r["compute_comm_ratio"] is not None for r in done) else None,
        })
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _markdown(rows: list[dict[str, Any]], target: Target | None = None,
              by_strategy: list[dict[str, Any]] | None = None) -> str:
    header = ["strategy", "ranks", *(["seed"] if any(r.get("seed") is not None for r in rows) else []),
              *([f"time to {target.label} (s)"] if target is not None else []),
              "val acc", "Δ acc vs ddp", "val loss", "samples/s", "vs ddp", "step s", "comm s/step", "MB/step", "MB/rank",
              "compute/comm", "outside epochs s", "ckpt s", "setup s", "consensus"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['strategy']} | {r['status']} |" + " |" * (len(header) - 2))
            continue
        reached = [] if target is None else [
            "not reached" if r.get("time_to_target_s") is None else format(r["time_to_target_s"], ".1f")]
        cells = [r["strategy"], str(r["world_size"]), *([_fmt(r.get("seed"), "d")] if "seed" in header else []),
                 *reached, _fmt(r["val_acc"], ".4f"), _fmt(r.get("val_acc_minus_ddp"), "+.4f"),
                 _fmt(r.get("val_loss"), ".4f"),
                 _fmt(r["samples_per_s"], ",.0f"), _fmt(r.get("throughput_vs_ddp"), ".2f") + "x",
                 _fmt(r["step_s_median"], ".4f"), _fmt(r["comm_s_per_step"], ".4f"),
                 _fmt(r["bytes_sent_per_step"] / 2**20, ".2f"), _fmt(r["bytes_sent_per_rank"] / 2**20, ",.1f"),
                 _fmt(r["compute_comm_ratio"], ".2f"), _fmt(r.get("outside_epochs_s"), ".1f"),
                 _fmt(r.get("checkpoint_s"), ".1f"), _fmt(r.get("setup_s"), ".1f"),
                 _fmt(r["consensus_distance"], ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    if by_strategy and target is not None:
        final = target.metric
        lines += ["", f"Time to {target.label}, over seeds (mean ± std, [min, max]; runs that reached it):", "",
                  f"| strategy | reached | time to target (s) | samples/s | final {final.replace('_', ' ')} "
                  "| compute/comm |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for a in by_strategy:
            if a["status"] != "ok":
                lines.append(f"| {a['strategy']} | {a['status']} | | | | |")
                continue
            time = ("not reached" if a["time_to_target_mean_s"] is None else
                    f"{a['time_to_target_mean_s']:.1f} ± {a['time_to_target_std_s']:.1f} "
                    f"[{a['time_to_target_min_s']:.1f}, {a['time_to_target_max_s']:.1f}]")
            lines.append(f"| {a['strategy']} | {a['reached']}/{a['runs']} | {time} | "
                         f"{_fmt(a['samples_per_s_mean'], ',.0f')} | {_fmt(a[f'{final}_mean'], '.4f')} | "
                         f"{_fmt(a['compute_comm_ratio_mean'], '.2f')} |")
    return "\n".join(lines) + "\n"


def per_strategy(runs: Sequence[Mapping[str, Any]], value: Callable[[Mapping[str, Any]], float | None]
                 ) -> list[tuple[str, list[float | None]]]:
    """``value`` of each run, grouped by strategy in the order strategies first appear.

    The plot draws one bar per strategy (the mean over its seeds, whiskers at min and max,
    a dot per seed) rather than one bar per run: with three seeds of nine strategies, 27
    rotated labels are unreadable, and the spread is what a reader needs to see."""
    groups: dict[str, list[float | None]] = {}
    for run in runs:
        groups.setdefault(run_label(run["summary"]), []).append(value(run))
    return list(groups.items())


def _bars(ax: Any, groups: list[tuple[str, list[float | None]]], title: str, color: str,
          missing: str | None = None) -> None:
    """Horizontal bars, one per strategy: mean of the values that exist, min-max whiskers,
    one dot per run; ``missing`` is written where some (or all) of a strategy's runs have no
    value (a target not reached), with how many did."""
    names = [name for name, _ in groups]
    noted = False
    for y, (_, values) in enumerate(groups):
        have = [v for v in values if v is not None]
        if have:
            mean = statistics.fmean(have)
            ax.barh(y, mean, color=color, alpha=0.8,
                    xerr=[[mean - min(have)], [max(have) - mean]] if len(have) > 1 else None, capsize=3)
            ax.plot(have, [y] * len(have), "o", color="black", markersize=3)
        if missing is not None and len(have) < len(values):
            ax.text(max(have, default=0.0), y, f"  {len(have)}/{len(values)} {missing}", va="center", fontsize=8)
            noted = True
    if noted:   # room right of the longest bar for its note, inside the axes
        ax.set_xlim(0, 1.3 * max((v for _, vs in groups for v in vs if v is not None), default=1.0))
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_title(title)


def chart(runs: list[dict[str, Any]], target: Target | None = None) -> Any:
    """Four panels per strategy (time to target or the final metric, throughput, communication
    per step, the metric's curves); notes and the curves' legend sit where they cover nothing
    (checked by eye at 2, 5 and 11 strategies)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    seeds = len({r["summary"].get("seed") for r in runs})
    if seeds > 1:
        fig.suptitle(f"{seeds} seeds: bars are means, whiskers min-max, a dot per run")
    metric = target.metric if target is not None else "val_acc"   # the curves' and the final bars' metric
    if target is not None:
        _bars(axes[0, 0], per_strategy(runs, lambda r: time_to_target(r["history"], target)),
              f"time to {target.label} (s, lower is better)", "C2", missing="reached")
    else:
        _bars(axes[0, 0], per_strategy(runs, lambda r: r["summary"]["metrics"]["val_acc"]),
              "final validation accuracy", "C2")
    _bars(axes[0, 1], per_strategy(runs, lambda r: r["summary"]["throughput"]["samples_per_s"]),
          "throughput (samples/s, all ranks)", "C0")
    _bars(axes[1, 0], per_strategy(runs, lambda r: r["summary"]["comm"]["seconds"] / max(r["summary"]["steps"], 1)),
          "communication time per step (s)", "C1")
    # one colour per strategy; every seed is a line of that colour, named once in the legend
    curves = axes[1, 1]
    colours: dict[str, str] = {}
    for run in runs:
        name = run_label(run["summary"])
        clock, points = 0.0, []
        for record in run["history"]:
            clock += record.get("epoch_s", 0.0)
            if record.get(metric) is not None:
                points.append((clock, record[metric]))
        if not points:
            continue
        first = name not in colours
        colour = colours.setdefault(name, f"C{len(colours) % 10}")
        curves.plot(*zip(*points), marker="o", markersize=3, color=colour, linewidth=1,
                    linestyle="-" if len(colours) <= 10 else "--", label=name if first else None)
    if target is not None:
        curves.axhline(target.value, color="grey", linestyle="--", linewidth=1, label=f"target {target.value:g}")
    curves.set_title(f"validation {'accuracy' if metric == 'val_acc' else 'loss'} vs training clock"
                     + (" (a line per seed)" if seeds > 1 else ""))
    curves.set_xlabel("seconds")
    # beside the axes, not on the curves (with 11 strategies it covered a quarter of them)
    curves.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def runs_under(root: Path) -> list[Path]:
    """Run directories (those holding a summary.json) below ``root``, in name order."""
    return sorted(p.parent for p in root.glob("*/summary.json"))
