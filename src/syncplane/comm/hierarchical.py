"""Hierarchical neighbour all-reduce: average inside each machine, exchange between
machines (one process per machine talks), broadcast the result inside the machine.

``y_r = Σ_m' Am[m', m(r)] · mean(x on machine m')`` for the static machine topology
(``set_machine_topology``); the dynamic form takes ``self_weight``,
``src_machine_weights`` and ``dst_machine_weights`` in *machine* ranks and applies the
dynamic formula of ``neighbor_allreduce`` at machine level. Only the machines'
leaders (local rank 0) cross the slow inter-machine links, once each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from syncplane import kernels
from syncplane.comm import context, topology
from syncplane.comm.check import check_if_enabled
from syncplane.comm.meter import CommMeter
from syncplane.comm.p2p import DEFAULT_TIMEOUT_S, Handle, exchange


def hierarchical_neighbor_allreduce(
    tensor: torch.Tensor, self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    *, enable_topo_check: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
    meter: CommMeter | None = None,
) -> torch.Tensor:
    layout = context.machine_layout()
    me = dist.get_rank()
    machine = layout.machine_of(me)
    intra = layout.groups[machine]
    local_mean = tensor.detach().clone().contiguous()
    if intra is not None:
        dist.all_reduce(local_mean, group=intra)
        local_mean /= layout.local_size

    self_w, src, dst, dynamic = _machine_plan(layout, machine, self_weight, src_machine_weights,
                                              dst_machine_weights)
    is_leader = me == layout.leader_of(machine)
    leader_sends = {layout.leader_of(m): s for m, s in dst.items()} if is_leader else {}
    leader_recvs = {layout.leader_of(m): w for m, w in src.items()} if is_leader else {}
    check_if_enabled(enable_topo_check, dynamic, leader_sends, leader_recvs,
                     what="hierarchical_neighbor_allreduce")

    result = local_mean
    if is_leader:
        sources, weights = list(leader_recvs), list(leader_recvs.values())
        handle = exchange(local_mean, leader_sends, sources, None,
                          lambda received: kernels.weighted_combine(local_mean, received, weights, self_w),
                          timeout_s=timeout_s, what="hierarchical_neighbor_allreduce", meter=meter)
        result = handle.wait()
    if intra is not None:
        dist.broadcast(result, group=intra, group_src=0)
    return result


def _machine_plan(layout: context.MachineLayout, machine: int, self_weight: float | None,
                  src: Mapping[int, float] | None, dst: Mapping[int, float] | Sequence[int] | None,
                  ) -> tuple[float, dict[int, float], dict[int, float], bool]:
    if self_weight is None and src is None and dst is None:
        return (*topology.static_weights(layout.graph, machine), False)
    if self_weight is None or src is None or dst is None:
        raise ValueError("dynamic hierarchical_neighbor_allreduce needs self_weight, src_machine_weights "
                         "and dst_machine_weights")
    return float(self_weight), {int(j): float(w) for j, w in src.items()}, topology.as_destinations(dst), True


_background: ThreadPoolExecutor | None = None


def hierarchical_neighbor_allreduce_nonblocking(
    tensor: torch.Tensor, self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    *, enable_topo_check: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
    meter: CommMeter | None = None,
) -> Handle:
    """``hierarchical_neighbor_allreduce`` on a background thread; ``.wait()`` returns the result.

    The operation chains three dependent steps (intra-machine reduce, leader exchange,
    broadcast), so it cannot be one batch of async works; one worker thread runs the
    launched operations in launch order (the same order on every rank) while the
    caller computes -- gloo releases the GIL while it moves data. ``tensor`` must not
    be modified until ``wait()`` returns. Keep the topology check off on hot paths: it is
    a collective on the default group and could interleave with the caller's own.
    """
    global _background
    if _background is None:
        _background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncplane-hierarchical")
    future = _background.submit(hierarchical_neighbor_allreduce, tensor, self_weight, src_machine_weights,
                                dst_machine_weights, enable_topo_check=enable_topo_check, timeout_s=timeout_s,
                                meter=meter)
    return Handle(_finish=future.result)
