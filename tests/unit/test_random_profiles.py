"""Property test: the topology-aware algorithms are valid on every cluster the profile format
can describe, not only the shipped ones.

Hypothesis draws profiles of 1-4 racks, 1-5 hosts per rack, 1-3 ranks per host, with slow
NICs, uneven uplinks and multi-NIC hosts (seeded through hypothesis' own database and
``derandomize``, so CI runs the same ≥ 200 profiles every time). For each it checks:
DS-Sync's period product mixes (λ₂ < 1, computed here from the groups, not taken from the
pattern) and every step partitions the ranks, for the initial pattern and every adjustment
candidate; H-ATC/H-AWC's machines (racks, hosts: any sizes) cover every rank exactly once
and its cost pattern sends one payload per machine per neighbour machine; the probe's rack
clustering recovers the profile's racks from its bandwidth matrix; and the α-β model gives
a finite, positive time for every strategy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncplane.algorithms import strategy_names, strategy_time
from syncplane.algorithms.decentralized.cost import hierarchical_one_peer_steps, rack_machines
from syncplane.algorithms.spec import CostOptions
from syncplane.comm.context import check_machines
from syncplane.cluster.cost import CostModel
from syncplane.cluster.probe import cluster_racks, from_profile
from syncplane.cluster.profile import parse_profile
from syncplane.algorithms.ds_sync.pattern import build_pattern, candidate_patterns

PROFILES = 220


@st.composite
def profiles(draw: st.DrawFn) -> dict:
    racks = []
    n_racks = draw(st.integers(1, 4))
    for r in range(n_racks):
        hosts = []
        for h in range(draw(st.integers(1, 5))):
            slow_nic = draw(st.booleans()) and draw(st.booleans())          # ~1 in 4 hosts
            hosts.append({"name": f"r{r}h{h}", "nic_mbit": draw(st.sampled_from([100, 400] if slow_nic else [400])),
                          "ranks": draw(st.integers(1, 3)), "nics": draw(st.sampled_from([1, 1, 2]))})
        rack = {"name": f"r{r}", "hosts": hosts}
        if n_racks > 1:
            rack["uplink_mbit"] = draw(st.sampled_from([25, 50, 100, 100, 200]))
        racks.append(rack)
    return {"name": "random", "racks": racks}


def _mixing_norm(world: int, iterations) -> float:
    """‖Π W_k − 11ᵀ/n‖₂ from the groups themselves (W_k: 1/|g| inside each group)."""
    product = np.eye(world)
    for groups in iterations:
        w = np.zeros((world, world))
        for g in groups:
            w[np.ix_(g, g)] = 1.0 / len(g)
        product = w @ product
    return float(np.linalg.norm(product - np.full((world, world), 1.0 / world), 2))


def _connected(world: int, groups) -> bool:
    root = list(range(world))

    def find(r: int) -> int:
        while root[r] != r:
            root[r] = root[root[r]]
            r = root[r]
        return r

    for g in groups:
        for r in g[1:]:
            root[find(r)] = find(g[0])
    return len({find(r) for r in range(world)}) == 1


@pytest.mark.slow   # ~1.5 min alone on 2 cores: the α-β model of every strategy on every profile
@settings(max_examples=PROFILES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(profiles())
def test_topology_aware_algorithms_are_valid_on_random_profiles(data):
    profile = parse_profile(data)
    world = profile.world_size
    topo = from_profile(profile)
    # DS-Sync: the initial pattern mixes (λ₂ from the groups), and every candidate an
    # adjustment may switch to partitions every step and connects all ranks over its period
    # (for products of averaging projections, equivalent to λ₂ < 1)
    candidates = candidate_patterns(topo.racks, *topo.bottlenecks())
    assert candidates.patterns[0] == build_pattern(topo.racks, *topo.bottlenecks())
    if world > 1:
        assert _mixing_norm(world, candidates.patterns[0].iterations) < 1 - 1e-9, data
    for key, pattern in zip(candidates.keys, candidates.patterns):
        for groups in pattern.iterations:
            assert sorted(r for g in groups for r in g) == list(range(world)), (key, groups)
        assert _connected(world, {g for groups in pattern.iterations for g in groups}), (data, key)
    # H-ATC/H-AWC: racks and hosts as machines partition the ranks, whatever their sizes; in
    # every step each rack sends exactly one payload to each rack it mixes with
    racks = rack_machines(profile)
    for machines in (racks, [list(h.ranks) for h in profile.hosts]):
        assert check_machines(machines, world) == machines, data
    rack_of = {r: k for k, ranks in enumerate(racks) for r in ranks}
    for step in hierarchical_one_peer_steps(profile, 2**20, CostOptions()):
        crossing: dict[tuple[int, int], float] = {}
        for src, dst, size in (flow for phase in step for flow in phase):
            if rack_of[src] != rack_of[dst]:
                crossing[(rack_of[src], rack_of[dst])] = crossing.get((rack_of[src], rack_of[dst]), 0.0) + size
        assert all(total == pytest.approx(2**20) for total in crossing.values()), (data, crossing)
        assert len(crossing) == (len(racks) if len(racks) > 1 else 0), (data, crossing)
    # the probe's rack clustering finds the declared racks from the pairwise bandwidth, where
    # a measurement can tell them apart: racks of two or more hosts (a lone host behind a
    # slow uplink looks like a host with a slow NIC) joined by equal uplinks slower than every
    # NIC (with two uplink rates, two fast racks look like one rack behind the slower uplink)
    if len(profile.racks) > 1 and len({r.uplink_mbit for r in profile.racks}) == 1 and all(
            len(r.hosts) > 1 and r.uplink_mbit < min(h.nic_mbit for h in r.hosts) for r in profile.racks):
        host_bw = np.array([[topo.bandwidth[a[0], b[0]] if a != b else np.inf for b in topo.hosts]
                            for a in topo.hosts])
        found = cluster_racks(host_bw)
        want = [[i for i, h in enumerate(profile.hosts) if h.rack == k] for k in range(len(profile.racks))]
        assert sorted(map(sorted, found)) == sorted(want), (data, found)
    # the α-β model: a finite, positive time for every strategy
    model = CostModel(profile)
    for name in strategy_names():
        predicted, bound = strategy_time(model, name, 2**20)
        if world > 1:
            assert math.isfinite(predicted) and predicted > 0 and math.isfinite(bound), (name, data)
