"""Topology check: do the senders' and receivers' plans agree, before any payload moves?

Cost: one all-reduce of a ``3 × n`` float64 vector (24·n bytes: 24 KB at 1,024 ranks),
independent of the payload and of the degree -- the same order as BlueFog's scalar
negotiation. For every receiver k the vector holds (number of senders, Σ h₁(sender),
Σ h₂(sender)) minus the same sums over the senders k expects, with h₁, h₂ fixed
pseudo-random values per rank; it is all zeros exactly when every receiver expects
exactly the ranks that send to it (a wrong plan cancels out with probability ~1e-30).
Only when it is not zero does a second, diagnostic all-gather collect every plan so
that every rank can raise the same ``TopologyError`` naming the ranks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from syncplane.comm.context import Group
from syncplane.comm.errors import TopologyError
from syncplane.comm.process_groups import control_group


def _rank_hashes(n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0x5EED)
    return torch.rand(2, n, generator=generator, dtype=torch.float64) + 0.5   # in [0.5, 1.5)


def check_plan(sends: Iterable[int], recvs: Iterable[int], group: Group = None, what: str = "neighbor_allreduce") -> None:
    """Raise ``TopologyError`` on every rank if any rank's sends and receives disagree."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    sends, recvs = sorted(set(sends)), sorted(set(recvs))
    for peer in (*sends, *recvs):
        if not 0 <= peer < n:
            raise TopologyError(f"rank {me}: {what} names rank {peer}, outside a world of size {n}")
    if me in sends or me in recvs:
        raise TopologyError(f"rank {me}: {what} lists itself as a neighbour (use self_weight instead)")
    hashes = _rank_hashes(n)
    signature = torch.zeros(3, n, dtype=torch.float64)
    for k in sends:
        signature[0, k] += 1.0
        signature[1:, k] += hashes[:, me]
    for j in recvs:
        signature[0, me] -= 1.0
        signature[1:, me] -= hashes[:, j]
    dist.all_reduce(signature, group=control_group(group))
    if bool((signature.abs() < 1e-9).all()):
        return
    _raise_with_details(sends, recvs, group, what)


def check_if_enabled(enable_topo_check: bool | None, dynamic: bool, sends: Iterable[int], recvs: Iterable[int],
                     group: Group = None, what: str = "neighbor_allreduce") -> None:
    """The topology check is on by default for dynamic plans (a static topology was
    validated when it was set); ``enable_topo_check`` overrides that either way."""
    if enable_topo_check if enable_topo_check is not None else dynamic:
        check_plan(sends, recvs, group, what)


def _raise_with_details(sends: list[int], recvs: list[int], group: Group, what: str) -> None:
    n = dist.get_world_size(group)
    plans: list[object] = [None] * n
    dist.all_gather_object(plans, (sends, recvs), group=control_group(group))
    problems = []
    for j, (j_sends, _) in enumerate(plans):  # type: ignore[misc]
        for k in j_sends:
            if j not in plans[k][1]:  # type: ignore[index]
                problems.append(f"rank {j} sends to rank {k}, which does not expect it")
    for k, (_, k_recvs) in enumerate(plans):  # type: ignore[misc]
        for j in k_recvs:
            if k not in plans[j][0]:  # type: ignore[index]
                problems.append(f"rank {k} expects rank {j}, which does not send to it")
    raise TopologyError(f"{what}: senders and receivers disagree: " + "; ".join(problems))
