"""The network's lower bound for an all-reduce: what no pattern can beat on a cluster.

``bound_s`` (the cost model with α = 0) is a pattern's *own* bound: a bad pattern has a
high bound and can still reach it, so ``bound_ratio`` flatters it. This bound is the
operation's: a time below which no all-reduce of M bytes over these links can finish,
whatever its pattern. ``network_bound_ratio`` (this bound over the measured time) says how
far a strategy is from what the wire allows.

Setting: n ranks on h hosts in K racks, each rank holding M bytes, every rank to end with
their element-wise sum; values are sent as they are (no compression, no coding), ranks
of one host combine their values for free, and the switches forward but do not add.

1. **A cut** (one host's NIC, one rack's uplink), one direction. The ranks behind it
   must end with the sum, which depends on every element of the values outside: at
   least M bytes must enter (and, symmetrically, leave) -- whenever both sides hold a
   rank. So ``t ≥ M / c`` with ``c`` the cut's rate in that direction. (This implies the
   often-quoted ``2·M·min(k, n−k)/n`` bytes over a cut separating k of n ranks, both
   directions together: ``min(k, n−k)/n ≤ ½`` so that is ≤ M each way.)
2. **Counting** (hosts, and racks, as the nodes). Per element, a transfer from one node
   to another carries one value (a partial sum); for every node to know the sum of all
   N nodes' values takes at least 2(N − 1) such transfers: this is the one-way gossip
   problem, whose minimum is 2N − 2 calls (a call passing everything its sender knows is
   at least as strong as a partial sum). Summed over the elements, the N nodes send (and
   receive) ≥ 2(N − 1)·M bytes in all: ``t ≥ 2(N − 1)·M / Σ c_out`` (and ``Σ c_in``). With
   equal hosts that is the ring's 2(N − 1)/N·M per NIC (Patarasuk & Yuan's bound for
   all-reduce on clusters); with racks, 2(K − 1)/K·M per uplink.

The bound is the largest of these. A cut's rate is the cost model's for the most flows
the strategy may put on it -- ``streams`` connections per pair of ranks, so
``f = streams · senders · receivers`` -- times the TCP share ``f/(f+g)`` next to g greedy
background flows, at most ``f`` per-flow caps (a WAN link that caps each TCP flow), and a
host's ``min(f, nics)`` NICs. Loopback is left out (ranks of a host combine for free), so
on a single host the network bound is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncplane.cluster.cost import MBIT
from syncplane.cluster.profile import ClusterProfile


@dataclass(frozen=True)
class NetworkBound:
    """The bound in seconds and the constraint that sets it (``"uplink r0 out"``,
    ``"NICs of all hosts, out"``, ...); ``seconds`` is 0 on a single host."""

    seconds: float
    binding: str


def _rate(capacity_bps: float, per_flow_bps: float | None, flows: int, background: int, nics: int = 1) -> float:
    """Bytes/s ``flows`` of our flows get from a link (see the module docstring)."""
    rate = capacity_bps * min(nics, flows) * flows / (flows + background)
    return min(rate, per_flow_bps * flows) if per_flow_bps else rate


def allreduce_network_bound(profile: ClusterProfile, payload_bytes: float, streams: int = 1) -> NetworkBound:
    """The lower bound on one all-reduce of ``payload_bytes`` on ``profile`` when a pair of
    ranks may use ``streams`` connections at once (module docstring: cuts and counting)."""
    if streams < 1:
        raise ValueError(f"streams: must be at least 1, got {streams}")
    n = profile.world_size
    background: dict[tuple[str, int], int] = {}
    for flow in profile.background:
        src, dst = profile.host(flow.src), profile.host(flow.dst)
        keys = [("nic_out", src.index), ("nic_in", dst.index)]
        if src.rack != dst.rack:
            keys += [("up_out", src.rack), ("up_in", dst.rack)]
        for key in keys:
            background[key] = background.get(key, 0) + 1

    candidates: list[tuple[float, str]] = [(0.0, "one host: no network")]
    hosts = [h for h in profile.hosts]
    if len(hosts) > 1:
        totals = {"out": 0.0, "in": 0.0}
        for h in hosts:
            inside = h.spec.ranks
            flows = streams * inside * (n - inside)
            per_flow = h.spec.per_flow_mbit * MBIT if h.spec.per_flow_mbit else None
            for direction in ("out", "in"):
                rate = _rate(h.spec.nic_mbit * MBIT, per_flow, flows, background.get((f"nic_{direction}", h.index), 0),
                             h.spec.nics)
                totals[direction] += rate
                candidates.append((payload_bytes / rate, f"NIC of {h.name}, {direction}"))
        for direction, total in totals.items():
            candidates.append((2 * (len(hosts) - 1) * payload_bytes / total, f"NICs of all hosts, {direction}"))
    if len(profile.racks) > 1:
        totals = {"out": 0.0, "in": 0.0}
        for k, rack in enumerate(profile.racks):
            inside = sum(h.spec.ranks for h in hosts if h.rack == k)
            flows = streams * inside * (n - inside)
            assert rack.uplink_mbit is not None          # validated: several racks need uplinks
            per_flow = rack.per_flow_mbit * MBIT if rack.per_flow_mbit else None
            for direction in ("out", "in"):
                rate = _rate(rack.uplink_mbit * MBIT, per_flow, flows, background.get((f"up_{direction}", k), 0))
                totals[direction] += rate
                candidates.append((payload_bytes / rate, f"uplink of {rack.name}, {direction}"))
        for direction, total in totals.items():
            candidates.append((2 * (len(profile.racks) - 1) * payload_bytes / total, f"uplinks of all racks, {direction}"))
    seconds, binding = max(candidates, key=lambda c: c[0])
    return NetworkBound(seconds, binding)
