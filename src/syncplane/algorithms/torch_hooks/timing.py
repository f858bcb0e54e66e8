"""The CPU time of torch's DDP with a comm hook on this machine, per payload element: what
the cost model adds to the hook's wire (``syncplane.exchanges.cpu``).

torch's reducer and hook do more than send: the payload's backward through DDP, the copies
into and out of its buckets, and the hook's own work -- PowerSGD's error feedback, its two
matmuls and the orthogonalization; fp16's casts. On the emulator (every rank on this
machine's cores) that work, not the wire, is most of PowerSGD's step. It is timed here as
the bench runs it (``TorchHookStep``), on one thread, by one rank in a group of one (its
all-reduces move nothing), in a child process so that the caller's own process group, if it
has one, is left alone. The child's gloo listens on loopback only.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from syncplane.algorithms.torch_hooks.bench import TorchHookStep
from syncplane.comm import CommMeter
from syncplane.exchanges.cpu import Timer

TIMEOUT_S = 300


def hook_op(name: str, rank: int) -> str:
    """The CPU op that stands for one element through ``name``'s DDP step (PowerSGD: at ``rank``)."""
    return f"hook:{name}" + (f"(rank={rank})" if name == "torch_powersgd" else "")


def hook_timer(name: str, rank: int) -> Timer:
    return functools.partial(seconds_per_element, name, rank)


def seconds_per_element(name: str, rank: int, numel: int) -> float:
    """``name``'s step time per element on ``numel`` elements, timed in a child process."""
    child = f"from {__name__} import main; main()"
    result = subprocess.run([sys.executable, "-c", child, name, str(rank), str(numel)], capture_output=True,
                            text=True, timeout=TIMEOUT_S, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"timing {hook_op(name, rank)} failed (exit {result.returncode}): {tail}")
    return float(result.stdout.split()[-1])


def time_step(name: str, rank: int, numel: int, repeats: int = 5) -> float:
    """The fastest of ``repeats`` steps of ``TorchHookStep`` once the hook compresses (after its
    warm-up), per element; in a one-rank gloo group made here (the calling process must have none)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        step = TorchHookStep(name, {"powersgd_rank": rank})
        payload = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        for i in range(step.warmup + 1):
            step(payload, i, CommMeter())
        best = float("inf")
        for i in range(repeats):
            start = time.perf_counter()
            step(payload, step.warmup + 1 + i, CommMeter())
            best = min(best, time.perf_counter() - start)
        return best / numel
    finally:
        dist.destroy_process_group()


def main() -> None:
    """``NAME RANK NUMEL`` -> prints ``time_step``'s seconds per element."""
    print(time_step(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
