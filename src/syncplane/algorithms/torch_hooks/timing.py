"""The CPU time of torch's DDP with a comm hook on this machine, per payload element: what
the cost model adds to the hook's wire (``syncplane.exchanges.cpu``).

torch's reducer and hook do more than send: the payload's backward through DDP, the copies
into and out of its buckets, and the hook's own work -- PowerSGD's error feedback, its two
matmuls and the orthogonalization; fp16's casts. On the emulator (every rank on this
machine's cores) that work, not the wire, is most of PowerSGD's step. It is timed here as
the bench runs it (``TorchHookStep``), by one rank in a group of one (its all-reduces move
nothing), in a child process so that the caller's own process group, if it has one, is left
alone. The child's gloo listens on loopback only.

What is timed is the step's **CPU seconds** (every thread of the process), on the payload's
own size up to ``TIMED_MAX_ELEMENTS``: once a payload spans several of DDP's buckets, the
reducer works on one bucket while the backward fills the next, on two threads, and costs
more per element than on one bucket. Ranks that share cores (the emulator) pay the CPU
seconds, not the wall time; a rank with cores of its own may run the step somewhat faster
than priced. Measurements: ``docs/benchmarks.md``, "torch's hooks priced by their CPU seconds".
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from syncplane.algorithms.torch_hooks.bench import TorchHookStep
from syncplane.comm import DEFAULT_BUCKET_BYTES, CommMeter
from syncplane.exchanges.cpu import Timer

log = logging.getLogger(__name__)

TIMEOUT_S = 300
#: the most elements a hook's step is timed on: four of DDP's buckets (past one bucket the
#: per-element cost settles; a BERT-large payload would take minutes and gigabytes to time)
TIMED_MAX_ELEMENTS = 4 * DEFAULT_BUCKET_BYTES // 4


def timed_elements(elements: int) -> int:
    """The size a payload of ``elements`` has its hook's step timed on."""
    return min(elements, TIMED_MAX_ELEMENTS)


def hook_op(name: str, rank: int, elements: int) -> str:
    """The CPU op that stands for one element through ``name``'s DDP step (PowerSGD: at
    ``rank``) timed on ``elements`` (``timed_elements``): its rate depends on the size."""
    return f"hook:{name}" + (f"(rank={rank})" if name == "torch_powersgd" else "") + f"@{elements}"


def hook_timer(name: str, rank: int) -> Timer:
    """Times ``name``'s step on the elements it is given, capped by ``timed_elements``."""
    return functools.partial(_time_capped, name, rank)


def _time_capped(name: str, rank: int, numel: int) -> float:
    return seconds_per_element(name, rank, timed_elements(numel))


def seconds_per_element(name: str, rank: int, numel: int) -> float:
    """``name``'s CPU seconds per element of a step on ``numel`` elements, timed in a child process.

    A child killed by a signal is timed once more: one aborted in gloo's teardown under load
    ("Resource deadlock avoided", seen once in a full suite run) measured nothing wrong."""
    child = f"from {__name__} import main; main()"
    for attempt in range(2):
        result = subprocess.run([sys.executable, "-c", child, name, str(rank), str(numel)], capture_output=True,
                                text=True, timeout=TIMEOUT_S, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
        if result.returncode >= 0 or attempt:
            break
        log.warning("timing %s: the child died by signal %d; timing it again", hook_op(name, rank, numel),
                    -result.returncode)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"timing {hook_op(name, rank, numel)} failed (exit {result.returncode}): {tail}")
    return float(result.stdout.split()[-1])


def time_step(name: str, rank: int, numel: int, repeats: int = 5) -> float:
    """The least CPU time (``time.process_time``: every thread of this process) of ``repeats``
    warm steps of ``TorchHookStep`` (after its ``warmup``), per element; in a one-rank gloo group
    made here (the calling process must have none)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        step = TorchHookStep(name, {"matrix_approximation_rank": rank})
        payload = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        for i in range(step.warmup):
            step(payload, i, CommMeter())
        best = float("inf")
        for i in range(repeats):
            start = time.process_time()
            step(payload, step.warmup + i, CommMeter())
            best = min(best, time.process_time() - start)
        return best / numel
    finally:
        dist.destroy_process_group()


def main() -> None:
    """``NAME RANK NUMEL`` -> prints ``time_step``'s seconds per element."""
    print(time_step(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
