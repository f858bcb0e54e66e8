"""Probe -> profile: a topology written as a cluster profile reproduces the pairwise bandwidths
it was found with, racks and hosts included (the topology here is the one a profile declares,
``probe.from_profile``; the probe on emulated clusters: ``tests/cluster/test_probe_round_trip.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from syncplane.cluster import load_profile, parse_profile
from syncplane.cluster.probe import from_profile


@pytest.mark.parametrize("name", ["two_racks", "uneven_three_racks", "asymmetric_3_2_4", "slow_nic"])
def test_a_profile_written_from_a_topology_reproduces_its_bandwidths(name: str) -> None:
    topo = from_profile(load_profile(name))
    written = parse_profile(topo.to_profile("probed").to_dict())
    again = from_profile(written)
    assert again.racks == topo.racks and again.hosts == topo.hosts
    off = ~np.eye(topo.world_size, dtype=bool)
    ratio = again.bandwidth[off] / topo.bandwidth[off]
    assert np.all(np.abs(ratio - 1) <= 0.15), f"{name}: bandwidth ratios {ratio.min():.2f}..{ratio.max():.2f}"


@pytest.mark.parametrize("name,racks_found", [("two_racks", True), ("uneven_three_racks", False)])
def test_racks_are_found_from_noisy_measurements_and_written(name: str, racks_found: bool) -> None:
    """The probe's own path: noisy pairwise rates (fresh, ±5 %) and each rank's host id ->
    racks clustered -> a profile whose bandwidths are the truth's within 15 %. On
    ``uneven_three_racks`` pairwise rates alone cannot find the racks (host a2's 100 Mbit NIC
    equals the uplinks, so a2 looks as far from its rack as from the others): the profile
    still reproduces every pair's rate; finding those racks takes the probe's concurrent test
    (``cluster_racks``'s ``belongs``), which needs real flows."""
    from syncplane.cluster.probe import topology_from_measurements

    truth = from_profile(load_profile(name))
    rng = np.random.default_rng()
    noise = rng.uniform(0.95, 1.05, truth.bandwidth.shape)
    measured = np.where(np.isfinite(truth.bandwidth), truth.bandwidth * np.sqrt(noise * noise.T), np.inf)
    host_ids = [truth.host_of(r) for r in range(truth.world_size)]
    found = topology_from_measurements(measured, truth.latency, host_ids)
    assert (sorted(found.racks) == sorted(truth.racks)) == racks_found
    again = from_profile(parse_profile(found.to_profile().to_dict()))
    # the profile numbers ranks rack by rack, host by host: rank i of it is rank order[i] here
    order = np.array([r for rack in found.racks for host in found.hosts if host[0] in rack for r in host])
    off = ~np.eye(truth.world_size, dtype=bool)
    ratio = again.bandwidth[off] / truth.bandwidth[np.ix_(order, order)][off]
    assert np.all(np.abs(ratio - 1) <= 0.15), f"bandwidth ratios {ratio.min():.2f}..{ratio.max():.2f}"


def test_exclusive_rounds_never_put_one_part_in_a_round_twice() -> None:
    part = {r: r // 3 for r in range(9)}                 # three racks of three ranks
    pairs = [(a, b) for a in range(9) for b in range(a + 1, 9) if part[a] != part[b]]
    from syncplane.cluster.probe import exclusive_rounds

    rounds = exclusive_rounds(pairs, part)
    assert sorted(p for r in rounds for p in r) == sorted(pairs)
    for r in rounds:
        used = [part[x] for p in r for x in p]
        assert len(used) == len(set(used))


def test_a_slow_nic_host_placed_in_a_rack_is_retimed_with_that_rack() -> None:
    """``uneven_three_racks`` as the probe finds it: by pairwise rates host a2 (slow NIC) is close
    to nobody, so its close group is its own and its pairs out of r0 were timed beside a0's;
    once the concurrent test puts it into r0 the groups differ, and the rounds that time the
    pairs again by rack never hold two pairs leaving one rack."""
    from syncplane.cluster.probe import close_parts, exclusive_rounds, host_matrix, rack_parts, same_groups

    truth = from_profile(load_profile("uneven_three_racks"))
    racks = rack_parts(truth.hosts, truth.racks)
    assert racks == [0, 0, 0, 1, 1, 2]
    close = close_parts(host_matrix(truth.bandwidth, truth.hosts))
    assert not same_groups(racks, close)
    assert same_groups(racks, [5, 5, 5, 7, 7, 1]) and not same_groups(racks, [0, 0, 1, 1, 1, 2])
    pairs = [(a, b) for a in range(6) for b in range(a + 1, 6) if racks[a] != racks[b]]
    for r in exclusive_rounds(pairs, dict(enumerate(racks))):
        assert len(r) == 1                 # three racks: one pair at a time, none sharing an uplink


def test_pairs_that_shared_a_link_in_the_tournament_are_retimed_apart() -> None:
    """Hosts 0 (two ranks), 1 and 2 in one group, 3 in another: every pair leaving the group is
    retimed one per group per round; in the group, the pairs of the two-rank host are retimed
    one per host per round, and the pair of two one-rank hosts (1, 2) is not (nothing else of
    theirs ran beside it)."""
    from syncplane.cluster.probe import retime_rounds

    hosts = [[0, 1], [2], [3], [4]]
    pairs, rounds = retime_rounds(hosts, [0, 0, 0, 1])
    assert sorted(pairs) == [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3)]
    timed = sorted(p for r in rounds for p in r)
    assert timed == sorted([(0, 4), (2, 4), (3, 4), (0, 2), (0, 3)])     # hosts' first ranks
    for r in rounds:
        hosts_in = [h for p in r for h in p]
        assert len(hosts_in) == len(set(hosts_in))
        assert sum(4 in p for p in r) <= 1                                 # the group's uplink once


def test_a_host_that_belongs_to_no_rack_is_a_rack_of_its_own() -> None:
    """Hosts 0-1 and 2-3 fast pairs; hosts 4 and 5 slow to everyone. ``belongs`` (the probe's
    concurrent test) puts 4 into the second rack and rules 5 out of both."""
    from syncplane.cluster.probe import cluster_racks

    bw = np.full((6, 6), 10.0)
    bw[0, 1] = bw[1, 0] = bw[2, 3] = bw[3, 2] = 40.0
    asked = []

    def belongs(host: int, rack: list[int]) -> bool:
        asked.append((host, rack))
        return host == 4 and rack == [2, 3]

    assert cluster_racks(bw, belongs) == [[0, 1], [2, 3, 4], [5]]
    assert asked == [(4, [0, 1]), (4, [2, 3]), (5, [0, 1]), (5, [2, 3, 4])]
    assert cluster_racks(bw, lambda host, rack: None) == cluster_racks(bw)      # cannot tell: join the best


def test_per_flow_caps_are_written_and_read_back() -> None:
    """A cap on rack uplinks becomes the racks' ``per_flow_mbit`` with the several-stream rate
    as the uplink; a pair between the racks then gets the cap in the profile."""
    from syncplane.cluster.probe import FlowCap, Topology

    mb = 1e6 / 8
    bw = np.full((4, 4), 95 * mb)
    bw[0, 1] = bw[1, 0] = bw[2, 3] = bw[3, 2] = 1000 * mb
    np.fill_diagonal(bw, np.inf)
    cap = FlowCap(per_flow=95 * mb, link=380 * mb)
    topo = Topology(racks=[[0, 1], [2, 3]], hosts=[[0], [1], [2], [3]], bandwidth=bw, latency=np.zeros((4, 4)),
                    source="test", host_caps=[None] * 4, rack_caps=[cap, cap])
    assert Topology.from_dict(topo.to_dict()).rack_caps == [cap, cap]
    profile = parse_profile(topo.to_profile().to_dict())
    assert [(r.uplink_mbit, r.per_flow_mbit) for r in profile.racks] == [(380.0, 95.0), (380.0, 95.0)]
    assert all(h.spec.per_flow_mbit is None for h in profile.hosts)
    again = from_profile(profile).bandwidth
    assert again[0, 2] == pytest.approx(95 * mb) and again[0, 1] == pytest.approx(1000 * mb)


@pytest.mark.parametrize("tcp", ["bbr", "reno", None])
def test_the_hosts_congestion_control_is_written_and_read_back(tcp: str | None) -> None:
    """A probed profile runs what the hosts ran (None, not known: the profile's default)."""
    from syncplane.cluster.probe import Topology
    from syncplane.cluster.profile import DEFAULT_TCP_CONGESTION

    topo = from_profile(load_profile("two_racks"))
    topo.tcp_congestion = tcp
    assert Topology.from_dict(topo.to_dict()).tcp_congestion == tcp
    profile = parse_profile(topo.to_profile().to_dict())
    assert profile.tcp_congestion == (tcp or DEFAULT_TCP_CONGESTION)


def test_the_congestion_control_is_read_from_the_kernel_or_unknown(tmp_path) -> None:
    from syncplane.cluster.probe import congestion_control

    written = tmp_path / "tcp_congestion_control"
    written.write_text("bbr\n")
    assert congestion_control(written) == "bbr"
    assert congestion_control(tmp_path / "absent") is None


def test_hosts_that_disagree_give_the_most_common_congestion_control_and_a_warning(caplog) -> None:
    from syncplane.cluster.probe import agreed_congestion

    # ranks 0-1 on host 0 (cubic), host 1 (bbr), hosts 2-3 (cubic), host 4 unknown
    found, hosts = ["cubic", "cubic", "bbr", "cubic", "cubic", None], [0, 0, 1, 2, 3, 4]
    assert agreed_congestion(found, hosts) == "cubic"
    assert "hosts 1 run bbr" in caplog.text and "3 of 4 hosts" in caplog.text
    assert agreed_congestion(["bbr", "cubic"], [1, 0]) == "cubic"     # a tie: the lowest host's
    caplog.clear()
    assert agreed_congestion(["reno"] * 3, [0, 1, 2]) == "reno" and not caplog.text
    assert agreed_congestion([None, None], [0, 1]) is None
