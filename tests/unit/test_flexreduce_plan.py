"""FlexReduce's planner (paper §III, Fig. 2/3, Eq. 12) on fixed and random trees.

The reference for the properties is the paper's definition, checked directly on the plan:
every level's ranges partition [0, n) inside each branch, each learner owns one contiguous
range made of its calls, every call's holders really held the piece the level before
(one per child of the branch), and the bytes over each root link are equal both ways.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncplane.exchanges.tree import plan as P
from syncplane.exchanges.tree import tree as T
from syncplane.cluster.profile import load_profile
from syncplane.config import ConfigError

# ----------------------------------------------------------------------------- Fig. 2


def test_fig2_example_exact() -> None:
    """Two machines of 2 (D, E = ranks 0, 1) and 3 (F, G, H = ranks 2..4) learners, 12 items."""
    tree = T.from_host_sizes([2, 3])
    levels, _, portions = P.fractional_plan(tree)
    assert [portions[0][r] for r in range(5)] == [Fraction(1, 2)] * 2 + [Fraction(1, 3)] * 3
    assert [portions[1][r] for r in range(5)] == [Fraction(1, 4)] * 2 + [Fraction(1, 6)] * 3
    plan = P.make_plan(tree, 12)
    # Fig. 2 (a)-(c): D [0,6), E [6,12); F [0,4), G [4,8), H [8,12)
    assert plan.ranges[0] == ((0, 6), (6, 12), (0, 4), (4, 8), (8, 12))
    # Fig. 2 (d): sorted F, D, G, E, H -> F [0,2), D [2,5), G [5,7), E [7,10), H [10,12)
    assert plan.ranges[1] == ((2, 5), (7, 10), (0, 2), (5, 7), (10, 12))
    # Fig. 2 (e): the reduce calls of the root level, with their data holders
    root = [((c.lo, c.hi), c.holders, c.owner) for c in plan.levels[1]]
    assert root == [((0, 2), (0, 2), 2), ((2, 4), (0, 2), 0), ((4, 5), (0, 3), 0), ((5, 6), (0, 3), 3),
                    ((6, 7), (1, 3), 3), ((7, 8), (1, 3), 1), ((8, 10), (1, 4), 1), ((10, 12), (1, 4), 4)]
    assert [plan.reduce_calls(r) for r in range(5)] == [[1, 2], [1, 2], [1, 1], [1, 2], [1, 1]]
    # rank 0's view: per level, (range, participants, owner)
    assert plan.rank_view(0) == [[((0, 6), (0, 1), 0), ((6, 12), (0, 1), 1)],
                                 [((0, 2), (0, 2), 2), ((2, 4), (0, 2), 0), ((4, 5), (0, 3), 0),
                                  ((5, 6), (0, 3), 3)]]


def test_fig2_calls_within_eq12_bound() -> None:
    tree = T.from_host_sizes([2, 3])
    plan = P.make_plan(tree, 12)
    for rank in range(5):
        for level in range(2):
            assert plan.reduce_calls(rank)[level] <= P.calls_bound(tree, rank, level)
    # level 1 for D: portion 1/4 over F's, G's, H's 1/3 -> ceil(3/4) + E's side ceil(1/2) + 1 = 3
    assert P.calls_bound(tree, 0, 1) == 3


def test_describe_names_calls_and_links() -> None:
    tree = T.from_host_sizes([2, 3])
    text = P.describe(tree, P.plan_for(tree, 12), element_size=4)
    assert "per learner [2, 2, 1, 2, 1]" in text
    assert "0:[2,5)" in text and "4:[10,12)" in text


# ----------------------------------------------------------------------------- shapes and errors


def test_profile_trees_collapse_single_children() -> None:
    two_racks = T.from_profile(load_profile("two_racks"))
    assert two_racks.describe() == "core[r0[0, 1, 2, 3], r1[4, 5, 6, 7]]"   # one-rank hosts collapse
    assert two_racks.num_levels == 2
    asym = T.from_profile(load_profile("asymmetric_2_3"))
    assert asym.describe() == "r0[m0[0, 1], m1[2, 3, 4]]"                   # a single rack collapses
    assert T.from_nested([[0]], 1).num_levels == 0                            # one rank: no levels
    assert P.make_plan(T.from_nested([[0]], 1), 5).levels == ()


def test_tree_must_cover_world() -> None:
    with pytest.raises(ConfigError, match=r"5 leaves do not cover the world of 6 ranks; missing ranks \[5\]"):
        T.from_host_sizes([2, 3], world_size=6)
    with pytest.raises(ConfigError, match="profile 'asymmetric_2_3' has 5 ranks, but the job has 4"):
        T.from_profile(load_profile("asymmetric_2_3"), world_size=4)
    with pytest.raises(ConfigError, match="listed twice"):
        T.from_nested([[0, 1], [1, 2]], 3)


def test_empty_host_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no ranks below it"):
        T.from_nested([[0, 1], []])
    with pytest.raises(ConfigError, match="host 1 has 0 ranks"):
        T.from_host_sizes([2, 0])
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=3 does not divide the world size 4"):
        T.from_local_world_size(4, 3)


def test_plan_for_another_numel_is_an_error() -> None:
    plan = P.plan_for(T.from_host_sizes([2, 3]), 12)
    plan.check(12)
    with pytest.raises(ValueError, match="made for 12 elements, the tensor has 13"):
        plan.check(13)
    assert P.plan_for(T.from_host_sizes([2, 3]), 12) is plan     # cached


# ----------------------------------------------------------------------------- properties


def _nested(depth: int) -> st.SearchStrategy:
    """Children lists of 1..5, each a leaf (None) or a subtree, at most ``depth`` branch levels."""
    if depth == 1:
        return st.lists(st.none(), min_size=1, max_size=5)
    return st.lists(st.one_of(st.none(), _nested(depth - 1)), min_size=1, max_size=5)


def _number(shape: object, counter: list[int]) -> object:
    if shape is None:
        counter[0] += 1
        return counter[0] - 1
    return [_number(s, counter) for s in shape]  # type: ignore[union-attr]


def check_plan_properties(tree: T.FlexTree, numel: int) -> None:
    plan = P.make_plan(tree, numel)
    n, world = numel, tree.world_size
    previous = tuple((0, n) for _ in range(world))
    for level, nodes in enumerate(tree.levels()):
        calls, ranges = plan.levels[level], plan.ranges[level]
        for node in nodes:
            # the leaves' new ranges partition [0, n) inside every branch of the level
            spans = sorted(ranges[v] for v in node.leaves if ranges[v][1] > ranges[v][0])
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            # its calls cover [0, n) once
            mine = sorted((c.lo, c.hi) for c in calls if c.owner in node.leaves)
            assert sum(hi - lo for lo, hi in mine) == n
            for c in (c for c in calls if c.owner in node.leaves):
                # one holder per child, each really holding the piece before this level
                assert sorted(sum(h in ch.leaves for h in c.holders) for ch in node.children) == [1] * node.degree
                assert all(previous[h][0] <= c.lo and c.hi <= previous[h][1] for h in c.holders)
        for v in range(world):
            # each learner's calls tile exactly its one contiguous range
            owned = sorted((c.lo, c.hi) for c in calls if c.owner == v)
            if owned:
                assert owned[0][0] == ranges[v][0] and owned[-1][1] == ranges[v][1]
                assert all(a[1] == b[0] for a, b in zip(owned, owned[1:]))
            # reduce calls within the paper's bound (Eq. 12)
            assert len(owned) <= max(1, P.calls_bound(tree, v, level))
        previous = ranges
    if world > 1:
        # the root level balances every root link: as many bytes up as down. Exactly in
        # fractions; in elements up to the rounding of the child's owned share (one element
        # per leaf boundary, times the root's degree: down - up = degree·owned - n)
        links = P.link_bytes(tree, plan, tree.num_levels - 1)
        for child in tree.root.children:
            up, down = links.get(child.name, (0, 0))
            assert abs(up - down) <= tree.root.degree * len(child.leaves), (child.name, up, down)
            if numel % (tree.root.degree * _lcm_portions(tree)) == 0:
                assert up == down
        # after the whole reduce-scatter every item has exactly one owner
        final = sorted(plan.final_range(v) for v in range(world) if plan.final_range(v)[1] > plan.final_range(v)[0])
        assert final[0][0] == 0 and final[-1][1] == n and all(a[1] == b[0] for a, b in zip(final, final[1:]))


def _lcm_portions(tree: T.FlexTree) -> int:
    """The least n for which every portion of the plan is a whole number of elements."""
    _, _, portions = P.fractional_plan(tree)
    return math.lcm(*(p.denominator for p in portions[-1].values())) if portions else 1


@settings(max_examples=150, deadline=None)
@given(shape=st.integers(1, 3).flatmap(_nested), numel=st.one_of(st.integers(1, 50), st.integers(1000, 10**7)))
def test_random_trees(shape: list, numel: int) -> None:
    nested = _number(shape, [0])
    count = [0]
    _number(shape, count)
    if count[0] < 2:
        return
    tree = T.from_nested(nested, count[0])   # type: ignore[arg-type]
    check_plan_properties(tree, numel)
    exact = tree.root.degree * _lcm_portions(tree)   # an element count with no rounding at all
    if exact <= 10**7:
        check_plan_properties(tree, exact)


@pytest.mark.parametrize("shape", [[[0, 1], [2, 3]], [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], [[0, 1], [2, 3, 4]],
                                   [[0, 1, 2], [3, 4], [5, 6, 7, 8]], [[0], [1, 2, 3, 4]], [[0], [1], [2]]])
@pytest.mark.parametrize("numel", [1, 2, 7, 12, 1001])
def test_named_shapes(shape: list, numel: int) -> None:
    check_plan_properties(T.from_nested(shape), numel)


def test_symmetric_tree_is_blueconnect_like() -> None:
    """2×2×2: every learner owns n/8 and makes one reduce call per level (Eq. 7 conditions)."""
    tree = T.from_nested([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    plan = P.make_plan(tree, 800)
    assert all(plan.reduce_calls(r) == [1, 1, 1] for r in range(8))
    assert all(hi - lo == 100 for lo, hi in plan.ranges[-1])
