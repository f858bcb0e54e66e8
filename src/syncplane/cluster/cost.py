"""The α-β cost model: how long a communication pattern takes on a cluster profile.

A pattern is a list of *phases*; a phase is a set of concurrent flows (src rank, dst
rank, bytes) that must all finish before the next phase starts. A phase costs

    α + max( max_links load(L) / capacity(L),  max_flows bytes / per_flow_cap )

where a flow crosses its source host's NIC (egress), the destination host's NIC
(ingress) and, between racks, both racks' uplinks; flows inside one host use loopback.
A link carrying g greedy background flows next to f of ours gives ours f/(f+g) of its
capacity (TCP fair share); one flow uses one NIC, f flows use at most min(f, k) of a
host's k NICs (gloo binds one collective to one NIC: striping needs several groups). With α = 0
this is the bandwidth lower bound (``bound_s``); with the α measured on the emulator it
is the prediction ``syncplane simulate`` prints.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from syncplane.cluster.profile import ClusterProfile

Flow = tuple[int, int, float]            # src rank, dst rank, bytes
Phase = list[Flow]

MBIT = 1e6 / 8                            # bytes per second in one Mbit/s
DEFAULT_ALPHA_S = 2.2e-3                  # per-phase latency of gloo on the emulator (measured, docs/benchmarks.md)
DEFAULT_LOOPBACK_BPS = 2.5e9              # memory-to-memory over loopback on this class of machine


@dataclass
class CostModel:
    profile: ClusterProfile
    alpha_s: float = DEFAULT_ALPHA_S
    loopback_bytes_per_s: float = DEFAULT_LOOPBACK_BPS

    def _links(self, src: int, dst: int) -> list[tuple[str, int]]:
        a, b = self.profile.host_of_rank(src), self.profile.host_of_rank(dst)
        if a.index == b.index:
            return [("lo", a.index)]
        links = [("nic_out", a.index), ("nic_in", b.index)]
        if a.rack != b.rack:
            links += [("up_out", a.rack), ("up_in", b.rack)]
        return links

    def _capacity(self, link: tuple[str, int]) -> tuple[float, float | None]:
        """(total bytes/s, per-flow cap bytes/s or None)."""
        kind, index = link
        if kind == "lo":
            return self.loopback_bytes_per_s, None
        if kind in ("nic_out", "nic_in"):
            spec = self.profile.hosts[index].spec
            cap = spec.per_flow_mbit * MBIT if spec.per_flow_mbit else None
            return spec.nic_mbit * MBIT, cap
        rack = self.profile.racks[index]
        assert rack.uplink_mbit is not None
        return rack.uplink_mbit * MBIT, (rack.per_flow_mbit * MBIT if rack.per_flow_mbit else None)

    def _background_load(self) -> dict[tuple[str, int], int]:
        """Greedy background flows per link (paced ones count as greedy: an upper bound on their share)."""
        counts: dict[tuple[str, int], int] = defaultdict(int)
        for flow in self.profile.background:
            src, dst = self.profile.host(flow.src), self.profile.host(flow.dst)
            for link in self._links(src.first_rank, dst.first_rank):
                counts[link] += 1
        return counts

    def phase_time(self, flows: Iterable[Flow], alpha_s: float | None = None) -> float:
        load: dict[tuple[str, int], float] = defaultdict(float)
        count: dict[tuple[str, int], int] = defaultdict(int)
        slowest_flow = 0.0
        for src, dst, nbytes in flows:
            if src == dst or nbytes <= 0:
                continue
            for link in self._links(src, dst):
                load[link] += nbytes
                count[link] += 1
                _, per_flow = self._capacity(link)
                if per_flow:
                    slowest_flow = max(slowest_flow, nbytes / per_flow)
        background = self._background_load()
        busiest = 0.0
        for link, nbytes in load.items():
            capacity, _ = self._capacity(link)
            if link[0] in ("nic_out", "nic_in"):
                # a TCP flow uses one NIC; several flows can use several (at best evenly)
                capacity *= min(self.profile.hosts[link[1]].spec.nics, count[link])
            share = count[link] / (count[link] + background.get(link, 0))
            busiest = max(busiest, nbytes / (capacity * share))
        if not load:
            return 0.0
        return (self.alpha_s if alpha_s is None else alpha_s) + max(busiest, slowest_flow)

    def time(self, phases: Sequence[Phase], alpha_s: float | None = None) -> float:
        return sum(self.phase_time(phase, alpha_s) for phase in phases)

    def bound(self, phases: Sequence[Phase]) -> float:
        """The bandwidth lower bound: no per-message latency."""
        return self.time(phases, alpha_s=0.0)


# ----------------------------------------------------------------------------- patterns


def ring_allreduce(world_size: int, payload_bytes: float) -> list[Phase]:
    """Reduce-scatter then all-gather around the ring 0→1→…→n−1→0: 2(n−1) phases of M/n."""
    if world_size < 2:
        return []
    chunk = payload_bytes / world_size
    step = [(r, (r + 1) % world_size, chunk) for r in range(world_size)]
    return [list(step) for _ in range(2 * (world_size - 1))]


def neighbor_exchange(sends: dict[int, Sequence[int]], payload_bytes: float) -> list[Phase]:
    """One phase: every rank sends the whole payload to each of its destinations."""
    return [[(src, dst, payload_bytes) for src, dsts in sends.items() for dst in dsts]]


def owner_exchange(world_size: int, payload_bytes: float, streams: int = 1) -> list[Phase]:
    """DiLoCo's exchange (``comm.sharded``): every rank sends segment j (M/n) to its owner j,
    then every owner sends its averaged segment to everyone -- two phases of n(n−1)
    concurrent flows of M/n (times ``streams`` flows of 1/streams of it: one per shard);
    each rank sends 2(n−1)/n·M, like a ring."""
    if world_size < 2:
        return []
    step = [(src, dst, payload_bytes / world_size / streams) for src in range(world_size)
            for dst in range(world_size) if src != dst for _ in range(streams)]
    return [step, list(step)]


#: Strategy name -> its per-step communication pattern (world size, payload bytes).
PATTERNS: dict[str, Callable[..., list[Phase]]] = {
    "ddp": ring_allreduce,
    "torch_periodic": ring_allreduce,    # torch's PeriodicModelAverager: one ring per `period` steps
    "diloco": owner_exchange,            # one exchange of Δ per `period` (= sync_every) steps
}

#: Strategies that communicate once per `period` steps: their per-step cost is amortized.
PERIODIC = {"torch_periodic", "diloco"}

#: Strategies whose pattern takes a number of parallel streams (a third argument).
MULTI_STREAM = {"diloco", "ds_sync"}


def concurrent_group_allreduces(groups: Sequence[Sequence[int]], payload_bytes: float,
                                pair_streams: int = 1) -> list[Phase]:
    """Disjoint groups, each running a ring all-reduce at the same time (DS-Sync's step).

    Every ring link of a group of n carries 2(n−1)/n of the payload; spreading that evenly
    over max 2(n−1) phases keeps the bound exact (concurrent groups add up on shared links)
    and charges the latency of the longest ring. A pair's link carries ``pair_streams``
    flows, each with its share of the bytes (``GroupSet``'s pair swap).
    """
    rings = [sorted(g) for g in groups if len(g) > 1]
    if not rings:
        return []
    phases = max(2 * (len(g) - 1) for g in rings)
    step = []
    for g in rings:
        flows = pair_streams if len(g) == 2 else 1
        per_flow = 2 * (len(g) - 1) / len(g) * payload_bytes / phases / flows
        step += [(g[i], g[(i + 1) % len(g)], per_flow) for i in range(len(g)) for _ in range(flows)]
    return [list(step) for _ in range(phases)]


def ds_sync_steps(profile: ClusterProfile, payload_bytes: float, streams: int = 1) -> list[list[Phase]]:
    """DS-Sync on ``profile``: the phases of every step of one period of its group pattern
    (racks and bottlenecks as the strategy derives them from the profile), pairs swapping
    over ``streams`` connections per direction."""
    from syncplane.cluster.probe import from_profile
    from syncplane.comm.group_pattern import build_pattern

    topo = from_profile(profile)
    pattern = build_pattern(topo.racks, *topo.bottlenecks())
    return [concurrent_group_allreduces(groups, payload_bytes, streams) for groups in pattern.iterations]


def one_peer_steps(profile: ClusterProfile, payload_bytes: float) -> list[list[Phase]]:
    """ATC/AWC's dynamic one-peer exponential schedule: step t, rank r sends to r + 2^t."""
    from syncplane.comm.schedule import OnePeerSchedule

    schedule = OnePeerSchedule(profile.world_size)
    return [neighbor_exchange({r: list(schedule.plan(t, r).dst_weights) for r in range(profile.world_size)},
                              payload_bytes) for t in range(schedule.period)]


def rack_machines(profile: ClusterProfile) -> list[list[int]]:
    """The ranks of each rack: the "machines" of H-ATC/H-AWC when they group by rack."""
    return [[r for h in profile.hosts if h.rack == k for r in h.ranks] for k in range(len(profile.racks))]


def hierarchical_one_peer_steps(profile: ClusterProfile, payload_bytes: float) -> list[list[Phase]]:
    """H-ATC/H-AWC with racks as machines (``hierarchical_neighbor_allreduce``'s data path):
    a reduce-scatter inside every rack (half a ring all-reduce), local rank ℓ of each rack
    exchanging its 1/L shard with local rank ℓ of the neighbour rack (one-peer schedule over
    racks), then an all-gather inside the rack (the other half). Buckets are pipelined, so
    the three phases overlap: one step is modelled as a single phase carrying all their
    flows (each link's total load at its rate; one latency). Racks of different sizes: shard
    ℓ of a rack of L ranks goes to local rank ℓ mod L' of a neighbour rack of L' ranks."""
    from syncplane.comm.schedule import OnePeerSchedule

    machines = rack_machines(profile)
    schedule = OnePeerSchedule(len(machines))
    half_ring = [flow for phase in concurrent_group_allreduces(machines, payload_bytes / 2) for flow in phase]
    steps = []
    for t in range(schedule.period):
        shards = [(src, machines[k][i % len(machines[k])], payload_bytes / len(m))
                  for mi, m in enumerate(machines) for i, src in enumerate(m)
                  for k in schedule.plan(t, mi).dst_weights]
        steps.append([half_ring + shards + half_ring])
    return steps


#: Strategies whose pattern depends on the racks, not only the world size: (profile, payload)
#: -> the phases of each step of one period; a step costs the period's mean.
TOPOLOGY_PATTERNS: dict[str, Callable[..., list[list[Phase]]]] = {
    "ds_sync": ds_sync_steps,
    "atc": one_peer_steps,
    "awc": one_peer_steps,
    "h_atc": hierarchical_one_peer_steps,
    "h_awc": hierarchical_one_peer_steps,
}


def strategy_time(model: CostModel, strategy: str, payload_bytes: float, period: int = 4,
                  streams: int = 1) -> tuple[float, float]:
    """(predicted seconds, bound seconds) of one step's sync of ``strategy`` (amortized
    over ``period`` steps for periodic ones); ``streams``: parallel connections of the
    strategies in ``MULTI_STREAM`` (DiLoCo's shards, DS-Sync's pair streams)."""
    extra = (streams,) if strategy in MULTI_STREAM else ()
    if strategy in TOPOLOGY_PATTERNS:
        steps = TOPOLOGY_PATTERNS[strategy](model.profile, payload_bytes, *extra)
        return (sum(model.time(p) for p in steps) / len(steps), sum(model.bound(p) for p in steps) / len(steps))
    if strategy not in PATTERNS:
        raise KeyError(f"no cost pattern for strategy {strategy!r} yet; modelled: "
                       f"{', '.join([*PATTERNS, *TOPOLOGY_PATTERNS])}")
    phases = PATTERNS[strategy](model.profile.world_size, payload_bytes, *extra)
    share = 1.0 / period if strategy in PERIODIC else 1.0
    return model.time(phases) * share, model.bound(phases) * share
