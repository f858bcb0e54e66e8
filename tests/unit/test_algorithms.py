"""The algorithm catalogue: one declaration per family, read by every tool."""

from __future__ import annotations

import math

import pytest

from syncplane import algorithms
from syncplane.algorithms import CostOptions, strategy_time
from syncplane.cluster import load_profile
from syncplane.cluster.cost import CostModel
from syncplane.strategies import registry

SHIPPED = ["local", "homogeneous8", "two_racks", "two_racks_contended", "slow_nic", "asymmetric_2_3", "multi_nic",
           "wan_two_sites", "wan_nodes"]


def test_every_strategy_is_declared_once_and_registered():
    names = [n for spec in algorithms.SPECS for n in spec.strategies]
    assert len(names) == len(set(names))                        # no name in two families
    assert sorted(registry.names()) == sorted(algorithms.strategy_names())   # every declared strategy has glue
    for name in registry.names():
        assert registry.describe()[name] == algorithms.description(name)
    assert not set(algorithms.PLANNED) & set(names)


def test_an_unknown_or_planned_name_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(algorithms.PLANNED, "future", "a promised strategy")
    with pytest.raises(KeyError, match="'future' is planned but not implemented yet"):
        algorithms.spec_for("future")
    with pytest.raises(KeyError, match="'nope' is unknown; implemented: ddp, atc"):
        algorithms.spec_for("nope")


@pytest.mark.parametrize("profile_name", SHIPPED)
def test_every_strategy_has_a_finite_cost_on_every_shipped_profile(profile_name):
    model = CostModel(load_profile(profile_name))
    for name in algorithms.strategy_names() + ["torch_periodic"]:
        predicted, bound = strategy_time(model, name, 2**24)
        assert math.isfinite(predicted) and math.isfinite(bound) and 0 <= bound <= predicted, (name, profile_name)


def test_wan_nodes_leaves_ddp_computing_about_a_tenth_of_the_time():
    """The profile's arithmetic (docs/cluster-profiles.md): tiny_lm's fp32 gradients all-reduced
    over the 3 Mbit site link take ~9x the emulated 2.5 s step, as a 1B model's over 1 Gbit/s."""
    profile = load_profile("wan_nodes")
    assert [len(host.ranks) for host in profile.hosts] == [2, 2] and len(profile.racks) == 2
    predicted, _ = strategy_time(CostModel(profile), "ddp", 1_334_016 * 4)
    assert 0.08 < 2.5 / (2.5 + predicted) < 0.12, predicted


def test_periodic_families_are_amortized_over_their_period():
    model = CostModel(load_profile("homogeneous8"))
    for name in ("diloco", "torch_periodic"):
        assert algorithms.spec_for(name).periodic
        one = strategy_time(model, name, 2**24, CostOptions(period=1))
        ten = strategy_time(model, name, 2**24, CostOptions(period=10))
        assert ten == pytest.approx((one[0] / 10, one[1] / 10))


@pytest.mark.parametrize(("largest_host", "expected"), [(4, "host"), (1, "rack")])
def test_hierarchical_machines_auto_means_hosts_when_hosts_run_several_ranks(largest_host, expected):
    from syncplane.algorithms.decentralized.machines import machines_for, resolve_machines
    from syncplane.job import JobContext

    assert resolve_machines("auto", largest_host) == expected
    assert resolve_machines("rack") == "rack" and resolve_machines("host") == "host"
    job = JobContext(world_size=6)
    assert machines_for(job, "auto", ranks_per_machine=3, world_size=6) == ("explicit", [[0, 1, 2], [3, 4, 5]])
    with pytest.raises(ValueError, match="world size 7 is not a multiple of ranks_per_machine 3"):
        machines_for(job, "auto", ranks_per_machine=3, world_size=7)
    with pytest.raises(ValueError, match="unknown machine kind 'node'; allowed values: auto, host, rack"):
        resolve_machines("node")
