"""``syncplane bench --matrix``: every strategy on every profile, one scoreboard.

Each profile is one ``run_bench`` (the same launch, worker and report rows as ``syncplane
bench``) with ``ddp`` beside, so a row's *vs DDP* compares two syncs of one run. Per profile
it writes ``OUT/<profile>.json`` (the bench report, plus ``meta``: date, commit, command),
``OUT/<profile>.md`` (the table) and ``OUT/<profile>.png`` (``scoreboard_chart``: vs DDP,
bound ratio, model error).

``repeat`` runs a profile's cells that many times, one run after another: each row is then the
run whose sync time is the median of its runs' (its other fields -- *vs DDP*, model error, CPU
busy -- that run's own), with every run's time beside it (``repeats``; the table shows their
range): on a shared machine one run is one draw (``docs/design-notes.md``).

Resumable: a cell (profile × strategy) whose row is already in ``OUT/<profile>.json`` with
status ``ok`` is skipped; the rest of that profile runs again, with ``ddp`` beside. The
worker writes its results after each strategy, so an interrupted or failed run keeps the
strategies it finished; a strategy whose run fails gets a ``failed: ...`` row (retried on
the next invocation) and the profile goes on with the strategies after it. Ctrl-C, SIGTERM
or SIGHUP stop the matrix after writing what finished.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncplane.bench.runner import emulator_cpu_rates, report_rows, run_bench, save_figure
from syncplane.cluster import ClusterProfile
from syncplane.cluster.emulator import EmulationError
from syncplane.config import ConfigError
from syncplane.runtime.launcher import JobStopped

log = logging.getLogger(__name__)

#: The issue-34 targets a row is held against (its *misses* column names the ones it misses).
BOUND_TARGET, MODEL_ERROR_TARGET = 0.8, 0.10
#: a share of the machine's cores this busy over a row's timed steps names the CPU as a cause
CPU_SATURATED = 0.9
#: a share of a host's bytes this large on its busiest NIC (hosts with several) names one NIC as a cause
ONE_NIC = 0.9

#: The report fields that must match for a new run's rows to join an existing profile JSON.
SETTINGS_KEYS = ("payload_bytes", "compute_ms", "world_size")


@dataclass(frozen=True)
class MatrixSettings:
    """What one ``bench --matrix`` runs: every (profile, strategy) cell, one payload."""

    profiles: list[ClusterProfile]
    strategies: list[str]
    payload_bytes: int
    out_dir: Path
    steps: int = 5
    warmup: int = 1
    compute_ms: float = 0.0
    repeat: int = 1
    command: str = field(default_factory=lambda: shlex.join(["syncplane", *sys.argv[1:]]))


def profile_report_path(out_dir: Path, profile: ClusterProfile) -> Path:
    return out_dir / f"{profile.name}.json"


def load_existing(path: Path, profile: ClusterProfile, payload_bytes: int, compute_ms: float) -> dict[str, Any] | None:
    """The profile's report from an earlier (interrupted) matrix, or None; refuse to mix
    runs of another payload, compute or cluster size into it (the error names the file)."""
    if not path.exists():
        return None
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--out: {path} is not a bench report ({exc}); move it away to start afresh") from None
    wanted = {"payload_bytes": payload_bytes, "compute_ms": compute_ms, "world_size": profile.world_size}
    differs = [f"{key} {report.get(key)!r} (now {value!r})" for key, value in wanted.items() if report.get(key) != value]
    if differs:
        raise ConfigError(f"--out: {path} holds another matrix: {', '.join(differs)}; "
                          "give another --out, or remove the file to start afresh")
    return report


def pending_cells(existing: dict[str, Any] | None, strategies: list[str]) -> list[str]:
    """The strategies of ``strategies`` without an ``ok`` row in ``existing``, in order."""
    done = {r["strategy"] for r in (existing or {}).get("results", []) if r.get("status") == "ok"}
    return [s for s in strategies if s not in done]


def merge_rows(existing: dict[str, Any] | None, new_rows: list[dict[str, Any]],
               strategies: list[str]) -> list[dict[str, Any]]:
    """The profile's rows after a run: each new row replaces the old one of its strategy;
    ordered as ``strategies``, then any other strategy the file already held."""
    by_name = {r["strategy"]: r for r in (existing or {}).get("results", [])}
    by_name.update({r["strategy"]: r for r in new_rows})
    order = [s for s in dict.fromkeys(strategies) if s in by_name] + [s for s in by_name if s not in strategies]
    return [by_name[s] for s in order]


def git_commit(where: Path) -> str | None:
    """The checkout's commit (short id, ``+dirty`` when it has changes), or None outside git."""
    def git(*args: str) -> str | None:
        result = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return commit


class CellProgress(io.TextIOBase):
    """Rank 0's output during a profile's run: each ``bench: NAME median ...`` line a
    strategy's worker prints when it finishes advances the bar by one cell (the first time
    that cell finishes) and is shown above it; the rest stays in the run's rank logs."""

    FINISHED = re.compile(r"^bench: (\S+) median (\S+)")

    def __init__(self, progress: Any, task: Any, profile: str, cells: set[str]) -> None:
        self.progress, self.task, self.profile, self.cells, self._pending = progress, task, profile, cells, ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            found = self.FINISHED.match(line.strip())
            if not found:
                continue
            self.progress.console.print(f"{self.profile}: {found.group(1)} {found.group(2)} s/step")
            if found.group(1) in self.cells:
                self.cells.discard(found.group(1))
                self.progress.advance(self.task)
        return len(text)


def _partial_rows(profile: ClusterProfile, order: list[str], settings: MatrixSettings,
                  run_dir: Path) -> list[dict[str, Any]]:
    """Rows for the strategies a failed or interrupted run finished (its worker's last
    ``results.json``), ``ddp`` beside them when it finished too."""
    results = run_dir / "results.json"
    measured = json.loads(results.read_text())["results"] if results.exists() else {}
    finished = [s for s in order if s in measured]
    cpu = emulator_cpu_rates(profile, finished, settings.payload_bytes, None, {})
    return stamp_run(report_rows(profile, finished, settings.payload_bytes, measured, compute_ms=settings.compute_ms,
                                 cpu=cpu), dataclasses.asdict(cpu))


def stamp_run(rows: list[dict[str, Any]], cpu_rates: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Mark the rows of one run with its time, its ``ddp`` sync (what their *vs DDP* is
    against) and the CPU rates they were priced at (measured on the machine that ran them):
    a resumed profile's file holds rows of several runs, perhaps of several machines."""
    ddp = next((r.get("sync_s_median") for r in rows if r["strategy"] == "ddp"), None)
    measured = time.strftime("%Y-%m-%dT%H:%M:%S")
    return [{**r, "measured": measured, "ddp_sync_s": ddp, **({"cpu_rates": cpu_rates} if cpu_rates else {})}
            for r in rows]


def machine() -> str:
    """This machine in a few words (CPU model, cores, torch's CPU instruction set): rows of
    CPU-bound strategies measured on two machines differ by more than their runs' spread."""
    import torch

    from syncplane.exchanges.cpu import cpu_model

    return f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores, torch CPU {torch.backends.cpu.get_cpu_capability()}"


def reprice(report: dict[str, Any], profile: ClusterProfile) -> dict[str, Any]:
    """``report`` with every measured row priced again by the cost model as it is now, at the
    CPU rates of the machine that measured it (the row's ``cpu_rates``; a row from before they
    were kept: the report's, its last run's or last reprice's; this machine's, measured, for
    any op they lack, then kept in the row's and the report's ``cpu_rates``) and with the TCP
    measured under the congestion control its hosts ran (``ran_under``): the measurements are kept,
    the model's fields replaced, and ``meta.repriced`` says when and at which commit (a model
    fixed after a matrix ran is checked against its measurements without running it again)."""
    from syncplane import algorithms
    from syncplane.bench.runner import price_row
    from syncplane.cluster.cost import CostModel, emulated_tcp
    from syncplane.exchanges.cpu import CpuRates

    if profile.world_size != report["world_size"]:
        raise ConfigError(f"reprice: profile {profile.name!r} has {profile.world_size} ranks, its report "
                          f"{report['world_size']}")
    rows = [dict(r) for r in report["results"]]
    measured = [r["strategy"] for r in rows if r.get("status") == "ok"]
    options = {"shards": report.get("shards", 1), "pair_streams": report.get("pair_streams", "auto"),
               "compression": report.get("compression", "none"), "exchange": report.get("exchange", "auto"),
               "density": report.get("density", 0.02), "bits": report.get("bits", 2)}
    here = emulator_cpu_rates(profile, measured, report["payload_bytes"], report.get("period"), options)

    def rates(stored: dict[str, Any] | None) -> CpuRates:
        """The stored rates (a run's, or an earlier reprice's); this machine's for what they lack."""
        return CpuRates({**here.per_element, **stored["per_element"]}, stored["sharing"]) if stored else here

    cpu = rates(report.get("cpu_rates"))
    models: dict[str, CostModel] = {}       # by the congestion control each row ran under
    periods = algorithms.periods(measured, report.get("period"))
    for row in rows:
        if row.get("status") == "ok":
            used = rates(row["cpu_rates"]) if row.get("cpu_rates") else cpu
            tcp = ran_under(report, row)
            model = models.setdefault(tcp, CostModel(profile, tcp=emulated_tcp(tcp)))
            price_row(row, model, row["strategy"], report["payload_bytes"], report.get("compute_ms", 0.0),
                      periods.get(row["strategy"], report.get("period")), options, used)
            # every rate it was priced at, kept: a later reprice elsewhere fills in no op of another machine
            row["cpu_rates"] = dataclasses.asdict(used)
    meta = {**report.get("meta", {}), "repriced": {"at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                   "commit": git_commit(Path(__file__).parent)}}
    return {**report, "results": rows, "meta": meta, "cpu_rates": dataclasses.asdict(cpu)}


def failed_row(strategy: str, reason: str) -> dict[str, Any]:
    """The row of a strategy whose run failed: the report's keys, no numbers."""
    return {"strategy": strategy, "status": f"failed: {reason}",
            **dict.fromkeys(("sync_s_median", "sync_s_p90", "bytes_sent_per_rank", "bound_s", "bound_ratio",
                             "network_bound_s", "network_bound_ratio", "speedup_vs_ddp"))}


def run_profile(profile: ClusterProfile, settings: MatrixSettings, progress: Any, task: Any) -> dict[str, Any]:
    """Run the profile's pending cells ``settings.repeat`` times (``ddp`` first, beside them),
    keep each cell's median run (``median_rows``) and write its files; a failing strategy gets
    a ``failed`` row and the run goes on with the ones after it. Stopped (Ctrl-C, SIGTERM): the
    runs so far are kept, then the stop goes on."""
    path = profile_report_path(settings.out_dir, profile)
    existing = load_existing(path, profile, settings.payload_bytes, settings.compute_ms)
    pending = pending_cells(existing, settings.strategies)
    report: dict[str, Any] = dict(existing or {})
    runs: list[list[dict[str, Any]]] = []
    for _ in range(settings.repeat):
        try:
            report, rows = _run_once(profile, settings, pending, report, progress, task)
        except _Stopped as stopped:
            runs.append(stopped.rows)
            _write_profile(path, profile, settings, existing, report, median_rows(runs),
                           stopped=f"stopped in run {len(runs)} of {settings.repeat}")
            raise stopped.cause from None
        runs.append(rows)
    return _write_profile(path, profile, settings, existing, report, median_rows(runs))


class _Stopped(Exception):
    """A run told to stop, with the rows it finished."""

    def __init__(self, cause: BaseException, rows: list[dict[str, Any]]) -> None:
        super().__init__(str(cause))
        self.cause, self.rows = cause, rows


def median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per strategy from the rows of several runs of a profile: of its ``ok`` rows, the
    one whose sync time is their median (the lower of the two middle ones for an even count),
    with every run's time in ``repeats``, in run order, where there were several; a strategy
    with none ``ok``: its last row (the failure). All rows say one time (``measured``): the
    runs were one matrix invocation."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            by_name.setdefault(row["strategy"], []).append(row)
    out = []
    for rows in by_name.values():
        ok = [r for r in rows if r.get("status") == "ok"]
        if not ok:
            out.append(rows[-1])
            continue
        middle = sorted(ok, key=lambda r: r["sync_s_median"])[(len(ok) - 1) // 2]
        out.append({**middle, **({"repeats": [r["sync_s_median"] for r in ok]} if len(runs) > 1 else {})})
    last = next((r["measured"] for rows in reversed(runs) for r in rows if r.get("measured")), None)
    return [{**r, "measured": last} if last and r.get("measured") else r for r in out]


def _run_once(profile: ClusterProfile, settings: MatrixSettings, pending: list[str], report: dict[str, Any],
              progress: Any, task: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One run of ``pending`` (the bench report and its rows); a strategy that fails is run no
    more in it, and is a ``failed`` row (``ddp`` failing fails them all)."""
    run_dir = settings.out_dir / ".runs" / profile.name
    rows: list[dict[str, Any]] = []
    echo = CellProgress(progress, task, profile.name, set(pending))
    while pending:
        order = ["ddp", *[s for s in pending if s != "ddp"]]
        try:
            report = run_bench(profile, order, settings.payload_bytes, steps=settings.steps, warmup=settings.warmup,
                               compute_ms=settings.compute_ms, out_dir=run_dir, echo_to=echo)
            rows, pending = merge_rows({"results": rows}, stamp_run(report["results"], report.get("cpu_rates")),
                                       order), []
        except (RuntimeError, EmulationError, KeyboardInterrupt) as exc:    # LaunchError is a RuntimeError
            finished = _partial_rows(profile, order, settings, run_dir)
            rows = merge_rows({"results": rows}, finished, order)
            done = {r["strategy"] for r in finished}
            if isinstance(exc, (KeyboardInterrupt, JobStopped)):     # told to stop: keep what finished, stop
                raise _Stopped(exc, rows) from None
            failed = next((s for s in order if s not in done), None)
            if failed is None:           # every strategy finished; what failed came after them
                rows, pending = merge_rows({"results": rows}, finished, order), []
                continue
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            log.error("%s: %s failed: %s (rank logs in %s)", profile.name, failed, reason, run_dir / "logs")
            rows = merge_rows({"results": rows}, [failed_row(failed, reason)], order)
            echo.cells.discard(failed)
            progress.advance(task)
            pending = [s for s in pending if s not in done and s != failed]
            if failed == "ddp":          # nothing runs beside a failed baseline: the rest fails alike
                rows = merge_rows({"results": rows}, [failed_row(s, f"ddp failed first: {reason}") for s in pending],
                                  order)
                progress.advance(task, len(echo.cells))
                echo.cells.clear()
                pending = []
    return report, rows


def _write_profile(path: Path, profile: ClusterProfile, settings: MatrixSettings, existing: dict[str, Any] | None,
                   report: dict[str, Any], rows: list[dict[str, Any]], stopped: str = "") -> dict[str, Any]:
    """Merge ``rows`` into the profile's report and write its JSON, table and chart; ``stopped``:
    how far a stopped run got (kept in its ``meta``, said in the table's heading)."""
    created = time.strftime("%Y-%m-%dT%H:%M:%S")
    merged = {**(existing or {}), **{k: v for k, v in report.items() if k != "results"},
              "cluster": profile.name, "world_size": profile.world_size, "payload_bytes": settings.payload_bytes,
              "compute_ms": settings.compute_ms, "steps": report.get("steps", settings.steps),
              "results": merge_rows(existing, rows, ["ddp", *settings.strategies])}
    run = {"created": created, "commit": git_commit(Path(__file__).parent), "machine": machine(),
           "tcp": profile.tcp_congestion, "command": settings.command, **({"stopped": stopped} if stopped else {})}
    merged["meta"] = {**run, "runs": [*run_history((existing or {}).get("meta", {})), run]}
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown_table(merged))
    if any(r.get("status") == "ok" for r in merged["results"]):
        save_figure(scoreboard_chart(merged), path.with_suffix(".png"))
    return merged


def scoreboard_chart(report: dict[str, Any]) -> Any:
    """One profile's scoreboard as three panels of a bar per strategy: *vs DDP*, *bound ratio*
    and *model error*, the same numbers as its table (so the figure can be redrawn from the
    JSON alone and never disagrees with the text); a failed cell reads 'n/a', the targets are
    drawn as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = [r["strategy"] for r in rows]
    panels = [("vs DDP (×, higher is faster)", "speedup_vs_ddp", 1.0, "{:.2f}×", [1.0]),
              ("bound ratio", "bound_ratio", 1.0, "{:.2f}", [BOUND_TARGET, 1.0]),
              ("model error (%)", "model_error", 100.0, "{:+.0f}", [-MODEL_ERROR_TARGET * 100, MODEL_ERROR_TARGET * 100])]
    fig, axes = plt.subplots(1, 3, figsize=(max(9.0, 3.0 + 1.2 * len(names)), 4.2))
    for ax, (title, key, scale, label, lines) in zip(axes, panels):
        values = [r[key] * scale if r.get("status") == "ok" and r.get(key) is not None else None for r in rows]
        bars = ax.bar(names, [v or 0.0 for v in values],
                      color=["C0" if v is not None else "lightgrey" for v in values])
        for bar, value in zip(bars, values):
            ax.annotate("n/a" if value is None else label.format(value),
                        (bar.get_x() + bar.get_width() / 2, value or 0.0), xytext=(0, 3 if (value or 0) >= 0 else -10),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7)
        for y in lines:
            ax.axhline(y, color="C3", linestyle="--", linewidth=0.8)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", rotation_mode="anchor", fontsize=8)
        ax.set_title(title, fontsize=10)
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + 0.1 * (high - low))      # room for the value above the tallest
    fig.suptitle(f"{report['cluster']}: {report['payload_bytes'] / 2**20:.1f} MB, {report['world_size']} ranks "
                 f"(dashed: the targets)", fontsize=11)
    fig.tight_layout()
    return fig


def measured_cause(row: dict[str, Any]) -> str:
    """What was measured beside a row that misses a target ('' when nothing): the machine's
    cores saturated, or the ranks' own CPU work long enough to fill the gap between the
    measurement and the bound (the bound prices the wire with free CPU; the model prices the
    CPU work at rates measured alone, shared by rank count); packets dropped at the rack
    uplinks (TCP backs off and resends, which neither prices); where every host has several
    NICs (else gloo lists one), the bytes left by one of them (the bound spreads them over all);
    below the bound's target, what the model prices above the bound (``runner.above_bound``:
    TCP's sharing of the links, the latency, the CPU work), each term of at least 1 % of the
    measurement."""
    causes = []
    cpu, ranks_s = row.get("machine_cpu"), row.get("rank_cpu_s")
    if cpu and cpu["busy"] >= CPU_SATURATED:
        causes.append(f"CPU {cpu['busy'] * 100:.0f} % busy: ranks {ranks_s:.1f} core-s/step, "
                      f"kernel {cpu['kernel'] * 100:.0f} %")
    elif cpu and row.get("bound_s") is not None and row.get("sync_s_median") is not None:
        floor, gap = ranks_s / cpu["cores"], row["sync_s_median"] - row["bound_s"]
        if 0 < gap <= floor and row["bound_ratio"] < BOUND_TARGET:
            causes.append(f"ranks' CPU {ranks_s:.1f} core-s/step, {floor:.2f} s on {cpu['cores']} cores: "
                          f"more than the {gap:.2f} s above the bound")
    if row.get("uplink_drops"):
        causes.append(f"{row['uplink_drops']:.0f} uplink drops/step")
    terms = _above_bound_terms(row)
    if terms and row.get("bound_ratio") is not None and row["bound_ratio"] < BOUND_TARGET:
        causes.append("priced above the bound: " + terms)
    by_host = (row.get("nic_bytes_by_host") or {}).values()
    several = [nics for nics in by_host if len(nics) > 1 and sum(nics.values())]
    if several and all(len(nics) > 1 for nics in by_host):
        busiest = sum(max(nics.values()) / sum(nics.values()) for nics in several) / len(several)
        if busiest >= ONE_NIC:
            causes.append(f"one NIC of {max(len(n) for n in several)} sent {busiest * 100:.0f} % of a host's bytes")
    return "; ".join(causes)


def _above_bound_terms(row: dict[str, Any]) -> str:
    """The terms of ``runner.above_bound`` kept in the row, largest first, each of at least 1 %
    of the measurement ('' when none)."""
    above = row.get("priced_above_bound")
    if not above or not row.get("sync_s_median"):
        return ""
    terms = sorted(((above[key], label) for key, label in (("tcp_s", "TCP sharing"), ("latency_s", "latency"),
                                                           ("cpu_s", "CPU"))
                    if above[key] >= 0.01 * row["sync_s_median"]), reverse=True)
    return ", ".join(f"{label} {s:.3g} s" for s, label in terms)


def overpriced(row: dict[str, Any]) -> str:
    """Where the model is pessimistic beyond its target on a row that meets the bound's: how much
    it prices above the bound against what was measured above it, and in which terms -- where
    its excess sits, not a measured cause ('' otherwise)."""
    if ((row.get("model_error") or 0.0) <= MODEL_ERROR_TARGET or row.get("bound_s") is None
            or (row.get("bound_ratio") or 0.0) < BOUND_TARGET):      # a bound miss names its terms already
        return ""
    terms = _above_bound_terms(row)
    return (f"priced {row['predicted_s'] - row['bound_s']:.3g} s above the bound where "
            f"{row['sync_s_median'] - row['bound_s']:.3g} s was measured: {terms}") if terms else ""


def run_spread(row: dict[str, Any]) -> str:
    """Where the row is the median of several runs: how far they spread, and whether the
    prediction lies inside them (``within_runs``: then the spread is the miss's cause; a narrow
    spread says the miss is no run's accident). '' for a row of one run."""
    repeats = row.get("repeats") or ()
    if len(repeats) < 2 or not row.get("sync_s_median"):
        return ""
    return (f"{len(repeats)} runs spread {(max(repeats) - min(repeats)) / row['sync_s_median'] * 100:.0f} %"
            + (", the prediction inside them" if within_runs(row) else ""))


def within_runs(row: dict[str, Any]) -> bool:
    """Whether the row's prediction lies between the fastest and the slowest of its runs (a row
    of several, ``repeats``): a miss the machine's own spread covers."""
    repeats, predicted = row.get("repeats") or (), row.get("predicted_s")
    return len(repeats) > 1 and predicted is not None and min(repeats) <= predicted <= max(repeats)


def explained(row: dict[str, Any]) -> bool:
    """Whether a measured row's miss has a cause in its *misses* text: something measured beside
    it (``measured_cause``), or its runs' range holding the prediction (``within_runs``)."""
    return bool(measured_cause(row)) or within_runs(row)


def misses(row: dict[str, Any]) -> str:
    """Which of the scoreboard's targets ``row`` misses, in words ('' when none)."""
    if row.get("status") != "ok":
        return row.get("status", "")
    missed = []
    if row.get("bound_ratio") is not None and row["bound_ratio"] < BOUND_TARGET:
        missed.append(f"bound ratio < {BOUND_TARGET:g}")
    if row.get("model_error") is not None and abs(row["model_error"]) > MODEL_ERROR_TARGET:
        missed.append(f"model error beyond ±{MODEL_ERROR_TARGET * 100:.0f} %")
    cause = "; ".join(c for c in (run_spread(row), measured_cause(row), overpriced(row)) if c) if missed else ""
    return "; ".join(missed) + (f" ({cause})" if cause else "")


#: ``syncplane plan``'s targets against the bench: its pick within this of the best measured of
#: its class, and its predictions within ``PREDICTION_TARGET``.
PICK_TARGET, PREDICTION_TARGET = 0.10, 0.15


def planner_check(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The planner against one profile's measurements, per class (``exact``: DDP's result;
    ``approximate``: any): the plan's pick among the measured rows (``plan.choose_candidate``: the
    fastest *predicted*, or DDP within its margin; the rows' ``predicted_s`` is
    ``plan.price``'s), the fastest *measured*, how much slower the
    pick measured than that, which rows' predictions miss by more than ``PREDICTION_TARGET``, and
    which lie inside their runs' range (``within_runs``)."""
    from syncplane.algorithms import is_exact
    from syncplane.algorithms.plan import accepts, choose_candidate

    rows = [r for r in report["results"] if r.get("status") == "ok" and r.get("predicted_s") is not None
            and r.get("sync_s_median")]
    out = []
    for accept in ("exact", "approximate"):
        allowed = [r for r in rows if accepts(accept, is_exact(r["strategy"]))]
        if not allowed:
            continue
        ranked = sorted(allowed, key=lambda r: r["predicted_s"])
        pick = choose_candidate(ranked, lambda r: r["predicted_s"], lambda r: r["strategy"])
        best = min(allowed, key=lambda r: r["sync_s_median"])
        slower = pick["sync_s_median"] / best["sync_s_median"] - 1
        out.append({"accept": accept, "pick": pick["strategy"], "predicted_s": pick["predicted_s"],
                    "pick_measured_s": pick["sync_s_median"], "best": best["strategy"],
                    "best_measured_s": best["sync_s_median"], "pick_slower": slower,
                    "pick_ok": slower <= PICK_TARGET,
                    "prediction_misses": {r["strategy"]: r["model_error"] for r in allowed
                                          if abs(r["model_error"]) > PREDICTION_TARGET},
                    "inside_runs": {r["strategy"] for r in allowed if within_runs(r)}})
    return out


def _misses_text(check: dict[str, Any]) -> str:
    """A ``planner_check`` class's predictions beyond the target, as "`name` +NN %" items (and
    "(inside its runs)" where its runs' range holds the prediction)."""
    return ", ".join(f"`{name}` {err * 100:+.0f} %" + (" (inside its runs)" if name in check["inside_runs"] else "")
                     for name, err in check["prediction_misses"].items())


def planner_lines(report: dict[str, Any]) -> list[str]:
    """``planner_check`` in words, one line per class (for the profile's table)."""
    lines = []
    for c in planner_check(report):
        verdict = "the best" if c["pick"] == c["best"] else \
            f"{c['pick_slower'] * 100:+.0f} % against `{c['best']}` ({c['best_measured_s']:.3f} s)"
        missed = _misses_text(c)
        lines.append(f"- plan, {c['accept']}: `{c['pick']}` (predicted {c['predicted_s']:.3f} s, measured "
                     f"{c['pick_measured_s']:.3f} s): {verdict}" + ("" if c["pick_ok"] else
                                                                   f" (beyond {PICK_TARGET * 100:.0f} %)")
                     + f"; predictions beyond ±{PREDICTION_TARGET * 100:.0f} %: {missed or 'none'}")
    return lines


def planner_table(reports: list[dict[str, Any]]) -> str:
    """``planner_check`` of every profile as one table: per profile and class the plan's pick,
    the best measured, how much slower the pick measured, and the predictions beyond
    ``PREDICTION_TARGET``; then how many cells meet each target."""
    lines = ["| profile | class | plan's pick (predicted s) | measured best (s) | pick measured (s) | pick within "
             f"{PICK_TARGET * 100:.0f} % | predictions beyond ±{PREDICTION_TARGET * 100:.0f} % |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    checks = [(report["cluster"], c) for report in reports for c in planner_check(report)]
    rows = sum(len([r for r in report["results"] if r.get("status") == "ok" and r.get("model_error") is not None])
               for report in reports)
    missed = {(name, strategy) for name, c in checks for strategy in c["prediction_misses"]}
    for name, c in checks:
        ok = "yes" if c["pick"] == c["best"] else f"{'yes' if c['pick_ok'] else '**no**'} ({c['pick_slower'] * 100:+.0f} %)"
        misses_ = _misses_text(c) or "none"
        lines.append(f"| {name} | {c['accept']} | `{c['pick']}` ({c['predicted_s']:.3f}) | `{c['best']}` "
                     f"({c['best_measured_s']:.3f}) | {c['pick_measured_s']:.3f} | {ok} | {misses_} |")
    good = sum(c["pick_ok"] for _, c in checks)
    inside = {(name, strategy) for name, c in checks for strategy in c["inside_runs"]} & missed
    lines += ["", f"The pick is within {PICK_TARGET * 100:.0f} % of the best measured of its class in {good} of "
                  f"{len(checks)} cells; {rows - len(missed)} of {rows} measured rows are predicted within "
                  f"±{PREDICTION_TARGET * 100:.0f} %"
                  + (f", and {len(inside)} more inside the range of their runs." if inside else ".")]
    return "\n".join(lines) + "\n"


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _sync_cell(row: dict[str, Any]) -> str:
    """A row's sync time, with the range of its runs where it is the median of several."""
    repeats = row.get("repeats") or ()
    cell = _fmt(row.get("sync_s_median"), ".3f")
    return cell + (f" ({min(repeats):.3f}–{max(repeats):.3f})" if len(repeats) > 1 else "")


def run_history(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs that wrote a profile's file, oldest first (``meta.runs``; a file from before
    it was kept: its one run, from ``meta`` itself)."""
    if "runs" in meta:
        return list(meta["runs"])
    return [{k: meta.get(k) for k in ("created", "commit", "command")}] if meta.get("command") else []


#: The congestion control of a report from before the emulator recorded it: its hosts ran the
#: machine's own default, which on the VM image every committed report ran on is bbr.
UNRECORDED_TCP = "bbr"


def ran_under(report: dict[str, Any], row: dict[str, Any] | None = None) -> str:
    """The congestion control the emulated hosts ran when ``row`` was measured (its run's, in
    ``meta.runs``; no row: the report's latest run's), ``UNRECORDED_TCP`` where the run does
    not say: what a reprice prices the row with, whatever the profile's YAML says now."""
    runs = {run.get("created"): run for run in run_history(report.get("meta", {}))}
    if row is not None and row.get("measured") in runs:
        return runs[row["measured"]].get("tcp") or UNRECORDED_TCP
    return report.get("tcp_congestion") or report.get("meta", {}).get("tcp") or UNRECORDED_TCP


def tcp_words(run: dict[str, Any]) -> str:
    """The emulated hosts' TCP congestion control in a run's heading; a run from before the
    emulator set it ran under the machine's own default, unrecorded (this VM image's: bbr)."""
    return f"TCP {run['tcp']}" if run.get("tcp") else "TCP: the machine's default (not recorded)"


def markdown_table(report: dict[str, Any]) -> str:
    """One profile's scoreboard: a heading with how it was made (every run that still holds a
    row, where a resumed or partly re-run matrix wrote it; the JSON's ``meta.runs`` keeps them
    all), then a row per strategy."""
    meta = report.get("meta", {})
    history = run_history(meta) or [meta]
    measured = {r["measured"] for r in report["results"] if r.get("measured")}
    shown = [run for run in history if run.get("created") in measured] or history
    made = [f"{run.get('created', '?')}, commit `{run.get('commit') or '?'}`"
            + (f", {run['machine']}" if run.get("machine") else "") + f", {tcp_words(run)}"
            + f": `{run.get('command', '?')}`"
            + (f" ({run['stopped']})" if run.get("stopped") else "") for run in shown]
    if len(shown) < len(history):
        made[-1] += (f" ({len(history) - len(shown)} earlier run(s) hold no row now: every row of theirs was "
                     "measured again; the JSON's meta.runs lists them)")
    lines = [f"### `{report['cluster']}` ({report['world_size']} ranks, {report['payload_bytes'] / 2**20:.1f} MB"
             + (f", compute {report['compute_ms']:g} ms" if report.get("compute_ms") else "") + ")", "",
             *(made if len(made) == 1 else [f"Runs: {'; '.join(made)}"]), "",
             "| strategy | sync s | vs DDP | bound ratio | net bound ratio | model error | NIC MB/rank "
             "| uplink drops/step | CPU busy | misses |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in report["results"]:
        nic = r.get("nic_bytes_per_rank")
        lines.append(" | ".join([
            f"| `{r['strategy']}`", _sync_cell(r), _fmt(r.get("speedup_vs_ddp"), ".2f", "×"),
            _fmt(r.get("bound_ratio"), ".2f"), _fmt(r.get("network_bound_ratio"), ".2f"),
            _fmt(r["model_error"] * 100 if r.get("model_error") is not None else None, "+.0f", " %"),
            _fmt(nic / 2**20 if nic is not None else None, ".1f"), _fmt(r.get("uplink_drops"), ".0f"),
            _fmt(r["machine_cpu"]["busy"] * 100 if r.get("machine_cpu") else None, ".0f", " %"),
            misses(r)]) + " |")
    check = planner_lines(report)
    if check:
        lines += ["", *check]
    repeated = sorted({len(r["repeats"]) for r in report["results"] if len(r.get("repeats") or ()) > 1})
    if repeated:
        lines += ["", f"*sync s* with a range: the median of {' or '.join(map(str, repeated))} runs of the profile, "
                      "one after another (min–max); the row's other fields are its median run's."]
    runs = sorted({r["measured"] for r in report["results"] if r.get("measured")})
    if len(runs) > 1:
        lines += ["", f"Rows from {len(runs)} runs ({', '.join(runs)}; a resumed matrix): each row's *vs DDP* is "
                      "against the `ddp` of its own run (`ddp_sync_s` in the JSON)."]
    return "\n".join(lines) + "\n"


def run_matrix(settings: MatrixSettings) -> dict[str, dict[str, Any]]:
    """Every profile's pending cells in turn, under one progress bar with an ETA; returns
    each profile's (merged) report by name."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    plan = [(p, pending_cells(load_existing(profile_report_path(settings.out_dir, p), p, settings.payload_bytes,
                                            settings.compute_ms), settings.strategies)) for p in settings.profiles]
    total = sum(len(cells) for _, cells in plan) * settings.repeat
    reports = {}
    with Progress(TextColumn("[bold]bench matrix[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()) as progress:
        task = progress.add_task("", total=total)
        for profile, cells in plan:
            if not cells:
                progress.console.print(f"{profile.name}: every cell already in "
                                       f"{profile_report_path(settings.out_dir, profile)}, skipped")
                continue
            progress.update(task, description=f"{profile.name} ({len(cells)} cells)")
            reports[profile.name] = run_profile(profile, settings, progress, task)
    return reports
