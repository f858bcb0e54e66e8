"""``syncplane soak``: run each strategy's sync for many steps and check that nothing grows.

Users run for days; a sync that leaks one socket, one thread or one kilobyte per step dies
on day two, long after any test has ended. A soak runs the same step ``syncplane bench``
times (the family's ``bench_step``) ``steps`` times on a small payload over loopback, and
samples this process's resident memory, open file descriptors, threads and sockets every
``steps / samples`` steps on every rank.

The verdict is a slope, not a glance: over the second half of the samples (the first half
holds the warm-up: lazily created groups, threads, allocator pools) a least-squares line is
fitted per metric and rank, and its rise across the *whole* run must stay under the
tolerance -- zero for descriptors, threads and sockets (they are counted, so any rise is a
leak), ``rss_tolerance_mb`` for memory (the allocator is not exact). A leak of 1 KB per step
over 10,000 steps is a 10 MB rise: far above the default 4 MB.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from syncplane import algorithms
from syncplane.job import JobContext
from syncplane.comm import CommMeter
from syncplane.comm.basics import release_groups

#: counted metrics: any rise over the second half is a leak
COUNTED = ("fds", "threads", "sockets")
RSS_TOLERANCE_MB = 4.0


def sample() -> dict[str, float]:
    """This process's resident memory (bytes), open descriptors, threads and sockets."""
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass   # the descriptor listing the directory itself, closed by now
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return {"rss": float(pages * os.sysconf("SC_PAGE_SIZE")), "fds": float(len(fds)),
            "threads": float(len(os.listdir("/proc/self/task"))), "sockets": float(sockets)}


def rise(steps: list[int], values: list[float]) -> float:
    """The least-squares line through the second half of ``(steps, values)``, extended
    over the whole run: how much the metric grows from the first step to the last."""
    half = len(steps) // 2
    x, y = np.asarray(steps[half:], dtype=float), np.asarray(values[half:], dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        return 0.0
    slope = np.polyfit(x, y, 1)[0]
    return float(slope * (steps[-1] - steps[0]))


def verdict(steps: list[int], samples: list[dict[str, float]], rss_tolerance_mb: float) -> dict[str, Any]:
    """Rise per metric over the run and whether it is within tolerance."""
    rises = {key: rise(steps, [s[key] for s in samples]) for key in ("rss", *COUNTED)}
    limits = {"rss": rss_tolerance_mb * 2**20, **{key: 0.5 for key in COUNTED}}
    flat = all(rises[key] < limits[key] for key in rises)
    return {"rise": rises, "flat": flat, "first": samples[0], "last": samples[-1]}


def worker(spec_path: str) -> None:
    """One rank: every strategy's sync for ``steps`` steps, sampled; rank 0 writes the results."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=120))
    rank, steps = dist.get_rank(), int(spec["steps"])
    job = JobContext.from_environment(rank=rank, world_size=dist.get_world_size())
    every = max(1, steps // int(spec["samples"]))
    results: dict[str, Any] = {}
    for name in spec["strategies"]:
        sync = algorithms.spec_for(name).bench_step(name, spec, job)
        payload = torch.randn(int(spec["payload_bytes"]) // 4, generator=torch.Generator().manual_seed(rank))
        meter, at, samples = CommMeter(), [], []
        start = time.perf_counter()
        for step in range(steps):
            sync(payload, step, meter)
            if step % every == 0 or step == steps - 1:
                at.append(step)
                samples.append(sample())
        elapsed = time.perf_counter() - start
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (at, samples))
        if rank == 0:
            per_rank = [verdict(a, s, float(spec["rss_tolerance_mb"])) for a, s in gathered]
            results[name] = {"steps": steps, "seconds": elapsed, "ranks": per_rank,
                             "flat": all(r["flat"] for r in per_rank)}
            print(f"soak: {name}: {steps} steps in {elapsed:.1f} s, "
                  f"{'flat' if results[name]['flat'] else 'GROWS'}", flush=True)
        del sync
    if rank == 0:
        Path(spec_path).with_name("results.json").write_text(json.dumps(results, indent=1))
    release_groups()


def run_soak(strategies: list[str], *, steps: int, ranks: int, payload_bytes: int, out_dir: Path,
             samples: int = 50, rss_tolerance_mb: float = RSS_TOLERANCE_MB) -> dict[str, Any]:
    """Launch ``ranks`` local processes (loopback, a file store: no listener beyond gloo's
    on ``lo``) that soak every strategy in turn; returns rank 0's results."""
    from syncplane.runtime.launcher import launch, local_ranks

    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / "store"
    store.unlink(missing_ok=True)
    spec = {"strategies": strategies, "steps": steps, "samples": samples, "payload_bytes": payload_bytes,
            "rss_tolerance_mb": rss_tolerance_mb, "store": str(store.resolve()), "warmup": 0, "period": 4,
            "shards": 1, "compression": "none", "pair_streams": 1, "compute_ms": 0.0}
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    launch([sys.executable, "-m", "syncplane.bench.soak", str(spec_path)], local_ranks(ranks), out_dir / "logs",
           env=env)
    return json.loads((out_dir / "results.json").read_text())


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="syncplane soak: rise over the run (second-half slope), worst rank")
    for column in ("strategy", "steps", "s", "RSS MB", "fds", "threads", "sockets", "verdict"):
        table.add_column(column, justify="left" if column in ("strategy", "verdict") else "right")
    for name, result in results.items():
        worst = {key: max(r["rise"][key] for r in result["ranks"]) for key in ("rss", *COUNTED)}
        table.add_row(name, f"{result['steps']:,}", f"{result['seconds']:.1f}", f"{worst['rss'] / 2**20:+.2f}",
                      *(f"{worst[key]:+.2f}" for key in COUNTED), "flat" if result["flat"] else "GROWS")
    Console().print(table)


if __name__ == "__main__":
    worker(sys.argv[1])
