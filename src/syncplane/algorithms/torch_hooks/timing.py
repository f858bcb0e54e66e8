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
8-rank bench: ``docs/benchmarks.md``, "torch's hooks timed in a group of the job's size").
fp16's is timed alone (``timed_ranks``). The children rendezvous through a file, and their
gloo listens on loopback only.

What is timed is the step's **CPU seconds** (every thread of the process), the median of a
few warm steps on each rank, averaged over the ranks, on the payload's own size up to
``TIMED_MAX_ELEMENTS``: once a payload spans several of DDP's buckets, the reducer works on
one bucket while the backward fills the next, on two threads, and costs more per element
than on one bucket. Ranks that share cores (the emulator) pay the CPU seconds, not the wall
time; a rank with cores of its own may run the step somewhat faster than priced.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    child processes in one gloo group (``time_step``), averaged over them.

    A group with a child killed by a signal is timed once more (children aborted in gloo's
    teardown under load before they left without one, ``main``)."""
    try:
        return _time_group(name, rank, numel, ranks)
    except _ChildKilled as exc:
        log.warning("%s; timing it again", exc)
    try:
        return _time_group(name, rank, numel, ranks)
    except _ChildKilled as exc:
        raise RuntimeError(str(exc)) from None


class _ChildKilled(RuntimeError):
    """A timing child died by a signal."""


def _time_group(name: str, rank: int, numel: int, ranks: int) -> float:
    """One timing of ``seconds_per_element``: the group's children are watched together, so a
    child that fails stops the others at once (they would wait for it in gloo) and its error
    is raised; none outlives the call."""
    op, env = hook_op(name, rank, numel, ranks), {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    with tempfile.TemporaryDirectory(prefix="syncplane-hook-timing-") as folder:
        logs = [(Path(folder) / f"{r}.out", Path(folder) / f"{r}.err") for r in range(ranks)]
        children: list[subprocess.Popen[bytes]] = []
        stopped: set[int] = set()           # the children stopped here, not failed by themselves
        try:
            for r, (out, err) in enumerate(logs):
                with out.open("w") as stdout, err.open("w") as stderr:
                    children.append(subprocess.Popen(
                        [sys.executable, "-c", f"from {__name__} import main; main()", name, str(rank), str(numel),
                         str(ranks), str(r), str(Path(folder) / "store")], stdout=stdout, stderr=stderr, env=env))
            deadline = time.monotonic() + TIMEOUT_S
            while any(c.poll() is None for c in children):
                if any(c.returncode not in (None, 0) for c in children) or time.monotonic() > deadline:
                    break
                try:
                    next(c for c in children if c.returncode is None).wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for i, c in enumerate(children):
                if c.poll() is None:
                    stopped.add(i)
                    c.kill()
                    c.wait()
        codes = [c.returncode for c in children]
        if all(code == 0 for code in codes):
            return statistics.fmean(float(out.read_text().split()[-1]) for out, _ in logs)
        first = next((i for i, code in enumerate(codes) if code != 0 and i not in stopped), None)
        if first is None:
            raise RuntimeError(f"timing {op} took longer than {TIMEOUT_S} s")
        tail = "\n".join(logs[first][1].read_text().strip().splitlines()[-5:])
        if codes[first] < 0:
            raise _ChildKilled(f"timing {op}: child {first} died by signal {-codes[first]}: {tail}")
        raise RuntimeError(f"timing {op} failed (child {first}, exit {codes[first]}): {tail}")


def time_step(name: str, rank: int, numel: int, ranks: int, group_rank: int, store: str, repeats: int = 5) -> float:
    """The median CPU time (``time.process_time``: every thread of this process) of
    ``repeats`` warm steps of ``TorchHookStep`` (after its ``warmup``), per element, as rank
    ``group_rank`` of a gloo group of ``ranks`` made here (through a ``FileStore`` at
    ``store``; the calling process must have none), once every rank has passed a barrier.
    The median, not the least: every step of a job pays its own CPU, and the least of a few
    steps is what few of them see. The group is left up: the process leaves (``main``)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, ranks), rank=group_rank, world_size=ranks)
    step = TorchHookStep(name, {"matrix_approximation_rank": rank})
    payload = torch.randn(numel, generator=torch.Generator().manual_seed(group_rank))
    for i in range(step.warmup):
        step(payload, i, CommMeter())
    seconds = []
    for i in range(repeats):
        start = time.process_time()
        step(payload, step.warmup + i, CommMeter())
        seconds.append(time.process_time() - start)
    dist.barrier()          # every rank's steps are over: nothing of this rank is still awaited
    return statistics.median(seconds) / numel


def main() -> None:
    """``NAME RANK NUMEL RANKS GROUP_RANK STORE`` -> prints ``time_step``'s seconds per element,
    then leaves at once (``os._exit``), its gloo group never torn down: under load a child's
    teardown aborted ("Resource deadlock avoided": the last reference to the group dropped
    on one of the group's own threads, which cannot join itself), twice in a row in one
    suite run beside another."""
    name, rank, numel, ranks, group_rank, store = sys.argv[1:7]
    print(time_step(name, int(rank), int(numel), int(ranks), int(group_rank), store), flush=True)
    sys.stderr.flush()
    os._exit(0)
