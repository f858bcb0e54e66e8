"""Hierarchical neighbour all-reduce: average inside each machine, mix machines with
their neighbours, and leave every process of a machine holding the machine's result.

The weights, for machines of any sizes: with ``mean_m = (1/L_m) Σ_{r on m} x_r`` (each
machine's plain mean over its own L_m ranks), every rank r of machine m receives

    ``y_r = Am[m, m] · mean_m + Σ_{m' ≠ m} Am[m', m] · mean_m'``

with ``Am`` the machine graph's weights (``set_machine_topology``; the dynamic form takes
``self_weight``, ``src_machine_weights`` and ``dst_machine_weights`` in *machine* ranks).
Every machine counts once whatever its size, so with a doubly-stochastic ``Am`` the
replicas agree on the unweighted average of the machine means -- on uneven machines that
is not the average over ranks (a rank of a small machine weighs more).

Data path (why it is not BlueFog's leader-only one): the payload is cut into L shards,
L the largest machine's size; shard s of machine m is owned by its local rank ``s mod L_m``
(so on equal machines local rank ℓ owns shard ℓ). Every member sends each shard straight
to its owner, which averages it (a reduce-scatter); each owner exchanges its shards with
the owners of the same shards on the neighbouring machines; an all-gather inside the
machine reassembles the mixed result. The inter-machine traffic is one payload per
machine per neighbour, as the leader's would be, but spread over the processes -- and
over every NIC of a multi-NIC machine -- while the intra-machine traffic drops from an
all-reduce plus a broadcast to a reduce-scatter plus an all-gather (why not the
leader-only path: ``docs/design-notes.md``). Several tensors (buckets) are pipelined so the
inter-machine and in-machine links work at once. BlueFog's hierarchical operations
need machines of one size; these do not.
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
from syncplane.comm.p2p import DEFAULT_TIMEOUT_S, Handle, exchange_tensors


def owned_shards(layout: context.MachineLayout, rank: int) -> list[int]:
    """The shards (of ``layout.max_size``) that ``rank`` averages and exchanges: ``s mod L_m == ℓ``."""
    machine, local = layout.machine_of(rank), layout.local_rank(rank)
    return list(range(local, layout.max_size, layout.size_of(machine)))


def shard_owner(layout: context.MachineLayout, machine: int, shard: int) -> int:
    """The rank of ``machine`` that owns ``shard``."""
    return layout.machines[machine][shard % layout.size_of(machine)]


def machine_peers(layout: context.MachineLayout, rank: int, machines: Mapping[int, float]) -> dict[int, float]:
    """``{machine: value}`` -> ``{rank: value}``: the ranks ``rank`` exchanges shards with on
    those machines (the owners of its shards there; on equal machines, its local index)."""
    mine = owned_shards(layout, rank)
    return {shard_owner(layout, m, s): v for m, v in machines.items() for s in mine}


def _by_peer(layout: context.MachineLayout, machine: int, shards: Sequence[int]) -> dict[int, list[int]]:
    """``{rank of machine: positions in shards}``: who owns each of ``shards`` on ``machine``."""
    out: dict[int, list[int]] = {}
    for position, s in enumerate(shards):
        out.setdefault(shard_owner(layout, machine, s), []).append(position)
    return out


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
    check_if_enabled(enable_topo_check, dynamic, machine_peers(layout, me, dst), machine_peers(layout, me, src),
                     what="hierarchical_neighbor_allreduce")
    intra, local, size, shards = layout.groups[machine], layout.local_rank(me), layout.size_of(machine), \
        layout.max_size
    mine = owned_shards(layout, me)
    per_member = math.ceil(shards / size)       # shards a member owns, at most
    sends = [(m, scale, _by_peer(layout, m, mine)) for m, scale in dst.items()]
    recvs = [(m, weight, _by_peer(layout, m, mine)) for m, weight in src.items()]
    results: list[torch.Tensor] = []

    def gather(index: int, handle: Handle) -> None:
        mixed, like = handle.wait(), tensors[index]
        if intra is None:
            out = mixed.reshape(-1)[: like.numel()].reshape(like.shape)
        else:
            # every member contributes per_member shards (padded), gathered member-major;
            # member j's q-th shard is shard j + q·L_m: transposing puts shard s at row s
            shard_numel = mixed.shape[1]
            chunk = mixed if mixed.shape[0] == per_member else torch.cat(
                [mixed, mixed.new_zeros(per_member - mixed.shape[0], shard_numel)])
            gathered = mixed.new_empty(size * per_member * shard_numel)
            all_gather_flat(gathered, chunk.reshape(-1), group=intra)
            whole = gathered.view(size, per_member, shard_numel).transpose(0, 1).reshape(-1)
            out = whole[: like.numel()].reshape(like.shape)
        results.append(out)
        if on_result is not None:
            on_result(index, out)

    in_flight: tuple[int, Handle] | None = None
    for index, tensor in enumerate(tensors):
        flat = tensor.detach().reshape(-1)
        shard_numel = math.ceil(flat.numel() / shards)
        padded = flat if shard_numel * shards == flat.numel() else torch.cat(
            [flat, flat.new_zeros(shard_numel * shards - flat.numel())])
        rows = padded.view(shards, shard_numel)
        owned = rows.clone() if intra is None else _reduce_to_owners(rows, intra, local, size, timeout_s)
        handle = _exchange_shards(owned, sends, recvs, self_w, timeout_s, meter, tag=index)
        if in_flight is not None:
            gather(*in_flight)
        in_flight = (index, handle)
    if in_flight is not None:
        gather(*in_flight)
    return results


def _exchange_shards(owned: torch.Tensor, sends: list[tuple[int, float, dict[int, list[int]]]],
                     recvs: list[tuple[int, float, dict[int, list[int]]]], self_weight: float,
                     timeout_s: float, meter: CommMeter | None, tag: int = 0) -> Handle:
    """Send this rank's averaged shards (rows of ``owned``) to their owners on the destination
    machines, receive the same shards from the source machines' owners, and combine them
    with the machine weights: one message per peer rank (a rank owning several shards sends
    a peer all the ones it owns there at once), with ``tag`` (the tensor's index: consecutive
    tensors' exchanges, in flight together, take a host's NICs in turn under gloo)."""
    rows, shard_numel = owned.shape
    everything = list(range(rows))

    def rows_of(tensor: torch.Tensor, positions: list[int]) -> torch.Tensor:
        return tensor if positions == everything else tensor[positions]

    outgoing: list[tuple[int, torch.Tensor]] = []
    for _, scale, peers in sends:
        scaled = owned if scale == 1.0 else owned * scale
        outgoing += [(peer, rows_of(scaled, positions).contiguous()) for peer, positions in peers.items()]
    incoming = [(peer, owned.new_empty(len(positions), shard_numel))
                for _, _, peers in recvs for peer, positions in peers.items()]

    def finish() -> torch.Tensor:
        buffers, weights, k = [], [], 0
        for _, weight, peers in recvs:
            if len(peers) == 1:     # one owner there holds all of this rank's shards
                buffers.append(incoming[k][1])
            else:
                assembled = owned.new_empty(rows, shard_numel)
                for i, positions in enumerate(peers.values()):
                    assembled[positions] = incoming[k + i][1]
                buffers.append(assembled)
            k += len(peers)
            weights.append(weight)
        return kernels.weighted_combine(owned, buffers, weights, self_weight)

    return exchange_tensors(outgoing, incoming, None, finish, timeout_s=timeout_s,
                            what="hierarchical_neighbor_allreduce", meter=meter, tag=tag)


def _reduce_to_owners(rows: torch.Tensor, group: dist.ProcessGroup, local: int, size: int,
                      timeout_s: float) -> torch.Tensor:
    """The machine mean of the shards (rows) this member owns, ``rows[local::size]``: every
    member sends the shards member j owns straight to member j.

    Each NIC sends and receives (L−1)/L of the payload once on equal machines -- the
    reduce-scatter bound. (gloo's own ``reduce_scatter_tensor`` moves an all-reduce's worth
    of bytes and needs equal shares.) The message from member i to member j has tag i + j:
    a member's messages take a host's NICs in turn under gloo.
    """
    peers = [j for j in range(size) if j != local]
    mine = rows[local::size].contiguous()
    received = [torch.empty_like(mine) for _ in peers]
    exchange_tensors([(j, rows[j::size].contiguous()) for j in peers], list(zip(peers, received)), group,
                     lambda: mine, timeout_s=timeout_s, tag=lambda src, dst: src + dst,
                     what="hierarchical reduce-scatter (peers are machine-local ranks)").wait()
    return kernels.weighted_combine(mine, received, [1.0 / size] * len(received), 1.0 / size)


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
