"""Topology check: do the senders' and receivers' plans agree, before any payload moves?

Cost: one all-reduce of a ``4 × n`` float64 vector (32·n bytes: 32 KB at 1,024 ranks),
independent of the payload and of the degree -- the same order as BlueFog's scalar
negotiation. For every receiver k the vector holds (number of senders, Σ h₁(sender),
Σ h₂(sender), Σ g(sender's payload)·h₁(sender)) minus the same sums over the senders k
expects (with k's own payload), with h₁, h₂ fixed pseudo-random values per rank and g a
hash of element count and dtype; it is all zeros exactly when every receiver expects
exactly the ranks that send to it, each sending a tensor the receiver's size (a wrong
plan cancels out with probability ~1e-30; a size mismatch would abort gloo).
Only when it is not zero does a second, diagnostic all-gather collect every plan so
that every rank can raise the same ``TopologyError`` naming the ranks.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from syncplane.comm.context import Group
from syncplane.comm.errors import TopologyError
from syncplane.comm.process_groups import control_group


def _rank_hashes(n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0x5EED)
    return torch.rand(2, n, generator=generator, dtype=torch.float64) + 0.5   # in [0.5, 1.5)


def _payload_hash(payload: torch.Tensor | None) -> float:
    """A value in [0.5, 1.5) fixed by the payload's element count and dtype (1 without one)."""
    if payload is None:
        return 1.0
    key = (payload.numel() * 2654435761 + zlib.crc32(str(payload.dtype).encode()) % 1_000_003) % (1 << 31)
    return 0.5 + key / float(1 << 31)


def check_plan(sends: Iterable[int], recvs: Iterable[int], group: Group = None, what: str = "neighbor_allreduce",
               payload: torch.Tensor | None = None) -> None:
    """Raise ``TopologyError`` on every rank if any rank's sends and receives disagree --
    or, given ``payload``, if a sender's tensor differs in size or dtype from its
    receiver's (which would otherwise abort the process inside gloo)."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    sends, recvs = sorted(set(sends)), sorted(set(recvs))
    for peer in (*sends, *recvs):
        if not 0 <= peer < n:
            raise TopologyError(f"rank {me}: {what} names rank {peer}, outside a world of size {n}")
    if me in sends or me in recvs:
        raise TopologyError(f"rank {me}: {what} lists itself as a neighbour (use self_weight instead)")
    hashes = _rank_hashes(n)
    mine = _payload_hash(payload)
    signature = torch.zeros(4, n, dtype=torch.float64)
    for k in sends:
        signature[0, k] += 1.0
        signature[1:3, k] += hashes[:, me]
        signature[3, k] += mine * hashes[0, me]
    for j in recvs:
        signature[0, me] -= 1.0
        signature[1:3, me] -= hashes[:, j]
        signature[3, me] -= mine * hashes[0, j]
    dist.all_reduce(signature, group=control_group(group))
    if bool((signature.abs() < 1e-9).all()):
        return
    _raise_with_details(sends, recvs, group, what, payload)


_skip_negotiate = False


def set_skip_negotiate_stage(value: bool) -> None:
    """Process-wide: skip the plan check unless a call asks for it with ``enable_topo_check=True``
    (BlueFog's switch of the same name; every rank must set the same value)."""
    global _skip_negotiate
    _skip_negotiate = bool(value)


def get_skip_negotiate_stage() -> bool:
    return _skip_negotiate


def check_if_enabled(enable_topo_check: bool | None, dynamic: bool, sends: Iterable[int], recvs: Iterable[int],
                     group: Group = None, what: str = "neighbor_allreduce",
                     payload: torch.Tensor | None = None) -> None:
    """The topology check is on by default for dynamic plans (a static topology was
    validated when it was set); ``enable_topo_check`` overrides that either way, and
    ``set_skip_negotiate_stage(True)`` turns the default off."""
    default = dynamic and not _skip_negotiate
    if enable_topo_check if enable_topo_check is not None else default:
        check_plan(sends, recvs, group, what, payload)


def _raise_with_details(sends: list[int], recvs: list[int], group: Group, what: str,
                        payload: torch.Tensor | None = None) -> None:
    n = dist.get_world_size(group)
    described = None if payload is None else (str(payload.dtype).removeprefix("torch."), list(payload.shape))
    plans: list[object] = [None] * n
    dist.all_gather_object(plans, (sends, recvs, described), group=control_group(group))
    problems = []
    for j, (j_sends, _, _) in enumerate(plans):  # type: ignore[misc]
        for k in j_sends:
            if j not in plans[k][1]:  # type: ignore[index]
                problems.append(f"rank {j} sends to rank {k}, which does not expect it")
    for k, (_, k_recvs, k_payload) in enumerate(plans):  # type: ignore[misc]
        for j in k_recvs:
            if k not in plans[j][0]:  # type: ignore[index]
                problems.append(f"rank {k} expects rank {j}, which does not send to it")
            elif k_payload is not None and plans[j][2] is not None and \
                    (plans[j][2][0], math.prod(plans[j][2][1])) != (k_payload[0], math.prod(k_payload[1])):  # type: ignore[index]
                problems.append(f"rank {j} sends {plans[j][2][0]} {plans[j][2][1]} to rank {k}, "  # type: ignore[index]
                                f"which holds {k_payload[0]} {k_payload[1]}")
    raise TopologyError(f"{what}: senders and receivers disagree: " + "; ".join(problems))
