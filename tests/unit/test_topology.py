"""Graph builders, weights, validators and dynamic schedules."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest

from syncplane.comm import topology as T

BUILDERS = {
    "ExponentialTwoGraph": T.ExponentialTwoGraph,
    "ExponentialGraph3": lambda n: T.ExponentialGraph(n, base=3),
    "SymmetricExponentialGraph": T.SymmetricExponentialGraph,
    "Ring0": lambda n: T.RingGraph(n, 0),
    "Ring1": lambda n: T.RingGraph(n, 1),
    "Ring2": lambda n: T.RingGraph(n, 2),
    "MeshGrid2DGraph": T.MeshGrid2DGraph,
    "StarGraph": T.StarGraph,
    "FullyConnectedGraph": T.FullyConnectedGraph,
}


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12])
def test_builders_are_doubly_stochastic_and_connected(name, n):
    graph = BUILDERS[name](n)
    assert sorted(graph.nodes) == list(range(n))
    assert T.is_doubly_stochastic(graph)
    assert T.is_strongly_connected(graph)
    if n > 1:
        assert 0.0 < T.spectral_gap(graph) <= 1.0


def test_exponential_two_graph_shape():
    graph = T.ExponentialTwoGraph(8)
    assert sorted(graph.successors(0)) == [0, 1, 2, 4]      # self + 2^k
    assert sorted(graph.predecessors(0)) == [0, 4, 6, 7]    # receives from i − 2^k
    assert np.allclose(T.mixing_matrix(graph)[graph.number_of_nodes() - 1, 0], 0.25)


def test_ring_styles():
    assert sorted(T.RingGraph(5, 0).predecessors(2)) == [1, 2, 3]
    assert sorted(T.RingGraph(5, 1).predecessors(2)) == [1, 2]   # from the left
    assert sorted(T.RingGraph(5, 2).predecessors(2)) == [2, 3]   # from the right
    with pytest.raises(ValueError, match="connect_style"):
        T.RingGraph(5, 3)


def test_mesh_and_star_use_metropolis_hastings():
    mesh = T.MeshGrid2DGraph(6)                 # 2 x 3
    assert T.mixing_matrix(mesh)[0, 1] == pytest.approx(1 / 4)   # degrees 2 and 3
    star = T.StarGraph(5)
    assert T.mixing_matrix(star)[0, 1] == pytest.approx(1 / 5)   # hub degree 4
    assert T.mixing_matrix(star)[1, 1] == pytest.approx(4 / 5)
    with pytest.raises(ValueError, match="holds 6 ranks, not 8"):
        T.MeshGrid2DGraph(8, shape=(2, 3))


def test_fully_connected_mixes_in_one_step():
    assert T.spectral_gap(T.FullyConnectedGraph(6)) == pytest.approx(1.0)


def test_validators_detect_bad_weights():
    graph = nx.DiGraph()
    graph.add_weighted_edges_from([(0, 0, 0.5), (1, 0, 0.5), (1, 1, 1.0)])   # 0 only receives
    assert T.is_column_stochastic(graph)
    assert not T.is_row_stochastic(graph)
    assert not T.is_strongly_connected(graph)
    uniform = T.uniform_weights(nx.DiGraph([(0, 1), (1, 2), (2, 0)]))
    assert T.is_doubly_stochastic(uniform)


@pytest.mark.parametrize("n", [2, 5, 8])
def test_one_peer_schedule_is_consistent_across_ranks(n):
    schedules = [T.one_peer_exponential(n, r) for r in range(n)]
    for _ in range(10):
        plans = [next(s) for s in schedules]
        for rank, (send, recv) in enumerate(plans):
            assert len(send) == len(recv) == 1
            for dst in send:
                assert rank in plans[dst][1]
        # a fresh iterator on any rank reproduces the same plan (deterministic)
    again = list(itertools.islice(T.one_peer_exponential(n, 1), 10))
    first = list(itertools.islice(T.one_peer_exponential(n, 1), 10))
    assert again == first


def test_one_peer_schedule_mixes_over_a_period():
    n = 8
    weights = np.eye(n)
    schedules = [T.one_peer_exponential(n, r) for r in range(n)]
    for _ in range(3):                           # log2(8) steps reach the exact mean
        step = np.zeros((n, n))
        for rank, s in enumerate(schedules):
            send, recv = next(s)
            step[rank, rank] = 0.5
            step[recv[0], rank] = 0.5
        weights = weights @ step
    assert np.allclose(weights, 1.0 / n)


@pytest.mark.parametrize("size,local", [(8, 2), (8, 4), (6, 3), (4, 1)])
def test_inner_outer_schedule_is_consistent(size, local):
    schedules = [T.inner_outer_exponential(size, local, r) for r in range(size)]
    for step in range(8):
        plans = [next(s) for s in schedules]
        for rank, (send, recv) in enumerate(plans):
            for dst in send:
                assert rank in plans[dst][1]
                same_machine = dst // local == rank // local
                if local > 1 and size // local > 1:
                    assert same_machine == (step % 2 == 0)
    with pytest.raises(ValueError, match="not a multiple"):
        next(T.inner_outer_exponential(6, 4, 0))
