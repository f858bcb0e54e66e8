"""A host's loopback capacity on this machine, as the baseline's all-reduce uses it: what the
cost model's loopback links carry (``syncplane.exchanges.cpu.loopback_op``).

Loopback is memory-to-memory copying by the kernel, so its rate is this machine's and depends
on how many ranks share it (two 2-core EPYCs: 2.5 and about 4 GB/s with 4 ranks,
``docs/design-notes.md``). It is timed with ``DDPStep`` itself -- the bench's bucketed ring
all-reduce, its sums and its average -- in a gloo group of ``ranks`` child processes on
loopback (``comm.timing``): the median over a few warm steps of the slowest rank's wall time
(a step's sync time, as ``syncplane bench`` reads it), per element the ring puts on the
host's loopback (each rank sends 2(n-1)/n of the payload: 2(n-1) payloads in all).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from syncplane.algorithms.ddp.bench import DDPStep
from syncplane.comm import CommMeter
from syncplane.comm.timing import join_child_group, report, time_in_group
from syncplane.exchanges.cpu import LOOPBACK_ELEMENTS, CpuWork, loopback_op, loopback_ranks


def loopback_work(ranks_per_host: int) -> CpuWork:
    """The loopback's rate as an op to calibrate (no CPU work: it prices nothing itself)."""
    ranks = loopback_ranks(ranks_per_host)
    # timed on its own size (``LOOPBACK_ELEMENTS``, what the op's name says), not the one given
    return CpuWork(timers={loopback_op(ranks): lambda _numel: seconds_per_element(ranks)})


def seconds_per_element(ranks: int, numel: int = LOOPBACK_ELEMENTS) -> float:
    """Seconds per fp32 element through one host's loopback while ``ranks`` ranks on it run
    ``DDPStep`` on ``numel`` elements each (module doc)."""
    steps = time_in_group(__name__, [str(numel)], ranks, loopback_op(ranks))
    return statistics.fmean(steps) / (2 * (ranks - 1) * numel)


def time_step(numel: int, group_rank: int, repeats: int = 5) -> float:
    """The median of ``repeats`` warm ``DDPStep`` steps on ``numel`` elements, each the slowest
    rank's wall time from a barrier, as rank ``group_rank`` of the default gloo group."""
    step = DDPStep()
    payload = torch.randn(numel, generator=torch.Generator().manual_seed(group_rank))
    step(payload, 0, CommMeter())
    seconds = []
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step(payload, 1 + i, CommMeter())
        slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds.append(slowest.item())
    return statistics.median(seconds)


def main() -> None:
    """``NUMEL`` and the group's (``comm.timing``) -> reports ``time_step``'s seconds."""
    (numel,), group_rank = join_child_group(1)
    report(time_step(int(numel), group_rank))
