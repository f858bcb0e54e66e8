"""Neighbour collectives vs gloo all-reduce on this host, side by side in one run.

    python scripts/bench_comm.py --ranks 4 8 --mb 1 4 16 64 [--repeats 5] [--json out.json]
    python scripts/bench_comm.py --cluster homogeneous8 --mb 16        # on an emulated cluster (root)

For each world size and payload: gloo ``all_reduce``, static ``neighbor_allreduce`` on
the exponential-2 graph, dynamic one-peer exponential ``neighbor_allreduce``, and the
same one-peer call with the topology check on. Time = median over repeats of the
slowest rank. The α-β bound uses the point-to-point bandwidth B measured first in the
same run (one 64 MB send between two ranks): ring all-reduce ``2(n−1)/n·M/B``,
neighbour exchange ``degree·M/B``. On one host every "link" is loopback memory
traffic on shared cores, so ratios here show software overhead; network-shaped
numbers come from the cluster emulator (``syncplane bench``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's time for ``fn`` (after one warm-up)."""
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(elapsed.item())
    return statistics.median(samples)


def _worker(rank: int, world: int, port: int, sizes_mb: list[float], repeats: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    result = _measure(rank, world, sizes_mb, repeats)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def _cluster_worker(result_path: str, sizes_mb: list[float], repeats: int) -> None:
    """One rank inside an emulated host (started by ``launch_on_cluster``, torchrun env)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    result = _measure(dist.get_rank(), dist.get_world_size(), sizes_mb, repeats)
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _measure(rank: int, world: int, sizes_mb: list[float], repeats: int) -> dict[str, Any]:
    import syncplane.comm as sc
    from syncplane.comm import topology as T

    sc.set_topology(T.ExponentialTwoGraph(world))
    degree = len(sc.out_neighbor_ranks())
    # point-to-point bandwidth between ranks 0 and 1
    probe = torch.ones(16 * 2**20)
    def p2p() -> None:
        if rank == 0:
            dist.send(probe, 1)
        elif rank == 1:
            dist.recv(probe, 0)
    bandwidth = probe.numel() * 4 / timed(p2p, repeats)
    rows = []
    for mb in sizes_mb:
        x = torch.randn(int(mb * 2**20 / 4))
        payload = x.numel() * 4
        schedule = T.one_peer_exponential(world, rank)
        plans = list(itertools.islice(schedule, 64))
        step = itertools.count()

        def one_peer(check: bool) -> None:
            send, recv = plans[next(step) % len(plans)]
            sc.neighbor_allreduce(x, self_weight=0.5, src_weights={recv[0]: 0.5}, dst_weights=send,
                                  enable_topo_check=check)

        ops = {
            "allreduce": (lambda: dist.all_reduce(x.clone()), 2 * (world - 1) / world),
            "static_exp2": (lambda: sc.neighbor_allreduce(x), degree),
            "one_peer": (lambda: one_peer(False), 1),
            "one_peer+check": (lambda: one_peer(True), 1),
        }
        for name, (fn, factor) in ops.items():
            seconds = timed(fn, repeats)
            bound = factor * payload / bandwidth
            rows.append({"ranks": world, "mb": mb, "op": name, "seconds": seconds, "bound_s": bound,
                         "bound_ratio": bound / seconds})
    return {"bandwidth_bytes_per_s": bandwidth, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--mb", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--cluster", help="run on this emulated cluster (root) instead of localhost; its world "
                                          "size replaces --ranks")
    parser.add_argument("--worker", help=argparse.SUPPRESS)   # internal: one rank on a cluster
    args = parser.parse_args()
    if args.worker:
        _cluster_worker(args.worker, args.mb, args.repeats)
        return

    from rich.console import Console
    from rich.table import Table

    from syncplane.runtime.launcher import free_port

    results = []
    if args.cluster:
        import sys
        import tempfile
        from pathlib import Path

        from syncplane.cluster import load_profile
        from syncplane.runtime.launcher import launch_on_cluster

        profile = load_profile(args.cluster)
        args.ranks = [profile.world_size]
        with tempfile.TemporaryDirectory() as tmp:
            result_path = Path(tmp) / "result.json"
            launch_on_cluster([sys.executable, __file__, "--worker", str(result_path), "--repeats", str(args.repeats),
                               "--mb", *map(str, args.mb)], profile, Path(tmp) / "logs")
            results.append(json.loads(result_path.read_text()))
    else:
        ctx = mp.get_context("spawn")
        for world in args.ranks:
            queue = ctx.Queue()
            mp.start_processes(_worker, args=(world, free_port(), args.mb, args.repeats, queue), nprocs=world,
                               start_method="spawn")
            results.append(queue.get())
    where = f"emulated cluster {args.cluster}" if args.cluster else "localhost"
    table = Table(title=f"neighbour collectives vs all-reduce ({where}, gloo)")
    for col in ("ranks", "MB", "op", "seconds", "vs allreduce", "bound s", "bound ratio"):
        table.add_column(col, justify="right")
    for result in results:
        base = {r["mb"]: r["seconds"] for r in result["rows"] if r["op"] == "allreduce"}
        for r in result["rows"]:
            table.add_row(str(r["ranks"]), f"{r['mb']:g}", r["op"], f"{r['seconds']:.4f}",
                          f"{base[r['mb']] / r['seconds']:.2f}x", f"{r['bound_s']:.4f}", f"{r['bound_ratio']:.2f}")
    console = Console(width=120)
    console.print(table)
    for result, world in zip(results, args.ranks):
        console.print(f"{world} ranks: measured point-to-point bandwidth "
                      f"{result['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
