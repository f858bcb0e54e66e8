"""Neighbour collectives (BlueFog's API on current torch.distributed).

Static form (no weights given): the topology set with ``set_topology`` decides,
``y_i = Σ_j A[j, i] x_j`` with ``A = nx.to_numpy_array(G)``.

Dynamic form: ``y_i = a·x_i + Σ_{j∈src} r_ij · s_ij · x_j`` where ``a = self_weight``,
``r_ij = src_weights[j]`` (applied by the receiver) and ``s_ij`` is the
``dst_weights[i]`` rank j used when sending (``1`` when ``dst_weights`` is a list).
Push style (``dst_weights`` only): each rank's sources are discovered from the other
ranks' destinations, received with weight 1. Pull style (``src_weights`` only): the
sources send unscaled; each sender must then list its destinations -- with only
``src_weights`` given a rank's destinations are discovered the same way.

The combine runs in the compiled ``weighted_combine`` kernel; many small tensors go
through ``neighbor_allreduce_tensors``, which fuses them into buckets first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from syncplane import kernels
from syncplane.comm import context, topology
from syncplane.comm.buckets import DEFAULT_BUCKET_BYTES, make_buckets
from syncplane.comm.collectives import all_gather_flat
from syncplane.comm.check import check_if_enabled
from syncplane.comm.context import Group
from syncplane.comm.errors import TopologyError
from syncplane.comm.meter import CommMeter
from syncplane.comm.p2p import DEFAULT_TIMEOUT_S, Handle, completed, exchange
from syncplane.comm.process_groups import control_group

Weights = Mapping[int, float]
Destinations = Mapping[int, float] | Sequence[int]


def _discover(peers: Sequence[int], group: Group) -> list[int]:
    """Ranks that list *this* rank among their ``peers`` (one all-gather of an n-vector each).

    Costs O(n) bytes per rank; pass both src and dst weights to avoid it.
    """
    n, me = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.zeros(n, dtype=torch.uint8)
    mine[list(peers)] = 1
    everyone = torch.zeros(n * n, dtype=torch.uint8)
    all_gather_flat(everyone, mine, group=control_group(group))
    return [j for j in range(n) if j != me and everyone[j * n + me]]


def resolve_plan(self_weight: float | None, src_weights: Weights | None, dst_weights: Destinations | None,
                 group: Group) -> tuple[float, dict[int, float], dict[int, float], bool]:
    """(self weight, {src: receive weight}, {dst: send scale}, dynamic?) for this rank."""
    if self_weight is None and src_weights is None and dst_weights is None:
        return (*topology.static_weights(context.load_topology(group), context.rank(group)), False)
    if self_weight is None:
        raise ValueError("dynamic neighbor_allreduce needs self_weight together with src_weights/dst_weights")
    if src_weights is None and dst_weights is None:
        raise ValueError("dynamic neighbor_allreduce needs src_weights, dst_weights or both")
    if dst_weights is None:
        src = {int(j): float(w) for j, w in src_weights.items()}  # type: ignore[union-attr]
        dst = {k: 1.0 for k in _discover(list(src), group)}
    else:
        dst = topology.as_destinations(dst_weights)
        src = ({int(j): float(w) for j, w in src_weights.items()} if src_weights is not None
               else {j: 1.0 for j in _discover(list(dst), group)})
    return float(self_weight), src, dst, True


def neighbor_allreduce_nonblocking(
    tensor: torch.Tensor, self_weight: float | None = None, src_weights: Weights | None = None,
    dst_weights: Destinations | None = None, *, enable_topo_check: bool | None = None, group: Group = None,
    timeout_s: float = DEFAULT_TIMEOUT_S, meter: CommMeter | None = None, out: torch.Tensor | None = None,
    recv_buffers: Sequence[torch.Tensor] | None = None,
) -> Handle:
    """Launch a neighbour all-reduce; ``.wait()`` returns the combined tensor.

    ``enable_topo_check`` defaults to on for dynamic calls and off for static ones (a
    static topology was validated by ``set_topology``). With it off, a plan mismatch
    still ends in ``TopologyError`` after ``timeout_s``, never in a hang. ``out`` may be
    ``tensor`` itself (combined in place); ``recv_buffers`` are reused receive buffers, one
    per source in ``src_weights`` order.
    """
    self_w, src, dst, dynamic = resolve_plan(self_weight, src_weights, dst_weights, group)
    check_if_enabled(enable_topo_check, dynamic, dst, src, group)
    tensor = tensor.contiguous()
    if context.size(group) == 1 or (not src and not dst):
        result = tensor * self_w if out is None else out.copy_(tensor).mul_(self_w)
        return completed(result)
    sources, weights = list(src), list(src.values())

    def combine(received: list[torch.Tensor]) -> torch.Tensor:
        target = out if out is not None else torch.empty_like(tensor)
        return kernels.weighted_combine(tensor, received, weights, self_w, out=target)

    return exchange(tensor, dst, sources, group, combine, timeout_s=timeout_s, what="neighbor_allreduce",
                    meter=meter, recv_buffers=recv_buffers)


def neighbor_allreduce(tensor: torch.Tensor, self_weight: float | None = None, src_weights: Weights | None = None,
                       dst_weights: Destinations | None = None, **kwargs: object) -> torch.Tensor:
    """Blocking ``neighbor_allreduce_nonblocking(...).wait()``; see the module docstring."""
    return neighbor_allreduce_nonblocking(tensor, self_weight, src_weights, dst_weights, **kwargs).wait()  # type: ignore[arg-type]


def neighbor_allreduce_tensors(
    tensors: Sequence[torch.Tensor], self_weight: float | None = None, src_weights: Weights | None = None,
    dst_weights: Destinations | None = None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    enable_topo_check: bool | None = None, group: Group = None, timeout_s: float = DEFAULT_TIMEOUT_S,
    meter: CommMeter | None = None,
) -> list[Handle]:
    """Tensor fusion: neighbour-all-reduce ``tensors`` *in place* as a few flat buckets.

    Buckets hold at most ``bucket_bytes`` of payload (what one rank contributes, not
    payload × degree). All buckets are launched before the first wait; wait on every
    returned handle (each writes its bucket back into the tensors). The plan is checked
    once for all buckets.
    """
    self_w, src, dst, dynamic = resolve_plan(self_weight, src_weights, dst_weights, group)
    check_if_enabled(enable_topo_check, dynamic, dst, src, group)
    handles = []
    for bucket in make_buckets(tensors, bucket_bytes):
        flat = bucket.pack()
        inner = neighbor_allreduce_nonblocking(flat, self_w, src, dst, enable_topo_check=False, group=group,
                                               timeout_s=timeout_s, meter=meter, out=flat)
        handles.append(_then_unpack(inner, bucket))
    return handles


def _then_unpack(inner: Handle, bucket: object) -> Handle:
    def finish() -> torch.Tensor:
        result = inner.wait()
        bucket.unpack(result)  # type: ignore[attr-defined]
        return result

    return Handle(_finish=finish)


def neighbor_allgather(tensor: torch.Tensor, src_ranks: Sequence[int] | None = None,
                       dst_ranks: Sequence[int] | None = None, *, enable_topo_check: bool | None = None,
                       group: Group = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Concatenate (along dim 0) the tensors of ``src_ranks``, in that order.

    Default: the topology's in-/out-neighbours. Every rank's tensor must have the same
    shape. Dynamic ranks are checked like ``neighbor_allreduce``.
    """
    dynamic = src_ranks is not None or dst_ranks is not None
    if src_ranks is None and dst_ranks is None:
        src_ranks, dst_ranks = context.in_neighbor_ranks(group), context.out_neighbor_ranks(group)
    elif src_ranks is None or dst_ranks is None:
        raise ValueError("neighbor_allgather needs both src_ranks and dst_ranks (or neither)")
    check_if_enabled(enable_topo_check, dynamic, dst_ranks, src_ranks, group, what="neighbor_allgather")
    flat_shape = tensor.reshape(1, -1).shape if tensor.dim() == 0 else tensor.shape
    handle = exchange(tensor, {k: 1.0 for k in dst_ranks}, list(src_ranks), group,
                      lambda received: torch.cat([r.reshape(flat_shape) for r in received])
                      if received else tensor.new_empty((0, *flat_shape[1:])),
                      timeout_s=timeout_s, what="neighbor_allgather")
    return handle.wait()


def allreduce_nonblocking(tensor: torch.Tensor, average: bool = True, group: Group = None,
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> Handle:
    """Global all-reduce (sum or mean) of a copy of ``tensor``, handle style."""
    result = tensor.detach().clone()
    n = context.size(group)
    work = dist.all_reduce(result, group=group, async_op=True)

    def finish() -> torch.Tensor:
        return result.div_(n) if average else result

    return Handle(_works=[("all-reducing with", -1, work)], _finish=finish, _timeout_s=timeout_s,
                  _what="allreduce")


def allreduce(tensor: torch.Tensor, average: bool = True, group: Group = None) -> torch.Tensor:
    return allreduce_nonblocking(tensor, average, group).wait()


def broadcast_nonblocking(tensor: torch.Tensor, root_rank: int, group: Group = None,
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> Handle:
    """Copy of ``tensor`` as held by ``root_rank`` (a group rank), handle style."""
    if not 0 <= root_rank < context.size(group):
        raise TopologyError(f"broadcast root {root_rank} is outside a group of size {context.size(group)}")
    result = tensor.detach().clone().contiguous()
    work = dist.broadcast(result, group=group, group_src=root_rank, async_op=True)
    return Handle(_works=[("broadcast from", root_rank, work)], _finish=lambda: result, _timeout_s=timeout_s,
                  _what="broadcast")


def broadcast(tensor: torch.Tensor, root_rank: int, group: Group = None) -> torch.Tensor:
    return broadcast_nonblocking(tensor, root_rank, group).wait()
