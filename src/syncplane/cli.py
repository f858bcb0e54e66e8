"""``syncplane`` command line: info, build-ext, emulate, bench, compare, chaos, soak, plan, simulate."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from syncplane.cluster.cost import DEFAULT_ALPHA_S
from syncplane.cluster.emulator import EmulationError
from syncplane.config import ConfigError
from syncplane.ext import ExtensionError
from syncplane.runtime.launcher import LaunchError
from syncplane.runtime.probe_job import ProbeError
from syncplane.runtime.rendezvous import RendezvousTimeout

#: ``--exchange`` of bench and simulate: one vocabulary (``syncplane.exchanges``) for every
#: family that has a choice; a family that does not run the name given uses auto
EXCHANGE_CHOICES = ["auto", "mesh", "tree", "nested", "cube", "gather", "owner"]
EXCHANGE_HELP = ("the exchange of the families that have one: mesh (every rank owns 1/n), tree (FlexReduce's plan; "
                 "diloco), nested (by host and rack; canary), cube (BCube; canary), gather (every rank gathers the encoded pieces; diloco, priced as its sparse codec at the default density and bits); auto = the most topology-aware "
                 "one that can run. A family that does not run the name given uses auto. 'owner' is the old name "
                 "of mesh")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def emulation_support() -> dict[str, Any]:
    """Can this machine build emulated clusters (network namespaces + tc shaping)?"""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return {"available": False, "reason": f"missing tools: {', '.join(missing)} (install iproute2)"}
    if os.geteuid() != 0:
        return {"available": False, "reason": "needs root (network namespaces and tc)"}
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return {"available": False, "reason": f"`ip netns` failed: {probe.stderr.strip()}"}
    return {"available": True, "reason": None}


def collect_info() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from syncplane import __version__, ext
    from syncplane.strategies import registry

    return {
        "syncplane": __version__,
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("torch", "lightning", "hydra-core", "wandb", "torchvision")},
        "backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "cuda_available": torch.cuda.is_available(),
            "torch_cuda_version": torch.version.cuda,
        },
        "extension": ext.status(),
        "strategies": registry.describe(),
        "emulation": emulation_support(),
    }


def _print_info(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"syncplane {info['syncplane']}", show_header=False)
    table.add_column("item")
    table.add_column("value")
    table.add_row("python", info["python"])
    for name, ver in info["versions"].items():
        table.add_row(name, ver or "not installed")
    for name, value in info["backends"].items():
        table.add_row(name, str(value))
    extension = info["extension"]
    table.add_row("extension built", str(extension["built"]) + ("" if extension["built"] else
                                                                "  (run: syncplane build-ext)"))
    table.add_row("CUDA kernels built", str(extension["cuda_kernels"]))
    emulation = info["emulation"]
    table.add_row("cluster emulation", "available" if emulation["available"] else f"no: {emulation['reason']}")
    console.print(table)
    strategies = Table(title="strategies", show_header=True)
    strategies.add_column("name")
    strategies.add_column("description")
    for name, description in info["strategies"].items():
        strategies.add_row(name, description)
    console.print(strategies)


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


def cmd_build_ext(args: argparse.Namespace) -> int:
    from syncplane import ext

    ext.load_cpu(verbose=args.verbose)
    print("syncplane: CPU kernels ready", flush=True)
    if args.cuda:
        ext.load_cuda(verbose=args.verbose)
        print("syncplane: CUDA kernels compiled (they run only where a GPU exists)", flush=True)
    return 0


def cmd_emulate(args: argparse.Namespace) -> int:
    from syncplane.cluster import emulator, load_profile

    emulator.require_support()
    if args.action == "up":
        if not args.profile:
            raise ConfigError("emulate up: name a profile (a shipped name or a YAML path)")
        profile = load_profile(args.profile)
        emulator.up(profile)
        print(f"emulated cluster {profile.name!r} is up: {len(profile.hosts)} hosts, {profile.world_size} ranks, "
              f"TCP {profile.tcp_congestion}")
        for host in profile.hosts:
            nics = ", ".join(host.address(k) for k in range(host.spec.nics))
            print(f"  {host.name:>8}  rack {profile.racks[host.rack].name:<8} ranks {list(host.ranks)}  "
                  f"NIC {host.spec.nic_mbit:g} Mbit x{host.spec.nics}  {nics}  (netns {emulator.host_namespace(host)})")
    elif args.action == "down":
        removed = emulator.down()
        print(f"removed {len(removed)} namespaces" + (f": {', '.join(removed)}" if removed else ""))
    else:
        state = emulator.status()
        print(json.dumps(state, indent=2))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from syncplane.bench.runner import parse_payload, parse_strategies
    from syncplane.cluster import load_profile
    from syncplane.algorithms import PLANNED, describe_periods, periods, spec_for, variant
    from syncplane.algorithms.plan import PlanInputs, link_tcp, settled_times
    from syncplane.cluster.cost import CostModel
    from syncplane.cluster.profile import scaled

    profile = load_profile(args.cluster)
    if args.racks or args.hosts_per_rack:
        profile = scaled(profile, args.racks or len(profile.racks), args.hosts_per_rack or len(profile.racks[0].hosts))
    payload = parse_payload(args.payload_mb)
    if (args.period is not None and args.period < 1) or args.streams < 1:
        raise ConfigError(f"--period and --streams must be at least 1, got {args.period} and {args.streams}")
    model = CostModel(profile, alpha_s=args.alpha_ms / 1000, tcp=link_tcp(args.tcp, profile))
    names = parse_strategies(args.strategies)
    used = periods(names, args.period)
    title = ", ".join(part for part in (f"α-β model: {profile.name}", f"{profile.world_size} ranks",
                                        f"{payload / 2**20:.1f} MB", f"α = {args.alpha_ms:g} ms",
                                        f"TCP {args.tcp} ({profile.tcp_congestion})",
                                        describe_periods(used, args.period), f"streams {args.streams}") if part)
    table = Table(title=title)
    for col in ("strategy", "predicted s", "bound s", "net bound s", "net ratio", "vs ddp"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    rows = {}
    for name in names:     # a label: NAME or NAME[key=value,...] (diloco[replica=node,streams=2])
        base, settings = variant(name)
        if base in PLANNED:
            rows[name] = None
            continue
        # priced as plan and bench price it: --streams is DiLoCo's streams and DS-Sync's pair
        # streams (Canary opens one stream per NIC), the row's own settings first
        family = spec_for(base)
        kwargs = {"streams": args.streams, "pair_streams": args.streams, "exchange": args.exchange, **settings,
                  **({family.period_key: used[name]} if family.periodic and family.period_key else {})}
        rows[name] = settled_times(model, base, kwargs, PlanInputs(payload))
    ddp = rows.get("ddp")

    def net_ratio(value: Any) -> float | None:
        """The network's bound over the prediction: how near the wire's limit the pattern runs."""
        return value.network_bound_s / value.predicted_s if value.predicted_s and value.network_bound_s else None

    for name, value in rows.items():
        if value is None:
            table.add_row(escape(name), "[yellow]not modelled yet[/]", "-", "-", "-", "-")
        else:
            speed = f"{ddp.predicted_s / value.predicted_s:.2f}x" if ddp and value.predicted_s else "-"
            ratio = net_ratio(value)
            table.add_row(escape(name), f"{value.predicted_s:.3f}", f"{value.bound_s:.3f}", f"{value.network_bound_s:.3f}",
                          "-" if ratio is None else f"{ratio:.2f}", speed)
    Console(width=110).print(table)
    if any(rows.values()):
        binding = next(v for v in rows.values() if v).network_binding
        print(f"network bound of one all-reduce: set by {binding} (per communicating step)")
    if args.plan:
        from syncplane.exchanges.tree.cost import ELEMENT_SIZE
        from syncplane.exchanges.tree.plan import describe, plan_for
        from syncplane.exchanges.tree.tree import from_profile

        tree = from_profile(profile)
        print(describe(tree, plan_for(tree, payload // ELEMENT_SIZE), ELEMENT_SIZE))
    if args.json:
        Path(args.json).write_text(json.dumps({"cluster": profile.name, "world_size": profile.world_size,
                                               "payload_bytes": payload, "alpha_s": model.alpha_s, "tcp": args.tcp,
                                               "period": args.period, "periods": used, "streams": args.streams,
                                               "results": [{"strategy": n, "period": used.get(n),
                                                            "predicted_s": v.predicted_s if v else None,
                                                            "bound_s": v.bound_s if v else None,
                                                            "network_bound_s": v.network_bound_s if v else None,
                                                            "network_bound_ratio": net_ratio(v) if v else None,
                                                            "network_binding": v.network_binding if v else None}
                                                           for n, v in rows.items()]}, indent=2))
    return 0


def check_bench_args(args: argparse.Namespace) -> Any:
    """Validate ``bench``'s arguments before anything launches (the docs test calls this
    too): for ``--matrix`` every cell's inputs, returning its ``MatrixSettings``; else None."""
    from syncplane.bench.matrix import MatrixSettings
    from syncplane.bench.runner import parse_payload, parse_strategies
    from syncplane.cluster import load_profile, shipped_profiles

    if not args.matrix:
        for key, value in (("--cluster", args.cluster), ("--json", args.json)):
            if value is None:
                raise ConfigError(f"bench: {key} is required (or run every profile with --matrix)")
        if args.clusters or args.out or args.repeat != 1:
            raise ConfigError("bench: --clusters, --out and --repeat belong to --matrix (one cluster: --cluster, "
                              "--json)")
        return None
    if args.cluster and args.clusters:
        raise ConfigError("bench --matrix: give --clusters (a list) or --cluster (one), not both")
    if args.json or args.png:
        raise ConfigError("bench --matrix: writes OUT/<profile>.{json,md,png}; give --out DIR instead of --json/--png")
    unsupported = [key for key, value in (("--period", args.period), ("--profile", args.profile or None),
                                          ("--wandb", args.wandb or None)) if value is not None]
    if unsupported or (args.shards, args.compression, args.pair_streams, args.exchange, args.density,
                       args.bits) != (1, "none", "auto", "auto", 0.02, 2):
        raise ConfigError(f"bench --matrix runs each strategy as train.py does (its defaults); not with "
                          f"{', '.join(unsupported) or '--streams/--compression/--density/--bits/--pair-streams/--exchange'}")
    names = [c.strip() for c in (args.clusters or args.cluster or ",".join(shipped_profiles())).split(",") if c.strip()]
    if not names:
        raise ConfigError("bench --matrix: --clusters is empty")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--steps must be at least 1 and --warmup at least 0, got {args.steps} and {args.warmup}")
    if args.repeat < 1:
        raise ConfigError(f"bench --matrix: --repeat must be at least 1, got {args.repeat}")
    return MatrixSettings(profiles=[load_profile(n) for n in names], strategies=parse_strategies(args.strategies or "all"),
                          payload_bytes=parse_payload(args.payload_mb), out_dir=Path(args.out or "bench-matrix"),
                          steps=args.steps, warmup=args.warmup, compute_ms=args.compute_ms, repeat=args.repeat)


def cmd_plan(args: argparse.Namespace) -> int:
    """Price every strategy and its main settings on a cluster for this job; rank; explain."""
    from syncplane.algorithms.plan import PlanInputs, cpu_sharing, make_plan, plan_cpu
    from syncplane.bench import plan_report
    from syncplane.bench.runner import parse_payload
    from syncplane.cluster import load_profile

    if args.probe:
        from syncplane.runtime.probe_job import probe_emulated, probe_here

        if args.probe_mb <= 0 or args.probe_streams < 1:
            raise ConfigError(f"plan --probe: --probe-mb must be positive and --probe-streams at least 1, got "
                              f"{args.probe_mb} and {args.probe_streams}")

        profile = probe_emulated(args.cluster, args.probe_mb, args.probe_streams) if args.cluster else \
            probe_here(args.probe_mb, args.probe_streams, args.probe_timeout_s)
        if profile is None:                  # a rank other than 0 under the launcher: rank 0 plans
            return 0
        import yaml

        Path(args.probe_out).write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))
        label = args.probe_out if "/" in args.probe_out else f"./{args.probe_out}"
        print(f"plan --probe: the network as found is in {label} (for --cluster, cluster=, bench, simulate)")
    elif args.cluster is None:
        raise ConfigError("plan: give --cluster NAME|PATH, or --probe to measure the network first")
    else:
        profile, label = load_profile(args.cluster), args.cluster
    if (args.mb is None) == (args.recipe is None):
        raise ConfigError("plan: give the payload as --mb MB (or a preset: resnet50, bert_large) or --recipe NAME")
    payload = parse_payload(args.mb) if args.mb is not None else plan_report.recipe_payload(args.recipe)
    if args.compute_ms is None and args.recipe is None:
        raise ConfigError("--compute-ms: give the compute time per step (or --recipe NAME to time a few steps of it)")
    compute_s = (args.compute_ms / 1000 if args.compute_ms is not None
                 else plan_report.time_recipe_steps(args.recipe, args.time_steps))
    strategies = tuple(s for s in args.strategies.split(",") if s) if args.strategies else None
    inputs = PlanInputs(payload, compute_s, args.period, args.alpha_ms / 1000, strategies, tcp=args.tcp)
    cpu_mode = args.cpu or ("host" if args.probe and not args.cluster else "emulated")
    plan = make_plan(profile, plan_cpu(profile, inputs, cpu_sharing(cpu_mode, profile)))
    plan_report.print_plan(plan, label, args.top)
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    plan_report.write_outputs(plan, label, args.json, png)
    plan.best(args.accept)   # none in the class the user accepts: the error, exit 2
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from syncplane.bench.runner import main_bench
    from syncplane.cluster.emulator import say_if_left_up

    matrix = check_bench_args(args)
    if matrix is not None:
        return run_bench_matrix(matrix)
    with say_if_left_up(True):
        main_bench(args.cluster, args.strategies or "ddp", args.payload_mb, args.steps, args.warmup, args.compute_ms,
                   args.json, args.png, args.wandb, args.period, args.shards, args.compression, args.pair_streams,
                   args.exchange, args.profile, args.density, args.bits)
    return 0


def run_bench_matrix(settings: Any) -> int:
    """``bench --matrix``: run every pending cell; exit 1 when a cell failed (a rerun retries it)."""
    from syncplane.bench.matrix import run_matrix
    from syncplane.cluster.emulator import require_support, say_if_left_up

    require_support()
    with say_if_left_up(True):
        reports = run_matrix(settings)
    failed = [f"{name}/{row['strategy']}" for name, report in reports.items() for row in report["results"]
              if row.get("status", "ok").startswith("failed")]
    for name in reports:
        print(f"bench matrix: {name}: {settings.out_dir / name}.{{json,md,png}}")
    if failed:
        print(f"bench matrix: {len(failed)} cells failed ({', '.join(failed)}); rerun the same command to retry "
              "them (the rest is kept)", file=sys.stderr)
    return 1 if failed else 0


def cmd_compare(args: argparse.Namespace) -> int:
    import logging

    from rich.logging import RichHandler

    from syncplane.cluster.emulator import say_if_left_up
    from syncplane.experiments.comparison import print_report, run_comparison, settings_from_args

    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler(show_path=False)])
    settings = settings_from_args(args)
    with say_if_left_up(settings.cluster is not None):
        run_comparison(settings)
        print_report(settings.out)
    return 0


def cmd_chaos(args: argparse.Namespace) -> int:
    import logging
    import time

    from syncplane.cluster.emulator import say_if_left_up
    from syncplane.experiments.chaos import prepare, print_report, run_chaos

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.deadline_s <= 0 or args.timeout_s <= 0:
        raise ConfigError(f"--deadline-s and --timeout-s must be positive, got {args.deadline_s} and {args.timeout_s}")
    out = Path(args.out) if args.out else Path("outputs") / "chaos" / time.strftime("%Y-%m-%d/%H-%M-%S")
    if args.matrix:
        return _chaos_matrix(args, out)
    if not args.fault:
        raise ConfigError("syncplane chaos: give at least one --fault KIND:rank=N:step=S (or --matrix)")
    plan = prepare(args.overrides, args.fault, out)
    json_path = Path(args.json) if args.json else plan.run_dir / "chaos.json"
    with say_if_left_up(plan.job.cluster is not None):
        report = run_chaos(plan, deadline_s=args.deadline_s, timeout_s=args.timeout_s, json_path=json_path)
        print_report(report, json_path)
    return 0 if report["ok"] else 1


def _chaos_matrix(args: argparse.Namespace, out: Path) -> int:
    from syncplane.bench.runner import parse_strategies
    from syncplane.cluster.emulator import say_if_left_up
    from syncplane.experiments.chaos import matrix_plans, print_matrix, run_matrix

    if args.fault:
        raise ConfigError("--matrix places one fault per cell (--kinds, --rank, --step); drop --fault")
    plans = matrix_plans(parse_strategies(args.strategies), [k.strip() for k in args.kinds.split(",") if k.strip()],
                         args.overrides, out, rank=args.rank, step=args.step)
    json_path = Path(args.json) if args.json else out / "matrix.json"
    with say_if_left_up(any(plan.job.cluster is not None for plan in plans)):
        rows = run_matrix(plans, deadline_s=args.deadline_s, timeout_s=args.timeout_s, json_path=json_path)
        print_matrix(rows, args.deadline_s, json_path)
    return 0 if all(r["ok"] for r in rows) else 1


def cmd_soak(args: argparse.Namespace) -> int:
    from syncplane.bench.runner import parse_strategies
    from syncplane.bench.soak import print_table, run_soak

    names = parse_strategies(args.strategies, variants=False)
    if args.steps < 10 or args.ranks < 2:
        raise ConfigError(f"--steps must be >= 10 and --ranks >= 2, got {args.steps} and {args.ranks}")
    out_dir = Path(args.json).resolve().parent / (Path(args.json).stem + "-run")
    results = run_soak(names, steps=args.steps, ranks=args.ranks, payload_bytes=int(args.payload_kb * 1024),
                       out_dir=out_dir, rss_tolerance_mb=args.rss_tolerance_mb)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"soak report written to {args.json}")
    return 0 if all(r["flat"] for r in results.values()) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="syncplane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, backends, extension status, strategies, emulation support")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)
    build = sub.add_parser("build-ext", help="compile the kernel extension now (cached afterwards)")
    build.add_argument("--cuda", action="store_true", help="also compile the CUDA kernels with nvcc")
    build.add_argument("--verbose", action="store_true", help="show compiler commands")
    build.set_defaults(func=cmd_build_ext)

    emulate = sub.add_parser("emulate", help="build / remove / show an emulated cluster (root)")
    emulate.add_argument("action", choices=["up", "down", "status"])
    emulate.add_argument("profile", nargs="?", help="shipped profile name or YAML path (for up)")
    emulate.set_defaults(func=cmd_emulate)

    bench = sub.add_parser("bench", help="time every strategy's sync on an emulated cluster, side by side")
    bench.add_argument("--cluster", help="shipped profile name or YAML path (required without --matrix)")
    bench.add_argument("--strategies", default=None,
                       help="comma-separated strategy names, or all (default: ddp; with --matrix: all); a "
                            "strategy with settings of its own is a row of its own: "
                            "'ddp,diloco,diloco[replica=node]'")
    bench.add_argument("--payload-mb", default="resnet50", help="MB, or a preset: resnet50, bert_large")
    bench.add_argument("--compute-ms", type=float, default=0.0, help="emulated compute per step (a timed wait)")
    bench.add_argument("--steps", type=int, default=5,
                       help="timed steps per strategy (a periodic strategy's rounded up to whole rounds of its own)")
    bench.add_argument("--warmup", type=int, default=1,
                       help="untimed steps first (a periodic strategy's in whole rounds: its first round is not timed)")
    bench.add_argument("--json", help="where to write the report (required without --matrix)")
    bench.add_argument("--png", help="chart path (default: next to --json)")
    bench.add_argument("--period", type=int, default=None,
                       help="steps per round of the periodic algorithms: DiLoCo's H (sync_every) and the "
                            "period of torch_periodic / torch_hierarchical. Default: each one's own (diloco's "
                            "sync_every; torch's averagers 4); the table's title and the JSON say which")
    bench.add_argument("--streams", "--shards", dest="shards", type=int, default=1,
                       help="diloco: concurrent gloo streams for the exchange of Δ (--shards: the old name; a "
                            "row's own diloco[streams=S] wins)")
    bench.add_argument("--pair-streams", default="auto",
                       help="ds_sync: TCP connections per direction of a two-rank group, or auto "
                            "(timed at setup, as the strategy does by default)")
    bench.add_argument("--exchange", default="auto", choices=EXCHANGE_CHOICES,
                       help=EXCHANGE_HELP)
    bench.add_argument("--compression", default="none", choices=["none", "int8", "sparse"],
                       help="diloco: codec of Δ on the wire (sparse: chunked top-k on the gather)")
    bench.add_argument("--density", type=float, default=0.02,
                       help="diloco with --compression sparse: fraction of each chunk sent, in (0, 1]")
    bench.add_argument("--bits", type=int, default=2, help="diloco with --compression sparse: bits per value, 2, 4 or 8")
    bench.add_argument("--profile", action="store_true",
                       help="diloco, canary: time each phase of the exchange (copies, encodes, sums, waits "
                            "per stream and level, the commit agreement) on every rank; written to the JSON "
                            "row's 'profile' (canary: its colayers in flight add up, so phases exceed the step)")
    bench.add_argument("--wandb", action="store_true", help="also log offline W&B runs, grouped")
    bench.add_argument("--matrix", action="store_true",
                       help="every strategy (--strategies, default all) on every profile (--clusters, default "
                            "every shipped one), each profile in one run with ddp beside; writes "
                            "OUT/<profile>.{json,md,png} and resumes: cells already in OUT are skipped")
    bench.add_argument("--clusters", help="--matrix: comma-separated profile names or YAML paths")
    bench.add_argument("--out", help="--matrix: the folder of the per-profile reports (default bench-matrix)")
    bench.add_argument("--repeat", type=int, default=1,
                       help="--matrix: run each profile this many times, one run after another, and keep each "
                            "cell's median run, with the range of its runs (default 1)")
    bench.set_defaults(func=cmd_bench)

    compare = sub.add_parser("compare", help="train one recipe with several strategies and peers (horovod, "
                                             "torchft_diloco) in turn; report time to accuracy side by side")
    compare.add_argument("--recipe", default="digits", help="a recipe config (configs/recipe/NAME.yaml)")
    compare.add_argument("--cluster", help="an emulated cluster: a shipped profile name or a YAML path; default: this machine")
    compare.add_argument("--strategies", default="ddp,diloco,torchft_diloco",
                         help="comma-separated strategies and peers (horovod, torchft_diloco); a variant of a "
                              "strategy's kwargs is its own row: 'ddp,diloco,diloco[compression=int8]'")
    compare.add_argument("--target-acc", type=float, help="validation accuracy whose time to reach is reported")
    compare.add_argument("--target-loss", type=float,
                         help="validation loss whose time to get down to is reported (e.g. --recipe tiny_lm)")
    compare.add_argument("--seeds", default="42", help="comma-separated seeds; each strategy runs once per seed")
    compare.add_argument("--devices", type=int, help="ranks (default: the cluster's slots, else trainer.devices)")
    compare.add_argument("--out", help="report folder (default comparisons/RECIPE-CLUSTER)")
    compare.add_argument("--no-wandb", action="store_true", help="CSV logs only, no W&B runs")
    compare.add_argument("--wandb-mode", default="offline", help="offline (default), online or disabled")
    compare.add_argument("overrides", nargs="*",
                         help="Hydra overrides for every run, as for train.py: trainer.max_epochs=5 recipe.lr=0.1")
    compare.set_defaults(func=cmd_compare)

    chaos = sub.add_parser("chaos", help="train a job, fail chosen ranks or emulated hosts at chosen steps, and "
                                         "report what the job did (exit 0 when it failed fast and clean)")
    chaos.add_argument("--fault", action="append", metavar="KIND:rank=N:step=S",
                       help="kill, stop (SIGSTOP: a hang), raise or netdown (emulated clusters), on rank=N or on "
                            "host=N (every rank of emulated host N) after training step S; repeat for more faults")
    chaos.add_argument("--deadline-s", type=float, default=30.0,
                       help="the job must have ended this long after the first fault (not for elastic DiLoCo, "
                            "which must go on)")
    chaos.add_argument("--timeout-s", type=float, default=900.0, help="stop the whole job after this long")
    chaos.add_argument("--out", help="the job's run directory (default outputs/chaos/DATE/TIME)")
    chaos.add_argument("--json", help="where to write the report (default OUT/chaos.json, OUT/matrix.json)")
    chaos.add_argument("--matrix", action="store_true",
                       help="one job per strategy x fault kind (--strategies, --kinds), one fault each (--rank, "
                            "--step), and a table of the outcomes; exit 0 when every cell kept the promise")
    chaos.add_argument("--strategies", default="all",
                       help="--matrix: comma-separated rows, or all; a row is a strategy or a variant of its "
                            "kwargs, NAME[key=value,...] (diloco[replica=node] runs on cluster=multi_nic unless the "
                            "job names a cluster)")
    chaos.add_argument("--kinds", default="kill,stop,netdown",
                       help="--matrix: fault kinds (netdown runs on cluster=multi_nic unless the job names a cluster)")
    chaos.add_argument("--rank", type=int, default=2, help="--matrix: the rank that fails (default 2)")
    chaos.add_argument("--step", type=int, default=12,
                       help="--matrix: the step after which it fails (default 12: just after the first epoch's "
                            "checkpoint of digits on 4 ranks)")
    chaos.add_argument("overrides", nargs="*",
                       help="the job, as for train.py: strategy=ddp trainer.devices=4 cluster=multi_nic ...")
    chaos.set_defaults(func=cmd_chaos)

    soak = sub.add_parser("soak", help="run each strategy's sync for many steps; fail if memory, descriptors, "
                                       "threads or sockets grow")
    soak.add_argument("--strategies", default="all", help="comma-separated strategy names, or all")
    soak.add_argument("--steps", type=int, default=10_000, help="sync steps per strategy")
    soak.add_argument("--ranks", type=int, default=2, help="local processes (loopback)")
    soak.add_argument("--payload-kb", type=float, default=64.0, help="payload per step")
    soak.add_argument("--rss-tolerance-mb", type=float, default=4.0,
                      help="allowed rise of resident memory over the run (second-half slope)")
    soak.add_argument("--json", required=True, help="where to write the report")
    soak.set_defaults(func=cmd_soak)

    plan = sub.add_parser("plan", help="price every strategy and its settings on a cluster for this job, "
                                       "ranked by predicted step time, exact and approximate apart")
    plan.add_argument("--cluster", help="shipped profile name or YAML path (with --probe: the emulated cluster to probe)")
    plan.add_argument("--probe", action="store_true",
                      help="measure the network first and plan on what was found: once per rank under "
                           "torchrun/srun, or on the emulated --cluster")
    plan.add_argument("--probe-mb", type=float, default=2.0, help="--probe: MB each pair exchanges")
    plan.add_argument("--probe-streams", type=int, default=4,
                      help="--probe: streams per pair for the per-flow cap test (1: no test)")
    plan.add_argument("--probe-out", default="probed.yaml", help="--probe: where the probed profile is written")
    plan.add_argument("--probe-timeout-s", type=float, default=120.0,
                      help="--probe under a launcher: how long to wait for every rank")
    plan.add_argument("--mb", help="the payload: MB of fp32 parameters, or a preset: resnet50, bert_large")
    plan.add_argument("--recipe", help="the payload from a recipe's parameter count (and, without "
                                       "--compute-ms, its compute timed over a few real steps here)")
    plan.add_argument("--compute-ms", type=float, help="compute per training step, in ms")
    plan.add_argument("--time-steps", type=int, default=3, help="--recipe without --compute-ms: steps timed")
    plan.add_argument("--period", type=int, default=None, help="H of the periodic strategies (default: each one's)")
    plan.add_argument("--strategies", help="comma-separated strategies to price (default: every registered one)")
    plan.add_argument("--accept", default="exact", choices=["exact", "approximate"],
                      help="the accuracy class the winner must be in (exit 2 if none can run)")
    plan.add_argument("--alpha-ms", type=float, default=DEFAULT_ALPHA_S * 1000, help="per-phase latency")
    plan.add_argument("--tcp", default="emulated", choices=["emulated", "ideal"],
                      help="how TCP flows share a link: as measured on the emulator under the profile's tcp_congestion "
                           "(default), or the plain α-β formula")
    plan.add_argument("--cpu", choices=["emulated", "host", "none"],
                      help="the ranks' CPU work (codecs, torch's hooks), measured on this machine: every rank on its "
                           "cores (emulated; the default with --cluster), each host's ranks on cores like its own "
                           "(host; the default with --probe under a launcher), or not priced (none: GPU jobs whose "
                           "strategies encode on the GPU; canary and diloco encode on the host even there)")
    plan.add_argument("--top", type=int, default=None, help="rows per class in the table (default: all)")
    plan.add_argument("--json", help="also write the plan here")
    plan.add_argument("--png", help="chart path (default: next to --json)")
    plan.set_defaults(func=cmd_plan)

    simulate = sub.add_parser("simulate", help="α-β cost model of each strategy on a profile, at any scale")
    simulate.add_argument("--cluster", required=True, help="shipped profile name or YAML path (the template)")
    simulate.add_argument("--strategies", default="ddp",
                          help="comma-separated strategy names; NAME[key=value,...] prices one with settings of "
                               "its own (streams, exchange, compression, replica, sync_every)")
    simulate.add_argument("--payload-mb", default="resnet50")
    simulate.add_argument("--racks", type=int, help="scale the template to this many racks")
    simulate.add_argument("--hosts-per-rack", type=int, help="and this many hosts per rack")
    simulate.add_argument("--alpha-ms", type=float, default=DEFAULT_ALPHA_S * 1000, help="per-phase latency")
    simulate.add_argument("--tcp", default="emulated", choices=["emulated", "ideal"],
                          help="how TCP flows share a link: as measured on the emulator under the profile's "
                               "tcp_congestion (default, as plan and bench price), or the plain α-β formula")
    simulate.add_argument("--period", type=int, default=None,
                          help="steps per round of the periodic algorithms (DiLoCo's H, torch_periodic's period); "
                               "their per-step cost is one round's divided by it. Default: each one's own "
                               "(diloco's sync_every; torch's averagers 4); the table's title says which")
    simulate.add_argument("--streams", type=int, default=1,
                          help="parallel connections of the multi-stream algorithms (DiLoCo's streams, "
                               "DS-Sync's pair streams; Canary opens one per NIC)")
    simulate.add_argument("--exchange", default="auto", choices=EXCHANGE_CHOICES,
                          help=EXCHANGE_HELP)
    simulate.add_argument("--json", help="also write the predictions here")
    simulate.add_argument("--plan", action="store_true",
                          help="also print FlexReduce's plan on this cluster (reduce calls per learner, bytes per "
                               "link per level, ranges owned)")
    simulate.set_defaults(func=cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ExtensionError, ConfigError, EmulationError, LaunchError, ProbeError, RendezvousTimeout) as exc:
        print(f"syncplane {args.command}: {exc}", file=sys.stderr)   # one clear message, no traceback
        return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
