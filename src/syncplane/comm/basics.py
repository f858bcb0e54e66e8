"""Process basics a BlueFog program asks for: start-up, ranks and sizes, machines, barriers,
and the parameter/optimizer-state broadcasts of ``bluefog.torch.utility``.

A "machine" is ``LOCAL_WORLD_SIZE`` consecutive ranks (what torchrun starts per host);
``machine_rank = rank // local_size``, as in BlueFog's homogeneous layout.
"""

from __future__ import annotations

import datetime
import gc
import logging
from collections.abc import Callable, Iterable

import networkx as nx
import torch
import torch.distributed as dist

from syncplane import net
from syncplane.comm import context, group_cache, process_groups, window
from syncplane.comm.neighbor import allreduce_, broadcast_
from syncplane.launch import Launch

log = logging.getLogger(__name__)

_started_here = False
_local_sizes: list[int] | None = None    # every rank's LOCAL_WORLD_SIZE, gathered by init()


def init(topology_fn: Callable[[int], nx.DiGraph] | None = None, is_weighted: bool = False,
         backend: str | None = None, timeout_s: float = 1800.0) -> None:
    """Join the job (``torch.distributed`` from torchrun's environment, unless already
    initialised) and set the topology: ``topology_fn(size)`` or exponential-2.

    ``is_weighted=False`` (BlueFog's default) averages uniformly over in-neighbours.
    """
    global _started_here, _local_sizes
    if not dist.is_initialized():
        chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        net.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout_s))
        _started_here = True
    sizes: list[object] = [None] * size()
    dist.all_gather_object(sizes, local_size())
    _local_sizes = [int(s) for s in sizes]  # type: ignore[call-overload]
    graph = topology_fn(size()) if topology_fn is not None else None
    context.set_topology(graph, is_weighted=is_weighted)


def shutdown() -> None:
    """Free the windows, stop RPC and, if ``init`` started it, leave the process group."""
    global _started_here
    window.shutdown()
    release_groups(destroy_default=_started_here)
    _started_here = False


def release_groups(destroy_default: bool = True) -> None:
    """Drop every process group syncplane holds (control group, cached groups, the
    background worker's topology state) and, with ``destroy_default``, leave the default
    group -- now, while the interpreter is whole.

    Why: a gloo group still referenced from a module global is destroyed during interpreter
    finalization, where its threads can abort the process ("terminate called without an
    active exception") after a run that succeeded; the launcher then reports a failed rank.
    ``destroy_process_group`` alone does not help, since it only forgets the groups it
    created, and our caches still hold them.
    """
    context.reset()
    group_cache.clear()
    process_groups.reset()
    if destroy_default and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def destroy_subgroups() -> None:
    """``release_groups`` but for the default group, and destroy every other process group
    torch holds, on this rank (every rank calls it at the same point, with nothing in flight).

    Why: each gloo group keeps threads and sockets until destroyed. After a strategy that
    made hundreds of groups (DS-Sync's pair groups and streams: 2,000 threads on 8 ranks),
    their wake-ups cost a timed run that follows in the same processes up to 2.6x (measured
    on ``homogeneous8``), so ``syncplane bench`` destroys them between strategies. torch has
    no public list of its groups; ``_world.pg_map`` is where ``new_group`` registers them."""
    if dist.is_initialized():
        world = dist.group.WORLD
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not world:
                dist.destroy_process_group(group)
    release_groups(destroy_default=False)       # our caches' references go too, then one collect


def size() -> int:
    return dist.get_world_size()


def rank() -> int:
    return dist.get_rank()


def local_size() -> int:
    """Processes on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 when not launched by it)."""
    return context.launched_local_size()


def local_rank() -> int:
    """This process's index on its machine (``LOCAL_RANK``, else ``rank mod local_size``)."""
    launched = Launch.read().local_rank
    return launched if launched is not None else rank() % local_size()


def machine_size() -> int:
    return size() // local_size()


def machine_rank() -> int:
    return rank() // local_size()


def is_homogeneous() -> bool:
    """Every machine runs the same number of processes (known exactly after ``init``;
    before it, assumed from this rank's ``LOCAL_WORLD_SIZE`` dividing the world size)."""
    if _local_sizes is not None:
        return len(set(_local_sizes)) == 1
    return size() % local_size() == 0


def barrier() -> None:
    dist.barrier()


def nccl_built() -> bool:
    return dist.is_nccl_available()


def is_topo_weighted() -> bool:
    return context.state().weighted


def load_machine_topology() -> nx.DiGraph:
    return context.machine_layout().graph


def in_neighbor_machine_ranks() -> list[int]:
    me = machine_rank()
    return sorted(j for j in load_machine_topology().predecessors(me) if j != me)


def out_neighbor_machine_ranks() -> list[int]:
    me = machine_rank()
    return sorted(k for k in load_machine_topology().successors(me) if k != me)


def broadcast_parameters(params: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
                         root_rank: int) -> None:
    """Overwrite every parameter (``model.named_parameters()`` or a state dict) with root's."""
    items = params.items() if isinstance(params, dict) else params
    with torch.no_grad():
        for _, p in sorted(items, key=lambda kv: kv[0]):
            broadcast_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank)


def allreduce_parameters(params: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> None:
    """Replace every parameter with its average over all ranks, in place."""
    items = params.items() if isinstance(params, dict) else params
    with torch.no_grad():
        for _, p in sorted(items, key=lambda kv: kv[0]):
            allreduce_(p.data if isinstance(p, torch.nn.Parameter) else p, average=True)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Load root's optimizer state (hyper-parameters and per-parameter buffers) on every rank."""
    state: list[object] = [optimizer.state_dict() if rank() == root_rank else None]
    dist.broadcast_object_list(state, src=root_rank)
    optimizer.load_state_dict(state[0])  # type: ignore[arg-type]
