"""Graph builders, weights, validators and dynamic schedules."""

from __future__ import annotations

import itertools
import math

import networkx as nx
import numpy as np
import pytest

from syncplane.comm import topology as T

BUILDERS = {
    "ExponentialTwoGraph": T.ExponentialTwoGraph,
    "ExponentialGraph3": lambda n: T.ExponentialGraph(n, base=3),
    "SymmetricExponentialGraph": T.SymmetricExponentialGraph,
    "SymmetricExponentialGraph2": lambda n: T.SymmetricExponentialGraph(n, base=2),
    "PlusMinusExponentialGraph": T.PlusMinusExponentialGraph,
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
    # BlueFog's style 1 ("left") makes rank i send to i - 1, so rank 2 averages with rank 3
    assert sorted(T.RingGraph(5, 1).predecessors(2)) == [2, 3]
    assert sorted(T.RingGraph(5, 2).predecessors(2)) == [1, 2]
    with pytest.raises(ValueError, match="connect_style"):
        T.RingGraph(5, 3)


def test_ring_left_on_four_ranks_averages_with_the_next_rank():
    """The issue's example: with x = rank, RingGraph(4, 1) gives rank 0 the mean of 0 and 1."""
    x = np.arange(4.0)
    y = T.mixing_matrix(T.RingGraph(4, 1)).T @ x          # y_i = sum_j A[j, i] x_j
    assert y.tolist() == [0.5, 1.5, 2.5, 1.5]


# BlueFog's builders are circulant: rank i sends to i + d (mod n) for every offset d of
# the set below, weight 1 / (|offsets| + 1) on every edge and on the self-loop. The sets
# are written out by hand from BlueFog's definitions (topology_util: ExponentialGraph
# keeps offsets that are powers of base; SymmetricExponentialGraph keeps the offsets
# whose ring distance min(d, n - d) is a power of base; RingGraph style 1 = offset n-1).
BLUEFOG_OFFSETS = {
    ("ExponentialTwoGraph", ()): {1: set(), 2: {1}, 3: {1, 2}, 5: {1, 2, 4}, 8: {1, 2, 4}, 9: {1, 2, 4, 8}},
    ("ExponentialGraph", (3,)): {4: {1, 3}, 10: {1, 3, 9}, 12: {1, 3, 9}},
    ("SymmetricExponentialGraph", (4,)): {2: {1}, 5: {1, 4}, 6: {1, 5}, 7: {1, 6}, 9: {1, 4, 5, 8},
                                          12: {1, 4, 8, 11}},
    ("SymmetricExponentialGraph", (2,)): {4: {1, 2, 3}, 7: {1, 2, 5, 6}, 11: {1, 2, 4, 7, 9, 10},
                                          13: {1, 2, 4, 9, 11, 12}, 15: {1, 2, 4, 11, 13, 14}},
    ("RingGraph", (0,)): {1: set(), 2: {1}, 3: {1, 2}, 6: {1, 5}},
    ("RingGraph", (1,)): {2: {1}, 3: {2}, 4: {3}, 7: {6}},
    ("RingGraph", (2,)): {2: {1}, 3: {1}, 4: {1}, 7: {1}},
    ("FullyConnectedGraph", ()): {1: set(), 4: {1, 2, 3}},
}


def _assert_circulant(graph: nx.DiGraph, n: int, offsets: set[int]) -> None:
    expected = {(i, i) for i in range(n)} | {(i, (i + d) % n) for i in range(n) for d in offsets}
    assert set(graph.edges) == expected
    for j, i, weight in graph.edges(data="weight"):
        assert weight == pytest.approx(1 / (len(offsets) + 1), abs=1e-15)


@pytest.mark.parametrize("builder,args", list(BLUEFOG_OFFSETS))
def test_builders_match_bluefog_edge_for_edge_on_small_sizes(builder, args):
    for n, offsets in BLUEFOG_OFFSETS[(builder, args)].items():
        _assert_circulant(getattr(T, builder)(n, *args), n, offsets)


def _powers_below(n: int, base: int) -> set[int]:
    out, d = set(), 1
    while d < n:
        out.add(d)
        d *= base
    return out


@pytest.mark.parametrize("n", range(1, 33))
def test_builders_structure_up_to_32_ranks(n):
    """Properties that pin BlueFog's definitions for every n up to 32."""
    for base in (2, 3, 4):
        exp = T.ExponentialGraph(n, base)
        _assert_circulant(exp, n, _powers_below(n, base))      # i -> i + base^k, base^k < n
        sym = T.SymmetricExponentialGraph(n, base)
        matrix = T.mixing_matrix(sym)
        assert np.array_equal(matrix, matrix.T)                # undirected
        reached = {d for d in range(1, n) if sym.has_edge(0, d)}
        # offsets up to n // 2 are exactly the powers of base there; the rest mirror them
        assert {d for d in reached if d <= n // 2} == {d for d in _powers_below(n // 2 + 1, base)}
        assert reached == {d for d in range(1, n) if min(d, n - d) in _powers_below(n // 2 + 1, base)}
        plus_minus = T.PlusMinusExponentialGraph(n, base)
        assert set(sym.edges) <= set(plus_minus.edges)
    assert len(list(T.ExponentialTwoGraph(n).successors(0))) - 1 == (math.ceil(math.log2(n)) if n > 1 else 0)
    for style, step in ((1, -1), (2, 1)):
        ring = T.RingGraph(n, style)
        if n > 2:
            assert {k for k in ring.successors(0) if k != 0} == {step % n}
            assert ring[0][0]["weight"] == 0.5
    full = T.FullyConnectedGraph(n)
    assert full.number_of_edges() == n * n and np.allclose(T.mixing_matrix(full), 1 / n)
    for center in {0, n - 1}:
        star = T.mixing_matrix(T.StarGraph(n, center))
        expected = np.diag(np.full(n, 1 - 1 / n))
        expected[center, :] = expected[:, center] = 1 / n
        assert np.allclose(star, expected)
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    mesh = T.MeshGrid2DGraph(n)
    cols = n // rows
    for i in range(n):
        neighbours = {k for k in mesh.successors(i) if k != i}
        grid = {i + 1} if (i + 1) % cols else set()
        grid |= {i - 1} if i % cols else set()
        grid |= {k for k in (i - cols, i + cols) if 0 <= k < n}
        assert neighbours == grid
        for k in neighbours:
            degree_i, degree_k = len(neighbours), len({m for m in mesh.successors(k) if m != k})
            assert mesh[i][k]["weight"] == pytest.approx(1 / (1 + max(degree_i, degree_k)))


def test_plus_minus_variant_keeps_our_old_edges():
    """syncplane's former SymmetricExponentialGraph (i ± base^k for all base^k < n) lives on
    as PlusMinusExponentialGraph: n = 6, base 4 also links i to i ± 4."""
    _assert_circulant(T.PlusMinusExponentialGraph(6, 4), 6, {1, 2, 4, 5})
    _assert_circulant(T.SymmetricExponentialGraph(6, 4), 6, {1, 5})


def test_mesh_and_star_use_metropolis_hastings():
    mesh = T.MeshGrid2DGraph(6)                 # 2 x 3
    assert T.mixing_matrix(mesh)[0, 1] == pytest.approx(1 / 4)   # degrees 2 and 3
    star = T.StarGraph(5)
    assert T.mixing_matrix(star)[0, 1] == pytest.approx(1 / 5)   # hub degree 4
    assert T.mixing_matrix(star)[1, 1] == pytest.approx(4 / 5)
    with pytest.raises(ValueError, match=r"shape \(2, 3\) does not hold exactly 8 ranks"):
        T.MeshGrid2DGraph(8, shape=(2, 3))


def test_bluefog_graph_utilities():
    g = T.StarGraph(4)
    assert T.send_weights(g, 0) == (pytest.approx(0.25), {1: 0.25, 2: 0.25, 3: 0.25})
    assert T.send_weights(g, 2) == (pytest.approx(0.75), {0: 0.25})
    assert T.is_topology_equivalent(T.RingGraph(5), T.RingGraph(5))
    assert not T.is_topology_equivalent(T.RingGraph(5, 1), T.RingGraph(5, 2))
    assert not T.is_topology_equivalent(None, T.RingGraph(5))
    assert T.is_regular_graph(T.ExponentialTwoGraph(6)) and not T.is_regular_graph(T.StarGraph(4))


def _consistent(plans: list[tuple[list[int], list[int]]]) -> None:
    for rank, (send, recv) in enumerate(plans):
        for k in send:
            assert rank in plans[k][1]
        for j in recv:
            assert rank in plans[j][0]


def test_dynamic_one_peer_walks_out_neighbours_clockwise():
    """BlueFog's GetDynamicOnePeerSendRecvRanks: rank r's t-th send goes to its out-neighbours
    sorted by clockwise distance, cycling; receivers are whoever picked r."""
    n = 5
    schedules = [T.dynamic_one_peer(T.ExponentialTwoGraph(n), r) for r in range(n)]
    expected_offsets = [1, 2, 4]
    for t in range(7):
        plans = [next(s) for s in schedules]
        _consistent(plans)
        for r, (send, recv) in enumerate(plans):
            d = expected_offsets[t % 3]
            assert send == [(r + d) % n] and recv == [(r - d) % n]
    # star: the centre cycles over its spokes; each spoke always sends to the centre
    star = [T.dynamic_one_peer(T.StarGraph(4), r) for r in range(4)]
    first = [next(s) for s in star]
    _consistent(first)
    assert first[0] == ([1], [1, 2, 3]) and first[2] == ([0], [])


@pytest.mark.parametrize("world,local", [(6, 3), (8, 4), (12, 3), (16, 4)])
def test_bluefog_inner_outer_and_machine_schedules_are_consistent(world, local):
    for build in (T.inner_outer_ring, T.inner_outer_expo2):
        schedules = [build(world, local, r) for r in range(world)]
        for t in range(12):
            plans = [next(s) for s in schedules]
            _consistent(plans)
            for r, (send, _) in enumerate(plans):
                crosses = send[0] // local != r // local
                assert crosses == (r % local == t % local)       # one local rank per step goes out
    machines = world // local
    machine_plans = [list(itertools.islice(T.exp2_machine_ranks(world, local, r, r % local), 4))
                     for r in range(world)]
    for r, plans in enumerate(machine_plans):
        m = r // local
        period = int(math.log2(machines - 1)) + 1
        assert plans == [([(m + 2 ** (t % period)) % machines], [(m - 2 ** (t % period)) % machines])
                         for t in range(4)]
    with pytest.raises(ValueError, match="more than 2 processes per machine"):
        next(T.inner_outer_ring(8, 2, 0))


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
