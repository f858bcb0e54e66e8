"""Topology detection: which ranks share a host, which hosts share a rack, and how fast
every pair of ranks can exchange data (DS-Sync's ``topologyDetect``).

Two sources, one result (``Topology``):

- **a cluster profile** (the launcher of an emulated cluster tells its ranks which one,
  ``SYNCPLANE_CLUSTER``): racks and hosts as declared, pairwise bandwidth from the α-β
  cost model (NIC, uplink and background-flow shares included);
- **a probe**: short timed exchanges between every pair of ranks, scheduled as a
  round-robin tournament (circle method) -- ``n − 1`` rounds of ``n/2`` concurrent pairs,
  so probing takes O(n) rounds instead of O(n²) sequential transfers. Hosts come from
  the launcher's node rank (``GROUP_RANK``); racks by splitting the host-to-host links into
  fast and slow (``rack_threshold``: Otsu's split of log bandwidth, not the single largest
  gap) and grouping hosts whose fast neighbourhoods agree (``cluster_racks``): a rack is a set
  of hosts that reach each other much faster than they reach the rest.

  The tournament's concurrent pairs share rack uplinks, so a slow (cross-rack) pair's rate
  is only a share of it: those pairs are timed again in rounds where no group of close
  hosts takes part twice (``exclusive_rounds``), and so are the pairs of a host of several
  ranks with its close hosts (its other ranks' pairs shared its NIC). A host with no fast
  link (a slow NIC, or a rack of its own: their pairwise rates look alike) is placed by a
  concurrent test: its
  exchange with a rack runs beside an exchange that leaves that rack; if the two slow each
  other down they share the rack's uplink, and the host is outside (``cluster_racks``'s
  ``belongs``); a slow-NIC host so placed then has its pairs out of the rack timed again, one
  pair per rack at a time (its first timings ran beside its rack-mates'). With ``streams`` >
  1, one pair per rack and per pair of racks is timed over one TCP stream and over
  ``streams`` at once: a link on which several streams get at least twice one stream's rate
  caps each flow (``FlowCap``), which the profile writes as ``per_flow_mbit``.

Each rank also reads its host's TCP congestion control (``congestion_control``): a profile
written from a probe reproduces it (``tcp_congestion``), since the same links move bulk traffic
both ways 10-40 % faster or slower under bbr than under cubic (``docs/design-notes.md``).

A probe's result is cached per cluster (``~/.cache/syncplane/probe/<key>.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import networkx as nx
import numpy as np
import torch
import torch.distributed as dist

from syncplane import net
from syncplane.cluster.cost import MBIT, CostModel
from syncplane.cluster.profile import ClusterProfile, load_profile
from syncplane.config import ConfigError
from syncplane.launch import Launch

log = logging.getLogger(__name__)


class ProbeSite(Protocol):
    """What the probe reads of the job: where this rank runs and the profile it was placed on.
    ``syncplane.job.JobContext`` has these fields, and so has the launcher's ``Launch``; the
    probe names neither the job nor the runtime (cluster sits below them)."""

    @property
    def node_rank(self) -> str | None: ...

    @property
    def cluster(self) -> str | None: ...

    @property
    def master_addr(self) -> str: ...
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "syncplane" / "probe"
MIN_GAP_RATIO = 2.0                    # a rack boundary: bandwidth drops by at least this factor


#: several streams get at least this multiple of one stream's rate: the link caps each flow
#: (1.5 found a false cap on emulated 10 Gbit NICs, where 2 CPU cores are the limit)
FLOW_CAP_RATIO = 2.0
#: two concurrent transfers that keep this far apart (``kept_apart``: 1 sharing a link, 2 not)
#: share no link; halfway, as the measure cannot err high (two transfers through one 100 Mbit
#: uplink cannot end sooner than one after the other), only low (a late start)
NO_SHARED_LINK = 1.5
#: Which congestion control a host's new TCP connections use (per network namespace; Linux).
CONGESTION_FILE = Path("/proc/sys/net/ipv4/tcp_congestion_control")


@dataclass(frozen=True)
class FlowCap:
    """A link on which one TCP stream gets ``per_flow`` bytes/s and several at once ``link``
    (a lower bound of the link's rate when the streams did not fill it)."""

    per_flow: float
    link: float


@dataclass
class Topology:
    """Ranks grouped into hosts and racks, with pairwise bandwidth (bytes/s) and latency (s);
    per-flow caps found on a host's NIC (``host_caps``, per host) or a rack's uplink
    (``rack_caps``, per rack), empty when not measured."""

    racks: list[list[int]]
    hosts: list[list[int]]
    bandwidth: np.ndarray
    latency: np.ndarray
    source: str
    host_caps: list[FlowCap | None] = field(default_factory=list)
    rack_caps: list[FlowCap | None] = field(default_factory=list)
    #: the hosts' TCP congestion control (``agreed_congestion``; None: not known)
    tcp_congestion: str | None = None

    @property
    def world_size(self) -> int:
        return len(self.bandwidth)

    def _index_of(self, groups: list[list[int]]) -> dict[int, int]:
        return {rank: g for g, ranks in enumerate(groups) for rank in ranks}

    def host_of(self, rank: int) -> int:
        return self._index_of(self.hosts)[rank]

    def rack_of(self, rank: int) -> int:
        return self._index_of(self.racks)[rank]

    def nic_estimate(self) -> list[float | None]:
        """Per rank: its best bandwidth to another host of its rack (what its NIC allows); None
        when its rack has no other host (a lone host's NIC cannot be told from its uplink)."""
        host, rack = self._index_of(self.hosts), self._index_of(self.racks)
        out: list[float | None] = []
        for i in range(self.world_size):
            peers = [j for j in self.racks[rack[i]] if host[j] != host[i]]
            out.append(float(self.bandwidth[i, peers].max()) if peers else None)
        return out

    def uplink_estimate(self) -> list[float | None]:
        """Per rack: median bandwidth of its ranks to ranks of other racks."""
        out: list[float | None] = []
        for members in self.racks:
            others = np.setdiff1d(np.arange(self.world_size), members)
            values = self.bandwidth[np.ix_(members, others)].ravel()
            out.append(statistics.median(values.tolist()) if values.size else None)
        return out

    def bottlenecks(self, slow_factor: float = 0.5) -> tuple[list[int], list[int]]:
        """(slow ranks, slow racks), worst first: below ``slow_factor`` × the median of their kind."""
        def slow(values: list[float | None]) -> list[int]:
            known = [v for v in values if v is not None]
            if len(known) < 2:
                return []
            median = statistics.median(known)
            found = [(v, i) for i, v in enumerate(values) if v is not None and v < slow_factor * median]
            return [i for _, i in sorted(found)]                        # worst first

        return slow(self.nic_estimate()), slow(self.uplink_estimate()) if len(self.racks) > 2 else []

    def to_profile(self, name: str = "probed", loopback_mbit: float = 10_000.0) -> ClusterProfile:
        """A cluster profile of what was found, for ``bench``/``simulate``/``emulate``/``plan``:
        hosts and racks as found; a host's ``nic_mbit`` its best rate to another host of its
        rack (a host alone in its rack: its best rate to any host -- its NIC cannot be told
        from its uplink, and the slower of the two is what the profile then reproduces), a
        single host ``loopback_mbit``; each rack's ``uplink_mbit`` (several racks) the median
        rate of its ranks to other racks. Ranks are renumbered rack by rack, host by host, as
        profiles number them. A per-flow cap found on a NIC or an uplink becomes its
        ``per_flow_mbit``, and the link's rate the faster of its pairwise and its several-stream rate.
        The hosts' congestion control, where known, is the profile's ``tcp_congestion``."""
        from syncplane.cluster.profile import HostSpec, RackSpec

        nic, uplink = self.nic_estimate(), self.uplink_estimate()
        several = len(self.racks) > 1

        def mbit(bytes_per_s: float) -> float:
            return float(f"{bytes_per_s * 8 / 1e6:.3g}")

        racks = []
        for k, members in enumerate(self.racks):
            hosts = []
            for h, ranks in enumerate(self.hosts):
                if ranks[0] not in members:
                    continue
                others = [j for j in range(self.world_size) if j not in ranks]
                rate = nic[ranks[0]] if nic[ranks[0]] is not None else \
                    (float(self.bandwidth[ranks[0], others].max()) if others else loopback_mbit * 1e6 / 8)
                cap = self.host_caps[h] if self.host_caps else None
                hosts.append(HostSpec(name=f"h{h}", nic_mbit=mbit(max(rate, cap.link) if cap else rate),
                                      ranks=len(ranks), per_flow_mbit=mbit(cap.per_flow) if cap else None))
            cap = self.rack_caps[k] if self.rack_caps and several else None
            rate = max(uplink[k], cap.link) if cap and uplink[k] is not None else uplink[k]
            racks.append(RackSpec(name=f"r{k}", hosts=hosts, uplink_mbit=mbit(rate) if several and rate is not None
                                  else None, per_flow_mbit=mbit(cap.per_flow) if cap else None))
        profile = ClusterProfile(name=name, racks=racks,
                                 **({"tcp_congestion": self.tcp_congestion} if self.tcp_congestion else {}))
        profile.validate()
        return profile

    def to_dict(self) -> dict[str, Any]:
        return {"racks": self.racks, "hosts": self.hosts, "bandwidth": self.bandwidth.tolist(),
                "latency": self.latency.tolist(), "source": self.source,
                "host_caps": [asdict(c) if c else None for c in self.host_caps],
                "rack_caps": [asdict(c) if c else None for c in self.rack_caps],
                "tcp_congestion": self.tcp_congestion}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        def caps(key: str) -> list[FlowCap | None]:
            return [FlowCap(**c) if c else None for c in data.get(key, [])]

        return cls(racks=data["racks"], hosts=data["hosts"], bandwidth=np.asarray(data["bandwidth"], dtype=float),
                   latency=np.asarray(data["latency"], dtype=float), source=data["source"],
                   host_caps=caps("host_caps"), rack_caps=caps("rack_caps"),
                   tcp_congestion=data.get("tcp_congestion"))


# ----------------------------------------------------------------------------- from a profile


def from_profile(profile: ClusterProfile, world_size: int | None = None, probe_bytes: float = 2**20) -> Topology:
    """The topology a profile declares; pairwise bandwidth from the cost model (both directions
    of an exchange at once, so a pair's rate is its slower direction's)."""
    if world_size is not None and world_size != profile.world_size:
        raise ConfigError(f"cluster profile {profile.name!r} has {profile.world_size} ranks but the job has "
                          f"{world_size} processes")
    n = profile.world_size
    model = CostModel(profile)
    bw = np.full((n, n), np.inf)
    lat = np.zeros((n, n))
    first, second = np.triu_indices(n, k=1)             # one two-flow phase per pair, evaluated as one batch
    pairs = len(first)
    seconds = model.batch_phase_times(np.repeat(np.arange(pairs), 2), np.stack([first, second], 1).ravel(),
                                      np.stack([second, first], 1).ravel(), np.full(2 * pairs, float(probe_bytes)),
                                      pairs, alpha_s=0.0)
    bw[first, second] = bw[second, first] = probe_bytes / seconds
    lat[first, second] = lat[second, first] = model.alpha_s
    racks: list[list[int]] = [[] for _ in profile.racks]
    for host in profile.hosts:
        racks[host.rack].extend(host.ranks)
    return Topology(racks=racks, hosts=[list(h.ranks) for h in profile.hosts], bandwidth=bw, latency=lat,
                    source=f"profile {profile.name}")


# ----------------------------------------------------------------------------- probing


def round_robin_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Circle-method tournament: every unordered pair of ``n`` ranks meets exactly once, in
    ``n − 1`` rounds (``n`` rounds when odd: one rank sits out each round)."""
    players: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


Parts = list[tuple[Any, torch.Tensor, torch.Tensor]]     # (stream group, part to send, part to receive)


def _both_ways(parts: Parts, peer: int) -> float:
    """Seconds for both ends to send their parts to each other at once."""
    start = time.perf_counter()
    # sends posted first, unlike the exchanges (``p2p.exchange_tensors``): DS-Sync's re-probe
    # (``algorithms.ds_sync.runtime``) was measured on this order; not yet timed the other way
    works = [w for lane, out, into in parts for w in (dist.isend(out, peer, group=lane),
                                                      dist.irecv(into, peer, group=lane))]
    for w in works:
        w.wait()
    return time.perf_counter() - start


def _one_way(parts: Parts, pair: tuple[int, int], me: int, tiny_out: torch.Tensor, tiny_in: torch.Tensor,
             group: Any) -> float:
    """Seconds for this rank to send its parts to its peer until the peer replies that it has
    them; ``pair[0]`` sends first, then the other way round (which the peer times)."""
    took = 0.0
    peer = pair[1] if pair[0] == me else pair[0]
    for sender in pair:
        start = time.perf_counter()
        if sender == me:
            for w in [dist.isend(out, peer, group=lane) for lane, out, _ in parts]:
                w.wait()
            dist.recv(tiny_in, peer, group=group)
            took = time.perf_counter() - start
        else:
            for w in [dist.irecv(into, peer, group=lane) for lane, _, into in parts]:
                w.wait()
            dist.send(tiny_out, peer, group=group)
    return took


def measure_rounds(rounds: Sequence[Sequence[tuple[int, int]]], nbytes: int,
                   pings: int = 3, repeats: int = 2, group: Any = None,
                   streams: Sequence[Any] = (), one_way: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Collective: in each round the pairs exchange ``nbytes / 4`` and then ``nbytes`` both ways
    at once, ``repeats`` times (after a few tiny ping-pongs for the latency). Returns (bandwidth bytes/s, latency s),
    n×n, on every rank; pairs that did not meet hold 0. ``streams``: process groups over every
    rank, one TCP connection per pair each, that carry equal parts of the exchange at once
    (none: one stream, ``group``). ``one_way``: each end sends in turn, timed by the sender up
    to the receiver's reply (a link's rate: an exchange both ways, posted send first as here, got
    ~60 % of an emulated 100 Mbit uplink under load -- gloo's notice that a receive is posted
    queued behind the other direction's data; both ways is what DS-Sync's swaps do)."""
    n, me = dist.get_world_size(), dist.get_rank()   # group: the job's gloo control group (CPU tensors)
    bw, lat = torch.zeros(n, n, dtype=torch.float64), torch.zeros(n, n, dtype=torch.float64)
    send = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    recv = torch.empty_like(send)
    tiny_out, tiny_in = torch.zeros(1), torch.zeros(1)
    lanes = list(streams) or [group]
    for pairs in rounds:
        dist.barrier(group=group)
        pair = next(((a, b) for a, b in pairs if me in (a, b)), None)
        if pair is None:
            continue
        peer = pair[1] if pair[0] == me else pair[0]
        rtts = []
        for _ in range(pings):
            start = time.perf_counter()
            if me < peer:
                dist.send(tiny_out, peer, group=group)
                dist.recv(tiny_in, peer, group=group)
            else:
                dist.recv(tiny_in, peer, group=group)
                dist.send(tiny_out, peer, group=group)
            rtts.append(time.perf_counter() - start)
        # Two sizes, bandwidth from the difference: a shaper's burst allowance (and the
        # latency) gives both the same head start, so the slope is the sustained rate. Each
        # size is timed `repeats` times and the fastest kept (a descheduled process only ever
        # slows a transfer down), and the slope is capped by the large transfer's plain rate:
        # a small transfer that stalled would otherwise shrink the difference and report a
        # slow link as a fast one -- enough, once, to merge two racks.
        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            for k, numel in enumerate((send.numel() // 4, send.numel())):
                parts = list(zip(lanes, send[:numel].tensor_split(len(lanes)), recv[:numel].tensor_split(len(lanes))))
                best[k] = min(best[k], _one_way(parts, pair, me, tiny_out, tiny_in, group) if one_way
                              else _both_ways(parts, peer))
        large = send.numel() * 4
        slope = (large - send.numel() // 4 * 4) / max(best[1] - best[0], 1e-9)
        bw[me, peer] = min(slope, large / best[1])
        lat[me, peer] = min(rtts) / 2
    dist.all_reduce(bw, group=group)
    dist.all_reduce(lat, group=group)
    bw = (bw + bw.T) / 2                        # both ends timed it
    lat = (lat + lat.T) / 2
    return bw.numpy(), lat.numpy()


def exclusive_rounds(pairs: Sequence[tuple[int, int]], part: Mapping[int, int]) -> list[list[tuple[int, int]]]:
    """``pairs`` of ranks into rounds in which no part (``part[rank]``: a group of close ranks,
    e.g. a rack) takes part twice, so that on a tree network no two pairs of a round cross the
    same uplink; greedily, in the order given (the same rounds on every rank)."""
    left, rounds = list(pairs), []
    while left:
        used: set[int] = set()
        taken = []
        for a, b in left:
            if not {part[a], part[b]} & used:
                used |= {part[a], part[b]}
                taken.append((a, b))
        rounds.append(taken)
        left = [p for p in left if p not in taken]
    return rounds


def _a_rack_gap(ratio: float) -> bool:
    """Does bandwidth drop by ``MIN_GAP_RATIO`` (exactly 2× counts, despite rounding)?"""
    return ratio >= MIN_GAP_RATIO * (1 - 1e-9)


def rack_threshold(values: Sequence[float]) -> float | None:
    """The bandwidth separating fast (in-rack) from slow links, or None when the links are
    one class. The split maximises the between-class variance of log bandwidth (Otsu): unlike
    the single largest gap, one stray measurement cannot move it much. It counts only if the
    two classes' geometric means differ by ``MIN_GAP_RATIO``."""
    logs = np.sort(np.log(np.asarray(values, dtype=float)))
    if len(logs) < 2:
        return None
    best, split = -1.0, 0
    for k in range(1, len(logs)):
        low, high = logs[:k], logs[k:]
        score = len(low) * len(high) * (high.mean() - low.mean()) ** 2
        if score > best:
            best, split = score, k
    if not _a_rack_gap(float(np.exp(logs[split:].mean() - logs[:split].mean()))):
        return None
    return float(np.exp((logs[split - 1] + logs[split]) / 2))


#: does host x belong to rack R (a list of hosts): True, False, or None (cannot tell)
Belongs = Callable[[int, list[int]], "bool | None"]


def cluster_racks(host_bw: np.ndarray, belongs: Belongs | None = None) -> list[list[int]]:
    """Hosts into racks. Each link is classed fast or slow (``rack_threshold``); two hosts
    share a rack when most of their fast neighbourhoods agree (Jaccard similarity of the sets
    {self} ∪ {fast peers} above ½), racks are the connected components of that relation.
    Comparing whole neighbourhoods, not single links, is what makes it robust: one cross-rack
    pair that happened to measure fast (or one in-rack pair that measured slow) changes one
    member of two sets and merges (or splits) nothing. A host with no fast link at all has a
    slow NIC rather than a rack of its own (the two look alike by pairwise rates): it joins
    the rack it reaches best, of those ``belongs`` (a concurrent test, ``probe``) does not rule
    out; a host that ``belongs`` rules out of every rack is a rack of its own."""
    h = len(host_bw)
    if h <= 2:
        return [list(range(h))]
    threshold = rack_threshold([float(host_bw[i, j]) for i in range(h) for j in range(i + 1, h)])
    if threshold is None:
        return [list(range(h))]
    fast = [{i} | {j for j in range(h) if j != i and host_bw[i, j] >= threshold} for i in range(h)]
    similar = nx.Graph()
    similar.add_nodes_from(range(h))
    similar.add_edges_from((i, j) for i in range(h) for j in range(i + 1, h)
                           if len(fast[i] & fast[j]) > len(fast[i] | fast[j]) / 2)
    clusters = sorted(sorted(c) for c in nx.connected_components(similar))
    racks = [c for c in clusters if len(c) > 1]
    if not racks:
        return [list(range(h))]
    lone_hosts = [c[0] for c in clusters if len(c) == 1]
    own = _racks_of_lone_hosts(host_bw, racks, lone_hosts)
    placed = {host for rack in own for host in rack}
    for lone in (host for host in lone_hosts if host not in placed):
        verdicts = [belongs(lone, list(rack)) for rack in racks] if belongs is not None else []
        options = [r for r, v in enumerate(verdicts) if v] if verdicts and None not in verdicts \
            else list(range(len(racks)))
        if not options:
            own.append([lone])
            continue
        best = max(options, key=lambda r: statistics.median(float(host_bw[lone, j]) for j in racks[r]))
        racks[best].append(lone)
    return sorted(sorted(r) for r in racks + own)


def _racks_of_lone_hosts(host_bw: np.ndarray, racks: list[list[int]], lone: list[int]) -> list[list[int]]:
    """The hosts with no fast link that form a rack of their own: a rack behind a slow uplink
    whose hosts' NICs are slower than the fast links elsewhere, but faster than that uplink.
    Hosts with slow NICs inside one rack reach each other no faster than they reach the rest
    of it (their NICs cap both); these reach each other ``MIN_GAP_RATIO`` faster than any host
    of the racks found."""
    if len(lone) < 2:
        return []
    found = []
    for group in cluster_racks(host_bw[np.ix_(lone, lone)]):
        members = [lone[i] for i in group]
        if len(members) < 2:
            continue
        inside = min(float(host_bw[a, b]) for a in members for b in members if a != b)
        outside = max(float(host_bw[a, b]) for a in members for rack in racks for b in rack)
        if _a_rack_gap(inside / outside):
            found.append(sorted(members))
    return found


def hosts_of(host_ids: Sequence[int]) -> list[list[int]]:
    """Ranks grouped by host id (one per rank), hosts in id order."""
    return [[r for r, h in enumerate(host_ids) if h == hid] for hid in sorted(set(host_ids))]


def host_matrix(bw: np.ndarray, hosts: list[list[int]]) -> np.ndarray:
    """Host-to-host bandwidth: the best of their ranks' pairs (0 on the diagonal)."""
    hb = np.zeros((len(hosts), len(hosts)))
    for a, ra in enumerate(hosts):
        for b, rb in enumerate(hosts):
            if a != b:
                hb[a, b] = max(float(bw[i, j]) for i in ra for j in rb)
    return hb


def topology_from_measurements(bw: np.ndarray, lat: np.ndarray, host_ids: Sequence[int],
                               belongs: Belongs | None = None) -> Topology:
    """Hosts from ``host_ids`` (one per rank), racks from clustering the host-level bandwidth."""
    hosts = hosts_of(host_ids)
    hb = host_matrix(bw, hosts)
    racks = [sorted(r for h in rack for r in hosts[h]) for rack in cluster_racks(hb, belongs)]
    bw = bw.copy()
    np.fill_diagonal(bw, np.inf)
    return Topology(racks=sorted(racks), hosts=hosts, bandwidth=bw, latency=lat, source="probe")


def close_parts(host_bw: np.ndarray) -> list[int]:
    """Per host, the id of its group of close hosts: connected by links above the rack
    threshold (``rack_threshold``); one group when the links are one class."""
    h = len(host_bw)
    threshold = rack_threshold([float(host_bw[i, j]) for i in range(h) for j in range(i + 1, h)]) if h > 1 else None
    graph = nx.Graph()
    graph.add_nodes_from(range(h))
    if threshold is not None:
        graph.add_edges_from((i, j) for i in range(h) for j in range(i + 1, h) if host_bw[i, j] >= threshold)
    part = [0] * h
    for k, members in enumerate(sorted(sorted(c) for c in nx.connected_components(graph))):
        for m in members:
            part[m] = k
    return part


def rack_parts(hosts: list[list[int]], racks: Sequence[Sequence[int]]) -> list[int]:
    """Per host, the index of its rack (``racks``: lists of ranks), for ``retime_contended_pairs``."""
    of = {r: k for k, rack in enumerate(racks) for r in rack}
    return [of[ranks[0]] for ranks in hosts]


def same_groups(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two labellings of the hosts (per host, its group) group them alike."""
    return len(set(a)) == len(set(b)) == len(set(zip(a, b)))


def retime_rounds(hosts: list[list[int]], part: Sequence[int]) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]]:
    """The host pairs to time again after the tournament, and the rounds that time them (pairs
    of hosts' first ranks). The tournament ran every rank in a pair of its own at once, so
    (1) a pair of hosts in different groups (``part``, per host) shared its groups' uplinks with
    the other pairs that left them: those are timed again one pair per group per round
    (``exclusive_rounds``); (2) a pair of hosts of one group where a host runs several ranks
    shared that host's NIC with its other ranks' pairs: those are timed again one pair per
    host per round (no uplink in between)."""
    first = [ranks[0] for ranks in hosts]
    cross, shared = [], []
    for a in range(len(hosts)):
        for b in range(a + 1, len(hosts)):
            if part[a] != part[b]:
                cross.append((a, b))
            elif len(hosts[a]) > 1 or len(hosts[b]) > 1:
                shared.append((a, b))
    rounds = exclusive_rounds([(first[a], first[b]) for a, b in cross], {first[h]: part[h] for h in range(len(hosts))})
    rounds += exclusive_rounds([(first[a], first[b]) for a, b in shared], {r: r for r in first})
    return cross + shared, rounds


def retime_contended_pairs(bw: np.ndarray, hosts: list[list[int]], nbytes: int, group: Any = None,
                           part: Sequence[int] | None = None) -> np.ndarray:
    """Collective: ``bw`` with the pairs of hosts the tournament timed beside other pairs
    sharing a link with them timed again (``retime_rounds``). ``part``: per host, its group --
    its rack where the racks are known (``rack_parts``), else its group of close hosts
    (``close_parts``), which splits a rack at a slow-NIC host, whose pairs then still share its
    rack's uplink."""
    part = list(part) if part is not None else close_parts(host_matrix(bw, hosts))
    pairs, rounds = retime_rounds(hosts, part)
    if not pairs:
        return bw
    again, _ = measure_rounds(rounds, nbytes, group=group, one_way=True)
    out = bw.copy()
    for a, b in pairs:
        out[np.ix_(hosts[a], hosts[b])] = out[np.ix_(hosts[b], hosts[a])] = again[hosts[a][0], hosts[b][0]]
    return out


def measure_pairs(world_size: int, hosts: list[list[int]], nbytes: int, group: Any = None,
                  racks: Sequence[Sequence[int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Collective: (bandwidth, latency) of every pair, one way, each pair once in round-robin
    rounds; then the pairs across racks (``racks``, lists of ranks, where known) or across close
    groups of hosts, and those beside a host's other ranks, timed again apart
    (``retime_contended_pairs``)."""
    bw, lat = measure_rounds(round_robin_rounds(world_size), nbytes, group=group, one_way=True)
    part = rack_parts(hosts, racks) if racks is not None else None
    return retime_contended_pairs(bw, hosts, nbytes, group, part), lat


def time_sends(pairs: Sequence[tuple[int, int]], nbytes: int, repeats: int = 2, group: Any = None) -> float:
    """Collective: seconds from a barrier until every pair of ``pairs`` has sent ``nbytes``
    (the first rank of each pair to the second): the slowest rank's, the receiver's that got
    the last byte; the fastest of ``repeats`` (a descheduled rank only ever adds time). As
    ``comm.timing.slowest_times``, which the cluster layer may not import."""
    me = dist.get_rank()
    pair = next(((a, b) for a, b in pairs if me in (a, b)), None)
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        if pair is not None and me == pair[0]:
            dist.send(data, pair[1], group=group)
        elif pair is not None:
            dist.recv(data, pair[0], group=group)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
        best = min(best, float(took))
    return best


def kept_apart(alone_a: float, alone_b: float, together: float) -> float:
    """How far two transfers kept apart, from their times alone and the time both took at once:
    1 when they shared a link (``together`` = the sum: the second waited for the first), 2 when
    they shared none (``together`` = the longer one: the shorter one cost nothing). Times, not
    each transfer's own rate: a pair that TCP served first and then let run alone finished at
    nearly its lone rate beside a shared link (1.84 of 2 on the old per-pair rates)."""
    return 1.0 + (alone_a + alone_b - together) / max(min(alone_a, alone_b), 1e-9)


def concurrent_test(host_bw: np.ndarray, hosts: list[list[int]], nbytes: int, group: Any = None) -> Belongs:
    """``cluster_racks``'s ``belongs`` for a probe (collective: every rank must call it with the
    same arguments in the same order). Host x and rack R: x's best peer y in R sends to x while
    another host u of R sends to the host v outside R (not x) it reaches best: out of R only,
    4x the probe's bytes (long beside a descheduled rank's late start). If x is outside R both
    transfers cross R's uplink and take as long together as one after the other; if x is in R
    they share no link and take as long as the longer one (``kept_apart``: 1 against 2).
    (Each pair's own rate, timed each way in turn, both ways at once, or out of R alone, each
    placed ``uneven_three_racks``'s lone-rack host into another rack on the loaded emulator.)"""
    first = [ranks[0] for ranks in hosts]

    def belongs(x: int, rack: list[int]) -> bool | None:
        y = max(rack, key=lambda h: float(host_bw[x, h]))
        outside = [h for h in range(len(hosts)) if h not in rack and h != x]
        if len(rack) < 2 or not outside:
            return None
        u = next(h for h in rack if h != y)
        v = max(outside, key=lambda h: float(host_bw[u, h]))
        xy, uv = (first[y], first[x]), (first[u], first[v])
        alone = [time_sends([p], 4 * nbytes, group=group) for p in (xy, uv)]
        both = time_sends([xy, uv], 4 * nbytes, group=group)
        kept = kept_apart(*alone, both)
        log.info("probe: host %d beside rack %s (pairs %s, %s): alone %.3f, %.3f s, together %.3f s: "
                 "kept %.2f of 2", x, rack, xy, uv, *alone, both, kept)
        return bool(kept >= NO_SHARED_LINK)

    return belongs


def measure_flow_caps(topo: Topology, nbytes: int, streams: int, group: Any = None,
                      lanes: Sequence[Any] | None = None) -> tuple[list[FlowCap | None], list[FlowCap | None]]:
    """Collective: (per host, per rack) per-flow caps. One pair inside each rack (its NICs) and
    one between each two racks (their uplinks), the pairs with the best rate, are timed over
    one stream and over ``streams`` at once (``streams - 1`` extra gloo groups). A rack whose
    in-rack pair shows a cap gives it to each of its hosts' NICs; a rack gets an uplink cap
    when every pair to another rack shows one (with two racks a cap seen between them is put
    on both: which uplink has it cannot be told). ``lanes``: the ``streams`` groups to time
    them over (``group`` first), made by a caller that probes again and again; None: made here."""
    host_index = {r: h for h, ranks in enumerate(topo.hosts) for r in ranks}
    rack_of_host = {host_index[r]: k for k, rack in enumerate(topo.racks) for r in rack}
    firsts = [[ranks[0] for ranks in topo.hosts if ranks[0] in rack] for rack in topo.racks]

    def best(a: list[int], b: list[int]) -> tuple[int, int] | None:
        pairs = [(i, j) for i in a for j in b if host_index[i] != host_index[j]]
        return max(pairs, key=lambda p: float(topo.bandwidth[p])) if pairs else None

    inside = {k: best(f, f) for k, f in enumerate(firsts)}
    across = {(k, m): best(firsts[k], firsts[m]) for k in range(len(firsts)) for m in range(k + 1, len(firsts))}
    samples = [(min(p), max(p)) for p in [*inside.values(), *across.values()] if p is not None]
    rounds = exclusive_rounds(samples, {r: topo.rack_of(r) for r in range(topo.world_size)})
    if lanes is None:
        lanes = [group] + [dist.new_group(backend="gloo") for _ in range(streams - 1)]
    one, _ = measure_rounds(rounds, nbytes, group=group, one_way=True)
    several, _ = measure_rounds(rounds, nbytes, group=group, streams=lanes, one_way=True)

    def cap(pair: tuple[int, int] | None) -> FlowCap | None:
        if pair is None or several[pair] < FLOW_CAP_RATIO * one[pair]:
            return None
        return FlowCap(per_flow=float(one[pair]), link=float(several[pair]))

    host_caps = [cap(inside[rack_of_host[h]]) for h in range(len(topo.hosts))]
    rack_caps: list[FlowCap | None] = []
    for k in range(len(topo.racks)):
        found = [cap(p) for (a, b), p in across.items() if k in (a, b) and p is not None]
        rack_caps.append(min(found, key=lambda c: c.per_flow) if found and all(found) else None)  # type: ignore[arg-type]
    return host_caps, rack_caps


def congestion_control(path: Path = CONGESTION_FILE) -> str | None:
    """This host's TCP congestion control, None where the kernel does not say (not Linux)."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def agreed_congestion(found: Sequence[str | None], host_ids: Sequence[int]) -> str | None:
    """The congestion control of the hosts (``found``: each rank's; ``host_ids``: its host's),
    one value as a profile holds it: where hosts differ, the most common (ties: the one of the
    lowest host), with a warning naming the others; None when no host says."""
    by_host = {host: name for host, name in sorted(zip(host_ids, found), key=lambda pair: pair[0]) if name}
    if not by_host:
        return None
    names = list(by_host.values())
    agreed = max(dict.fromkeys(names), key=names.count)
    others = {host: name for host, name in by_host.items() if name != agreed}
    if others:
        log.warning("probe: the hosts' TCP congestion control differs; the profile says %s, as %d of %d hosts "
                    "run; hosts %s run %s", agreed, names.count(agreed), len(names),
                    ", ".join(map(str, others)), ", ".join(others.values()))
    return agreed


def probe(nbytes: int = 2**20, cache_dir: Path | None = CACHE_DIR, refresh: bool = False,
          group: Any = None, job: ProbeSite | None = None, streams: int = 1) -> Topology:
    """Collective: measure (or load from the cache) this job's topology; same result on every
    rank. ``job``: the job's context (default: what the launcher said, ``Launch.read``).
    ``streams`` > 1: measure per-flow caps too (``measure_flow_caps``)."""
    if streams < 1:
        raise ConfigError(f"probe streams: must be at least 1, got {streams}")
    n = dist.get_world_size()
    job = job if job is not None else Launch.read()
    host_id = int(job.node_rank) if job.node_rank is not None else dist.get_rank()
    found: list[Any] = [None] * n
    dist.all_gather_object(found, (host_id, congestion_control()), group=group)
    ids, tcp = [f[0] for f in found], [f[1] for f in found]
    cluster_file = job.cluster      # the emulated cluster's profile (its content, not its path)
    cluster = Path(cluster_file).read_text() if cluster_file and Path(cluster_file).exists() else ""
    key = hashlib.sha1(json.dumps([n, ids, job.master_addr, nbytes, cluster, streams, tcp]).encode()).hexdigest()[:16]
    path = cache_dir / f"{key}.json" if cache_dir is not None else None
    box: list[Any] = [None]
    if dist.get_rank() == 0 and path is not None and path.exists() and not refresh:
        box[0] = json.loads(path.read_text())
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        topo = Topology.from_dict(box[0])
        topo.source = f"probe (cached {path})"
        return topo
    hosts = hosts_of(ids)
    bw, lat = measure_pairs(n, hosts, nbytes, group)
    host_bw = host_matrix(bw, hosts)
    topo = topology_from_measurements(bw, lat, ids, concurrent_test(host_bw, hosts, nbytes, group))
    topo.tcp_congestion = agreed_congestion(tcp, ids)
    racks = rack_parts(hosts, topo.racks)
    if not same_groups(racks, close_parts(host_bw)):
        # a slow-NIC host joined a rack it was not close to: its pairs out of the rack were
        # timed beside its rack-mates' and shared their uplink, so they are timed again by rack
        topo.bandwidth = retime_contended_pairs(bw, hosts, nbytes, group, racks)
        np.fill_diagonal(topo.bandwidth, np.inf)
    if streams > 1:
        topo.host_caps, topo.rack_caps = measure_flow_caps(topo, nbytes, streams, group)
    if dist.get_rank() == 0 and path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = topo.to_dict()
        data["bandwidth"] = [[v if np.isfinite(v) else 1e300 for v in row] for row in data["bandwidth"]]
        path.write_text(json.dumps(data))
    return topo


def resolve_topology(job: ProbeSite, source: str = "auto", probe_bytes: int = 2**20, refresh: bool = False,
                     group: Any = None) -> Topology:
    """Collective (over ``group``: pass the job's gloo control group; the probe moves CPU
    tensors, which an NCCL default group refuses). ``auto``: the profile the job was placed on
    (``job.cluster``) if any, else a probe; ``probe``: always probe; anything else: a shipped
    profile name or a YAML path."""
    world = dist.get_world_size()
    if source == "probe" or (source == "auto" and not job.cluster):
        return probe(probe_bytes, refresh=refresh, group=group, job=job)
    name = job.cluster if source == "auto" else source
    assert name is not None
    return from_profile(load_profile(name), world)


def print_table(topo: Topology, slow_factor: float = 0.5, file: Any = None) -> None:
    """What was found, as a table (one row per host), on ``file`` (default: stdout)."""
    from rich.console import Console
    from rich.table import Table

    slow_ranks, slow_racks = topo.bottlenecks(slow_factor)
    nic, uplink = topo.nic_estimate(), topo.uplink_estimate()
    tcp = f", TCP {topo.tcp_congestion}" if topo.tcp_congestion else ""
    table = Table(title=f"DS-Sync topology ({topo.source}): {len(topo.racks)} racks, {len(topo.hosts)} hosts, "
                        f"{topo.world_size} ranks{tcp}")
    for col in ("rack", "host", "ranks", "NIC Mbit/s", "uplink Mbit/s", "bottleneck"):
        table.add_column(col, justify="left" if col in ("rack", "host", "ranks", "bottleneck") else "right")

    def mbit(v: float | None) -> str:
        return "-" if v is None or not np.isfinite(v) else f"{v * 8 / 1e6:.0f}"

    for k, rack in enumerate(topo.racks):
        for h, ranks in enumerate(topo.hosts):
            if ranks[0] not in rack:
                continue
            flags = (["slow NIC"] if any(r in slow_ranks for r in ranks) else []) + \
                    (["slow uplink"] if k in slow_racks else [])
            table.add_row(str(k), str(h), ",".join(map(str, ranks)), mbit(nic[ranks[0]]), mbit(uplink[k]),
                          ", ".join(flags) or "-")
    Console(width=110, file=file).print(table)


def table_text(topo: Topology, slow_factor: float = 0.5) -> str:
    """``print_table``'s table as text, for a log."""
    import io

    out = io.StringIO()
    print_table(topo, slow_factor, file=out)
    return out.getvalue()


def build_parser() -> argparse.ArgumentParser:
    """The probe's command line (``docs/reference/cli.md`` is generated from it)."""
    parser = argparse.ArgumentParser(prog="python -m syncplane.cluster.probe")
    parser.add_argument("--mb", type=float, default=1.0, help="bytes each pair exchanges, in MB")
    parser.add_argument("--json", help="where rank 0 writes the topology")
    parser.add_argument("--refresh", action="store_true", help="ignore (and rewrite) the cached result")
    parser.add_argument("--streams", type=int, default=4,
                        help="streams per pair for the per-flow cap test (1: no test)")
    parser.add_argument("--profile", help="where rank 0 writes a cluster profile YAML of what was found "
                                          "(for bench, simulate, emulate, plan and train.py cluster=PATH)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m syncplane.cluster.probe [--mb M] [--json OUT] [--refresh] [--profile YAML]``, once
    per rank (torchrun-style environment): probe, print the table on rank 0, write the topology."""
    import datetime

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.mb <= 0:
        parser.error(f"--mb must be positive, got {args.mb}")
    if args.streams < 1:
        parser.error(f"--streams must be at least 1, got {args.streams}")
    net.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        topo = probe(int(args.mb * 2**20), refresh=args.refresh, streams=args.streams)
        if dist.get_rank() == 0:
            print_table(topo)
            if args.json:
                data = topo.to_dict()
                data["bandwidth"] = [[v if np.isfinite(v) else None for v in row] for row in data["bandwidth"]]
                Path(args.json).write_text(json.dumps(data, indent=1))
            if args.profile:
                import yaml

                profile = topo.to_profile(Path(args.profile).stem)
                Path(args.profile).write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))
                print(f"cluster profile written to {args.profile}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
