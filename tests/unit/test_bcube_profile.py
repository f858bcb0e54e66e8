"""BCube(α, β) profiles (paper 004 §4.4; Guo et al. 2009): addressing and switches, the
relay routes the emulator installs, the cost model's per-NIC links and relayed flows, the
topology a profile declares, and bad profiles naming the field."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from syncplane.cluster import load_profile, parse_profile
from syncplane.cluster.cost import MBIT, CostModel
from syncplane.cluster.emulator import bcube_routes
from syncplane.cluster.probe import from_profile
from syncplane.cluster.profile import scaled
from syncplane.config import ConfigError

MB = 1e6


def cube_data(alpha: int = 2, beta: int = 2, nics: int | None = None) -> dict:
    hosts = [{"name": f"w{h}", "nic_mbit": 100, "nics": beta if nics is None else nics} for h in range(alpha ** beta)]
    return {"name": "cube", "bcube": {"alpha": alpha, "beta": beta}, "racks": [{"name": "c", "hosts": hosts}]}


def test_bcube_3_2_switches_pick_hosts_one_digit_apart():
    profile = load_profile("bcube_3_2")
    cube = profile.bcube
    assert (cube.alpha, cube.beta, profile.world_size) == (3, 2, 9)
    assert all(h.spec.nics == 2 for h in profile.hosts)
    for a, b in itertools.combinations(range(9), 2):
        differing = [lv for lv in range(2) if cube.digits(a)[lv] != cube.digits(b)[lv]]
        for level in range(2):   # same level-ℓ switch  <=>  the addresses differ in digit ℓ only
            assert (cube.switch(a, level) == cube.switch(b, level)) == (differing == [level])
    assert parse_profile(profile.to_dict()).bcube == cube            # round-trips


@pytest.mark.parametrize("alpha,beta", [(3, 2), (2, 3)])
def test_routes_fix_one_digit_per_hop_and_end_on_the_addressed_nic(alpha, beta):
    profile = parse_profile(cube_data(alpha, beta))
    cube = profile.bcube
    for src, dst, level in itertools.product(range(cube.hosts), range(cube.hosts), range(beta)):
        hops = cube.route(src, dst, level)
        if src == dst:
            assert hops == []
            continue
        assert hops[0][0] == src and hops[-1][1] == dst
        for (u, v, lv), nxt in zip(hops, hops[1:] + [None]):
            assert cube.switch(u, lv) == cube.switch(v, lv)                     # one hop: one shared switch
            assert nxt is None or nxt[0] == v
            # the next host routes the rest by the same rule (what every namespace installs)
            assert cube.route(v, dst, level) == hops[hops.index((u, v, lv)) + 1:]
        differing = sum(a != b for a, b in zip(cube.digits(src), cube.digits(dst)))
        assert len(hops) == differing
        if cube.digits(src)[level] != cube.digits(dst)[level]:
            assert hops[-1][2] == level                                       # arrives on NIC ℓ


def test_emulator_routes_every_address_off_its_switches_through_a_neighbour():
    profile = load_profile("bcube_3_2")
    w00 = profile.hosts[0]
    routes = {dst: (gw, dev) for dst, gw, dev in bcube_routes(profile, w00)}
    # w00 reaches w01, w02 (level 0) and w10, w20 (level 1) on-link; everything else via a relay
    assert "198.18.0.2" not in routes and "198.18.1.4" not in routes
    assert routes["198.18.0.5"] == ("198.18.1.4", "eth1")        # w11 on NIC 0: via w10, then level 0
    assert routes["198.18.1.5"] == ("198.18.0.2", "eth0")        # w11 on NIC 1: via w01, then level 1
    assert routes["198.18.1.2"] == ("198.18.0.2", "eth0")        # w01's NIC 1: one hop on level 0
    assert len(routes) == 2 * 8 - 4


def test_cost_model_loads_each_nic_and_every_relay():
    profile = load_profile("bcube_3_2")
    model, nic = CostModel(profile), 100 * MBIT
    assert model.phase_time([(0, 1, 100 * MB)], alpha_s=0) == pytest.approx(100 * MB / nic)   # one hop, one NIC
    # two digits apart: half the bytes via w10 (to NIC 0), half via w01 (to NIC 1), in parallel
    assert model.phase_time([(0, 4, 100 * MB)], alpha_s=0) == pytest.approx(50 * MB / nic)
    # w01 relays 0 -> 4 and also sends its own flow to w11 on level 1: its NIC 1 carries both
    assert model.phase_time([(0, 4, 100 * MB), (1, 4, 100 * MB)], alpha_s=0) == pytest.approx(150 * MB / nic)
    # a host's two NICs are separate links: one flow per level does not share
    assert model.phase_time([(0, 1, 100 * MB), (0, 3, 100 * MB)], alpha_s=0) == pytest.approx(100 * MB / nic)


def test_one_gloo_group_on_nic_0_loads_the_nics_as_its_connections_run():
    """One stream on NIC 0 (DiLoCo's one-stream mesh): the higher rank of a pair connects to
    the lower one's NIC 0, so the bytes sent up the ranks go to the address the connection
    left from. Measured on the emulator, the three racks' NIC 0 sent 22.9, 13.7 and 4.6 MB
    per step (ratio 5 : 3 : 1, every NIC 1 13.7): with f per ordered pair, 10, 6 and 2 flows
    of f, and 6 each on NIC 1. Spread over both NICs, or on two pinned streams, every NIC
    carries 6."""
    from syncplane.cluster.cost import FlowArray, LinkTcp, pinned_streams

    profile = load_profile("bcube_3_2")
    model, f = CostModel(profile, alpha_s=0.0), 10 * MB
    pairs = [(a, b) for a in range(9) for b in range(9) if a != b]
    src, dst = (np.array(c, dtype=np.int64) for c in zip(*pairs))
    one_nic = LinkTcp(one_nic_unpinned=True)            # no TCP loss: the loads alone
    unpinned = FlowArray(src, dst, np.full(len(pairs), f))
    assert model.phase_times([unpinned], tcp=one_nic)[0] == pytest.approx(10 * f / (100 * MBIT))
    assert model.bound([unpinned]) == pytest.approx(6 * f / (100 * MBIT))
    assert model.phase_times([pinned_streams(src, dst, f, 2)], tcp=one_nic)[0] == pytest.approx(6 * f / (100 * MBIT))


def test_profile_topology_is_one_rack_with_relayed_pairs_on_two_paths():
    topo = from_profile(load_profile("bcube_3_2"))
    assert topo.racks == [list(range(9))] and topo.hosts == [[h] for h in range(9)]
    mbit = topo.bandwidth * 8 / 1e6
    assert mbit[0, 1] == pytest.approx(100) and mbit[0, 3] == pytest.approx(100)    # neighbours: one NIC
    assert mbit[0, 4] == pytest.approx(200)                                         # two disjoint relay paths
    assert np.all(np.isfinite(mbit[~np.eye(9, dtype=bool)]))


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["racks"][0]["hosts"][3].update(nics=1),
     r"cluster.racks\[0\].hosts\[3\].nics: every host of BCube\(2, 2\) needs beta = 2 NICs"),
    (lambda d: d["racks"][0]["hosts"].pop(), r"cluster.racks\[0\].hosts: BCube\(2, 2\) has alpha\^beta = 4 hosts, got 3"),
    (lambda d: d["bcube"].update(alpha=1), r"cluster.bcube.alpha: a BCube switch needs at least 2 ports, got 1"),
    (lambda d: d["bcube"].update(levels=2), r"cluster.bcube: unknown key\(s\) levels"),
    (lambda d: d["racks"][0].update(uplink_mbit=100), r"cluster.racks\[0\].uplink_mbit: a BCube\(2, 2\) network has no uplink"),
    (lambda d: d["racks"].append({"name": "r1", "hosts": [{"name": "x", "nic_mbit": 1}]}), r"cluster.racks: a BCube"),
])
def test_bad_bcube_profiles_name_the_field(mutate, message):
    data = copy.deepcopy(cube_data())
    mutate(data)
    with pytest.raises(ConfigError, match=message):
        parse_profile(data)


def test_a_bcube_profile_is_not_scaled_by_racks():
    with pytest.raises(ConfigError, match="BCube network: it scales by alpha and beta"):
        scaled(load_profile("bcube_3_2"), 2, 4)


def test_canary_picks_the_cube_exchange_only_on_bcube_and_needs_one_rank_per_host():
    from syncplane.exchanges import cube_shape

    assert cube_shape(load_profile("bcube_3_2")) == (3, 2)
    assert cube_shape(load_profile("multi_nic")) is None
    data = cube_data()
    data["racks"][0]["hosts"][2]["ranks"] = 2
    with pytest.raises(ConfigError, match=r"cluster.racks\[0\].hosts\[2\].ranks: the cube exchange on "
                                          r"BCube\(2, 2\) runs one rank per host, host 'w2' has 2"):
        cube_shape(parse_profile(data))


@pytest.mark.parametrize("alpha, beta", [(3, 2), (2, 3), (4, 2), (3, 3), (5, 1)])
def test_the_direct_ring_visits_every_host_once_and_never_takes_a_relay(alpha: int, beta: int) -> None:
    cube = parse_profile(cube_data(alpha, beta)).bcube
    ring = cube.direct_ring()
    assert sorted(ring) == list(range(alpha ** beta))
    for a, b in zip(ring, ring[1:] + ring[:1]):              # the closing hop too
        assert sum(x != y for x, y in zip(cube.digits(a), cube.digits(b))) == 1
        assert all(len(cube.route(a, b, level)) == 1 for level in range(beta))
