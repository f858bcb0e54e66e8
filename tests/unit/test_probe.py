"""Topology detection without processes: the tournament schedule, rack clustering, profiles."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from syncplane.cluster import load_profile, parse_profile
from syncplane.cluster.probe import (
    Topology,
    cluster_racks,
    from_profile,
    kept_apart,
    round_robin_rounds,
    topology_from_measurements,
)
from syncplane.config import ConfigError


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_round_robin_meets_every_pair_once_in_linear_rounds(n):
    rounds = round_robin_rounds(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    for r in rounds:                                   # nobody is in two pairs of one round
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))


def measured_two_racks(seed: int, racks=((0, 1, 2, 3), (4, 5, 6, 7)), nic=50e6, uplink=12.5e6, slow=()):
    """What a probe sees: NIC-limited inside a rack, the uplink shared by the round's other
    cross-rack pairs, ±15 % noise."""
    rng = np.random.default_rng(seed)
    n = sum(len(r) for r in racks)
    rack_of = {r: k for k, rack in enumerate(racks) for r in rack}
    bw = np.zeros((n, n))
    for pairs in round_robin_rounds(n):
        crossing = sum(rack_of[a] != rack_of[b] for a, b in pairs)
        for a, b in pairs:
            v = nic if rack_of[a] == rack_of[b] else uplink / crossing
            if a in slow or b in slow:
                v = min(v, nic / 4)
            bw[a, b] = bw[b, a] = v * rng.uniform(0.85, 1.15)
    return bw


@pytest.mark.parametrize("seed", range(5))
def test_clustering_recovers_two_racks_despite_probe_contention_and_noise(seed):
    topo = topology_from_measurements(measured_two_racks(seed), np.zeros((8, 8)), list(range(8)))
    assert topo.racks == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.bottlenecks() == ([], [])


@pytest.mark.parametrize("seed", range(5))
def test_one_stray_measurement_does_not_merge_or_split_racks(seed):
    """A cross-rack pair measured at NIC speed (a stalled small transfer) and an in-rack pair
    measured slow (a descheduled rank): single-linkage clustering merged the racks on the
    first, which is how the emulated probe failed in CI."""
    bw = measured_two_racks(seed)
    rng = np.random.default_rng(seed)
    a, b = int(rng.integers(0, 4)), int(rng.integers(4, 8))
    bw[a, b] = bw[b, a] = 55e6                                        # faster than any NIC
    c, d = (a + 1) % 4, (a + 2) % 4
    bw[c, d] = bw[d, c] = 4e6                                         # slower than the uplink share
    topo = topology_from_measurements(bw, np.zeros((8, 8)), list(range(8)))
    assert topo.racks == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_slow_nic_is_not_a_rack_of_its_own():
    topo = topology_from_measurements(measured_two_racks(0, racks=(tuple(range(8)),), slow=(7,)),
                                      np.zeros((8, 8)), list(range(8)))
    assert topo.racks == [list(range(8))]
    assert topo.bottlenecks() == ([7], [])


def test_uniform_bandwidth_is_one_rack_and_hosts_come_from_host_ids():
    bw = np.full((4, 4), 40e6)
    bw[0, 1] = bw[1, 0] = 2e9                          # loopback between ranks of one host
    topo = topology_from_measurements(bw, np.zeros((4, 4)), [0, 0, 1, 2])
    assert topo.hosts == [[0, 1], [2], [3]]
    assert topo.racks == [[0, 1, 2, 3]]


def test_cluster_racks_on_host_matrix():
    hb = np.array([[0, 9, 1, 1], [9, 0, 1, 1], [1, 1, 0, 9], [1, 1, 9, 0]], dtype=float)
    assert cluster_racks(hb) == [[0, 1], [2, 3]]
    assert cluster_racks(np.where(hb == 9, 50e6, 25e6)) == [[0, 1], [2, 3]]   # a gap of exactly 2x counts


@pytest.mark.parametrize("slow_nic_mbit,uplink_mbit,racks", [
    (100, 50, [[0, 1], [2, 3]]),     # the slow rack's hosts reach each other 2x faster than the other rack
    (100, 25, [[0, 1], [2, 3]]),
    (100, 100, [[0, 1, 2, 3]]),      # uplink as fast as their NICs: the NICs cap everything, no boundary
])
def test_a_rack_of_slow_nics_behind_a_slower_uplink_is_a_rack(slow_nic_mbit, uplink_mbit, racks):
    """Hosts with no fast link (their NICs are slower than the other rack's links) still form a
    rack of their own when they reach each other ``MIN_GAP_RATIO`` faster than anyone else; in
    one rack, slow NICs cap a host's links to its rack-mates and to the rest alike."""
    profile = parse_profile({"name": "slow_rack", "racks": [
        {"name": "fast", "uplink_mbit": uplink_mbit, "hosts": [{"name": f"f{i}", "nic_mbit": 400} for i in range(2)]},
        {"name": "slow", "uplink_mbit": uplink_mbit,
         "hosts": [{"name": f"s{i}", "nic_mbit": slow_nic_mbit} for i in range(2)]}]})
    topo = from_profile(profile)
    host_bw = np.array([[topo.bandwidth[a[0], b[0]] if a != b else np.inf for b in topo.hosts] for a in topo.hosts])
    assert cluster_racks(host_bw) == racks


@pytest.mark.parametrize("name,racks,slow", [
    ("two_racks", [[0, 1, 2, 3], [4, 5, 6, 7]], []),
    ("slow_nic", [list(range(8))], [7]),
])
def test_profile_topology(name, racks, slow):
    topo = from_profile(load_profile(name), 8)
    assert topo.racks == racks
    assert topo.bottlenecks()[0] == slow
    assert Topology.from_dict(topo.to_dict()).racks == racks


def test_profile_size_must_match_the_job():
    with pytest.raises(ConfigError, match="has 8 ranks but the job has 4 processes"):
        from_profile(load_profile("two_racks"), 4)


@pytest.mark.parametrize("alone,together,kept", [
    ((0.36, 0.36), 0.72, 1.0),     # one uplink: the second transfer waited for the first
    ((0.36, 0.36), 0.36, 2.0),     # no shared link
    ((0.09, 0.36), 0.36, 2.0),     # a fast in-rack pair beside the uplink's: still apart
    ((0.09, 0.36), 0.45, 1.0),     # ... or behind one link
    ((0.36, 0.36), 0.54, 1.5),
])
def test_two_transfers_kept_apart_by_their_times(alone, together, kept):
    assert kept_apart(*alone, together) == pytest.approx(kept)
