"""The α-β cost model: how long a communication pattern takes on a cluster profile.

A pattern is a list of *phases*; a phase is a set of concurrent flows (src rank, dst
rank, bytes) that must all finish before the next phase starts. A phase costs

    α + max( max_links load(L) / capacity(L),  max_flows bytes / per_flow_cap )

where a flow crosses its source host's NIC (egress), the destination host's NIC
(ingress) and, between racks, both racks' uplinks; flows inside one host use loopback.
A link carrying g greedy background flows next to f of ours gives ours f/(f+g) of its
capacity (TCP fair share), and where such a flow holds a standing queue (the link that sets
its rate) a phase crossing it waits ``LinkTcp.queue_s`` behind that queue; one flow uses one
NIC, f flows use at most min(f, k) of a host's k NICs (gloo binds one collective to one NIC:
striping needs several groups), and flows of S streams pinned to NICs round-robin
(``FlowArray.pinned``) use S/⌈S/k⌉. With α = 0
this is the bandwidth lower bound (``bound_s``); with the α measured on the emulator it
is the prediction ``syncplane simulate`` prints. The bench's prediction also prices how
TCP shares a shaped link (``LinkTcp``, measured on the emulator under the hosts' congestion
control, ``emulated_tcp``: under bbr k concurrent flows of ours got 0.86 / (1 + 0.06 (k − 1))
of a 100 Mbit uplink's rate, under cubic 0.913 / (1 + 0.019 (k − 1)); a host's flows that are not pinned
streams share one NIC), which the plain formula misses: ATC's exponential graph puts up to four
flows on an uplink (the formula was 21–31 % optimistic there under bbr), and its sends on
``multi_nic`` ride one of the two NICs (44 %).

On a BCube profile every NIC is its own link (NIC ℓ of a host plugs into its level-ℓ
switch) and there are no uplinks. A flow between hosts one address digit apart crosses
the sender's and receiver's NICs of that level; any other flow is relayed, hop by hop
along the profile's BCube route, and loads every relay's NIC in and out. Which route a
flow takes depends on the NIC its destination address belongs to. A gloo connection is
opened by the higher rank to the address of the lower rank's NIC, so bytes sent up the
ranks go to the connecting side's *source* address: the NIC its route to that address
leaves by, which is another level's whenever the route starts with a relay (measured on
``bcube_3_2``: a one-stream mesh sent 22.9, 13.7 and 4.6 MB per step out of the three
racks' NIC 0, as this rule says, not 13.7 each). Pinned streams (``FlowArray.pinned``) use
NIC ``s mod β``; other flows are spread evenly over the β NICs (a gloo job listing all β
NICs: its collectives rotate over them), or, where the ``LinkTcp`` puts a host's unpinned
flows on one NIC, ride NIC 0 (one gloo group bound to the first NIC).

The model is evaluated with numpy, all phases of a pattern in one batch: every flow
becomes up to four (phase, link) entries, the per-link loads and flow counts are
``bincount``s over them, and a phase's time is a max over its entries. Consecutive
identical phases (a ring's 2(n−1) steps) are evaluated once. That is what lets
``syncplane simulate`` plan 1,024 ranks in seconds; the answers are the per-flow
formula's above (``tests/unit/test_cost_reference.py`` holds it to the values the
earlier per-flow Python loop computed on every shipped profile).

The generic patterns below (ring, neighbour exchange, concurrent groups) are building
blocks; the exchanges price themselves beside their code (``syncplane.exchanges``), and
which pattern an algorithm runs is declared by its package (``syncplane.algorithms.<family>``). A phase is a list of flow
tuples or, for the big all-to-all patterns, a ``FlowArray`` (the same flows as columns).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from syncplane.cluster.profile import ClusterProfile

Flow = tuple[int, int, float]            # src rank, dst rank, bytes

MBIT = 1e6 / 8                            # bytes per second in one Mbit/s
DEFAULT_ALPHA_S = 1.1e-3                  # per-phase latency of gloo on the emulator (measured 2026-11-29, docs/design-notes.md)
#: memory-to-memory over loopback where no rate was measured on the machine (a 2-core EPYC's);
#: the plan and the bench time this machine's (``syncplane.algorithms.ddp.timing``)
DEFAULT_LOOPBACK_BPS = 2.5e9


@dataclass(frozen=True, eq=False)
class FlowArray:
    """Flows as columns: flow i is ``copies[i]`` concurrent flows of ``nbytes[i]`` from
    ``src[i]`` to ``dst[i]`` (S streams of one shard are one row with ``copies`` S).

    An all-to-all of n ranks has n² flows; as tuples that alone takes seconds at 1,024
    ranks. Iterating yields the same flows as tuples, one per copy, so code written for
    a list of flows reads it unchanged.
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    copies: np.ndarray | None = None          # None: one flow per row
    #: the copies are streams pinned round-robin to their host's NICs (stream s on NIC
    #: s mod k, as ``comm.StreamRunner`` binds its groups): S streams get S/⌈S/k⌉ NICs'
    #: worth of a host's capacity (one stream: one NIC), not min(flows, k); a bool array:
    #: per row
    pinned: bool | np.ndarray = False
    #: the flows are one tick of a pipeline of chunks (FlexReduce's wavefront), each send its
    #: own op: they spread over a host's NICs (min(flows, k)) and pay no ``LinkTcp`` per-flow
    #: loss (measured, ``EMULATED_TCP_BBR``'s note)
    chunked: bool = False
    #: the flows are one step of a collective that goes step by step, each step's send after
    #: the previous step's arrival (a ring's reduce-scatter and all-gather in gloo): they pay no
    #: ``LinkTcp`` per-flow loss, as a pipeline's chunks (measured, ``EMULATED_TCP_BBR``'s note),
    #: but keep their NICs
    lockstep: bool = False
    #: per row (None: none): the flows run beside the phase, asynchronously (H-ATC's exchange
    #: between racks under the in-rack collectives): they load its links, but nothing waits for
    #: them before the pattern's end, so a greedy flow's queue (``LinkTcp.queue_s``) holds the
    #: pattern up once, not once per phase
    beside: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.copies is None:
            object.__setattr__(self, "copies", np.ones(len(self.src), dtype=np.int64))
        columns = ("src", "dst", "nbytes", "copies", *(("beside",) if self.beside is not None else ()))
        lengths = {name: len(getattr(self, name)) for name in columns}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"FlowArray: columns of different lengths {lengths}")

    def __len__(self) -> int:
        assert self.copies is not None
        return int(self.copies.sum())

    def __iter__(self) -> Iterator[Flow]:
        assert self.copies is not None
        for s, d, b, c in zip(self.src.tolist(), self.dst.tolist(), self.nbytes.tolist(), self.copies.tolist()):
            for _ in range(c):
                yield (s, d, b)


Phase = list[Flow] | FlowArray


def columns_of(phase: Phase) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, bytes, copies) of a phase as arrays."""
    if isinstance(phase, FlowArray):
        return (np.asarray(phase.src, dtype=np.int64), np.asarray(phase.dst, dtype=np.int64),
                np.asarray(phase.nbytes, dtype=np.float64), np.asarray(phase.copies, dtype=np.int64))
    flat = np.fromiter(itertools.chain.from_iterable(phase), dtype=np.float64, count=3 * len(phase))
    table = flat.reshape(-1, 3)
    return (table[:, 0].astype(np.int64), table[:, 1].astype(np.int64), table[:, 2].copy(),
            np.ones(len(phase), dtype=np.int64))


def pinned_streams(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray | float, streams: int,
                   chunked: bool = False, lockstep: bool = False, beside: np.ndarray | None = None) -> FlowArray:
    """Each flow ``src[i] -> dst[i]`` of ``nbytes`` as ``streams`` streams of nbytes/streams
    pinned to NICs round-robin (``FlowArray.pinned``; ``chunked``, ``lockstep``, ``beside``: theirs)."""
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    return FlowArray(src, dst, np.broadcast_to(np.asarray(nbytes, dtype=np.float64) / streams, src.shape).copy(),
                     np.full(len(src), streams, dtype=np.int64), pinned=True, chunked=chunked,
                     lockstep=lockstep, beside=beside)


def per_connection(columns: list[tuple[np.ndarray, ...]], width: int, scale: float = 1.0,
                   chunked: bool = False, streams: int = 1,
                   beside: list[tuple[np.ndarray, ...]] = ()) -> FlowArray:
    """The flows of ``columns`` (``columns_of`` of phases that run at once) as one flow per
    (src, dst) of ``width`` ranks, bytes summed (times ``scale``): what goes between two
    ranks at once shares their connection, so it counts as one flow on every link
    (``chunked``: ``FlowArray.chunked``). ``streams`` > 1: each as that many pinned streams
    of its bytes/streams (``FlowArray.pinned``): a host's connections spread over its NICs,
    as messages whose tags take them in turn do. ``beside``: flows that run beside those
    (``FlowArray.beside``); a connection that also carries one of ``columns`` is waited for."""
    both = [*columns, *beside]
    src, dst, nbytes = (np.concatenate([c[i] for c in both]) for i in range(3))
    pairs, where = np.unique(src * width + dst, return_inverse=True)
    total = np.bincount(where, weights=nbytes, minlength=len(pairs)) * scale
    aside = None
    if beside:
        waited = sum(len(c[0]) for c in columns)
        aside = np.bincount(where[:waited], minlength=len(pairs)) == 0
    if streams > 1:
        return pinned_streams(pairs // width, pairs % width, total, streams, chunked=chunked, beside=aside)
    return FlowArray(pairs // width, pairs % width, total, chunked=chunked, beside=aside)


@dataclass(frozen=True)
class LinkTcp:
    """How TCP flows of ours share a rate-limited link (a NIC or a rack uplink), beyond the
    α-β formula: one flow gets ``goodput`` of the rate (frame headers, slow start, the
    shaper's queue drops) -- or, with ``goodput_by_mbit``, the share measured at the link's
    rate (``(mbit, goodput)`` points, interpolated, held flat beyond the ends) -- and each
    further concurrent flow on the link costs ``per_flow_loss`` more (they overflow its
    queue together: drops and retransmits). With ``one_nic_unpinned``, the flows of a host
    that are not streams pinned to NICs share one of its NICs (measured: on ``multi_nic``
    eth0 carried 86 % of two ranks' sends; our reading is that gloo picks an op's device in
    turn, in the same order on every rank). ``IDEAL`` is the plain formula, what the bounds
    and ``CostModel``'s default use; ``emulated_tcp`` gives what was measured, by the hosts'
    congestion control."""

    goodput: float = 1.0
    per_flow_loss: float = 0.0
    one_nic_unpinned: bool = False
    goodput_by_mbit: tuple[tuple[float, float], ...] = ()
    #: flows on one link beyond this many add no further loss (None: each one does)
    loss_flows: int | None = None
    #: seconds a phase waits behind a greedy background flow's standing queue, where one of
    #: its flows crosses the link that sets that flow's rate (``CostModel``'s ``queued`` links)
    queue_s: float = 0.0

    def factor(self, flows: np.ndarray, capacity: np.ndarray | None = None) -> np.ndarray:
        """The share of a link's rate (``capacity``, bytes/s) that ``flows`` concurrent flows get together."""
        goodput: float | np.ndarray = self.goodput
        if self.goodput_by_mbit and capacity is not None:
            mbit, measured = zip(*self.goodput_by_mbit)
            goodput = np.interp(capacity / MBIT, mbit, measured)
        extra = np.maximum(flows - 1, 0)
        if self.loss_flows is not None:
            extra = np.minimum(extra, self.loss_flows - 1)
        return goodput / (1.0 + self.per_flow_loss * extra)


IDEAL = LinkTcp()
#: Measured on the emulator, its hosts under bbr (this VM image's default, which they inherited
#: until 2026-11-30; a profile's ``tcp_congestion: bbr`` now). Sharing (2026-11-26; gloo isend/irecv of 8 MB from every rank to
#: rank + s, 6 repetitions): ``two_racks`` (100 Mbit uplinks, 400 Mbit NICs): s = 1, 2, 4 puts
#: 1, 2, 4 flows on each uplink direction and took 0.78, 1.70, 3.70 s against the formula's
#: 0.67, 1.34, 2.69 s (ratios 1.16, 1.26, 1.38; 1 / factor = 1.16, 1.23, 1.37). ``multi_nic`` (2
#: hosts of 2 ranks and 2 NICs of 100 Mbit): s = 2 (both ranks of a host send across at once)
#: took 1.7–2.8 s, not the 0.67 s of two NICs, and the hosts' eth0 carried 86 % of the bytes.
#: Goodput by rate (2026-11-27; ``syncplane bench`` of DDP's 8 MB all-reduce on two one-rank
#: hosts, 5 steps): the bound over the median step was 0.957, 0.963, 0.969 at 200, 400, 1000
#: Mbit (about the payload's share of a 1,514-byte frame), 0.916 at 100 Mbit, with steps
#: spread 0.70–0.81 s; the 100-Mbit point is the uplink's 0.86 above. The matrix at 8 MB had
#: shown it: one 0.86 for every link priced DDP +20–27 % on profiles of 400 Mbit NICs.
#: The loss stops growing at 6 flows on a link (2026-11-27): measured at 1, 2 and 4 flows only, a
#: loss that kept growing priced Canary's piece mesh (8 ranks: 12–16 flows on each uplink) +31 to
#: +88 % on the uneven-rack profiles at 8 MB; with the cap the 8 MB matrix's predictions within
#: 15 % went from 114 to 119 of 165, the ResNet-50 matrix's from 85 to 88 of 125, and on
#: ``uneven_three_racks`` at ResNet-50, measured after the cap was chosen, Canary's from +65 to +14 %.
#: The queue behind a greedy flow (2026-11-29, ``two_racks_contended``: its flow a3 -> b3 fills r0's
#: 100 Mbit uplink): DDP's all-reduce of 4 KB over the 8 ranks (14 ring phases, every one crossing
#: that uplink once) took 97 ms a step (median of 30; p90 108) against 24 ms on ``two_racks``, 5.2 ms
#: more per phase; a 1-byte TCP ping-pong a0 -> b0 took 3.3 ms against 0.19. Unmodelled, it priced
#: torch's PowerSGD there at 1.045 s against 1.41-1.89 measured in three runs: its step is a chain
#: of small all-reduces, one after the other.
#: A ring's steps (``FlowArray.lockstep``) pay no per-flow loss (2026-11-29, ``bcube_3_2``, ResNet-50):
#: DDP's ring, two of its flows on each relay's NIC, ran at 0.91 of its bound where the loss of two
#: flows priced 1.23x (the old count, four, 1.37x); DS-Sync's groups of three and fp16's ring alike.
EMULATED_TCP_BBR = LinkTcp(goodput=0.86, per_flow_loss=0.06, one_nic_unpinned=True,
                           goodput_by_mbit=((100.0, 0.86), (200.0, 0.957), (400.0, 0.963), (1000.0, 0.969)),
                           loss_flows=6, queue_s=5.2e-3)
#: The same terms measured again with the hosts under cubic, Linux's default and the profiles'
#: (``scripts/calibrate_tcp.py``, docs/calibration/tcp_cubic.json), after every exchange of ours
#: came to post its receives before its sends (2026-12-01, ``p2p.exchange_tensors``: two ranks
#: that both post their send to each other first swap one way after the other under gloo).
#: Goodput by rate: 0.957, 0.959, 0.967, 0.987 at 100, 200, 400, 1000 Mbit. Sharing on
#: ``two_racks``' uplinks, 8 MB from rank r to r + s, receive posted first (median of 6): s = 1,
#: 2, 4 took 0.735, 1.565, 3.061 s against 0.671, 1.342, 2.684 (1.10, 1.17, 1.14; an earlier run
#: that day 1.07, 1.07, 1.10): one flow a direction gets 0.913, each further one loses 0.019.
#: Posted send first, the same run had given 1.13, 1.13, 1.39: at s = 4 each rank sends to and
#: receives from one peer, and the swap went one way after the other. The queue behind a greedy
#: flow: DDP's 4 KB all-reduce took 1.404 s a step on ``two_racks_contended`` against 0.020 on
#: ``two_racks``, 99 ms more per phase: the greedy flow, loss-based too, keeps the uplink's 100 ms
#: ``tbf`` queue full (under bbr, 5.2 ms).
EMULATED_TCP = LinkTcp(goodput=0.913, per_flow_loss=0.019, one_nic_unpinned=True,
                       goodput_by_mbit=((100.0, 0.913), (200.0, 0.959), (400.0, 0.967), (1000.0, 0.987)),
                       loss_flows=6, queue_s=0.099)
#: The emulator's TCP by the hosts' congestion control (a profile's ``tcp_congestion``).
EMULATED_TCP_BY_CONGESTION: dict[str, LinkTcp] = {"cubic": EMULATED_TCP, "bbr": EMULATED_TCP_BBR}


def emulated_tcp(congestion: str) -> LinkTcp:
    """``LinkTcp`` as measured on the emulator with its hosts under ``congestion``; one not
    measured (reno, ...) gets cubic's, the loss-based default."""
    return EMULATED_TCP_BY_CONGESTION.get(congestion, EMULATED_TCP)


class LinkTimes(NamedTuple):
    """``CostModel.link_times``: per phase, and per (phase, link) pair that carries flows."""

    #: each phase's seconds
    times: np.ndarray
    #: per (phase, link) pair: the phase, the link, the seconds its load takes on it, the
    #: seconds its slowest flow takes where the link caps each flow
    phase: np.ndarray
    links: np.ndarray
    load_s: np.ndarray
    flow_s: np.ndarray
    #: per phase: a greedy flow's queue that only flows beside it wait behind (``FlowArray.beside``),
    #: paid once by a pattern, after the last such phase
    late_s: np.ndarray


@dataclass
class CostModel:
    profile: ClusterProfile
    alpha_s: float = DEFAULT_ALPHA_S
    loopback_bytes_per_s: float = DEFAULT_LOOPBACK_BPS
    #: how TCP shares the shaped links in ``time`` (``bound`` is always ``IDEAL``)
    tcp: LinkTcp = IDEAL

    def __post_init__(self) -> None:
        """Index every link once: [NIC out per host | NIC in per host | uplink out per rack |
        uplink in per rack | loopback per host], with its capacity, per-flow cap (∞: none),
        NIC count and greedy background flows."""
        hosts, racks = self.profile.hosts, self.profile.racks
        n_hosts, n_racks = len(hosts), len(racks)
        self._host_of_rank = np.repeat(np.arange(n_hosts, dtype=np.int64), [h.spec.ranks for h in hosts])
        #: BCube: per (NIC, source host, destination host), where its links start in the second array
        self._routes: tuple[np.ndarray, np.ndarray] | None = None
        if self.profile.bcube is not None:
            self._init_bcube()
            return
        self._rack_of_host = np.array([h.rack for h in hosts], dtype=np.int64)
        self._nic_in, self._up_out = n_hosts, 2 * n_hosts
        self._up_in, self._lo = 2 * n_hosts + n_racks, 2 * n_hosts + 2 * n_racks
        self._num_links = 3 * n_hosts + 2 * n_racks
        capacity = np.full(self._num_links, np.nan)
        per_flow = np.full(self._num_links, np.inf)
        nics = np.ones(self._num_links, dtype=np.int64)
        for h in hosts:
            for base in (0, self._nic_in):
                capacity[base + h.index] = h.spec.nic_mbit * MBIT
                per_flow[base + h.index] = h.spec.per_flow_mbit * MBIT if h.spec.per_flow_mbit else np.inf
                nics[base + h.index] = h.spec.nics
            capacity[self._lo + h.index] = self.loopback_bytes_per_s
        for k, rack in enumerate(racks):
            for base in (self._up_out, self._up_in):
                # a single rack has no uplink (None): no flow ever crosses one, NaN marks it
                capacity[base + k] = rack.uplink_mbit * MBIT if rack.uplink_mbit is not None else np.nan
                per_flow[base + k] = rack.per_flow_mbit * MBIT if rack.per_flow_mbit else np.inf
        self._capacity, self._per_flow, self._nics = capacity, per_flow, nics
        self._is_nic = np.arange(self._num_links) < 2 * n_hosts
        self._is_shaped = np.arange(self._num_links) < self._lo      # NICs and uplinks, not loopback
        self._count_background()

    def _count_background(self) -> None:
        """Greedy background flows per link (paced ones count as greedy: an upper bound on their
        share), and the links where one holds a standing queue (``queued``): the slowest link on
        its path, the first of them where several tie (on BCube: the lowest-numbered), unless a per-flow cap below that rate or a
        pace below it (``FlowSpec.mbit``) sets the flow's rate instead -- a per-flow cap queues
        each flow apart (the emulator's ``htb`` classes)."""
        firsts = [(self.profile.host(f.src).first_rank, self.profile.host(f.dst).first_rank)
                  for f in self.profile.background]
        self._background = np.zeros(self._num_links, dtype=np.int64)
        self._queued = np.zeros(self._num_links, dtype=bool)
        if not firsts:
            return
        src, dst = (np.array(c, dtype=np.int64) for c in zip(*firsts))
        flows, links, _ = self._entries(src, dst)
        np.add.at(self._background, links, 1)
        for i, spec in enumerate(self.profile.background):
            path = links[flows == i]
            if self._routes is None:      # entries come by kind; the path goes NIC, uplink out, uplink in, NIC
                path = path[np.argsort(self._path_order(path), kind="stable")]
            rate = self._capacity[path].min()
            if self._per_flow[path].min() < rate or (spec.mbit is not None and spec.mbit * MBIT < rate):
                continue
            self._queued[path[np.flatnonzero(self._capacity[path] == rate)[0]]] = True

    def _path_order(self, links: np.ndarray) -> np.ndarray:
        """Where each link (not BCube's) comes on a flow's path: NIC out, uplink out, uplink in, NIC in."""
        return np.select([links < self._nic_in, links < self._up_out, links < self._up_in],
                         [0, 3, 1], default=2)

    def _init_bcube(self) -> None:
        """BCube links: [NIC out per (host, level) | NIC in per (host, level) | loopback per
        host], and for every ordered host pair its (link, share of the bytes) entries: the
        β routes' hops, each carrying 1/β (module docstring), merged where routes coincide."""
        cube, hosts = self.profile.bcube, self.profile.hosts
        assert cube is not None
        n_hosts, beta = len(hosts), cube.beta
        self._nic_in, self._lo = n_hosts * beta, 2 * n_hosts * beta
        self._num_links = 2 * n_hosts * beta + n_hosts
        capacity = np.full(self._num_links, np.nan)
        per_flow = np.full(self._num_links, np.inf)
        for h in hosts:
            for base in (0, self._nic_in):
                links = base + h.index * beta + np.arange(beta)
                capacity[links] = h.spec.nic_mbit * MBIT
                per_flow[links] = h.spec.per_flow_mbit * MBIT if h.spec.per_flow_mbit else np.inf
            capacity[self._lo + h.index] = self.loopback_bytes_per_s
        self._capacity, self._per_flow = capacity, per_flow
        self._nics = np.ones(self._num_links, dtype=np.int64)       # one NIC per link
        self._is_nic = np.arange(self._num_links) < self._lo
        self._is_shaped = np.arange(self._num_links) < self._lo
        ptr, links_of = [0], []
        for nic in range(beta):
            for a in range(n_hosts):
                for b in range(n_hosts):
                    if a != b:
                        # the higher host connected: bytes down go to the lower one's NIC ``nic``,
                        # bytes up to the address the connection left from (module docstring)
                        level = nic if a > b else cube.route(b, a, nic)[0][2]
                        links_of += [link for u, v, lvl in cube.route(a, b, level)
                                     for link in (u * beta + lvl, self._nic_in + v * beta + lvl)]
                    ptr.append(len(links_of))
        self._routes = (np.array(ptr, dtype=np.int64), np.array(links_of, dtype=np.int64))
        self._count_background()

    def _nic_shares(self, pinned: np.ndarray, one_nic: np.ndarray) -> np.ndarray:
        """Each flow's share of its bytes per NIC level on BCube (flows x β): ``pinned`` S > 0
        streams round-robin from NIC 0; any other flow on NIC 0 where ``one_nic``, else spread
        evenly."""
        assert self.profile.bcube is not None
        beta = self.profile.bcube.beta
        nic = np.arange(beta)
        streams = np.maximum(pinned, 1)[:, None]
        pinned_share = (streams // beta + (nic[None, :] < streams % beta)) / streams
        unpinned = np.where(one_nic[:, None], (nic == 0) * 1.0, 1.0 / beta)
        return np.where((pinned > 0)[:, None], pinned_share, unpinned)

    def _entries(self, src: np.ndarray, dst: np.ndarray, pinned: np.ndarray | None = None,
                 one_nic: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flow index, link, share of the flow's bytes on it) for every link every flow
        crosses, grouped by link kind (so the entries of one link keep the flows' order);
        ``pinned`` and ``one_nic`` (default: none) pick a flow's NICs on BCube (``_nic_shares``)."""
        n = self.profile.world_size
        if len(src) and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n):
            bad = next(int(r) for r in np.concatenate([src, dst]) if not 0 <= r < n)
            raise IndexError(f"rank {bad} is outside profile {self.profile.name!r} ({n} ranks)")
        hs, hd = self._host_of_rank[src], self._host_of_rank[dst]
        if self._routes is not None:
            pinned = np.zeros(len(src), dtype=np.int64) if pinned is None else pinned
            one_nic = np.zeros(len(src), dtype=bool) if one_nic is None else one_nic
            return self._bcube_entries(hs, hd, self._nic_shares(pinned, one_nic))
        local = hs == hd
        remote = np.flatnonzero(~local)
        cross = remote[self._rack_of_host[hs[remote]] != self._rack_of_host[hd[remote]]]
        inside = np.flatnonzero(local)
        flow = np.concatenate([remote, remote, cross, cross, inside])
        link = np.concatenate([hs[remote], self._nic_in + hd[remote],
                               self._up_out + self._rack_of_host[hs[cross]],
                               self._up_in + self._rack_of_host[hd[cross]], self._lo + hs[inside]])
        return flow, link, np.ones(len(flow))

    def _bcube_entries(self, hs: np.ndarray, hd: np.ndarray, nic_shares: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_entries`` on BCube: each remote flow's precomputed route entries for every NIC it
        uses (``nic_shares``, flows x β), a link on several of them entered once with their
        summed share; loopback inside a host."""
        assert self._routes is not None
        ptr, links = self._routes
        n_hosts, n_links = len(self.profile.hosts), self._num_links
        flows, nics = np.nonzero(nic_shares * (hs != hd)[:, None])
        pair = (nics * n_hosts + hs[flows]) * n_hosts + hd[flows]
        start, length = ptr[pair], ptr[pair + 1] - ptr[pair]
        within = np.arange(length.sum(), dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
        key = np.repeat(flows, length) * n_links + links[np.repeat(start, length) + within]
        merged, where = np.unique(key, return_inverse=True)      # sorted by flow, then link
        share = np.bincount(where, weights=np.repeat(nic_shares[flows, nics], length), minlength=len(merged))
        inside = np.flatnonzero(hs == hd)
        return (np.concatenate([merged // n_links, inside]), np.concatenate([merged % n_links, self._lo + hs[inside]]),
                np.concatenate([share, np.ones(len(inside))]))

    def batch_phase_times(self, phase: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                          num_phases: int, copies: np.ndarray | None = None,
                          alpha_s: float | None = None, pinned: np.ndarray | None = None,
                          tcp: LinkTcp | None = None, chunked: np.ndarray | None = None,
                          lockstep: np.ndarray | None = None) -> np.ndarray:
        """The time of each of ``num_phases`` phases (``link_times``, without the links)."""
        return self.link_times(phase, src, dst, nbytes, num_phases, copies, alpha_s, pinned, tcp, chunked,
                               lockstep).times

    def link_times(self, phase: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                   num_phases: int, copies: np.ndarray | None = None,
                   alpha_s: float | None = None, pinned: np.ndarray | None = None,
                   tcp: LinkTcp | None = None, chunked: np.ndarray | None = None,
                   lockstep: np.ndarray | None = None, beside: np.ndarray | None = None) -> LinkTimes:
        """``LinkTimes`` of phases whose flows are given as columns (flow i belongs to phase
        ``phase[i]``; ``copies[i]`` identical flows, default 1; ``pinned[i]`` > 0: they are
        that many streams pinned to NICs, ``FlowArray.pinned``; ``chunked[i]``: a pipeline's
        chunk, ``FlowArray.chunked``; ``lockstep[i]``: a step of a collective,
        ``FlowArray.lockstep``; ``beside[i]``: run beside the phase, ``FlowArray.beside``).

        The formula of the module docstring, vectorized: per (phase, link) the bytes and
        flows are summed (in flow order, as the per-flow loop did), each link's time is its
        load over its share of capacity, and a phase takes α plus the larger of its busiest
        link and its slowest per-flow-capped flow; a phase with nothing to send takes 0.
        ``tcp`` (default the model's): how the flows share a shaped link (``LinkTcp``); a
        greedy flow's queue holds up a phase whose waited-for flows cross it, and a pattern
        once where only flows beside its phases do (``LinkTimes.late_s``).
        """
        alpha = self.alpha_s if alpha_s is None else alpha_s
        tcp = self.tcp if tcp is None else tcp
        copies = np.ones(len(src), dtype=np.int64) if copies is None else copies
        pinned = np.zeros(len(src), dtype=np.int64) if pinned is None else pinned
        chunked = np.zeros(len(src), dtype=bool) if chunked is None else chunked
        lockstep = np.zeros(len(src), dtype=bool) if lockstep is None else lockstep
        beside = np.zeros(len(src), dtype=bool) if beside is None else beside
        keep = (src != dst) & (nbytes > 0)
        phase, src, dst, nbytes, copies, pinned, chunked, lockstep, beside = (
            phase[keep], src[keep], dst[keep], nbytes[keep], copies[keep], pinned[keep], chunked[keep], lockstep[keep],
            beside[keep])
        # a pipeline's chunks spread over a host's NICs; other unpinned flows share one (``LinkTcp``)
        flow, link, share_of_bytes = self._entries(src, dst, pinned, ~chunked & tcp.one_nic_unpinned)
        num_links = self._num_links
        key = phase[flow] * num_links + link
        direct = num_phases * num_links <= 1 << 22      # few slots: index them directly, else sort
        if direct:
            slot, size = key, num_phases * num_links
        else:
            uniq, slot = np.unique(key, return_inverse=True)
            size = len(uniq)
        load = np.bincount(slot, weights=(nbytes * copies)[flow] * share_of_bytes, minlength=size)
        count = np.bincount(slot, weights=copies[flow], minlength=size)
        # the TCP flows on a link: a flow whose streams take several routes (BCube's NICs) puts
        # only its share of them on each (elsewhere every share is 1 and this is ``count``)
        on_link = np.bincount(slot, weights=copies[flow] * share_of_bytes, minlength=size)
        streams = np.zeros(size, dtype=np.int64)
        np.maximum.at(streams, slot, pinned[flow])
        chunks, lossless, waited = (np.zeros(size, dtype=bool) for _ in range(3))
        np.logical_or.at(chunks, slot, chunked[flow])
        np.logical_or.at(lossless, slot, (chunked | lockstep)[flow])
        np.logical_or.at(waited, slot, ~beside[flow])
        used = np.flatnonzero(count > 0)
        keys = used if direct else uniq[used]
        links, owner = keys % num_links, keys // num_links
        load, count, on_link, streams = load[used], count[used], on_link[used], streams[used]
        chunks, lossless, waited = chunks[used], lossless[used], waited[used]
        nics = self._nics[links]
        unpinned = np.where(chunks | (not tcp.one_nic_unpinned), np.minimum(nics, count), 1)
        spread = np.where(streams > 0, streams / np.maximum(np.ceil(streams / nics), 1), unpinned)
        capacity = self._capacity[links] * np.where(self._is_nic[links], spread, 1)
        if tcp != IDEAL:       # the flows per NIC they are spread over share it; chunks and steps lose nothing
            flows = np.where(lossless, 1.0, on_link / np.where(self._is_nic[links], spread, 1))
            capacity = capacity * np.where(self._is_shaped[links], tcp.factor(flows, self._capacity[links]), 1.0)
        share = on_link / (on_link + self._background[links])
        queued, late = np.zeros(num_phases, dtype=bool), np.zeros(num_phases, dtype=bool)
        queued[owner[self._queued[links] & waited]] = True
        late[owner[self._queued[links] & ~waited]] = True
        # a link's time in a phase: its load, or its slowest flow where the link caps each flow
        load_s = load / (capacity * share)
        slowest = np.zeros(size)
        np.maximum.at(slowest, slot, nbytes[flow] / self._per_flow[link])
        flow_s = slowest[used]
        busiest = np.zeros(num_phases)
        np.maximum.at(busiest, owner, np.maximum(load_s, flow_s))
        active = np.zeros(num_phases, dtype=bool)
        active[owner] = True
        return LinkTimes(np.where(active, alpha + tcp.queue_s * queued + busiest, 0.0), owner, links, load_s, flow_s,
                         tcp.queue_s * (late & ~queued))

    def phase_times(self, phases: Sequence[Phase], alpha_s: float | None = None,
                    tcp: LinkTcp | None = None) -> list[float]:
        """Each phase's time, all evaluated in one batch; a phase equal to the one before it
        (a ring's repeated steps) is evaluated once. The last phase whose flows beside it wait
        behind a greedy flow's queue pays that queue (``LinkTimes.late_s``)."""
        got, which = self._evaluate(phases, alpha_s, tcp)
        times = [float(got.times[i]) for i in which]
        late = [k for k, i in enumerate(which) if got.late_s[i] > 0]
        if late:
            times[late[-1]] += float(got.late_s[which[late[-1]]])
        return times

    def pipelined(self, phases: Sequence[Phase], lanes: int, first_share: float, alpha_s: float | None = None,
                  tcp: LinkTcp | None = None) -> float:
        """A round cut in parts (Canary's colayers), ``lanes`` of them in flight, each part
        through ``phases`` in order, ``first_share`` the first part's share of the round: one
        part's phases run beside another's where they use other links (a rack's hop under the
        uplink's), so the round takes its busiest link's phases back to back (at least the
        phases over ``lanes``), plus the first part's share of the rest, which fills the
        pipeline; on a link that caps each flow, the lanes' flows each get the cap. One lane or
        one part: the phases add up (``time``). A greedy flow's queue that only flows beside
        the phases wait behind (``LinkTimes.late_s``) holds the round up once, at its end."""
        got, which = self._evaluate(phases, alpha_s, tcp)
        late = float(got.late_s[which].max(initial=0.0))
        total = float(sum(got.times[i] for i in which))
        if lanes < 2 or first_share >= 1 or not which:
            return total + late
        uses = np.bincount(np.asarray(which, dtype=np.int64), minlength=len(got.times))[got.phase]
        # a link carries every part's load; where it caps each flow, the lanes' flows are as
        # many flows at the cap at once
        per_link = np.maximum(np.bincount(got.links, weights=got.load_s * uses, minlength=self._num_links),
                              np.bincount(got.links, weights=got.flow_s * uses, minlength=self._num_links) / lanes)
        steady = min(total, max(float(per_link.max(initial=0.0)), total / lanes))
        return steady + first_share * (total - steady) + late

    def _evaluate(self, phases: Sequence[Phase], alpha_s: float | None, tcp: LinkTcp | None
                  ) -> tuple[LinkTimes, list[int]]:
        """``link_times`` of the distinct phases of ``phases`` (a phase equal to the one before
        it counted once), and which of them each phase is."""
        distinct: list[Phase] = []
        which: list[int] = []
        for phase in phases:
            if not isinstance(phase, (list, FlowArray)):
                phase = list(phase)
            if distinct and (phase is distinct[-1] or (isinstance(phase, list) and phase == distinct[-1])):
                which.append(len(distinct) - 1)
                continue
            distinct.append(phase)
            which.append(len(distinct) - 1)
        if not distinct:
            empty, none = np.zeros(0), np.zeros(0, dtype=np.int64)
            return LinkTimes(empty, none, none, empty, empty, empty), []
        columns = [columns_of(p) for p in distinct]
        owner = np.repeat(np.arange(len(distinct), dtype=np.int64), [len(c[0]) for c in columns])
        src, dst, nbytes, copies = (np.concatenate([c[i] for c in columns]) for i in range(4))
        pinned = np.concatenate([np.where(p.pinned, c[3], 0) if isinstance(p, FlowArray) else np.zeros_like(c[3])
                                 for p, c in zip(distinct, columns)])
        chunked, lockstep = (np.concatenate([np.full(len(c[0]), isinstance(p, FlowArray) and getattr(p, flag))
                                             for p, c in zip(distinct, columns)]) for flag in ("chunked", "lockstep"))
        beside = np.concatenate([p.beside if isinstance(p, FlowArray) and p.beside is not None
                                 else np.zeros(len(c[0]), dtype=bool) for p, c in zip(distinct, columns)])
        return self.link_times(owner, src, dst, nbytes, len(distinct), copies, alpha_s, pinned, tcp, chunked,
                               lockstep, beside), which

    def phase_time(self, flows: Phase | Sequence[Flow], alpha_s: float | None = None) -> float:
        return self.phase_times([flows if isinstance(flows, (list, FlowArray)) else list(flows)], alpha_s)[0]

    def time(self, phases: Sequence[Phase], alpha_s: float | None = None) -> float:
        return sum(self.phase_times(phases, alpha_s))

    def bound(self, phases: Sequence[Phase]) -> float:
        """The bandwidth lower bound: no per-message latency, ideal links."""
        return sum(self.phase_times(phases, alpha_s=0.0, tcp=IDEAL))

    def crosses_hosts(self, phases: Sequence[Phase]) -> bool:
        """Whether a flow of ``phases`` leaves its host: a step that only uses loopback (the
        all-reduce inside a node replica) asks nothing of the network."""
        for phase in phases:
            src, dst, nbytes, _ = columns_of(phase)
            if np.any((self._host_of_rank[src] != self._host_of_rank[dst]) & (nbytes > 0)):
                return True
        return False


# ----------------------------------------------------------------------------- patterns


def bucket_streams(buckets: int, nics: int) -> int:
    """gloo hands a group's collectives to the NICs it lists in turn (op i on NIC i mod k;
    measured on ``multi_nic``: one 8 MB op per step alternates eth0/eth1 from step to step,
    so the busiest NIC carries all of a step's bytes; four 25 MB ops go 2 + 2). The fewest
    round-robin pinned streams that spread as ``buckets`` ops do over ``nics`` (the busiest
    NIC carries ⌈b/k⌉ of b): one NIC, or one op, is one stream (no extra TCP flows)."""
    if nics < 2 or buckets < 2:
        return 1
    return min(buckets, nics) if buckets % nics == 0 else buckets


def ring_allreduce(world_size: int, payload_bytes: float, streams: int = 1,
                   ranks: Sequence[int] | None = None) -> list[Phase]:
    """Reduce-scatter then all-gather around the ring 0→1→…→n−1→0 (or around ``ranks``, n of
    them): 2(n−1) phases of M/n, one step of the collective each (``FlowArray.lockstep``);
    ``streams`` > 1: as that many concurrent rings of M/streams pinned to NICs round-robin
    (``FlowArray.pinned``)."""
    ring = np.arange(world_size, dtype=np.int64) if ranks is None else np.asarray(ranks, dtype=np.int64)
    if len(ring) < 2:
        return []
    src, dst, chunk = ring, np.roll(ring, -1), payload_bytes / len(ring)
    if streams > 1:
        step = pinned_streams(src, dst, chunk, streams, lockstep=True)
    else:
        step = FlowArray(src, dst, np.full(len(ring), chunk), lockstep=True)
    return [step] * (2 * (len(ring) - 1))      # one object: the cost model evaluates the repeats once


def neighbor_exchange(sends: dict[int, Sequence[int]], payload_bytes: float, streams: int = 1) -> list[Phase]:
    """One phase: every rank sends the whole payload to each of its destinations; ``streams``
    > 1: as that many streams of payload/streams pinned to NICs round-robin
    (``FlowArray.pinned``: buckets whose tags take a host's NICs in turn)."""
    flows = [(src, dst) for src, dsts in sends.items() for dst in dsts]
    if streams <= 1 or not flows:
        return [[(src, dst, payload_bytes) for src, dst in flows]]
    src, dst = zip(*flows)
    return [pinned_streams(np.array(src), np.array(dst), payload_bytes, streams)]


def concurrent_group_allreduces(groups: Sequence[Sequence[int]], payload_bytes: float,
                                pair_streams: int = 1, nic_streams: int = 1) -> list[Phase]:
    """Disjoint groups, each running a ring all-reduce at the same time (DS-Sync's step).

    Every ring link of a group of n carries 2(n−1)/n of the payload; spreading that evenly
    over max 2(n−1) phases keeps the bound exact (concurrent groups add up on shared links)
    and charges the latency of the longest ring. ``nic_streams`` > 1: a group of more than
    two runs that many rings pinned to NICs round-robin, as DDP's buckets do
    (``bucket_streams``). A pair swaps its buckets in ``pair_streams`` pieces each
    (``GroupSet``'s pair swap), every piece with a tag of its own, which gloo maps to a
    host's NICs in turn: priced as max(``pair_streams``, ``nic_streams``) pinned streams.
    """
    rings = [sorted(g) for g in groups if len(g) > 1]
    if not rings:
        return []
    phases = max(2 * (len(g) - 1) for g in rings)
    step = []
    for g in rings:
        flows = nic_streams if len(g) > 2 else max(pair_streams, nic_streams)
        per_flow = 2 * (len(g) - 1) / len(g) * payload_bytes / phases / flows
        step += [(g[i], g[(i + 1) % len(g)], per_flow, flows) for i in range(len(g))]
    src, dst, nbytes, copies = (np.array(column) for column in zip(*step))
    # groups of more than two run gloo's ring, step by step; a pair swaps its buckets at once
    flows = FlowArray(src.astype(np.int64), dst.astype(np.int64), nbytes.astype(np.float64), copies.astype(np.int64),
                      pinned=copies > 1, lockstep=all(len(g) > 2 for g in rings))
    return [flows] * phases        # one object: the cost model evaluates the repeats once
