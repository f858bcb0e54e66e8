"""Asynchronous push-sum average consensus over window operations (BlueFog Listing 3).

Each rank holds ``(x, p)`` with ``p = 1``; every iteration it pushes a share
``1/(d+1)`` of both to each of its d out-neighbours' windows (``win_accumulate``),
keeps the same share itself, and folds in whatever has arrived
(``win_update_then_collect``). Total mass Σ(x, p) never changes, so ``x / p`` on every
rank converges to the exact average -- with no barrier inside the loop, whatever the
ranks' relative speeds. Needs a strongly connected topology.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from syncplane.comm import context, topology, window


def push_sum_average(x: torch.Tensor, *, iterations: int | None = None, seconds: float | None = None,
                     name: str = "push_sum", on_iteration: Callable[[int], None] | None = None) -> torch.Tensor:
    """The global average of ``x`` (any shape; computed in float64), asynchronously.

    Stops after ``iterations`` local iterations or after ``seconds`` of wall time
    (whichever is given; a time budget keeps slow and fast ranks mixing over the same
    period). ``on_iteration(i)`` runs at the start of each iteration (e.g. to simulate
    a straggler). Collective at entry and exit only.
    """
    if (iterations is None) == (seconds is None):
        raise ValueError("give exactly one of iterations= or seconds=")
    graph = context.load_topology()
    if not topology.is_strongly_connected(graph):
        raise ValueError("push-sum needs a strongly connected topology")
    extended = torch.cat([x.detach().reshape(-1).double(), torch.ones(1, dtype=torch.float64)])
    window.win_create(extended, name=name, zero_init=True)
    outdegree = len(context.out_neighbor_ranks())
    share = 1.0 / (outdegree + 1)
    destinations = {k: share for k in context.out_neighbor_ranks()}
    deadline = time.monotonic() + seconds if seconds is not None else None
    step = 0
    while (iterations is not None and step < iterations) or (deadline is not None and time.monotonic() < deadline):
        if on_iteration is not None:
            on_iteration(step)
        window.win_accumulate(extended, name=name, self_weight=share, dst_weights=destinations, require_mutex=False)
        window.win_update_then_collect(name)
        step += 1
    dist.barrier()                       # every push has landed (win_accumulate waits for its acks)
    window.win_update_then_collect(name)
    result = (extended[:-1] / extended[-1]).reshape(x.shape).to(x.dtype)
    window.win_free(name)
    return result
