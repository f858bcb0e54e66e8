"""Measure ``cluster.cost.EMULATED_TCP``'s terms on the emulator, under one congestion control.

    python scripts/calibrate_tcp.py [--tcp cubic] [--repeats 6] [--json out.json]

Three measurements, each the way the constant's note in ``cluster/cost.py`` describes (root):

- **goodput by rate**: DDP's 8 MiB all-reduce between two one-rank hosts on one switch, at each
  NIC rate of ``--rates``; the goodput is the α-β bound over the median step;
- **sharing**: on ``two_racks`` every rank sends 8 MiB to rank + s (gloo isend/irecv, the
  receive posted first, as the exchanges do) for s = 1, 2, 4, which puts s flows on each uplink
  direction; measured over the formula's
  ``s · M / uplink`` gives 1 / factor, from which the one-flow goodput and the per-flow loss
  (least squares over s = 2, 4 of ``ratio(s) / ratio(1) - 1 = loss · (s - 1)``) follow;
- **queue**: DDP's 4 KiB all-reduce on ``two_racks_contended`` against ``two_racks`` (median of
  30 steps each); the difference over the ring's 14 phases is the time a phase waits behind
  the greedy flow's standing queue.

Prints each term as measured (what ``cost.py``'s ``LinkTcp`` constants hold); ``--json`` keeps
every sample.
The cluster it leaves up is removed with ``syncplane emulate down``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

log = logging.getLogger("calibrate_tcp")

MIB = 2**20
SHIFTS = (1, 2, 4)


def pair_profile(mbit: float, tcp: str) -> Any:
    """Two one-rank hosts on one switch, NICs at ``mbit``."""
    from syncplane.cluster.profile import parse_profile

    hosts = [{"name": f"h{i}", "nic_mbit": mbit, "ranks": 1} for i in range(2)]
    return parse_profile({"name": f"pair_{int(mbit)}", "racks": [{"name": "r0", "hosts": hosts}],
                          "tcp_congestion": tcp})


def bench_ddp(profile: Any, payload_bytes: int, steps: int, warmup: int, out_dir: Path) -> dict[str, Any]:
    from syncplane.bench.runner import run_bench

    report = run_bench(profile, ["ddp"], payload_bytes, steps=steps, warmup=warmup, out_dir=out_dir)
    return report["results"][0]


def goodput_by_rate(rates: list[float], tcp: str, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for mbit in rates:
        row = bench_ddp(pair_profile(mbit, tcp), 8 * MIB, steps=5, warmup=1, out_dir=tmp / f"pair_{mbit:g}")
        rows.append({"mbit": mbit, "bound_s": row["bound_s"], "median_s": row["sync_s_median"],
                     "goodput": row["bound_s"] / row["sync_s_median"]})
        log.info("goodput at %g Mbit: %.3f (median %.3f s, bound %.3f s)", mbit, rows[-1]["goodput"],
                 row["sync_s_median"], row["bound_s"])
    return rows


def fit_sharing(ratios: dict[int, float]) -> tuple[float, float]:
    """(one flow's goodput, per-flow loss) from measured / formula at each shift (flows per link):
    ``ratio(s) = (1 + loss · (s - 1)) / goodput``."""
    base = ratios[1]
    xs = [s - 1 for s in ratios if s > 1]
    ys = [ratios[s] / base - 1 for s in ratios if s > 1]
    loss = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return 1.0 / base, loss


def sharing(tcp: str, repeats: int, tmp: Path) -> dict[str, Any]:
    from syncplane.cluster import load_profile
    from syncplane.cluster.cost import MBIT
    from syncplane.runtime.launcher import launch_on_cluster

    profile = replace(load_profile("two_racks"), tcp_congestion=tcp)
    out = tmp / "sharing.json"
    launch_on_cluster([sys.executable, __file__, "--sharing-worker", str(out), "--repeats", str(repeats)],
                      profile, tmp / "sharing_logs")
    samples = {int(s): times for s, times in json.loads(out.read_text()).items()}
    uplink = profile.racks[0].uplink_mbit * MBIT
    rows, ratios = [], {}
    for s, times in samples.items():
        formula = s * 8 * MIB / uplink
        median = statistics.median(times)
        ratios[s] = median / formula
        rows.append({"flows": s, "formula_s": formula, "median_s": median, "times": times, "ratio": ratios[s]})
        log.info("%d flow(s) per uplink: %.3f s against %.3f (x%.2f)", s, median, formula, ratios[s])
    goodput, loss = fit_sharing(ratios)
    return {"rows": rows, "goodput": goodput, "per_flow_loss": loss}


def sharing_worker(out: Path, repeats: int) -> None:
    """One rank of the sharing measurement (run by ``launch_on_cluster`` in each host)."""
    import torch
    import torch.distributed as dist

    from syncplane.comm.timing import slowest_times

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    send, recv = torch.ones(8 * MIB // 4), torch.empty(8 * MIB // 4)

    def shift(s: int) -> None:
        # the receive first, as every exchange of ours posts it (``p2p.exchange_tensors``)
        for request in [dist.irecv(recv, (rank - s) % world), dist.isend(send, (rank + s) % world)]:
            request.wait()

    samples = {s: slowest_times(partial(shift, s), repeats) for s in SHIFTS}
    if rank == 0:
        out.write_text(json.dumps(samples))
    dist.destroy_process_group()


def queue(tcp: str, tmp: Path) -> dict[str, Any]:
    from syncplane.cluster import load_profile

    medians = {}
    for name in ("two_racks", "two_racks_contended"):
        profile = replace(load_profile(name), tcp_congestion=tcp)
        row = bench_ddp(profile, 4096, steps=30, warmup=2, out_dir=tmp / f"queue_{name}")
        medians[name] = {"median_s": row["sync_s_median"], "p90_s": row["sync_s_p90"]}
        log.info("DDP 4 KiB on %s: %.4f s a step (p90 %.4f)", name, row["sync_s_median"], row["sync_s_p90"])
    phases = 2 * (profile.world_size - 1)
    extra = medians["two_racks_contended"]["median_s"] - medians["two_racks"]["median_s"]
    return {"steps": medians, "phases": phases, "queue_s": extra / phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tcp", default="cubic", help="the hosts' congestion control (default: cubic, Linux's)")
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 200.0, 400.0, 1000.0],
                        help="NIC rates (Mbit) of the goodput measurement")
    parser.add_argument("--repeats", type=int, default=6, help="timed repetitions of each sharing shift")
    parser.add_argument("--only", choices=["goodput", "sharing", "queue"], nargs="+",
                        default=["goodput", "sharing", "queue"])
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--sharing-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sharing_worker:
        sharing_worker(args.sharing_worker, args.repeats)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result: dict[str, Any] = {"tcp_congestion": args.tcp, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory() as tmp:
        if "goodput" in args.only:
            result["goodput_by_rate"] = goodput_by_rate(args.rates, args.tcp, Path(tmp))
        if "sharing" in args.only:
            result["sharing"] = sharing(args.tcp, args.repeats, Path(tmp))
        if "queue" in args.only:
            result["queue"] = queue(args.tcp, Path(tmp))
    print(f"under {args.tcp}:")
    for row in result.get("goodput_by_rate", []):
        print(f"  goodput at {row['mbit']:g} Mbit: {row['goodput']:.3f}")
    if "sharing" in result:
        s = result["sharing"]
        print("  sharing, 1/factor at " + ", ".join(f"{r['flows']} flows: {r['ratio']:.2f}" for r in s["rows"])
              + f" -> one flow's goodput {s['goodput']:.3f}, per-flow loss {s['per_flow_loss']:.3f}")
    if "queue" in result:
        print(f"  queue behind the greedy flow: {result['queue']['queue_s'] * 1e3:.1f} ms a phase")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
