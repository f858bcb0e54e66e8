"""The cube all-reduce on an emulated BCube cluster, with and without the sketch, beside gloo's ring.

    python scripts/bench_cube.py --cluster bcube_3_2 --payload-mb resnet50 --repeats 3 [--json out.json]

``syncplane bench`` times Canary as it runs in training (always the gradient sketch); on a
2-core machine emulating 9 hosts that measures the codec's CPU as much as the network.
This script separates the two, in one run on the same cluster: gloo's ``all_reduce`` (the
ring DDP runs, in rank order, over the relays), the same ring over the same ranks renumbered
so that ring neighbours are one address digit apart (``direct_ranks``: no hop is relayed), the
cube exchange (``syncplane.exchanges.CubeExchange``) with exact fp32 (the topology's gain
alone) and with the gradient sketch (what Canary sends). Time = median over repeats of
the slowest rank; the cost model's bound of each pattern is printed beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench_comm import timed   # same directory: the shared timing loop of the comm benchmarks




def direct_ranks(profile: Any) -> list[int]:
    """Every rank, host by host in ``BCubeSpec.direct_ring``'s order (no ring hop relayed)."""
    hosts = [profile.hosts[h] for h in profile.bcube.direct_ring()]
    return [r for h in hosts for r in range(h.first_rank, h.first_rank + h.spec.ranks)]


def _direct_ring(job: Any) -> Any:
    """A gloo group of every rank, renumbered in ``direct_ranks``' order."""
    from torch.distributed import distributed_c10d

    ranks = direct_ranks(job.profile)
    store = dist.PrefixStore("direct_ring", distributed_c10d._get_default_store())
    return dist.ProcessGroupGloo(store, ranks.index(dist.get_rank()), len(ranks), datetime.timedelta(seconds=900))


def _rank(result_path: str, payload_bytes: int, repeats: int) -> None:
    """One rank inside an emulated host (started by ``launch_on_cluster``, torchrun env)."""
    from syncplane.comm import GradientSketch, StreamRunner
    from syncplane.exchanges import CubeExchange, cube_shape
    from syncplane.job import JobContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    job = JobContext.from_environment()
    shape = cube_shape(job.profile) if job.profile is not None else None
    if shape is None:
        raise SystemExit("bench_cube: the cluster is not a BCube profile")
    numel = payload_bytes // 4
    colayer = 25 * 2**20 // 4                               # DDP-sized colayers, as the bench's canary step
    payload = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    parts = list(payload.split(colayer))
    times = {"gloo_ring": timed(lambda: [dist.all_reduce(p) for p in parts], repeats)}
    direct = _direct_ring(job)
    times["gloo_ring_direct"] = timed(lambda: [direct.allreduce([p]).wait() for p in parts], repeats)
    for name, codec in (("cube_fp32", None), ("cube_sketch", GradientSketch())):
        cube = StreamRunner(CubeExchange(*shape), codec=codec, interfaces=job.interfaces)
        times[name] = timed(lambda: [cube.allreduce_mean_(p, offset=i * colayer, total=numel)
                                      for i, p in enumerate(parts)], repeats)
        cube.close()
    if dist.get_rank() == 0:
        Path(result_path).write_text(json.dumps(times))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/bench_cube.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", default="bcube_3_2", help="a BCube profile (shipped name or YAML path)")
    parser.add_argument("--payload-mb", default="resnet50", help="MB, or a preset: resnet50, bert_large")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--rank", nargs=3, metavar=("RESULT", "BYTES", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        _rank(args.rank[0], int(args.rank[1]), int(args.rank[2]))
        return 0

    from syncplane.algorithms.canary import sketch_ratio
    from syncplane.bench.runner import parse_payload
    from syncplane.cluster import load_profile
    from syncplane.cluster.bound import allreduce_network_bound
    from syncplane.cluster.cost import CostModel, ring_allreduce
    from syncplane.exchanges.digit import cube_cost
    from syncplane.runtime.launcher import launch_on_cluster

    profile = load_profile(args.cluster)
    if profile.bcube is None:
        parser.error(f"--cluster {args.cluster}: not a BCube profile (no bcube key)")
    payload = parse_payload(args.payload_mb)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "times.json"
        launch_on_cluster([sys.executable, os.path.abspath(__file__), "--rank", str(result), str(payload),
                           str(args.repeats)], profile, Path(tmp) / "logs", echo_rank0=False)
        times = json.loads(result.read_text())
    model = CostModel(profile)
    ratio = sketch_ratio(25 * 2**20 // 4, profile.world_size * profile.bcube.beta)
    bounds = {"gloo_ring": model.bound(ring_allreduce(profile.world_size, payload)),
              "gloo_ring_direct": model.bound(ring_allreduce(profile.world_size, payload, ranks=direct_ranks(profile))),
              "cube_fp32": model.bound(cube_cost(profile, payload)),
              "cube_sketch": model.bound(cube_cost(profile, payload * ratio))}
    network = allreduce_network_bound(profile, payload).seconds
    rows = [{"pattern": k, "seconds": v, "bound_s": bounds[k], "bound_ratio": bounds[k] / v,
             "network_bound_ratio": network / v, "vs_ring": times["gloo_ring"] / v} for k, v in times.items()]
    print(f"{profile.name}, {payload / 2**20:.1f} MB, network bound {network:.3f} s")
    print(f"{'pattern':<16} {'s':>8} {'bound s':>8} {'ratio':>6} {'net ratio':>9} {'vs ring':>8}")
    for r in rows:
        print(f"{r['pattern']:<16} {r['seconds']:8.3f} {r['bound_s']:8.3f} {r['bound_ratio']:6.2f} "
              f"{r['network_bound_ratio']:9.2f} {r['vs_ring']:7.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"cluster": profile.name, "payload_bytes": payload,
                                               "network_bound_s": network, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
