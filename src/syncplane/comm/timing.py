"""Timing a routine in a gloo group of child processes on loopback: what this machine's CPU
rates for torch's DDP hooks and for a host's loopback are measured with
(``syncplane.exchanges.cpu``).

``time_in_group`` starts ``ranks`` children, each running a module's ``main`` with the given
arguments and ``RANKS GROUP_RANK STORE`` after them; each joins one gloo group through a
``FileStore`` (``join_child_group``), times its routine, and reports one number (``report``). The
children are watched together, so a child that fails stops the others at once (they would
wait for it in gloo), and none outlives the call. Their gloo listens on loopback only.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TIMEOUT_S = 300


class ChildKilled(RuntimeError):
    """A timing child died by a signal."""


def time_in_group(module: str, args: Sequence[str], ranks: int, what: str) -> list[float]:
    """Every child's reported number (``module.main`` run by ``ranks`` children, see the
    module doc). A group with a child killed by a signal is timed once more (children aborted
    in gloo's teardown under load before they left without one, ``report``); a child that
    fails, or a group past ``TIMEOUT_S``, is a RuntimeError naming ``what``."""
    try:
        return _run_group(module, args, ranks, what)
    except ChildKilled as exc:
        log.warning("%s; timing it again", exc)
    try:
        return _run_group(module, args, ranks, what)
    except ChildKilled as exc:
        raise RuntimeError(str(exc)) from None


def _run_group(module: str, args: Sequence[str], ranks: int, what: str) -> list[float]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    with tempfile.TemporaryDirectory(prefix="syncplane-timing-") as folder:
        logs = [(Path(folder) / f"{r}.out", Path(folder) / f"{r}.err") for r in range(ranks)]
        children: list[subprocess.Popen[bytes]] = []
        stopped: set[int] = set()           # the children stopped here, not failed by themselves
        try:
            for r, (out, err) in enumerate(logs):
                with out.open("w") as stdout, err.open("w") as stderr:
                    children.append(subprocess.Popen(
                        [sys.executable, "-c", f"from {module} import main; main()", *args,
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
            return [float(out.read_text().split()[-1]) for out, _ in logs]
        first = next((i for i, code in enumerate(codes) if code != 0 and i not in stopped), None)
        if first is None:
            raise RuntimeError(f"timing {what} took longer than {TIMEOUT_S} s")
        tail = "\n".join(logs[first][1].read_text().strip().splitlines()[-5:])
        if codes[first] < 0:
            raise ChildKilled(f"timing {what}: child {first} died by signal {-codes[first]}: {tail}")
        raise RuntimeError(f"timing {what} failed (child {first}, exit {codes[first]}): {tail}")


def join_child_group(count: int) -> tuple[list[str], int]:
    """In a child: its ``count`` own arguments and its rank, once it has joined the group's
    gloo process group (one thread: a bench worker's and a training rank's setting)."""
    argv = sys.argv[1:]
    if len(argv) != count + 3:
        raise SystemExit(f"expected {count} arguments and RANKS GROUP_RANK STORE, got {argv}")
    ranks, group_rank, store = int(argv[count]), int(argv[count + 1]), argv[count + 2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, ranks), rank=group_rank, world_size=ranks)
    return argv[:count], group_rank


def report(value: float) -> None:
    """In a child: pass a barrier (every rank's timing is over: nothing of this rank is still
    awaited), print ``value`` and leave at once (``os._exit``), the gloo group never torn
    down: under load a child's teardown aborted ("Resource deadlock avoided": the last
    reference to the group dropped on one of the group's own threads, which cannot join
    itself), twice in a row in one suite run beside another."""
    dist.barrier()
    print(value, flush=True)
    sys.stderr.flush()
    os._exit(0)


def slowest_times(run: Callable[[], None], repeats: int, warmup: int = 1) -> list[float]:
    """Collective over the default group: ``run()`` ``warmup + repeats`` times, each from a
    barrier, and the slowest rank's wall time of each of the last ``repeats`` (the first ones
    open connections and leave slow start)."""
    slowest = torch.zeros(1, dtype=torch.float64)
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        run()
        slowest[0] = time.perf_counter() - start
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(slowest[0]))
    return times
