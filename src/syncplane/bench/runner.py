"""``syncplane bench``: every strategy's sync on one emulated cluster, side by side.

Output (``docs/benchmarks.md``): ``{"cluster", "world_size", "payload_bytes", "results": [{
"strategy", "sync_s_median", "sync_s_p90", "bytes_sent_per_rank", "bound_s",
"bound_ratio", "network_bound_s", "network_bound_ratio", "speedup_vs_ddp", ...}]}`` plus a
rich table and a PNG chart. ``bound_s`` is the strategy's own pattern's bandwidth bound;
``network_bound_s`` the network's lower bound for an all-reduce of the payload per
communicating step (``syncplane.cluster.bound``; ``network_binding`` names the cut that
sets it), so ``network_bound_ratio`` is how near the wire's limit a strategy runs. Extra
fields per row: ``status`` ("ok" or "not implemented"), ``predicted_s`` (the cost
model with its per-phase latency and the emulator's measured TCP sharing of its shaped
links, ``emulated_tcp`` of the profile's congestion control), ``nic_bytes_per_rank`` (from the namespaces'
interface counters: the cross-check of ``bytes_sent_per_rank``), ``step_s`` (all steps),
``overlap`` (with ``compute_ms``: the part of the step the sync ran behind; its sync,
bound and prediction are then the exposed part, bound − hidden compute, at least 0),
``model_error`` (predicted over measured, minus 1: negative when the model is optimistic),
``predicted_cpu_s`` (the prediction's CPU part: encoding, decoding and sums at rates measured
on this machine, ``syncplane.exchanges.cpu``, every rank sharing its cores) and
``model_error_wire`` (the error of the wire's price alone, without that part),
``switch_drops`` (packets each shaped switch port dropped per step, from ``tc -s``) and
``uplink_drops`` (their rack uplinks' sum; None without uplinks), ``rank_cpu_s`` (CPU seconds
per step of every rank's process together) and ``machine_cpu`` (the shares of the machine's
``cores`` that were ``busy``, in ``user`` code and in the ``kernel``, over the timed steps:
on the emulator the ranks and the network's packet work share them), ``nic_bytes_by_host`` (bytes per
step each host's NICs sent, NIC by NIC: how a host's traffic spread over them), ``described``
(what the step settled on, in its own words: DS-Sync's pair streams and the trial's timings) and,
in the report, ``ranks_per_host``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import IO, Any

from syncplane import algorithms
from syncplane.algorithms import plan
from syncplane.algorithms.ds_sync.pair_streams import check_pair_streams
from syncplane.bench.syncs import PRESETS_BYTES
from syncplane.cluster import ClusterProfile, load_profile
from syncplane.cluster.cost import IDEAL, CostModel, emulated_tcp
from syncplane.cluster.emulator import switch_namespace, uplink_drops
from syncplane.comm.codecs import check_sparse_options
from syncplane.config import ConfigError, parse_list
from syncplane.exchanges import normalize
from syncplane.exchanges.cpu import CpuRates

#: The module each bench rank runs (``python -m``).
WORKER = "syncplane.bench.worker"


def parse_payload(value: str) -> int:
    """``resnet50`` / ``bert_large`` presets, or a number of MB."""
    if value in PRESETS_BYTES:
        return PRESETS_BYTES[value]
    try:
        mb = float(value)
    except ValueError:
        raise ConfigError(f"--payload-mb: expected a number or one of {', '.join(PRESETS_BYTES)}, got {value!r}") \
            from None
    if mb <= 0:
        raise ConfigError(f"--payload-mb: must be positive, got {value}")
    return int(mb * 2**20)


def parse_strategies(value: str, variants: bool = True) -> list[str]:
    """Comma-separated names, or ``all`` (every product strategy, no peers). A name may carry
    settings of its own, ``NAME[key=value,...]`` (``diloco[replica=node]``): a row of its own,
    labelled by the whole item, whose settings override the command's options (bench,
    simulate); ``variants=False`` refuses them (a command that runs names only)."""
    if value.strip() == "all":
        return algorithms.strategy_names()
    names = parse_list(value, "--strategies") if value.strip() else []
    allowed = algorithms.all_names()
    unknown = [s for s in names if algorithms.variant(s)[0] not in allowed]
    if unknown or not names:
        raise ConfigError(f"--strategies: unknown {', '.join(unknown) or '(none given)'}; "
                          f"allowed values: {', '.join(allowed)}")
    labelled = [s for s in names if "[" in s]
    if labelled and not variants:
        raise ConfigError(f"--strategies: {', '.join(labelled)}: this command takes strategy names only "
                          "(NAME[key=value,...] rows are for bench, simulate and chaos --matrix)")
    if len(set(names)) != len(names):
        raise ConfigError(f"--strategies: {value!r} names a row twice")
    return names


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_bench(profile: ClusterProfile, strategies: list[str], payload_bytes: int, *, steps: int = 5,
              warmup: int = 1, compute_ms: float = 0.0, period: int | None = None, out_dir: Path, shards: int = 1,
              compression: str = "none", pair_streams: int | str = "auto", exchange: str = "auto",
              phase_profile: bool = False, echo_to: IO[str] | None = None, density: float = 0.02,
              bits: int = 2) -> dict[str, Any]:
    """Launch the bench workers on the emulated ``profile`` and assemble the report
    (``phase_profile``: each rank's per-phase times of the syncs that keep them, in the row;
    ``echo_to``: where rank 0's output goes, default stdout).
    ``period``: steps per round of every periodic strategy; None = each one's own default
    (DiLoCo's ``sync_every``), what ``train.py`` runs; ``periods`` in the report says which."""
    from syncplane.runtime import forkserver
    from syncplane.runtime.launcher import launch_on_cluster

    forkserver.preload(WORKER)   # ranks forked from a server that has imported it already
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").unlink(missing_ok=True)        # never an earlier run's
    implemented = [s for s in strategies if algorithms.variant(s)[0] not in algorithms.PLANNED]
    measured: dict[str, Any] = {}
    used = algorithms.periods(strategies, period)
    if implemented:     # each periodic strategy times whole rounds of its own (the worker's step_counts)
        spec = {"strategies": implemented, "payload_bytes": payload_bytes, "steps": steps, "warmup": warmup,
                "compute_ms": compute_ms, "periods": used, "shards": shards, "compression": compression,
                "pair_streams": pair_streams, "exchange": exchange, "profile": phase_profile,
                "density": density, "bits": bits, "drops_namespace": switch_namespace(),
                "compute_speeds": profile.compute_speeds()}
        spec_path = out_dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        launch_on_cluster([sys.executable, "-m", WORKER, str(spec_path)], profile, out_dir / "logs",
                          echo_to=echo_to)
        measured = json.loads((out_dir / "results.json").read_text())["results"]
    options = {"shards": shards, "pair_streams": pair_streams, "compression": compression, "exchange": exchange,
               "density": density, "bits": bits}
    cpu = emulator_cpu_rates(profile, strategies, payload_bytes, period, options)
    rows = report_rows(profile, strategies, payload_bytes, measured, compute_ms=compute_ms, period=period, cpu=cpu,
                       **options)
    return {"cluster": profile.name, "world_size": profile.world_size, "payload_bytes": payload_bytes,
            "ranks_per_host": [h.spec.ranks for h in profile.hosts],
            "steps": steps, "compute_ms": compute_ms, "period": period, "periods": used, "shards": shards,
            "pair_streams": pair_streams, "compute_speeds": profile.compute_speeds(),
            "compression": compression, **({"density": density, "bits": bits} if compression == "sparse" else {}),
            "exchange": exchange, "tcp_congestion": profile.tcp_congestion,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "cpu_rates": dataclasses.asdict(cpu),      # what its predictions used (a reprice keeps them)
            "results": rows}


def emulator_cpu_rates(profile: ClusterProfile, strategies: list[str], payload_bytes: int, period: int | None,
                       options: dict[str, Any]) -> CpuRates:
    """CPU rates for the strategies' work on the emulator: measured on this machine
    (``calibrate``, cached), every rank of ``profile`` sharing this machine's cores."""
    inputs = plan.PlanInputs(payload_bytes, period=period)
    runs = [(base, {**options, **settings}) for base, settings in map(algorithms.variant, strategies)
            if base not in algorithms.PLANNED]
    sharing = plan.cpu_sharing("emulated", profile)
    assert sharing is not None
    return plan.measured_cpu(profile, runs, inputs, sharing)


def report_rows(profile: ClusterProfile, strategies: list[str], payload_bytes: int, measured: dict[str, Any], *,
                compute_ms: float = 0.0, period: int | None = None, shards: int = 1,
                pair_streams: int | str = "auto", compression: str = "none",
                exchange: str = "auto", density: float = 0.02, bits: int = 2,
                cpu: CpuRates | None = None) -> list[dict[str, Any]]:
    """One report row per strategy: the workers' measurements (``measured[name]``: step
    times, bytes, NIC counters) next to the model's prediction and both bounds
    (``period``: the periodic strategies' steps per round; None = each one's own default;
    ``cpu``: the CPU rates its prediction adds, ``emulator_cpu_rates``; None: the wire only)."""
    periods = algorithms.periods(strategies, period)
    model = CostModel(profile, tcp=emulated_tcp(profile.tcp_congestion))     # measured where it runs: on the emulator
    background_senders = {profile.host(f.src).index for f in profile.background}
    options = {"shards": shards, "pair_streams": pair_streams, "compression": compression, "exchange": exchange,
               "density": density, "bits": bits}
    rows = []
    for name in strategies:
        row: dict[str, Any] = {"strategy": name, "status": "ok" if name in measured else "not implemented",
                               "period": periods.get(name)}
        if name in measured:
            m = measured[name]
            row["sync_s_median"] = statistics.median(m["step_s"])
            row["sync_s_p90"] = _percentile(m["step_s"], 0.9)
            row["bytes_sent_per_rank"] = statistics.fmean(m["comm_bytes"])
            per_host = [m["nic_tx_bytes"][h.first_rank] / h.spec.ranks for h in profile.hosts
                        if h.index not in background_senders]
            row["nic_bytes_per_rank"] = statistics.fmean(per_host) if per_host else None
            if m.get("nic_tx_by_nic"):     # where a host's bytes left: one counter per NIC, per step
                row["nic_bytes_by_host"] = {h.name: m["nic_tx_by_nic"][h.first_rank] for h in profile.hosts}
            row["step_s"] = m["step_s"]
            if "steps" in m:      # a periodic strategy's: whole rounds of its own
                row["timed_steps"] = m["steps"]
            if "switch_drops" in m:
                row["switch_drops"] = m["switch_drops"]
                row["uplink_drops"] = uplink_drops(m["switch_drops"])
            if "cpu_s" in m:     # the CPU the timed steps took: every rank's own, and the whole machine's
                row["rank_cpu_s"] = sum(m["cpu_s"])
                row["machine_cpu"] = {**m["machine_cpu"], "cores": m["cores"]}
            if m.get("profile"):
                row["profile"] = m["profile"]
            if m.get("described"):
                row["described"] = m["described"]
        price_row(row, model, name, payload_bytes, compute_ms, periods.get(name, period), options, cpu)
        rows.append(row)
    ddp = next((r for r in rows if r["strategy"] == "ddp" and "sync_s_median" in r), None)
    for row in rows:
        if ddp and "sync_s_median" in row:
            row["speedup_vs_ddp"] = ddp["sync_s_median"] / row["sync_s_median"]
        for key in ("sync_s_median", "sync_s_p90", "bytes_sent_per_rank", "bound_s", "bound_ratio", "network_bound_s",
                    "network_bound_ratio", "speedup_vs_ddp"):
            row.setdefault(key, None)
    return rows


def price_row(row: dict[str, Any], model: CostModel, name: str, payload_bytes: int, compute_ms: float,
              period: int | None, options: dict[str, Any], cpu: CpuRates | None) -> None:
    """Fill ``row``'s model fields (prediction, bounds, errors against its ``sync_s_median``
    where measured) as ``syncplane plan`` prices ``name``: the compute its overlap window
    hides comes off. A planned-only strategy gets none."""
    base, settings = algorithms.variant(name)
    if base in algorithms.PLANNED:
        return
    inputs = plan.PlanInputs(payload_bytes, compute_ms / 1000, period, cpu=cpu)
    model = plan.with_loopback(model, cpu)
    priced = plan.price(model, base, {**options, **settings}, inputs)
    row["priced_above_bound"] = above_bound(model, base, {**options, **settings}, inputs, priced)
    hidden = priced.hidden_s
    row["predicted_s"], row["bound_s"] = priced.exposed_s, max(0.0, priced.bound_s - hidden)
    row["predicted_cpu_s"] = priced.cpu_s
    row["network_bound_s"] = max(0.0, priced.network_bound_s - hidden)
    row["network_binding"] = priced.network_binding
    row["overlap"] = priced.overlap if hidden else None
    measured = row.get("sync_s_median")
    if measured is not None:
        row["bound_ratio"] = row["bound_s"] / measured
        # no network (one host): no ratio, rather than a 0 that reads as "far from the wire"
        row["network_bound_ratio"] = row["network_bound_s"] / measured if priced.network_bound_s else None
        row["model_error"] = row["predicted_s"] / measured - 1 if measured > 0 else None
        wire = max(0.0, priced.sync_s - priced.cpu_s - hidden)
        row["model_error_wire"] = wire / measured - 1 if measured > 0 else None


def above_bound(model: CostModel, name: str, kwargs: dict[str, Any], inputs: plan.PlanInputs,
                priced: plan.Candidate) -> dict[str, float]:
    """Where the model puts ``priced``'s sync above its bound, in seconds per step: the
    per-phase latency (``latency_s``), TCP's sharing of the links -- one flow's goodput, the
    loss of flows together, a greedy flow's queue (``tcp_s``) -- and the CPU work, net of what
    runs beside the wire (``cpu_s``): the prediction again without each, in that order, before
    any compute hides part of it (they sum to ``priced.sync_s - priced.bound_s``)."""
    no_latency = plan.price(dataclasses.replace(model, alpha_s=0.0), name, kwargs, inputs).sync_s
    ideal = plan.price(dataclasses.replace(model, alpha_s=0.0, tcp=IDEAL), name, kwargs, inputs).sync_s
    return {"latency_s": priced.sync_s - no_latency, "tcp_s": no_latency - ideal, "cpu_s": ideal - priced.bound_s}


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    period = algorithms.describe_periods(report.get("periods") or {}, report.get("period"))
    hosts = report.get("ranks_per_host") or []
    per_host = f", {len(hosts)} hosts of {'/'.join(map(str, sorted(set(hosts))))} ranks" if hosts else ""
    table = Table(title=f"syncplane bench: {report['cluster']} ({report['world_size']} ranks{per_host}), "
                        f"payload {report['payload_bytes'] / 2**20:.1f} MB" + (f", {period}" if period else ""))
    for col in ("strategy", "sync s (median)", "p90", "MB sent/rank", "NIC MB/rank", "bound s", "bound ratio",
                "net bound s", "net ratio", "predicted s", "vs ddp"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in report["results"]:
        if r["status"] != "ok":
            table.add_row(escape(r["strategy"]), "[yellow]not implemented yet[/]", *["-"] * 9)
            continue
        table.add_row(escape(r["strategy"]), fmt(r["sync_s_median"], ".3f"), fmt(r["sync_s_p90"], ".3f"),
                      fmt(r["bytes_sent_per_rank"] / 2**20, ".1f"),
                      fmt(r["nic_bytes_per_rank"] / 2**20 if r.get("nic_bytes_per_rank") is not None else None, ".1f"),
                      fmt(r["bound_s"], ".3f"), fmt(r["bound_ratio"], ".2f"),
                      fmt(r["network_bound_s"], ".3f"), fmt(r["network_bound_ratio"], ".2f"),
                      fmt(r.get("predicted_s"), ".3f"),
                      fmt(r["speedup_vs_ddp"], ".2f") + "x" if r["speedup_vs_ddp"] else "-")
    Console(width=150).print(table)


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Write a matplotlib figure to ``path`` and free it (the charts of bench, compare and the
    scoreboard)."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)


def plot(report: dict[str, Any], path: Path) -> None:
    """Write the bench's chart (``chart``) to ``path``."""
    save_figure(chart(report), path, dpi=120)


def chart(report: dict[str, Any]) -> Any:
    """The bench's chart: a bar per strategy, its value above the bar and above both bound
    markers (so no marker crosses it), headroom above the tallest, names slanted when
    several, and the legend below the axes, where it covers nothing (inside, it hid the
    tallest bar's value); checked by eye at 2, 5 and 11 strategies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["status"] == "ok"]
    names = [r["strategy"] for r in report["results"]]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.2 + 0.9 * len(names)), 4.2))
    medians = [r["sync_s_median"] or 0 for r in report["results"]]
    bars = ax.bar(names, medians, color=["C0" if r["status"] == "ok" else "lightgrey" for r in report["results"]])
    heights = [max(m, r.get("bound_s") or 0, r.get("network_bound_s") or 0) for m, r in zip(medians, report["results"])]
    for bar, r, top in zip(bars, report["results"], heights):
        label = "n/a" if r["status"] != "ok" else f"{r['sync_s_median']:.2f}s"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, top), xytext=(0, 4), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.18 * max(heights, default=0) or 1.0)      # room for the value above the tallest
    if len(names) > 4 or max(map(len, names), default=0) > 10:
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", rotation_mode="anchor")
    bounds = [(r["strategy"], r["bound_s"]) for r in rows if r["bound_s"] is not None]
    if bounds:
        ax.scatter([b[0] for b in bounds], [b[1] for b in bounds], marker="_", s=600, color="C3",
                   label="α-β bound (its pattern)", zorder=3)
    network = [(r["strategy"], r["network_bound_s"]) for r in rows if r.get("network_bound_s")]
    if network:
        ax.scatter([b[0] for b in network], [b[1] for b in network], marker="_", s=600, color="C2",
                   label="network bound (all-reduce)", zorder=3)
    ax.set_ylabel("sync time per step (s)")
    ax.set_title(f"{report['cluster']}: {report['payload_bytes'] / 2**20:.0f} MB, {report['world_size']} ranks")
    if bounds or network:
        fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2, frameon=False, fontsize=9)
        fig.tight_layout(rect=(0, 0.08, 1, 1))
    else:
        fig.tight_layout()
    return fig


def log_wandb(report: dict[str, Any], save_dir: Path) -> None:
    """One offline W&B run per strategy, grouped per comparison (no network calls)."""
    import os

    import wandb

    os.environ["WANDB_ERROR_REPORTING"] = "false"
    os.environ.setdefault("WANDB_SILENT", "true")
    group = f"bench-{report['cluster']}-{report['created']}"
    for row in report["results"]:
        if row["status"] != "ok":
            continue
        run = wandb.init(project="syncplane-bench", group=group, name=row["strategy"], dir=str(save_dir),
                         settings=wandb.Settings(mode="offline", console="off"), reinit="create_new",
                         config={"cluster": report["cluster"], "payload_bytes": report["payload_bytes"]})
        for step, seconds in enumerate(row["step_s"]):
            run.log({"sync_s": seconds}, step=step)
        run.summary.update({k: v for k, v in row.items() if k != "step_s"})
        run.finish()


def main_bench(cluster: str, strategies: str, payload: str, steps: int, warmup: int, compute_ms: float,
               json_out: str, png: str | None, wandb_log: bool, period: int | None = None, shards: int = 1,
               compression: str = "none", pair_streams: str = "auto", exchange: str = "auto",
               phase_profile: bool = False, density: float = 0.02, bits: int = 2) -> dict[str, Any]:
    profile = load_profile(cluster)
    names = parse_strategies(strategies)
    payload_bytes = parse_payload(payload)
    if steps < 1:
        raise ConfigError(f"--steps: must be at least 1, got {steps}")
    out = Path(json_out)
    work_dir = out.parent / f".{out.stem}-run"
    if period is not None and period < 1:
        raise ConfigError(f"--period: must be at least 1, got {period}")
    if shards < 1:
        raise ConfigError(f"--streams: must be at least 1, got {shards}")
    try:
        streams = check_pair_streams(pair_streams if pair_streams == "auto" else int(pair_streams))
    except ValueError:
        raise ConfigError(f"--pair-streams: 'auto' or an integer >= 1, got {pair_streams!r}") from None
    if compression not in ("none", "int8", "sparse"):
        raise ConfigError(f"--compression: allowed values: none, int8, sparse; got {compression!r}")
    try:
        check_sparse_options(density, bits, 4096)
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None
    try:
        exchange = normalize(exchange, "--exchange")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if exchange == "tree" and compression != "none":
        raise ConfigError(f"--exchange tree carries exact fp32 only; --compression {compression} needs mesh (or auto)")
    if compression == "sparse" and exchange not in ("auto", "gather"):
        raise ConfigError(f"--compression sparse rides the gather only (a sum of top-k pieces is dense); "
                          f"--exchange {exchange} cannot carry it: use gather (or auto)")
    report = run_bench(profile, names, payload_bytes, steps=steps, warmup=warmup, compute_ms=compute_ms,
                       period=period, out_dir=work_dir, shards=shards, compression=compression,
                       pair_streams=streams, exchange=exchange, phase_profile=phase_profile, density=density,
                       bits=bits)
    from syncplane.cluster import emulator

    report["emulated_cluster"] = emulator.left_up()   # kept up for the next run (None: taken down)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    png_path = Path(png) if png else out.with_suffix(".png")
    plot(report, png_path)
    if wandb_log:
        log_wandb(report, work_dir)
    print(f"bench report: {out} (chart {png_path}; rank logs in {work_dir / 'logs'})")
    return report
