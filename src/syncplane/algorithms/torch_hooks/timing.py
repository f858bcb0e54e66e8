"""The CPU time of torch's DDP with a comm hook on this machine, per payload element: what
the cost model adds to the hook's wire (``syncplane.exchanges.cpu``).

torch's reducer and hook do more than send: the payload's backward through DDP, the copies
into and out of its buckets, and the hook's own work -- PowerSGD's error feedback, its two
matmuls and the orthogonalization; fp16's casts. On the emulator (every rank on this
machine's cores) that work, not the wire, is most of PowerSGD's step. It is timed here as
the bench runs it (``TorchHookStep``). PowerSGD's is timed **in a gloo group of the job's
size** (up to ``TIMED_MAX_RANKS``), each rank a child process on loopback, so that a rank pays
what it pays in the job: its all-reduces' own CPU and whatever grows with the group (a rank
timed alone in a group of one costs 1.3-1.7x less per element than the same rank in an
8-rank bench: ``docs/design-notes.md``, "The cost model's CPU term").
fp16's is timed alone (``timed_ranks``). The children are ``syncplane.comm.timing``'s.

What is timed is the step's **CPU seconds** (every thread of the process), the median of a
few warm steps on each rank, averaged over the ranks, on the payload's own size up to
``TIMED_MAX_ELEMENTS``: once a payload spans several of DDP's buckets, the reducer works on
one bucket while the backward fills the next, on two threads, and costs more per element
than on one bucket. Ranks that share cores (the emulator) pay the CPU seconds, not the wall
time; a rank with cores of its own may run the step somewhat faster than priced.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from syncplane.algorithms.torch_hooks.bench import TorchHookStep
from syncplane.comm import DEFAULT_BUCKET_BYTES, CommMeter
from syncplane.comm.timing import join_child_group, report, time_in_group
from syncplane.exchanges.cpu import Timer

#: the most elements a hook's step is timed on: four of DDP's buckets (past one bucket the
#: per-element cost settles; a BERT-large payload would take minutes and gigabytes to time)
TIMED_MAX_ELEMENTS = 4 * DEFAULT_BUCKET_BYTES // 4
#: the largest group a hook's step is timed in: past a few ranks a rank's share of a ring's
#: work per step no longer grows, while the timing's processes and memory do
TIMED_MAX_RANKS = 8


def timed_elements(elements: int) -> int:
    """The size a payload of ``elements`` has its hook's step timed on."""
    return min(elements, TIMED_MAX_ELEMENTS)


def timed_ranks(name: str, world_size: int) -> int:
    """The size of the group a job of ``world_size`` ranks has ``name``'s step timed in: its
    own size (up to ``TIMED_MAX_RANKS``) for PowerSGD, whose all-reduces move almost nothing;
    one for fp16, whose step moves half the payload: in a group its copies through loopback
    would be priced on top of the wire's price of the same bytes, which they overlap."""
    return max(1, min(world_size, TIMED_MAX_RANKS)) if name == "torch_powersgd" else 1


def hook_op(name: str, rank: int, elements: int, ranks: int = 1) -> str:
    """The CPU op that stands for one element through ``name``'s DDP step (PowerSGD: at
    ``rank``) timed on ``elements`` (``timed_elements``) in a group of ``ranks``
    (``timed_ranks``): its rate depends on both."""
    return f"hook:{name}" + (f"(rank={rank})" if name == "torch_powersgd" else "") + f"@{elements}x{ranks}"


def hook_timer(name: str, rank: int, ranks: int = 1) -> Timer:
    """Times ``name``'s step on the elements it is given, capped by ``timed_elements``, in a
    group of ``ranks``."""
    return functools.partial(_time_capped, name, rank, ranks)


def _time_capped(name: str, rank: int, ranks: int, numel: int) -> float:
    return seconds_per_element(name, rank, timed_elements(numel), ranks)


def seconds_per_element(name: str, rank: int, numel: int, ranks: int = 1) -> float:
    """``name``'s CPU seconds per element of a step on ``numel`` elements, timed by ``ranks``
    child processes in one gloo group (``time_step``, through ``comm.timing``), averaged over
    them."""
    return statistics.fmean(time_in_group(__name__, [name, str(rank), str(numel)], ranks,
                                          hook_op(name, rank, numel, ranks)))


def time_step(name: str, rank: int, numel: int, group_rank: int, repeats: int = 5) -> float:
    """The median CPU time (``time.process_time``: every thread of this process) of
    ``repeats`` warm steps of ``TorchHookStep`` (after its ``warmup``), per element, as rank
    ``group_rank`` of the default gloo group. The median, not the least: every step of a job
    pays its own CPU, and the least of a few steps is what few of them see."""
    step = TorchHookStep(name, {"matrix_approximation_rank": rank})
    payload = torch.randn(numel, generator=torch.Generator().manual_seed(group_rank))
    for i in range(step.warmup):
        step(payload, i, CommMeter())
    seconds = []
    for i in range(repeats):
        start = time.process_time()
        step(payload, step.warmup + i, CommMeter())
        seconds.append(time.process_time() - start)
    return statistics.median(seconds) / numel


def main() -> None:
    """``NAME RANK NUMEL`` and the group's (``comm.timing``) -> reports ``time_step``'s
    seconds per element."""
    (name, rank, numel), group_rank = join_child_group(3)
    report(time_step(name, int(rank), int(numel), group_rank))
