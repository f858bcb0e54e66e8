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

import math
from collections.abc import Mapping, Sequence

import numpy as np
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
from syncplane.comm.p2p import DEFAULT_TIMEOUT_S, Handle, collective_dtype, completed, exchange
from syncplane.comm.process_groups import control_group

Weights = Mapping[int, float]
Destinations = Mapping[int, float] | Sequence[int]


def _gather_adjacency(peers: Sequence[int], group: Group) -> torch.Tensor:
    """``n × n`` uint8 matrix whose row j marks the ``peers`` rank j passed (one all-gather
    of an n-byte vector per rank)."""
    n = dist.get_world_size(group)
    mine = torch.zeros(n, dtype=torch.uint8)
    mine[list(peers)] = 1
    everyone = torch.zeros(n * n, dtype=torch.uint8)
    all_gather_flat(everyone, mine, group=control_group(group))   # CPU bytes: the control plane
    return everyone.view(n, n)


def _discover(peers: Sequence[int], group: Group) -> list[int]:
    """Ranks that list *this* rank among their ``peers``.

    Costs O(n) bytes per rank; pass both src and dst weights to avoid it.
    """
    me = dist.get_rank(group)
    column = _gather_adjacency(peers, group)[:, me]
    return [j for j in range(len(column)) if j != me and column[j]]


def _check_rank_list(ranks: Sequence[int], what: str, group: Group) -> list[int]:
    n, me = dist.get_world_size(group), dist.get_rank(group)
    problems = []
    if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
        problems.append("contains an element that is not an integer")
    elif any(not 0 <= r < n for r in ranks):
        problems.append(f"contains a rank outside 0..{n - 1}")
    if len(set(ranks)) != len(ranks):
        problems.append("contains a rank twice")
    if me in ranks:
        problems.append("contains this rank itself")
    if problems:
        raise ValueError(f"rank {me}: {what} {list(ranks)} " + "; ".join(problems))
    return list(ranks)


def _infer(ranks: Sequence[int], what: str, construct_adjacency_matrix: bool, from_sources: bool,
           group: Group) -> list[int] | tuple[list[int], np.ndarray]:
    me = dist.get_rank(group)
    listed = _gather_adjacency(_check_rank_list(ranks, what, group), group).numpy().astype(bool)
    found = [j for j in range(listed.shape[0]) if listed[j, me]]
    if not construct_adjacency_matrix:
        return found
    sends = listed.T if from_sources else listed          # sends[j, k]: j sends to k
    matrix = np.eye(listed.shape[0]) + sends
    return found, matrix / matrix.sum(axis=0, keepdims=True)


def infer_sources_from_destinations(dst_ranks: Sequence[int], construct_adjacency_matrix: bool = False,
                                    group: Group = None) -> list[int] | tuple[list[int], np.ndarray]:
    """The ranks that list this rank among their ``dst_ranks`` (sorted). Collective.

    With ``construct_adjacency_matrix`` also the ``n × n`` matrix ``W`` with ``W[j, k] > 0``
    iff j sends to k (self-loops included), each *column* normalised to sum to 1 -- the
    receive weights of a uniform average (BlueFog's ``InferSourceFromDestinationRanks``,
    as documented; BlueFog's code divides by row sums, equal when in- and out-degrees match).
    """
    return _infer(dst_ranks, "dst_ranks", construct_adjacency_matrix, from_sources=False, group=group)


def infer_destinations_from_sources(src_ranks: Sequence[int], construct_adjacency_matrix: bool = False,
                                    group: Group = None) -> list[int] | tuple[list[int], np.ndarray]:
    """The ranks that list this rank among their ``src_ranks`` (sorted). Collective; the
    matrix as in ``infer_sources_from_destinations`` (BlueFog's ``InferDestinationFromSourceRanks``)."""
    return _infer(src_ranks, "src_ranks", construct_adjacency_matrix, from_sources=True, group=group)


def resolve_plan(self_weight: float | None, src_weights: Weights | None, dst_weights: Destinations | None,
                 group: Group) -> tuple[float, dict[int, float], dict[int, float], bool]:
    """(self weight, {src: receive weight}, {dst: send scale}, dynamic?) for this rank."""
    if self_weight is None and src_weights is None and dst_weights is None:
        self_w, sources = context.recv_weights(group)
        return self_w, sources, {k: 1.0 for k in context.out_neighbor_ranks(group)}, False
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
    recv_buffers: Sequence[torch.Tensor] | None = None, tag: int = 0,
) -> Handle:
    """Launch a neighbour all-reduce; ``.wait()`` returns the combined tensor.

    ``enable_topo_check`` defaults to on for dynamic calls and off for static ones (a
    static topology was validated by ``set_topology``). With it off, a plan mismatch
    still ends in ``TopologyError`` after ``timeout_s``, never in a hang. ``out`` may be
    ``tensor`` itself (combined in place); ``recv_buffers`` are reused receive buffers, one
    per source in ``src_weights`` order. ``tag`` (``p2p.exchange_tensors``): which of a
    host's NICs the messages take under gloo; concurrent calls spread by consecutive tags.
    """
    if not tensor.is_floating_point():
        raise TypeError(f"neighbor_allreduce averages floating-point tensors, got dtype {tensor.dtype}")
    self_w, src, dst, dynamic = resolve_plan(self_weight, src_weights, dst_weights, group)
    check_if_enabled(enable_topo_check, dynamic, dst, src, group, payload=tensor)
    tensor = tensor.contiguous()
    if context.size(group) == 1 or (not src and not dst):
        result = tensor * self_w if out is None else out.copy_(tensor).mul_(self_w)
        return completed(result)
    sources, weights = list(src), list(src.values())

    def combine(received: list[torch.Tensor]) -> torch.Tensor:
        target = out if out is not None else torch.empty_like(tensor)
        return kernels.weighted_combine(tensor, received, weights, self_w, out=target)

    return exchange(tensor, dst, sources, group, combine, timeout_s=timeout_s, what="neighbor_allreduce",
                    meter=meter, recv_buffers=recv_buffers, tag=tag)


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
    payload × degree). All buckets are launched before the first wait, bucket i with tag i
    (spread over a host's NICs); wait on every returned handle (each writes its bucket back
    into the tensors). The plan is checked once for all buckets.
    """
    self_w, src, dst, dynamic = resolve_plan(self_weight, src_weights, dst_weights, group)
    check_if_enabled(enable_topo_check, dynamic, dst, src, group)
    handles = []
    for index, bucket in enumerate(make_buckets(tensors, bucket_bytes)):
        flat = bucket.pack()
        inner = neighbor_allreduce_nonblocking(flat, self_w, src, dst, enable_topo_check=False, group=group,
                                               timeout_s=timeout_s, meter=meter, out=flat, tag=index)
        handles.append(_then_unpack(inner, bucket))
    return handles


def _then_unpack(inner: Handle, bucket: object) -> Handle:
    def finish() -> torch.Tensor:
        result = inner.wait()
        bucket.unpack(result)  # type: ignore[attr-defined]
        return result

    return Handle(_finish=finish)


# ----------------------------------------------------------------- gathers (sizes first)

#: Shape header exchanged before a gather: [ndim, dtype code, numel, dim 0, dim 1, ...].
#: Fixed-size, so a header can never overflow a receive buffer, whatever the shapes.
_MAX_DIMS = 64
_HEADER = 3 + _MAX_DIMS
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
           torch.uint16, torch.uint32, torch.uint64)


def _gather_shape(tensor: torch.Tensor) -> torch.Size:
    """Gathers concatenate along dim 0; a 0-d tensor counts as one row."""
    return tensor.reshape(1).shape if tensor.dim() == 0 else tensor.shape


def _header(tensor: torch.Tensor) -> torch.Tensor:
    shape = _gather_shape(tensor)
    header = torch.full((_HEADER,), -1, dtype=torch.int64)
    header[0] = len(shape)
    header[1] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
    header[2] = tensor.numel()
    if len(shape) <= _MAX_DIMS:
        header[3:3 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
    return header


def _describe(header: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    ndim, code = int(header[0]), int(header[1])
    dtype = str(_DTYPES[code]).removeprefix("torch.") if code >= 0 else "unsupported dtype"
    return dtype, tuple(int(d) for d in header[3:3 + min(ndim, _MAX_DIMS)])


def _shape_problems(reference: torch.Tensor, owner: int, headers: Sequence[torch.Tensor],
                    ranks: Sequence[int]) -> list[str]:
    """Why the tensors described by ``headers`` (of ``ranks``) cannot be concatenated with
    ``owner``'s (described by ``reference``); empty: they can."""
    my_dtype, my_shape = _describe(reference)
    problems = [f"rank {r}'s tensor has {int(h[0])} dimensions, more than {_MAX_DIMS}"
                for r, h in zip([owner, *ranks], [reference, *headers]) if int(h[0]) > _MAX_DIMS]
    for j, header in zip(ranks, headers):
        dtype, shape = _describe(header)
        if dtype != my_dtype or shape[1:] != my_shape[1:]:
            problems.append(f"rank {j} has {dtype} {list(shape)} but rank {owner} has {my_dtype} "
                            f"{list(my_shape)} (dtype and all dimensions but the first must match)")
    return problems


def _raise_everywhere(problems: list[str], group: Group, what: str) -> None:
    """Collective: if any rank found a problem, every rank raises the same ValueError."""
    flag = torch.tensor([len(problems)], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return
    everyone: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problems, group=group)
    details = [p for found in everyone for p in found]  # type: ignore[union-attr]
    raise ValueError(f"{what}: tensors cannot be concatenated: " + "; ".join(details))


def neighbor_allgather_nonblocking(tensor: torch.Tensor, src_ranks: Sequence[int] | None = None,
                                   dst_ranks: Sequence[int] | None = None, *, enable_topo_check: bool | None = None,
                                   group: Group = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Handle:
    """Launch ``neighbor_allgather``; ``.wait()`` returns the concatenation.

    The sizes are exchanged (and checked, on every rank) when the call is made; only
    the payload moves in the background.
    """
    what = "neighbor_allgather"
    dynamic = src_ranks is not None or dst_ranks is not None
    if src_ranks is None and dst_ranks is None:
        src_ranks, dst_ranks = context.in_neighbor_ranks(group), context.out_neighbor_ranks(group)
    elif src_ranks is None or dst_ranks is None:
        raise ValueError("neighbor_allgather needs both src_ranks and dst_ranks (or neither)")
    sources, destinations = [int(j) for j in src_ranks], {int(k): 1.0 for k in dst_ranks}
    check_if_enabled(enable_topo_check, dynamic, destinations, sources, group, what=what)
    tensor = tensor.detach().contiguous()
    mine = _header(tensor)
    headers = exchange(mine, destinations, sources, group, lambda received: torch.stack(received)
                       if received else mine.new_empty((0, _HEADER)),
                       timeout_s=timeout_s, what=f"{what} (size exchange)").wait()
    _raise_everywhere(_shape_problems(mine, dist.get_rank(), list(headers), [_global(j, group) for j in sources]),
                      group, what)
    shape = _gather_shape(tensor)
    shapes = [(int(h[3]), *shape[1:]) for h in headers]
    # empty tensors are neither sent nor received (both ends know the size)
    sends = destinations if tensor.numel() else {}
    live = [(j, s) for j, s in zip(sources, shapes) if math.prod(s)]
    buffers = [tensor.new_empty(s) for _, s in live]

    def finish(received: list[torch.Tensor]) -> torch.Tensor:
        pieces = iter(received)
        parts = [next(pieces) if math.prod(s) else tensor.new_empty(s) for s in shapes]
        return torch.cat(parts) if parts else tensor.new_empty((0, *shape[1:]))

    flat = tensor.reshape(shape)
    return exchange(flat, sends, [j for j, _ in live], group, finish, timeout_s=timeout_s, what=what,
                    recv_buffers=buffers)


def neighbor_allgather(tensor: torch.Tensor, src_ranks: Sequence[int] | None = None,
                       dst_ranks: Sequence[int] | None = None, *, enable_topo_check: bool | None = None,
                       group: Group = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Concatenate (along dim 0) the tensors of ``src_ranks``, in that order (self excluded).

    Default: the topology's in-/out-neighbours. As in BlueFog, the first dimension may
    differ between ranks (sizes are exchanged first); dtype and the other dimensions
    must match, else every rank raises ``ValueError`` naming the ranks and shapes --
    whatever the shapes, the process never aborts inside the backend. Dynamic ranks are
    checked like ``neighbor_allreduce``.
    """
    return neighbor_allgather_nonblocking(tensor, src_ranks, dst_ranks, enable_topo_check=enable_topo_check,
                                          group=group, timeout_s=timeout_s).wait()


def allgather_nonblocking(tensor: torch.Tensor, group: Group = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Handle:
    """Launch ``allgather``; the sizes are all-gathered (and checked) at the call."""
    what = "allgather"
    tensor = tensor.detach().contiguous()
    carrier = collective_dtype(tensor, what, group)
    n = context.size(group)
    mine = _header(tensor)
    headers = torch.empty(n * _HEADER, dtype=torch.int64)
    dist.all_gather_into_tensor(headers, mine, group=group)
    headers = headers.view(n, _HEADER)
    # every rank sees every header, so every rank reaches the same verdict
    problems = _shape_problems(headers[0], _global(0, group), list(headers[1:]),
                               [_global(j, group) for j in range(1, n)])
    if problems:
        raise ValueError(f"{what}: tensors cannot be concatenated: " + "; ".join(problems))
    shape = _gather_shape(tensor)
    counts = [int(h[2]) for h in headers]
    padded = tensor.new_zeros(max(counts) or 1, dtype=carrier)
    padded[: tensor.numel()] = tensor.reshape(-1)
    gathered = padded.new_empty(n * padded.numel())
    work = dist.all_gather_into_tensor(gathered, padded, group=group, async_op=True)

    def finish() -> torch.Tensor:
        rows = gathered.view(n, -1)
        parts = [rows[j, : counts[j]].reshape(int(headers[j][3]), *shape[1:]) for j in range(n)]
        return torch.cat(parts).to(tensor.dtype)

    return Handle(_works=[("all-gathering with", -1, work)], _finish=finish, _timeout_s=timeout_s, _what=what)


def _global(rank_in_group: int, group: Group) -> int:
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)


def allgather(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0, in rank order (BlueFog's ``allgather``;
    first dimensions may differ between ranks)."""
    return allgather_nonblocking(tensor, group).wait()


def allreduce_dtype(tensor: torch.Tensor, average: bool, group: Group = None) -> torch.dtype:
    """The dtype ``tensor`` is all-reduced in (``collective_dtype``); a mean needs a
    floating-point or complex tensor (``TypeError`` otherwise, as in BlueFog)."""
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"allreduce: average=True needs a floating-point tensor, got dtype {tensor.dtype}; "
                        "pass average=False for a sum")
    return collective_dtype(tensor, "allreduce", group)


def allreduce_nonblocking(tensor: torch.Tensor, average: bool = True, group: Group = None,
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> Handle:
    """Global all-reduce (sum or mean) of a copy of ``tensor``, handle style (see
    ``allreduce_dtype`` for the dtypes)."""
    result = tensor.detach().to(allreduce_dtype(tensor, average, group), copy=True)
    n = context.size(group)
    work = dist.all_reduce(result, group=group, async_op=True)

    def finish() -> torch.Tensor:
        return result.div_(n) if average else result.to(tensor.dtype)

    return Handle(_works=[("all-reducing with", -1, work)], _finish=finish, _timeout_s=timeout_s,
                  _what="allreduce")


def allreduce(tensor: torch.Tensor, average: bool = True, group: Group = None) -> torch.Tensor:
    return allreduce_nonblocking(tensor, average, group).wait()


def _into(tensor: torch.Tensor, inner: Handle) -> Handle:
    """A handle whose ``wait()`` copies ``inner``'s result into ``tensor`` and returns it."""
    return Handle(_finish=lambda: tensor.copy_(inner.wait()))


def allreduce_nonblocking_(tensor: torch.Tensor, average: bool = True, group: Group = None) -> Handle:
    """In-place ``allreduce_nonblocking``: ``wait()`` writes the result into ``tensor``."""
    return _into(tensor, allreduce_nonblocking(tensor, average, group))


def allreduce_(tensor: torch.Tensor, average: bool = True, group: Group = None) -> torch.Tensor:
    return allreduce_nonblocking_(tensor, average, group).wait()


def broadcast_nonblocking(tensor: torch.Tensor, root_rank: int, group: Group = None,
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> Handle:
    """Copy of ``tensor`` as held by ``root_rank`` (a group rank), handle style."""
    if not 0 <= root_rank < context.size(group):
        raise TopologyError(f"broadcast root {root_rank} is outside a group of size {context.size(group)}")
    carrier = collective_dtype(tensor, "broadcast", group)
    result = tensor.detach().to(carrier, memory_format=torch.contiguous_format, copy=True)
    work = dist.broadcast(result, group=group, group_src=root_rank, async_op=True)
    return Handle(_works=[("broadcast from", root_rank, work)], _finish=lambda: result.to(tensor.dtype),
                  _timeout_s=timeout_s, _what="broadcast")


def broadcast(tensor: torch.Tensor, root_rank: int, group: Group = None) -> torch.Tensor:
    return broadcast_nonblocking(tensor, root_rank, group).wait()


def broadcast_nonblocking_(tensor: torch.Tensor, root_rank: int, group: Group = None) -> Handle:
    """In-place ``broadcast_nonblocking``: ``wait()`` writes root's tensor into ``tensor``."""
    return _into(tensor, broadcast_nonblocking(tensor, root_rank, group))


def broadcast_(tensor: torch.Tensor, root_rank: int, group: Group = None) -> torch.Tensor:
    return broadcast_nonblocking_(tensor, root_rank, group).wait()
