"""DS-Sync in the α-β cost model: concurrent group all-reduces, one period averaged."""

from __future__ import annotations

import pytest

from syncplane.cluster import load_profile
from syncplane.algorithms import CostOptions, strategy_time
from syncplane.cluster.cost import MBIT, CostModel, concurrent_group_allreduces

M = 100 * 2**20


def test_concurrent_rings_add_up_only_where_they_share_links():
    phases = concurrent_group_allreduces([(0, 1, 2), (3,), (4, 5)], M)
    assert len(phases) == 4                                     # the longest ring: 2(3-1) phases
    per_link: dict[tuple[int, int], float] = {}
    for phase in phases:
        for src, dst, nbytes in phase:
            per_link[(src, dst)] = per_link.get((src, dst), 0.0) + nbytes
    assert per_link[(0, 1)] == pytest.approx(2 * 2 / 3 * M)      # ring of 3: 2(n-1)/n of the payload
    assert per_link[(4, 5)] == pytest.approx(M) and per_link[(5, 4)] == pytest.approx(M)
    assert not any(3 in link for link in per_link)               # a group of one sends nothing


def test_two_racks_bound_is_the_uplink_pair_and_beats_the_ring_by_7_over_4():
    model = CostModel(load_profile("two_racks"))
    _, ds_bound = strategy_time(model, "ds_sync", M)
    _, ddp_bound = strategy_time(model, "ddp", M)
    assert ds_bound == pytest.approx(M / (100 * MBIT))             # the representatives' pair on the uplink
    assert ddp_bound / ds_bound == pytest.approx(1.75)


def test_slow_nic_pairs_the_slow_host():
    model = CostModel(load_profile("slow_nic"))
    _, bound = strategy_time(model, "ds_sync", M)
    assert bound == pytest.approx(M / (100 * MBIT))                # the slow NIC carries the payload once


def test_pair_streams_take_their_fair_share_of_a_contended_uplink():
    """k streams next to one greedy foreign flow get k/(k+1) of the uplink (TCP fair share):
    the cross-rack pair's bound shrinks from M/(½·100 Mbit) to M/(k/(k+1)·100 Mbit); an
    uncontended uplink gains nothing."""
    contended = CostModel(load_profile("two_racks_contended"))
    for k in (1, 2, 4):
        _, bound = strategy_time(contended, "ds_sync", M, CostOptions(streams=k))
        assert bound == pytest.approx(M / (k / (k + 1) * 100 * MBIT))
    quiet = CostModel(load_profile("two_racks"))
    assert strategy_time(quiet, "ds_sync", M, CostOptions(streams=4)) == pytest.approx(strategy_time(quiet, "ds_sync", M))
