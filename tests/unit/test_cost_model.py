"""The α-β model against hand-computed cases."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from syncplane.cluster import load_profile, parse_profile
from syncplane.cluster.profile import ClusterProfile
from syncplane.algorithms import strategy_time
from syncplane.algorithms.spec import CostOptions
from syncplane.cluster.cost import MBIT, CostModel, neighbor_exchange, ring_allreduce
from syncplane.exchanges import digit, mesh

M = 8 * 2**20


def test_ring_allreduce_on_two_racks_is_bound_by_the_uplink():
    model = CostModel(load_profile("two_racks"), alpha_s=0.0)
    # every ring phase sends M/8 across each uplink (one flow each way): 14 phases
    expected = 2 * 7 / 8 * M / (100 * MBIT)
    assert model.bound(ring_allreduce(8, M)) == pytest.approx(expected)


def test_ring_allreduce_on_one_switch_is_bound_by_the_nic():
    model = CostModel(load_profile("homogeneous8"), alpha_s=0.0)
    assert model.bound(ring_allreduce(8, M)) == pytest.approx(2 * 7 / 8 * M / (400 * MBIT))


def test_slow_nic_bounds_the_whole_ring():
    model = CostModel(load_profile("slow_nic"), alpha_s=0.0)
    assert model.bound(ring_allreduce(8, M)) == pytest.approx(2 * 7 / 8 * M / (100 * MBIT))


def test_parts_in_flight_run_the_racks_hops_under_the_uplinks():
    """Canary's nested exchange on two_racks, its colayers two in flight: one colayer's hop
    inside the rack (the 400 Mbit NICs) runs while another's crosses the 100 Mbit uplink, so
    the round takes the uplink's two phases back to back plus the first colayer's share of
    the rest; one in flight, or one part: the phases add up."""
    model = CostModel(load_profile("two_racks"), alpha_s=0.0)
    phases = digit.nested_cost([4, 2], M)
    inside, across = model.phase_times(phases)[:2]
    assert inside == pytest.approx(3 * M / 4 / (400 * MBIT))       # to 3 rack peers, M/4 each
    assert across == pytest.approx(4 * M / 8 / (100 * MBIT))       # 4 ranks' M/8 over one uplink
    total = model.time(phases)
    assert total == pytest.approx(2 * (inside + across))
    assert model.pipelined(phases, 1, 0.1) == model.pipelined(phases, 2, 1.0) == pytest.approx(total)
    assert model.pipelined(phases, 2, 0.1) == pytest.approx(2 * across + 0.1 * 2 * inside)
    # the mesh on one switch: every phase on the same NICs, nothing to run beside
    flat = CostModel(load_profile("homogeneous8"), alpha_s=0.0)
    assert flat.pipelined(mesh.cost(8, M), 2, 0.1) == pytest.approx(flat.time(mesh.cost(8, M)))


def test_parts_in_flight_each_get_a_capped_links_per_flow_rate():
    """wan_two_sites caps each flow at 100 Mbit on a 1 Gbit site link: two colayers in flight
    are twice the flows, each at the cap, so the sites' phases of both run at once."""
    model = CostModel(load_profile("wan_two_sites"), alpha_s=0.0)
    phases = digit.nested_cost([2, 2], M)
    inside, across = model.phase_times(phases)[:2]
    assert across == pytest.approx(M / 4 / (100 * MBIT))            # one flow to the other site, capped
    assert model.pipelined(phases, 2, 0.0) == pytest.approx(inside + across) == pytest.approx(model.time(phases) / 2)


def test_latency_adds_per_phase():
    model = CostModel(load_profile("homogeneous8"), alpha_s=0.002)
    phases = ring_allreduce(8, M)
    assert model.time(phases) == pytest.approx(model.bound(phases) + 14 * 0.002)


def test_background_flow_halves_the_uplink_share():
    quiet = CostModel(load_profile("two_racks"), alpha_s=0.0).bound(ring_allreduce(8, M))
    contended = CostModel(load_profile("two_racks_contended"), alpha_s=0.0).bound(ring_allreduce(8, M))
    assert contended == pytest.approx(2 * quiet)


def _with_background(flow: dict, uplink_cap: float | None = None) -> ClusterProfile:
    """two_racks_contended's layout (a0..a3 | b0..b3, 100 Mbit uplinks) with one background ``flow``."""
    racks = [{"name": r, "uplink_mbit": 100, "per_flow_mbit": uplink_cap,
              "hosts": [{"name": f"{h}{i}", "nic_mbit": 400} for i in range(4)]} for r, h in (("r0", "a"), ("r1", "b"))]
    return parse_profile({"name": "t", "racks": racks, "background": [flow]})


def test_a_phase_that_crosses_a_greedy_flows_queue_waits_behind_it():
    """A greedy flow a3 -> b3 queues at r0's uplink out, the first of its slowest links: a phase
    with a flow through that queue pays ``queue_s`` once (however many of its flows cross it);
    one that only shares the flow's other links, or its reverse path, does not. A paced flow
    below the uplink's rate, or one a per-flow cap paces (each flow queued apart), queues
    nothing; the bound never prices a queue."""
    from syncplane.cluster.cost import EMULATED_TCP_BBR, LinkTcp

    tcp = LinkTcp(queue_s=0.05)
    model = CostModel(_with_background({"src": "a3", "dst": "b3"}), alpha_s=0.0, tcp=tcp)
    tiny = 1.0       # one byte: the phase is its latency (a background flow's share doubles nothing visible)
    base = {name: CostModel(load_profile("two_racks"), alpha_s=0.0, tcp=tcp).phase_time(flows)
            for name, flows in (("across", [(0, 4, tiny)]), ("back", [(4, 0, tiny)]))}
    assert model.phase_time([(0, 4, tiny)]) == pytest.approx(base["across"] + 0.05, abs=1e-5)       # a0 -> b0: r0's uplink
    assert model.phase_time([(0, 4, tiny), (1, 5, tiny)]) == pytest.approx(base["across"] + 0.05, abs=1e-5)
    assert model.phase_time([(4, 0, tiny)]) == pytest.approx(base["back"], abs=1e-5)                # b0 -> a0
    assert model.phase_time([(3, 0, tiny), (4, 7, tiny)]) < 0.05         # a3's NIC, r1's uplink in, b3's NIC
    assert model.time([[(0, 4, tiny)]] * 3) == pytest.approx(3 * (base["across"] + 0.05), abs=1e-5)
    assert model.bound([[(0, 4, tiny)]]) == pytest.approx(base["across"], abs=1e-5)
    paced = {"src": "a3", "dst": "b3", "mbit": 50}
    for quiet in (CostModel(_with_background(paced), alpha_s=0.0, tcp=tcp),
                  CostModel(_with_background({"src": "a3", "dst": "b3"}, uplink_cap=50), alpha_s=0.0, tcp=tcp)):
        assert quiet.phase_time([(0, 4, tiny)]) < 0.05
    assert EMULATED_TCP_BBR.queue_s > 0 and LinkTcp().queue_s == 0


def test_flows_beside_the_phases_wait_behind_a_greedy_flows_queue_once():
    """A flow that runs beside the phases (``FlowArray.beside``: H-ATC's exchange between racks
    under the in-rack collectives) loads the links as any other, but only the pattern's end
    waits for it: the queue is paid once, on the last phase that carries such a flow, in
    ``phase_times``, ``time`` and ``pipelined`` alike; a connection that also carries bytes
    the phase waits for is waited for."""
    from syncplane.cluster.cost import LinkTcp, columns_of, per_connection

    tcp = LinkTcp(queue_s=0.05)          # goodput 1: the queue is all that differs from the plain formula
    model = CostModel(_with_background({"src": "a3", "dst": "b3"}), alpha_s=0.0, tcp=tcp)
    inside, across = columns_of([(0, 1, M)]), columns_of([(0, 4, M)])        # a0 -> a1; a0 -> b0 over r0's uplink
    aside = per_connection([inside], 8, beside=[across])
    assert aside.beside.tolist() == [False, True]
    steps = [aside, aside, per_connection([inside], 8), aside, per_connection([inside], 8)]
    times = model.phase_times(steps)
    extra = [t - p for t, p in zip(times, model.phase_times(steps, tcp=LinkTcp()))]
    assert extra == pytest.approx([0, 0, 0, 0.05, 0], abs=1e-9)           # the last phase beside the queue
    assert model.time(steps) == pytest.approx(sum(times))
    assert model.pipelined(steps, 1, 1.0) == pytest.approx(sum(times))
    assert model.bound(steps) == pytest.approx(sum(times) - 0.05)
    waited = per_connection([inside, across], 8, beside=[columns_of([(0, 4, M)])])
    assert not waited.beside.any()
    plain = model.phase_times([waited] * 2, tcp=LinkTcp())
    assert model.phase_times([waited] * 2) == pytest.approx([t + 0.05 for t in plain])      # every phase waits


def test_h_atc_on_a_contended_profile_waits_once_behind_the_greedy_flow():
    """On ``two_racks_contended`` the exchange between racks is H-ATC's only traffic through the
    queued uplink, beside its in-rack phases: one queue a step (measured: h_atc and h_awc ran
    within 0.3 s of the model without the queue, 11.5 and 12.0 s a step, where 96 queues priced 21.5 s)."""
    from syncplane.algorithms.decentralized.cost import hierarchical_one_peer_steps
    from syncplane.cluster.cost import EMULATED_TCP

    profile = load_profile("two_racks_contended")
    quiet = CostModel(profile, tcp=dataclasses.replace(EMULATED_TCP, queue_s=0.0))
    model = CostModel(profile, tcp=EMULATED_TCP)
    for step in hierarchical_one_peer_steps(profile, 97.5e6, CostOptions()):
        assert len(step) > 10
        assert model.time(step) - quiet.time(step) == pytest.approx(EMULATED_TCP.queue_s)
        assert model.bound(step) == quiet.bound(step)


def test_per_flow_cap_limits_a_single_stream():
    model = CostModel(load_profile("wan_two_sites"), alpha_s=0.0)
    one_flow = neighbor_exchange({0: [2]}, M)                          # site a -> site b, one TCP stream
    assert model.bound(one_flow) == pytest.approx(M / (100 * MBIT))
    eight_flows = [[(0, 2, M / 8)] * 8]                                # the same bytes over 8 streams
    assert model.bound(eight_flows) == pytest.approx(M / (8 * 100 * MBIT))
    sixteen_flows = [[(0, 2, M / 16)] * 16]                            # now the 1 Gbit link binds
    assert model.bound(sixteen_flows) == pytest.approx(M / (1000 * MBIT))


def test_flows_inside_a_host_use_loopback_and_neighbours_share_nics():
    profile = parse_profile({"name": "t", "racks": [{"name": "r", "hosts": [
        {"name": "a", "nic_mbit": 100, "ranks": 2}, {"name": "b", "nic_mbit": 100, "ranks": 2, "nics": 2}]}]})
    model = CostModel(profile, alpha_s=0.0, loopback_bytes_per_s=1e12)
    assert model.bound(neighbor_exchange({0: [1]}, M)) == pytest.approx(M / 1e12)
    # two flows leave host a (one 100 Mbit NIC) for host b (two NICs): a's NIC is the bottleneck
    assert model.bound(neighbor_exchange({0: [2], 1: [3]}, M)) == pytest.approx(2 * M / (100 * MBIT))


def test_strategy_time_reports_unmodelled_strategies(monkeypatch):
    from syncplane import algorithms

    monkeypatch.setitem(algorithms.PLANNED, "future", "a promised strategy")
    with pytest.raises(KeyError, match="'future' is planned but not implemented yet"):
        strategy_time(CostModel(load_profile("two_racks")), "future", M)


def test_one_peer_atc_on_two_racks_piles_flows_onto_the_uplink():
    """Step t of the one-peer schedule sends 2^t flows across each 100 Mbit uplink (t = 0,
    1, 2 for 8 ranks in two racks of 4): the bound is the mean of 1, 2 and 4 payloads at
    uplink speed -- why flat gossip loses to DDP there (the DS-Sync paper, §II), and why
    atc's default there mixes racks (``hierarchy: none`` keeps the ranks)."""
    from syncplane.algorithms import CostOptions

    model = CostModel(load_profile("two_racks"))
    _, bound = strategy_time(model, "atc", M, CostOptions(pattern="none"))
    uplink = 100e6 / 8
    assert bound == pytest.approx((1 + 2 + 4) / 3 * M / uplink, rel=1e-6)


@pytest.mark.parametrize("name", ["atc", "awc"])
def test_the_default_atc_mixes_racks_on_a_profile_with_racks_and_ranks_elsewhere(name):
    """``hierarchy: auto``: priced as h_atc on two_racks, as flat gossip on one rack."""
    racks = CostModel(load_profile("two_racks"))
    assert strategy_time(racks, name, M) == strategy_time(racks, "h_" + name, M)
    one_rack = CostModel(load_profile("homogeneous8"))
    assert strategy_time(one_rack, name, M) != strategy_time(one_rack, "h_" + name, M)


def test_hierarchical_atc_on_two_racks_sends_one_payload_per_rack_over_the_uplink():
    model = CostModel(load_profile("two_racks"))
    _, bound = strategy_time(model, "h_atc", M)
    nic, uplink = 400e6 / 8, 100e6 / 8
    in_rack = (2 * (3 / 4) + 1 / 4) * M / nic   # reduce-scatter + all-gather + own shard, per NIC
    assert in_rack < M / uplink                  # beside the in-rack phases: the uplink is the bottleneck
    assert bound == pytest.approx(M / uplink, rel=1e-6)


def test_hierarchical_atc_in_one_rack_is_the_all_to_all_then_the_ring_per_bucket():
    """One rack of L ranks (``homogeneous8``, one rank per host): per 4 MB bucket the
    reduce-scatter sends B/L to each of L − 1 peers at once, then gloo's ring all-gathers in
    L − 1 steps of B/L; nothing crosses a rack."""
    model = CostModel(load_profile("homogeneous8"), alpha_s=0.0)
    nic, ranks, bucket = 400e6 / 8, 8, 4 * 2**20
    _, bound = strategy_time(model, "h_atc", M)
    per_bucket = (ranks - 1) * bucket / ranks / nic + (ranks - 1) * bucket / ranks / nic
    assert bound == pytest.approx(M / bucket * per_bucket, rel=1e-6)


@pytest.mark.parametrize("shift, flows", [(1, 1), (2, 2), (4, 4)])
def test_flows_sharing_an_uplink_get_the_measured_share_of_it_and_the_bound_stays_ideal(shift, flows):
    """Rank r sends M to r + shift on two_racks: ``flows`` flows cross each uplink direction
    (the uplink binds). The emulator's TCP under bbr (measured: 0.78, 1.70, 3.70 s at 8 MB) gets
    0.86 / (1 + 0.06 (k - 1)) of the rate; the bound and the default model keep the formula."""
    from syncplane.cluster.cost import EMULATED_TCP_BBR, LinkTcp

    profile = load_profile("two_racks")
    phases = neighbor_exchange({r: [(r + shift) % 8] for r in range(8)}, M)
    ideal = flows * M / (100 * MBIT)
    tcp = CostModel(profile, alpha_s=0.0, tcp=EMULATED_TCP_BBR)
    assert tcp.time(phases) == pytest.approx(ideal * (1 + 0.06 * (flows - 1)) / 0.86)
    assert tcp.bound(phases) == pytest.approx(ideal) == CostModel(profile, alpha_s=0.0).time(phases)
    assert LinkTcp().factor(flows) == 1.0


def test_unpinned_flows_of_a_host_share_one_nic_in_the_prediction_and_both_in_the_bound():
    """multi_nic: both ranks of n0 send M to n1 at once. gloo puts both on one NIC (measured:
    eth0 carried 86 % of the bytes), so the prediction prices one NIC shared by two flows;
    the bound keeps the two NICs the pattern could use."""
    from syncplane.cluster.cost import EMULATED_TCP_BBR

    phase = [(0, 2, M), (1, 3, M)]
    model = CostModel(load_profile("multi_nic"), alpha_s=0.0, tcp=EMULATED_TCP_BBR)
    assert model.bound([phase]) == pytest.approx(M / (100 * MBIT))
    assert model.time([phase]) == pytest.approx(2 * M / (100 * MBIT) * 1.06 / 0.86)


@pytest.mark.parametrize("flows", [2, 4])
def test_a_pipelines_chunks_pay_no_per_flow_loss_and_spread_over_the_nics(flows):
    """FlexReduce's wavefront (``FlowArray.chunked``): the same flows as long ones pay the
    per-flow loss and, unpinned, share one NIC of ``multi_nic``'s two; as one tick of chunks,
    each its own op, they get the single flow's goodput and both NICs."""
    from syncplane.cluster.cost import EMULATED_TCP_BBR, FlowArray

    src, dst = np.arange(flows) % 2, 2 + np.arange(flows) % 2           # n0's ranks to n1's
    nbytes = np.full(flows, M / flows)
    model = CostModel(load_profile("multi_nic"), alpha_s=0.0, tcp=EMULATED_TCP_BBR)
    long = model.time([FlowArray(src, dst, nbytes)])
    chunks = model.time([FlowArray(src, dst, nbytes, chunked=True)])
    assert long == pytest.approx(M / (100 * MBIT) * (1 + 0.06 * (flows - 1)) / 0.86)
    assert chunks == pytest.approx(M / (2 * 100 * MBIT) / 0.86)
    assert model.bound([FlowArray(src, dst, nbytes, chunked=True)]) == pytest.approx(M / (2 * 100 * MBIT))


def test_flexreduce_ticks_are_chunked_and_the_levelwise_schedule_is_not():
    from syncplane.algorithms.flexreduce.cost import flexreduce_levelwise_steps, flexreduce_steps
    from syncplane.algorithms.spec import CostOptions

    profile = load_profile("two_racks")
    pipelined, = flexreduce_steps("flexreduce", profile, 8 * M, CostOptions())
    levelwise, = flexreduce_levelwise_steps("flexreduce", profile, 8 * M, CostOptions())
    assert all(p.chunked for p in pipelined) and not any(getattr(p, "chunked", False) for p in levelwise)


def test_canary_is_priced_on_the_streams_its_transport_opens_one_per_nic():
    """multi_nic (2 hosts of 2 ranks, 2 NICs of 100 Mbit): Canary's ``nics=auto`` opens one
    gloo group per NIC, doubled for the exact in-host hop (4 streams, 2 per NIC), so its
    cross-host phases ride both NICs: half the time of ``nics=1`` (measured: its bytes split
    evenly over eth0 and eth1). The bench's ``shards`` (DiLoCo's) does not set it."""
    from syncplane.algorithms.canary import canary_cost
    from syncplane.algorithms.plan import PlanInputs, cost_options

    profile, inputs = load_profile("multi_nic"), PlanInputs(M)
    assert cost_options("canary", {"shards": 3}, inputs).streams == 0
    assert cost_options("canary", {"nics": 1}, inputs).streams == 1
    model = CostModel(profile, alpha_s=0.0)
    auto, one = (model.phase_times(canary_cost("canary", profile, M, cost_options("canary", kw, inputs))[0])
                 for kw in ({}, {"nics": 1}))
    assert auto[0] == pytest.approx(one[0])                 # the in-host hop: memory, not the NICs
    assert auto[1:3] == pytest.approx([t / 2 for t in one[1:3]], rel=0.01)  # the sketch's size moves a little


@pytest.mark.parametrize("buckets, nics, streams", [(1, 2, 1), (4, 2, 2), (3, 2, 3), (4, 1, 1), (8, 4, 4), (6, 4, 6)])
def test_ddp_buckets_rotate_over_the_nics_as_pinned_streams(buckets, nics, streams):
    """gloo gives op i NIC i mod k: b buckets put ⌈b/k⌉ on the busiest NIC, what S pinned
    streams do (S/⌈S/k⌉ NICs' worth), with no more TCP flows than needed."""
    from syncplane.cluster.cost import bucket_streams

    assert bucket_streams(buckets, nics) == streams
    assert streams / math.ceil(streams / nics) == pytest.approx(buckets / math.ceil(buckets / nics)) or nics == 1


def test_ddp_four_buckets_use_both_nics_of_multi_nic_one_bucket_one():
    """multi_nic: a 100 MB payload (4 buckets) crosses each host on both NICs, half the
    one-NIC time (measured 6.85 s, 2026-11-26, where one NIC priced 14.3 s); 8 MB (one
    bucket) rides one NIC per step in the prediction. Each ring phase sends M/4 per rank;
    one flow per host direction crosses it."""
    from syncplane.algorithms.ddp import ddp_cost
    from syncplane.cluster.cost import EMULATED_TCP_BBR

    profile = load_profile("multi_nic")
    model = CostModel(profile, alpha_s=0.0, tcp=EMULATED_TCP_BBR)
    for payload, nics in ((100 * 2**20, 2), (8 * 2**20, 1)):
        phases = ddp_cost("ddp", profile, payload, CostOptions())[0]
        assert len(phases) == 6
        assert model.bound(phases) == pytest.approx(6 * payload / 4 / (nics * 100 * MBIT))


def test_emulated_goodput_follows_the_link_rate_between_measured_points():
    import numpy as np

    from syncplane.cluster.cost import EMULATED_TCP_BBR, IDEAL, MBIT

    one = np.array([1.0])
    at = {mbit: float(EMULATED_TCP_BBR.factor(one, np.array([mbit * MBIT]))[0]) for mbit in (50, 100, 150, 400, 1000, 10000)}
    assert at[50] == at[100] == pytest.approx(0.86)
    assert at[150] == pytest.approx((0.86 + 0.957) / 2)
    assert at[400] == pytest.approx(0.963) and at[1000] == at[10000] == pytest.approx(0.969)
    assert float(EMULATED_TCP_BBR.factor(np.array([3.0]), np.array([400 * MBIT]))[0]) == pytest.approx(0.963 / 1.12)
    assert float(IDEAL.factor(one, np.array([400 * MBIT]))[0]) == 1.0
    # a flow on a 400 Mbit NIC is priced at that rate's goodput, one on a 100 Mbit uplink at its own
    model = CostModel(load_profile("two_racks"), tcp=EMULATED_TCP_BBR, alpha_s=0.0)
    assert model.phase_time([(0, 1, 50e6)]) == pytest.approx(50e6 / (400 * MBIT * 0.963))
    assert model.phase_time([(0, 4, 50e6)]) == pytest.approx(50e6 / (100 * MBIT * 0.86))


def test_the_per_flow_loss_stops_growing_at_six_flows_on_a_link():
    import numpy as np

    from syncplane.cluster.cost import EMULATED_TCP_BBR, MBIT

    rate = np.array([100 * MBIT])
    share = {n: float(EMULATED_TCP_BBR.factor(np.array([float(n)]), rate)[0]) for n in (1, 2, 4, 6, 7, 16)}
    assert share[2] == pytest.approx(0.86 / 1.06) and share[4] == pytest.approx(0.86 / 1.18)   # as measured
    assert share[6] == share[7] == share[16] == pytest.approx(0.86 / 1.30)


def test_hierarchical_gossip_sends_the_bytes_between_two_ranks_as_one_flow():
    from syncplane.algorithms.decentralized.cost import hierarchical_one_peer_steps

    for name in ("homogeneous8", "two_racks", "uneven_three_racks"):
        for step in hierarchical_one_peer_steps(load_profile(name), 8e6, CostOptions()):
            for phase in step:
                pairs = [(s, d) for s, d, _ in phase]
                assert len(pairs) == len(set(pairs)), name


def test_connections_given_as_streams_spread_over_the_nics_gloo_lists():
    """H-ATC's reduce-scatter tags each message by its pair, so a host's connections take its
    NICs in turn: as two pinned streams each, half the time of one NIC on ``multi_nic``."""
    from syncplane.algorithms.decentralized.cost import hierarchical_one_peer_steps
    from syncplane.cluster.cost import EMULATED_TCP_BBR, columns_of, per_connection

    model = CostModel(load_profile("multi_nic"), tcp=EMULATED_TCP_BBR)
    across = [columns_of([(0, 2, M), (1, 3, M), (0, 3, M), (1, 2, M)])]
    one, two = (model.phase_time(per_connection(across, 4, streams=s)) for s in (1, 2))
    assert two == pytest.approx(one / 2, rel=0.05)
    scattered = hierarchical_one_peer_steps(load_profile("multi_nic"), 4 * M, CostOptions())[0][0]
    assert scattered.pinned and set(scattered.copies.tolist()) == {2}
    flat = hierarchical_one_peer_steps(load_profile("two_racks"), 4 * M, CostOptions())[0][0]
    assert not flat.pinned             # one NIC a host: one flow a connection, as before


def test_a_link_counts_only_the_streams_of_a_flow_that_cross_it():
    """``bcube_3_2``: every rank sends M to the next as two streams pinned to NIC 0 and NIC 1.
    A relayed flow's streams take different routes, so a relay's NIC carries one stream of its
    own flow and one of the relayed one: two TCP flows, not the four that counting each flow's
    streams on every link it touches gave."""
    from syncplane.cluster.cost import EMULATED_TCP_BBR, pinned_streams

    ranks = np.arange(9)
    phase = pinned_streams(ranks, (ranks + 1) % 9, M, 2)
    model = CostModel(load_profile("bcube_3_2"), alpha_s=0.0, tcp=EMULATED_TCP_BBR)
    two_flows = float(EMULATED_TCP_BBR.factor(np.array([2.0]), np.array([100 * MBIT]))[0])
    assert model.time([phase]) == pytest.approx(model.bound([phase]) / two_flows)


@pytest.mark.parametrize("profile_name", ["bcube_3_2", "multi_nic", "two_racks"])
def test_a_collectives_ring_steps_pay_no_per_flow_loss(profile_name):
    """DDP's ring (``ring_allreduce``: ``FlowArray.lockstep``) sends each step after the previous
    one arrived. On ``bcube_3_2`` two of its flows share each relay's NIC, and it measured at
    0.91 of its bound (2026-11-29) where the per-flow loss priced it 1.23x the bound: its steps
    get one flow's goodput; the same flows sent at once (long flows) pay the loss there."""
    from syncplane.algorithms.ddp import ddp_cost
    from syncplane.cluster.cost import EMULATED_TCP_BBR, FlowArray

    profile = load_profile(profile_name)
    model = CostModel(profile, alpha_s=0.0, tcp=EMULATED_TCP_BBR)
    phases = ddp_cost("ddp", profile, 100 * 2**20, CostOptions())[0]
    assert all(p.lockstep for p in phases)
    one_flow = float(EMULATED_TCP_BBR.factor(np.array([1.0]), np.array([100 * MBIT]))[0])
    assert model.time(phases) == pytest.approx(model.bound(phases) / one_flow)
    at_once = model.time([FlowArray(p.src, p.dst, p.nbytes, p.copies, pinned=p.pinned) for p in phases])
    if profile.bcube:
        assert at_once == pytest.approx(model.time(phases) * 1.06)        # two flows on the busiest NICs
    else:
        assert at_once == pytest.approx(model.time(phases))                # one flow a link: no loss to lose


def test_the_emulators_tcp_is_the_one_measured_under_the_hosts_congestion_control():
    """bbr's terms for hosts under bbr, cubic's for cubic and for an algorithm not measured
    (reno: loss-based like cubic); the plan and simulate take them from the profile."""
    from dataclasses import replace

    from syncplane.algorithms.plan import link_tcp
    from syncplane.cluster.cost import EMULATED_TCP, EMULATED_TCP_BBR, IDEAL, emulated_tcp

    assert emulated_tcp("bbr") is EMULATED_TCP_BBR and EMULATED_TCP is not EMULATED_TCP_BBR
    assert emulated_tcp("cubic") is EMULATED_TCP and emulated_tcp("reno") is EMULATED_TCP
    profile = load_profile("two_racks")
    assert link_tcp("emulated", profile) is EMULATED_TCP
    assert link_tcp("emulated", replace(profile, tcp_congestion="bbr")) is EMULATED_TCP_BBR
    assert link_tcp("ideal", replace(profile, tcp_congestion="bbr")) is IDEAL
