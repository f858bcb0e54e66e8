"""The network's lower bound for an all-reduce (``syncplane.cluster.bound``) on topologies
solved by hand, and as a bound: no exact all-reduce pattern the cost model prices beats it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from syncplane.algorithms import CostOptions, strategy_time, strategy_times
from syncplane.cluster import load_profile, parse_profile
from syncplane.cluster.bound import allreduce_network_bound
from syncplane.cluster.cost import MBIT, CostModel
from syncplane.cluster.profile import shipped_profiles

from tests.unit.test_random_profiles import profiles

M = 25 * 2**20


def test_two_racks_uplink_carries_m_each_way():
    bound = allreduce_network_bound(load_profile("two_racks"), M)
    assert bound.seconds == pytest.approx(M / (100 * MBIT))
    assert bound.binding.startswith("uplink of")


def test_one_switch_of_equal_hosts_is_the_ring_bound():
    """Counting: 8 hosts send 2·7·M in all over 8 × 400 Mbit."""
    bound = allreduce_network_bound(load_profile("homogeneous8"), M)
    assert bound.seconds == pytest.approx(2 * 7 / 8 * M / (400 * MBIT))
    assert bound.binding == "NICs of all hosts, out"


def test_a_slow_nic_must_still_carry_m():
    assert allreduce_network_bound(load_profile("slow_nic"), M).seconds == pytest.approx(M / (100 * MBIT))


def test_per_flow_caps_times_streams_on_the_wan():
    """Two ranks per site, 100 Mbit per TCP flow on a 1 Gbit site link: one stream per pair
    gives 2·2 flows = 400 Mbit; eight give 32 flows, so the 1 Gbit link itself binds."""
    wan = load_profile("wan_two_sites")
    assert allreduce_network_bound(wan, M, streams=1).seconds == pytest.approx(M / (400 * MBIT))
    assert allreduce_network_bound(wan, M, streams=8).seconds == pytest.approx(M / (1000 * MBIT))


def test_background_flow_takes_its_fair_share():
    """16 flows of ours (4 × 4 rank pairs) next to one greedy flow get 16/17 of the uplink."""
    bound = allreduce_network_bound(load_profile("two_racks_contended"), M)
    assert bound.seconds == pytest.approx(M / (100 * MBIT * 16 / 17))


def test_multi_nic_hosts_use_both_nics():
    assert allreduce_network_bound(load_profile("multi_nic"), M).seconds == pytest.approx(M / (200 * MBIT))


def test_three_racks_count_beats_the_single_cut():
    """Three one-host racks on 100 Mbit uplinks: any one cut needs M, but the racks must pass
    2·2·M across the uplinks in all: 4/3 M per uplink."""
    profile = parse_profile({"name": "t", "racks": [
        {"name": f"r{k}", "uplink_mbit": 100, "hosts": [{"name": f"h{k}", "nic_mbit": 1000}]} for k in range(3)]})
    bound = allreduce_network_bound(profile, M)
    assert bound.seconds == pytest.approx(4 / 3 * M / (100 * MBIT))
    assert bound.binding == "uplinks of all racks, out"


def test_one_host_has_no_network_bound():
    assert allreduce_network_bound(load_profile("local"), M).seconds == 0.0


def test_bad_streams_is_named():
    with pytest.raises(ValueError, match="streams: must be at least 1, got 0"):
        allreduce_network_bound(load_profile("two_racks"), M, streams=0)


def test_periodic_strategies_amortize_the_bound():
    model = CostModel(load_profile("two_racks"))
    ddp = strategy_times(model, "ddp", M, CostOptions(period=4))
    diloco = strategy_times(model, "diloco", M, CostOptions(period=4))
    assert diloco.network_bound_s == pytest.approx(ddp.network_bound_s / 4)


#: Patterns that compute the exact sum on every rank (gossip and DS-Sync's groups do not).
EXACT = ["ddp", "flexreduce", "flexreduce_levelwise", "hier_allreduce", "diloco"]


def _check_no_exact_pattern_beats_the_bound(profile) -> None:
    model = CostModel(profile)
    for streams in (1, 3):
        network = allreduce_network_bound(profile, M, streams).seconds
        for name in EXACT:
            _, bound = strategy_time(model, name, M, CostOptions(period=1, streams=streams))
            assert bound >= network * (1 - 1e-9), (profile.name, name, streams, bound, network)


@pytest.mark.parametrize("name", shipped_profiles())
def test_shipped_profiles_no_exact_allreduce_beats_the_network(name):
    _check_no_exact_pattern_beats_the_bound(load_profile(name))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(profiles())
def test_random_profiles_no_exact_allreduce_beats_the_network(data):
    _check_no_exact_pattern_beats_the_bound(parse_profile(data))


def test_at_scale_the_racks_count_together():
    """32 racks of 32 one-rank hosts (400 Mbit NICs, 100 Mbit uplinks): the racks must send
    2·31·M over 32 uplinks, 2·31/32·M each -- above any single cut's M and the NICs' share."""
    from syncplane.cluster.profile import scaled

    bound = allreduce_network_bound(scaled(load_profile("two_racks"), 32, 32), M)
    assert bound.seconds == pytest.approx(2 * 31 / 32 * M / (100 * MBIT))
    assert bound.binding == "uplinks of all racks, out"
