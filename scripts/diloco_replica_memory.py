"""Host memory of DiLoCo's outer state per rank, ``replica: rank`` against ``replica: node``.

Runs the engines Lightning-free on real gloo ranks (nodes given as ranks per host) with an
MLP of ``--params`` values: a few inner SGD steps with momentum and ``--rounds`` outer rounds,
then prints, per layout, each rank's outer-state bytes (θ_g, the outer optimizer's state and
Δ: ``outer_state_bytes``) and its peak RSS (``ru_maxrss``, which includes the interpreter and
torch: compare the layouts, not the absolute value; also shown above the RSS at the start). On
CPU the model, its gradients, DDP's buckets and FSDP's unsharded parameters are host memory
too, which on a GPU job would sit on the device. Each layout runs in fresh processes.

    python3 scripts/diloco_replica_memory.py --ranks 4 --per-host 2 --params 8000000
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syncplane.runtime.launcher import free_port


def _model(params: int) -> torch.nn.Module:
    width = max(8, int((params / 2) ** 0.5))    # two square layers of width x width
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))


def _rank(rank: int, world: int, port: int, layout: str, per_host: int, params: int, rounds: int, out: str) -> None:
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import node_layout
    from syncplane.algorithms.diloco.node import NodeEngine
    from syncplane.comm import CommMeter
    from syncplane.job import JobContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    job = JobContext(rank=rank, world_size=world, local_world_size=per_host)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # interpreter, torch, the groups
    model = _model(params)
    replica, inner = layout.split("-") if "-" in layout else (layout, "ddp")
    config = DiLoCoConfig(sync_every=2, exchange="mesh", replica=replica, inner=inner)
    if replica == "rank":
        tensors = [p.data for p in model.parameters()]
        engine, module = DiLoCoEngine(tensors, sum(t.numel() for t in tensors), config, job), model
    else:
        engine = NodeEngine(model, config, job, node_layout(replica, inner, job))
        module = engine.module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    width = model[0].in_features
    for step in range(2 * rounds):
        optimizer.zero_grad()
        module(torch.randn(8, width)).square().mean().backward()
        optimizer.step()
        if (step + 1) % 2 == 0:
            tensors = [p.data for p in model.parameters()]
            engine.launch(tensors, 0, step + 1, False, CommMeter())
            engine.merge(tensors, engine.outer.pop(0), 0.0)
    result = {"layout": layout, "rank": rank, "params": sum(p.numel() for p in model.parameters()),
              "outer_state_bytes": engine.outer_state_bytes(),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_before_bytes": before}
    engine.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"{layout}-{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--params", type=int, default=8_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", default="rank,node,node-fsdp")
    parser.add_argument("--out", default="/tmp/diloco_replica_memory")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for layout in args.layouts.split(","):
        mp.spawn(_rank, args=(args.ranks, free_port(), layout, args.per_host, args.params, args.rounds, args.out),
                 nprocs=args.ranks)
        rows = [json.load(open(os.path.join(args.out, f"{layout}-{r}.json"))) for r in range(args.ranks)]
        print(f"{layout:10s} params {rows[0]['params']:,}  outer-state MB per rank "
              f"{[round(r['outer_state_bytes'] / 2**20, 1) for r in rows]}  peak RSS MB per rank "
              f"{[round(r['peak_rss_bytes'] / 2**20) for r in rows]}  peak RSS above the start MB "
              f"{[round((r['peak_rss_bytes'] - r['rss_before_bytes']) / 2**20) for r in rows]}")


if __name__ == "__main__":
    main()
