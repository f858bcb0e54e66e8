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
leader-only path was slower than flat neighbour averaging; this one is faster. Several
tensors (buckets) are pipelined so the inter-machine and in-machine links work at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist

from syncplane import kernels
from syncplane.comm import context, topology
from syncplane.comm.collectives import all_gather_flat
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
    return hierarchical_neighbor_allreduce_tensors(
        [tensor], self_weight, src_machine_weights, dst_machine_weights, enable_topo_check=enable_topo_check,
        timeout_s=timeout_s, meter=meter)[0]


def hierarchical_neighbor_allreduce_tensors(
    tensors: Sequence[torch.Tensor], self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    *, enable_topo_check: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
    meter: CommMeter | None = None, on_result: Callable[[int, torch.Tensor], None] | None = None,
) -> list[torch.Tensor]:
    """``hierarchical_neighbor_allreduce`` of each tensor, pipelined across tensors.

    The phases of one tensor depend on each other, but the phases of consecutive tensors
    use different links: while tensor i crosses the inter-machine links, tensor i+1 is
    reduce-scattered and tensor i−1 all-gathered inside the machine. The exchange runs
    asynchronously on the default group, the in-machine phases on the machine's group,
    in the same order on every rank. ``on_result(i, y_i)`` is called as soon as each
    result is ready (the non-blocking form completes its handles from it).
    """
    layout = context.machine_layout()
    me = dist.get_rank()
    machine = layout.machine_of(me)
    self_w, src, dst, dynamic = _machine_plan(layout, machine, self_weight, src_machine_weights,
                                              dst_machine_weights)
    sends, recvs = machine_peers(layout, me, dst), machine_peers(layout, me, src)
    check_if_enabled(enable_topo_check, dynamic, sends, recvs, what="hierarchical_neighbor_allreduce")
    sources, weights = list(recvs), list(recvs.values())
    intra, local_size = layout.groups[machine], layout.local_size
    local = me - layout.leader_of(machine)
    results: list[torch.Tensor] = []

    def gather(index: int, handle: Handle) -> None:
        mixed, like = handle.wait(), tensors[index]
        if intra is None:
            out = mixed.reshape(like.shape)
        else:
            gathered = mixed.new_empty(mixed.numel() * local_size)
            all_gather_flat(gathered, mixed.contiguous(), group=intra)
            out = gathered[: like.numel()].reshape(like.shape)
        results.append(out)
        if on_result is not None:
            on_result(index, out)

    in_flight: tuple[int, Handle] | None = None
    for index, tensor in enumerate(tensors):
        flat = tensor.detach().reshape(-1)
        shard_numel = math.ceil(flat.numel() / local_size)
        padded = flat if shard_numel * local_size == flat.numel() else torch.cat(
            [flat, flat.new_zeros(shard_numel * local_size - flat.numel())])
        shard = padded.clone() if intra is None else _reduce_scatter_mean(padded.contiguous(), intra, local,
                                                                          local_size, timeout_s)
        handle = exchange(shard, sends, sources, None,
                          lambda received, shard=shard: kernels.weighted_combine(shard, received, weights, self_w),
                          timeout_s=timeout_s, what="hierarchical_neighbor_allreduce", meter=meter)
        if in_flight is not None:
            gather(*in_flight)
        in_flight = (index, handle)
    if in_flight is not None:
        gather(*in_flight)
    return results


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


def hierarchical_neighbor_allreduce_nonblocking(
    tensors: Sequence[torch.Tensor], self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    *, enable_topo_check: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
    meter: CommMeter | None = None,
) -> list[Handle]:
    """``hierarchical_neighbor_allreduce_tensors`` on a background thread: one handle per
    tensor, each ready as soon as its own result is (in order).

    The phases chain, so they cannot be one batch of async works; one worker thread runs
    the launched pipelines in launch order (the same order on every rank) while the
    caller computes -- gloo releases the GIL while it moves data. ``tensors`` must not be
    modified until their handles' ``wait()`` returns. Keep the topology check off on hot
    paths: it is a collective on the default group and could interleave with the caller's.
    """
    futures: list[Future[torch.Tensor]] = [Future() for _ in tensors]

    def run() -> None:
        try:
            hierarchical_neighbor_allreduce_tensors(
                tensors, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check=enable_topo_check,
                timeout_s=timeout_s, meter=meter, on_result=lambda i, y: futures[i].set_result(y))
        except BaseException as exc:   # every handle not yet completed reports the failure
            for future in futures:
                if not future.done():
                    future.set_exception(exc)

    context.background_executor().submit(run)
    return [Handle(_finish=future.result) for future in futures]
