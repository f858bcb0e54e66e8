"""DS-Sync's group pattern: partitions, rotation, mixing, and adjustment (paper §III-B, §IV-B)."""

from __future__ import annotations

import numpy as np
import pytest

from syncplane.cluster.probe import Topology
from syncplane.algorithms.ds_sync.engine import choose_candidate, flagged_steps
from syncplane.algorithms.ds_sync.pattern import (
    MAX_PERIOD,
    GroupPattern,
    PatternError,
    build_pattern,
    candidate_patterns,
    check_partition,
    ring_time_s,
)

RACKS_2x4 = [[0, 1, 2, 3], [4, 5, 6, 7]]
RACKS_3 = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def assert_invariants(p: GroupPattern) -> None:
    for groups in p.iterations:                              # every rank in exactly one group
        assert sorted(r for g in groups for r in g) == list(range(p.world_size))
    assert p.lambda2 < 1 - 1e-9                              # one period mixes everybody
    product = p.period_product()                             # doubly stochastic
    np.testing.assert_allclose(product.sum(0), 1)
    np.testing.assert_allclose(product.sum(1), 1)


def representatives(p: GroupPattern, racks) -> list[list[int]]:
    """Per iteration: the ranks in a group that spans racks."""
    rack_of = {r: k for k, rack in enumerate(racks) for r in rack}
    return [[r for g in groups if len({rack_of[x] for x in g}) > 1 for r in g] for groups in p.iterations]


@pytest.mark.parametrize("racks", [RACKS_2x4, RACKS_3, [[0, 1], [2, 3]], [[0, 1, 2], [3, 4]], [list(range(6))]])
def test_initial_pattern_invariants_and_rotation(racks):
    p = build_pattern(racks)
    assert_invariants(p)
    if len(racks) > 1:
        reps = representatives(p, racks)
        for groups, rep in zip(p.iterations, reps):
            assert len(rep) == len(racks)                    # one flow per uplink: one rep per rack
        assert {r for it in reps for r in it} == set(range(p.world_size))   # everybody takes a turn


def test_two_racks_pattern_is_the_papers_fig4():
    p = build_pattern(RACKS_2x4)
    assert p.period == 4
    assert p.iterations[0] == ((0, 4), (1, 2, 3), (5, 6, 7))
    assert p.iterations[1] == ((0, 2, 3), (1, 5), (4, 6, 7))


def test_identical_on_every_call():
    assert build_pattern(RACKS_3, [5], [1]) == build_pattern([list(r) for r in RACKS_3], [5], [1])


def synthetic_bandwidth(racks, nic=50e6, uplink=12.5e6, slow_ranks=(), slow_racks=(), factor=0.2) -> Topology:
    n = sum(len(r) for r in racks)
    rack_of = {r: k for k, rack in enumerate(racks) for r in rack}
    bw = np.empty((n, n))
    for i in range(n):
        for j in range(n):
            b = nic if rack_of[i] == rack_of[j] else uplink
            if rack_of[i] != rack_of[j] and (rack_of[i] in slow_racks or rack_of[j] in slow_racks):
                b *= factor
            if i in slow_ranks or j in slow_ranks:
                b = min(b, nic * factor)
            bw[i, j] = b
    np.fill_diagonal(bw, np.inf)
    return Topology(racks=racks, hosts=[[r] for r in range(n)], bandwidth=bw, latency=np.zeros((n, n)),
                    source="synthetic")


def test_slow_nic_from_a_bandwidth_matrix_gets_a_rotating_partner():
    topo = synthetic_bandwidth(RACKS_2x4, slow_ranks=[6])
    slow_ranks, slow_racks = topo.bottlenecks()
    assert (slow_ranks, slow_racks) == ([6], [])
    p = build_pattern(topo.racks, slow_ranks, slow_racks)
    assert_invariants(p)
    partners = set()
    for groups in p.iterations:
        g = next(g for g in groups if 6 in g)
        assert len(g) == 2 and all(r in RACKS_2x4[1] for r in g)     # stays in its rack, in a pair
        partners |= set(g) - {6}
    assert partners == {4, 5, 7}                                     # the partner rotates over the rack
    assert all(6 not in rep for rep in representatives(p, RACKS_2x4))  # never the representative


def test_slow_rack_from_a_bandwidth_matrix_pairs_its_representative():
    topo = synthetic_bandwidth(RACKS_3, slow_racks=[2])
    slow_ranks, slow_racks = topo.bottlenecks()
    assert (slow_ranks, slow_racks) == ([], [2])
    p = build_pattern(topo.racks, slow_ranks, slow_racks)
    assert_invariants(p)
    swapped = set()
    for groups, reps in zip(p.iterations, representatives(p, RACKS_3)):
        g = next(g for g in groups if set(g) & set(reps) & set(RACKS_3[2]))
        assert len(g) == 2                                           # the slow rack's rep is in a group of two
        swapped |= {r // 4 for r in g} - {2}
    assert swapped == {0, 1}                                         # its partner rack rotates


def test_slow_rank_and_slow_rack_together():
    p = build_pattern(RACKS_3, [1], [0])
    assert_invariants(p)


def test_adjustment_candidates_keep_the_invariants_and_are_chosen_from_measurements():
    cands = candidate_patterns(RACKS_3)
    assert cands.keys[0] == "base" and "rank5" in cands.keys and "rack2" in cands.keys
    for p in cands.patterns:
        assert_invariants(p)
    assert set(cands.communicating_groups()) >= set(cands.patterns[0].communicating_groups())
    topo = synthetic_bandwidth(RACKS_3, slow_ranks=[9])
    assert cands.keys[choose_candidate(cands, *topo.bottlenecks())] == "rank9"
    topo = synthetic_bandwidth(RACKS_3, slow_racks=[1])
    assert cands.keys[choose_candidate(cands, *topo.bottlenecks())] == "rack1"
    assert choose_candidate(cands, *synthetic_bandwidth(RACKS_3).bottlenecks()) == 0


def test_a_slow_group_is_flagged_and_a_pair_is_not():
    p = build_pattern([list(range(6))], [5])
    bw = np.full((6, 6), 1e8)
    times = np.full((4, 6), 0.01)
    assert flagged_steps(times, p, 0, bw, 1e6, 1.5, None)[0] == 0
    slow = times.copy()
    slow[:, 5] = 1.0                                       # only the pair with rank 5 is slow: nothing to split
    assert flagged_steps(slow, p, 0, bw, 1e6, 1.5, None)[0] == 0
    single = build_pattern([list(range(6))])               # one group: compare with the earlier window
    _, q_ref = flagged_steps(times, single, 0, bw, 1e6, 1.5, None)
    assert flagged_steps(slow, single, 0, bw, 1e6, 1.5, q_ref)[0] == 4


def test_not_a_partition_names_the_ranks():
    with pytest.raises(PatternError, match=r"missing ranks \[3\]; ranks in more than one group \[1\]"):
        check_partition([[0, 1], [1, 2]], 4)
    with pytest.raises(PatternError, match="missing ranks"):
        GroupPattern(3, (((0, 1),),))


def test_a_pattern_that_never_mixes_fails_loudly():
    p = GroupPattern(4, (((0, 1), (2, 3)), ((0, 1), (2, 3))))
    with pytest.raises(PatternError, match=r"λ₂ .* ≥ 1.*\[\[0, 1\], \[2, 3\]\]"):
        p.check_mixing()


def test_ring_time_is_the_slowest_link():
    bw = np.full((3, 3), 100.0)
    bw[1, 2] = bw[2, 1] = 10.0
    assert ring_time_s((0, 1, 2), 300, bw) == pytest.approx(2 * 2 / 3 * 300 / 10)
    assert ring_time_s((0,), 300, bw) == 0.0


@pytest.mark.parametrize("sizes,slow_ranks,slow_racks", [
    ([4, 1, 2], [0], [0]),            # a rack of two whose representative turn aliases with the pairing
    ([2, 9, 9], [2, 13], [0]),
    ([2, 9, 2, 4], [3], [0, 2]),
    ([9, 13, 5, 9], [31, 32], [1, 3]),   # lcm of the regular rack sizes far beyond MAX_PERIOD
])
def test_uneven_racks_that_used_to_be_refused_now_mix(sizes, slow_ranks, slow_racks):
    starts = np.cumsum([0, *sizes])
    racks = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
    pattern = build_pattern(racks, slow_ranks, slow_racks)
    n = sum(sizes)
    product = np.eye(n)
    for groups in pattern.iterations:     # W_k from the groups, independently of the pattern's own
        assert sorted(r for g in groups for r in g) == list(range(n))
        w = np.zeros((n, n))
        for g in groups:
            w[np.ix_(g, g)] = 1.0 / len(g)
        product = w @ product
    assert np.linalg.norm(product - np.full((n, n), 1.0 / n), 2) < 1 - 1e-9
    assert pattern.period <= MAX_PERIOD


def test_period_product_and_lambda2_match_the_dense_definition():
    """The row-averaging product and the group-reduced norm equal Π W_k and ‖Π W_k − 11ᵀ/n‖₂
    computed densely (seeded random partitions; seed printed on failure)."""
    seed = 1907
    rng = np.random.default_rng(seed)
    for _ in range(20):
        n = int(rng.integers(2, 13))
        iterations = []
        for _ in range(int(rng.integers(1, 4))):
            perm = rng.permutation(n).tolist()
            cuts = sorted(rng.choice(np.arange(1, n), size=int(rng.integers(0, n - 1)), replace=False).tolist())
            iterations.append(tuple(tuple(sorted(perm[a:b])) for a, b in zip([0, *cuts], [*cuts, n])))
        p = GroupPattern(n, tuple(iterations))
        dense = np.eye(n)
        for k in range(p.period):
            dense = p.mixing_matrix(k) @ dense
        np.testing.assert_allclose(p.period_product(), dense, atol=1e-12, err_msg=f"seed {seed}")
        assert p.lambda2 == pytest.approx(np.linalg.norm(dense - 1.0 / n, 2), abs=1e-9), f"seed {seed}"
