"""Hierarchical neighbour all-reduce: average inside each machine, mix machines with
their neighbours, and leave every process of a machine holding the machine's result.

``y_r = Σ_m' Am[m', m(r)] · mean(x on machine m')`` for the static machine topology
(``set_machine_topology``); the dynamic form takes ``self_weight``,
``src_machine_weights`` and ``dst_machine_weights`` in *machine* ranks and applies the
dynamic formula of ``neighbor_allreduce`` at machine level.

Data path (why it is not BlueFog's leader-only one): a reduce-scatter inside the machine
leaves local rank ℓ with shard ℓ of the machine mean; each local rank exchanges *its
shard* with local rank ℓ of the neighbouring machines; an all-gather inside the machine
reassembles the mixed result. The inter-machine traffic is the same (one payload per
machine per neighbour), but it is spread over every process -- and over every NIC of a
multi-NIC machine -- while the intra-machine traffic drops from an all-reduce plus a
broadcast (the leader's NIC sending the whole payload to every member) to a
reduce-scatter plus an all-gather. Measured on an emulated two-rack cluster, the
leader-only path was slower than flat neighbour averaging; this one is faster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from syncplane import kernels
from syncplane.comm import context, topology
from syncplane.comm.check import check_if_enabled
from syncplane.comm.meter import CommMeter
from syncplane.comm.p2p import DEFAULT_TIMEOUT_S, Handle, exchange


def machine_peers(layout: context.MachineLayout, rank: int, machines: Mapping[int, float]) -> dict[int, float]:
    """``{machine: value}`` -> ``{rank: value}``: the process with ``rank``'s local index on each machine."""
    local = rank - layout.leader_of(layout.machine_of(rank))
    return {layout.leader_of(m) + local: v for m, v in machines.items()}


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
    intra, local_size = layout.groups[machine], layout.local_size
    flat = tensor.detach().reshape(-1)
    shard_numel = math.ceil(flat.numel() / local_size)
    padded = flat if shard_numel * local_size == flat.numel() else torch.cat(
        [flat, flat.new_zeros(shard_numel * local_size - flat.numel())])
    local = me - layout.leader_of(machine)
    shard = padded.clone() if intra is None else _reduce_scatter_mean(padded.contiguous(), intra, local, local_size,
                                                                      timeout_s)

    self_w, src, dst, dynamic = _machine_plan(layout, machine, self_weight, src_machine_weights,
                                              dst_machine_weights)
    sends, recvs = machine_peers(layout, me, dst), machine_peers(layout, me, src)
    check_if_enabled(enable_topo_check, dynamic, sends, recvs, what="hierarchical_neighbor_allreduce")
    sources, weights = list(recvs), list(recvs.values())
    mixed = exchange(shard, sends, sources, None,
                     lambda received: kernels.weighted_combine(shard, received, weights, self_w),
                     timeout_s=timeout_s, what="hierarchical_neighbor_allreduce", meter=meter).wait()
    if intra is None:
        return mixed.reshape(tensor.shape)
    gathered = mixed.new_empty(shard_numel * local_size)
    dist.all_gather_single(gathered, mixed.contiguous(), group=intra)
    return gathered[: flat.numel()].reshape(tensor.shape)


def _reduce_scatter_mean(flat: torch.Tensor, group: dist.ProcessGroup, local: int, size: int,
                         timeout_s: float) -> torch.Tensor:
    """Shard ``local`` of the group's mean: every member sends shard j straight to member j.

    Each NIC sends and receives (L−1)/L of the payload once -- the reduce-scatter bound.
    (gloo's own ``reduce_scatter_tensor`` moved an all-reduce's worth of bytes, measured.)
    """
    shards = flat.view(size, -1)
    received = [torch.empty_like(shards[local]) for _ in range(size - 1)]
    peers = [j for j in range(size) if j != local]
    ops = [dist.P2POp(dist.isend, shards[j], group=group, group_peer=j) for j in peers]
    ops += [dist.P2POp(dist.irecv, buffer, group=group, group_peer=j) for j, buffer in zip(peers, received)]
    Handle(_works=[("exchanging a shard with machine-local rank", j, w)
                   for j, w in zip(peers + peers, dist.batch_isend_irecv(ops))],
           _finish=lambda: flat, _timeout_s=timeout_s, _what="hierarchical reduce-scatter").wait()
    return kernels.weighted_combine(shards[local], received, [1.0 / size] * len(received), 1.0 / size)


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
