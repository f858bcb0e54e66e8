"""One rank of ``syncplane bench``: ``python -m syncplane.bench.worker SPEC.json``.

Times each requested strategy's sync for ``warmup + steps`` steps (steps rounded up to whole periods
of a sync that has one, e.g. a one-peer schedule's ⌈log₂ n⌉) on a payload of the
given size. A step is: barrier, emulated compute (a timed wait: on a GPU cluster the
compute does not load the CPU that drives gloo), the sync. A strategy that overlaps its
sync with part of the step (its spec's ``overlap``) launches it, computes that part, then waits; its
sync time is what was left exposed: the step's wall time minus the compute. The sync
time of a step is the slowest rank's. Rank 0 writes ``results.json`` beside the spec, with
each rank's CPU seconds per step and what the whole machine's cores did meanwhile
(``machine_cpu_shares``: on the emulator every rank and the network's kernel work share them).
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from syncplane import net
from syncplane import algorithms
from syncplane.bench.syncs import compute_split
from syncplane.cluster.emulator import EmulationError, switch_drops
from syncplane.runtime.lifetime import skip_collection_at_exit
from syncplane.job import JobContext
from syncplane.comm import CommMeter
from syncplane.comm.basics import destroy_subgroups, release_groups


def _nic_tx_bytes() -> dict[str, int]:
    """Bytes each of this host's NICs has sent (its namespace's ``eth*`` counters)."""
    return {Path(path).parts[-3]: int(Path(path).read_text())
            for path in sorted(glob.glob("/sys/class/net/eth*/statistics/tx_bytes"))}


def timed_step(sync: Any, payload: torch.Tensor, step: int, meter: CommMeter, window: str | None,
               compute_s: float) -> float:
    """One step; returns the seconds the sync was exposed (not hidden behind compute)."""
    before, during, after = compute_split(window if hasattr(sync, "launch") else None, compute_s)
    time.sleep(before)
    start = time.perf_counter()
    if during:
        sync.launch(payload, step, meter)
        time.sleep(during)
        sync.wait()
    else:
        sync(payload, step, meter)
    exposed = max(0.0, time.perf_counter() - start - during)
    time.sleep(after)
    return exposed


def step_counts(warmup: int, sync_warmup: int, steps: int, period: int) -> tuple[int, int]:
    """Untimed and timed steps for a sync with rounds of ``period`` steps: both in whole
    periods (a schedule's may exceed ``--steps``), so that a warm-up of one step or more
    runs a whole round -- a periodic sync's first round pays its one-off costs (the first
    touch of its buffers, the optimizer's state, the exchange's first use), which the timed
    rounds must not -- and the timed steps start on a round's boundary."""
    warmup = max(warmup, sync_warmup)
    return -(-warmup // period) * period, -(-steps // period) * period


#: /proc/stat's columns (after "cpu"), in clock ticks of all cores together
PROC_STAT = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu_ticks(stat: str | None = None) -> dict[str, int]:
    """The machine's CPU time so far by kind (``PROC_STAT``), all cores together, from
    ``/proc/stat`` (or ``stat``, its text)."""
    text = Path("/proc/stat").read_text() if stat is None else stat
    fields = text.splitlines()[0].split()[1:len(PROC_STAT) + 1]
    return dict(zip(PROC_STAT, map(int, fields)))


def machine_cpu_shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """What the machine's cores did between two ``machine_cpu_ticks``, as shares of their
    whole capacity: ``busy`` (all but idle and I/O wait), of it ``user`` (with nice: the ranks'
    own code) and ``kernel`` (system, irq and softirq: syscalls and the emulated network's
    packet work, wherever the kernel accounts it)."""
    delta = {k: after[k] - before[k] for k in PROC_STAT}
    total = sum(delta.values())
    if total <= 0:
        return {"busy": 0.0, "user": 0.0, "kernel": 0.0}
    user = (delta["user"] + delta["nice"]) / total
    kernel = (delta["system"] + delta["irq"] + delta["softirq"]) / total
    return {"busy": 1 - (delta["idle"] + delta["iowait"]) / total, "user": user, "kernel": kernel}


def _drops(spec: dict[str, Any], rank: int) -> dict[str, int] | None:
    """The switch ports' drop counters now (rank 0, when the spec names the namespace);
    None when they cannot be read: a diagnostic, not worth failing the bench for."""
    namespace = spec.get("drops_namespace")
    if not namespace or rank != 0:
        return None
    try:
        return switch_drops(namespace)
    except (EmulationError, OSError) as exc:
        print(f"bench: no drop counters ({exc})", flush=True)
        return None


def _write_results(spec_path: str, world: int, results: dict[str, Any]) -> None:
    out = Path(spec_path).with_name("results.json")
    out.write_text(json.dumps({"world_size": world, "hostname_ns": os.uname().nodename, "results": results}))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    net.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout_s", 300)))
    rank, world = dist.get_rank(), dist.get_world_size()
    job = JobContext.from_environment(rank=rank, world_size=world)
    numel = int(spec["payload_bytes"]) // 4
    # a host of the profile at compute_speed s computes (fastest / s) times as long (--compute-ms is the fastest's)
    speeds = spec.get("compute_speeds") or [1.0] * world
    compute_s = spec["compute_ms"] / 1000 * max(speeds) / speeds[rank]
    results = {}
    for name in spec["strategies"]:     # a label: NAME or NAME[key=value,...] (its settings over the spec's)
        base, settings = algorithms.variant(name)
        family = algorithms.spec_for(base)
        sync = family.bench_step(base, {**spec, **settings, "period": spec["periods"].get(name, 1)}, job)   # its H
        period = getattr(sync, "period", 1)   # periodic syncs are amortized over their rounds
        warmup, steps = step_counts(spec["warmup"], getattr(sync, "warmup", 0), spec["steps"], period)
        payload = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        meter = CommMeter()
        for step in range(warmup):
            sync(payload, step, CommMeter())
        phases = getattr(sync, "profile", None) if spec.get("profile") else None
        if phases is not None:
            phases.reset()      # the timed steps only
        times = []
        tx_before, drops_before = _nic_tx_bytes(), _drops(spec, rank)
        ticks_before, cpu_before = machine_cpu_ticks(), time.process_time()
        for step in range(steps):
            dist.barrier()
            exposed = timed_step(sync, payload, warmup + step, meter, family.overlap.get(base), compute_s)
            elapsed = torch.tensor([exposed], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        finish = getattr(sync, "finish", None)   # a step that leaves messages in flight (DS-Sync's late peers)
        if finish is not None:
            finish()
        dist.barrier()
        # this rank's CPU (every thread of its process) and the whole machine's, over the timed steps
        cpu_s, shares = time.process_time() - cpu_before, machine_cpu_shares(ticks_before, machine_cpu_ticks())
        tx_after = _nic_tx_bytes()
        by_nic = {nic: (n - tx_before.get(nic, 0)) / steps for nic, n in tx_after.items()}
        tx = torch.tensor([float(sum(by_nic.values())) * steps, float(meter.bytes_sent), cpu_s], dtype=torch.float64)
        per_rank = [torch.zeros_like(tx) for _ in range(world)]
        dist.all_gather(per_rank, tx)
        nics: list[Any] = [None] * world
        dist.all_gather_object(nics, by_nic)
        if period > 1:
            times = [sum(times[i:i + period]) / period for i in range(0, len(times) - period + 1, period)]
        results[name] = {"step_s": times, "steps": steps, "comm_bytes": [float(t[1]) / steps for t in per_rank],
                         "nic_tx_bytes": [float(t[0]) / steps for t in per_rank], "nic_tx_by_nic": nics,
                         "cpu_s": [float(t[2]) / steps for t in per_rank], "machine_cpu": shares,
                         "cores": len(os.sched_getaffinity(0))}
        drops_after = _drops(spec, rank)
        if drops_before is not None and drops_after is not None:
            results[name]["switch_drops"] = {dev: (n - drops_before.get(dev, 0)) / steps
                                             for dev, n in drops_after.items()}
        if phases is not None:      # every rank's, in rank order
            profiles: list[Any] = [None] * world
            dist.all_gather_object(profiles, phases.as_dict())
            results[name]["profile"] = profiles
        described = sync.describe() if hasattr(sync, "describe") else None
        if described is not None:      # what the step settled on (DS-Sync's pair streams): kept in the row
            results[name]["described"] = described
        del sync, finish
        destroy_subgroups()      # its groups' threads would slow the strategies timed after it
        if rank == 0:
            print(f"bench: {name} median {sorted(times)[len(times) // 2]:.3f} s/step", flush=True)
            if described is not None:
                print(f"bench: {described}", flush=True)
            _write_results(spec_path, world, results)
    release_groups()


if __name__ == "__main__":
    skip_collection_at_exit()   # a fresh process's exit (a fork of the server leaves with os._exit)
    main(sys.argv[1])
