"""Mixing schedules: every step is an average, a period reaches consensus, bad ones are refused."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from syncplane.comm import topology
from syncplane.algorithms.decentralized.schedule import OnePeerSchedule, StaticSchedule, build_schedule


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_one_peer_steps_are_doubly_stochastic_with_one_peer_each(size):
    schedule = OnePeerSchedule(size)
    assert schedule.period == int(np.ceil(np.log2(size)))
    for t in range(2 * schedule.period):
        a = schedule.matrix(t)
        np.testing.assert_allclose(a.sum(axis=0), 1.0)
        np.testing.assert_allclose(a.sum(axis=1), 1.0)
        for rank in range(size):
            plan = schedule.plan(t, rank)
            assert len(plan.dst_weights) == 1 and len(plan.src_weights) == 1
            d = 2 ** (t % schedule.period)
            assert plan.dst_weights == {(rank + d) % size: 1.0}
            assert plan.src_weights == {(rank - d) % size: 0.5}


@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_one_peer_period_averages_exactly_for_powers_of_two(size):
    np.testing.assert_allclose(OnePeerSchedule(size).period_product(), np.full((size, size), 1 / size), atol=1e-12)


@pytest.mark.parametrize("size", [3, 5, 6, 7])
def test_one_peer_period_contracts_for_other_sizes(size):
    moduli = np.sort(np.abs(np.linalg.eigvals(OnePeerSchedule(size).period_product())))[::-1]
    assert moduli[0] == pytest.approx(1.0) and moduli[1] < 1.0


def test_static_schedule_matrix_is_the_graph_matrix():
    graph = topology.RingGraph(5)
    schedule = StaticSchedule(graph)
    for t in range(3):
        np.testing.assert_allclose(schedule.matrix(t), topology.mixing_matrix(graph))
    assert schedule.lambda2() == pytest.approx(1 - topology.spectral_gap(graph))


def test_disconnected_schedule_is_refused():
    graph = nx.DiGraph()
    for i in range(4):
        graph.add_edge(i, i, weight=0.5)
    graph.add_edge(0, 1, weight=0.5), graph.add_edge(1, 0, weight=0.5)
    graph.add_edge(2, 3, weight=0.5), graph.add_edge(3, 2, weight=0.5)
    with pytest.raises(ValueError, match="never reaches consensus"):
        build_schedule("static", graph)


def test_weights_that_are_not_an_average_are_refused():
    graph = nx.DiGraph()
    graph.add_edge(0, 0, weight=0.5), graph.add_edge(1, 1, weight=0.5)
    graph.add_edge(1, 0, weight=0.7), graph.add_edge(0, 1, weight=0.5)
    with pytest.raises(ValueError, match="not an average"):
        build_schedule("static", graph)


def test_unknown_schedule_names_the_allowed_ones():
    with pytest.raises(ValueError, match="allowed values: one_peer, static"):
        build_schedule("gossip", topology.RingGraph(3))
