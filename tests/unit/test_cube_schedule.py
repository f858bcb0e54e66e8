"""The cube all-reduce's schedule (paper 004 §4.4, Table 2), checked by playing it out on
sets of piece indices for every rank of several BCube shapes: what a rank sends a peer in
a step is what that peer expects from it, peers are one address digit apart (one hop on
the step's level), the β streams use β different levels in every step, and the rounds
end with every rank owning its piece after the reduce-scatter and every piece after the
all-gather. The cost model's pattern for it is checked against the network bound."""

from __future__ import annotations

import pytest

from syncplane.cluster import load_profile
from syncplane.cluster.bound import allreduce_network_bound
from syncplane.cluster.cost import CostModel, ring_allreduce
from syncplane.exchanges.digit import cube_cost as bcube_cube_allreduce, nested_cost as nested_allreduce
from syncplane.exchanges.digit import cube_schedule, digit_schedule, nested_schedule


def _digits(alpha: int, beta: int, x: int) -> list[int]:
    return [(x // alpha ** lv) % alpha for lv in range(beta)]


def _mixed_digits(radices: list[int], x: int) -> list[int]:
    out = []
    for a in radices:
        out.append(x % a)
        x //= a
    return out


@pytest.mark.parametrize("alpha,beta", [(2, 2), (3, 2), (2, 3), (4, 1), (3, 3)])
def test_schedule_is_consistent_one_hop_and_complete(alpha, beta):
    n = alpha ** beta
    plans = [cube_schedule(alpha, beta, me) for me in range(n)]
    steps = len(plans[0])
    assert steps == 2 * beta
    # contributions: contrib[me][stream][piece] = set of ranks whose values it holds summed
    contrib = [[{p: {me} for p in range(n)} for _ in range(beta)] for me in range(n)]
    final = [[set() for _ in range(beta)] for _ in range(n)]
    for k in range(steps):
        levels = [step.level for step in plans[0][k]]
        assert sorted(levels) == list(range(beta))          # every NIC busy, one stream each
        new = [[dict(c) for c in contrib[me]] for me in range(n)]
        for me in range(n):
            for step in plans[me][k]:
                for peer, pieces in step.sends.items():
                    diff = [a != b for a, b in zip(_digits(alpha, beta, me), _digits(alpha, beta, peer))]
                    assert diff.count(True) == 1 and diff.index(True) == step.level   # one hop, this level
                    theirs = next(s for s in plans[peer][k] if s.stream == step.stream)
                    assert theirs.recvs[me] == pieces and theirs.level == step.level
                    if not step.gather:
                        for p in pieces:
                            new[peer][step.stream][p] = new[peer][step.stream][p] | contrib[me][step.stream][p]
                            new[me][step.stream].pop(p, None)
                    else:
                        final[peer][step.stream] |= set(pieces)
        contrib = new
        if k == beta - 1:                      # after the reduce-scatter: each rank owns its piece, fully summed
            for me in range(n):
                for t in range(beta):
                    assert contrib[me][t] == {me: set(range(n))}
                    final[me][t] = {me}
    for me in range(n):
        for t in range(beta):
            assert final[me][t] == set(range(n))


def test_cube_pattern_on_bcube_3_2_reaches_the_network_bound_and_beats_the_ring():
    profile = load_profile("bcube_3_2")
    model, payload = CostModel(profile), 100e6
    bound = allreduce_network_bound(profile, payload)
    cube = model.bound(bcube_cube_allreduce(profile, payload))
    assert cube == pytest.approx(bound.seconds, rel=1e-9)        # 2·8/9·M/2 per NIC: the bound itself
    assert cube == pytest.approx(2 * 8 / 9 * payload / 2 / (100e6 / 8))
    ring = model.bound(ring_allreduce(profile.world_size, payload))
    assert ring > 1.5 * cube                                     # the ring pays relays and one NIC at a time


def test_canary_is_priced_as_the_cube_pattern_of_its_sketched_bytes_on_bcube():
    from syncplane.algorithms import strategy_times
    from syncplane.algorithms.canary import sketch_ratio

    profile = load_profile("bcube_3_2")
    model, payload = CostModel(profile), 97.5 * 2**20
    canary = strategy_times(model, "canary", payload)
    ratio = sketch_ratio(int(payload // 4), 9 * 2)
    assert canary.bound_s == pytest.approx(model.bound(bcube_cube_allreduce(profile, payload * ratio)))
    assert strategy_times(model, "ddp", payload).bound_s > 5 * canary.bound_s


def _play(radices: list[int], plans: list, streams: int) -> None:
    """Play a digit schedule out on sets of contributions: peers differ in the step's digit
    only, sends match receives, each rank owns its piece fully summed after the
    reduce-scatter and holds every piece after the all-gather."""
    n = len(plans)
    levels = len(radices)
    contrib = [[{p: {me} for p in range(n)} for _ in range(streams)] for me in range(n)]
    final = [[set() for _ in range(streams)] for _ in range(n)]
    for k in range(2 * levels):
        new = [[dict(c) for c in contrib[me]] for me in range(n)]
        for me in range(n):
            for step in plans[me][k]:
                for peer, pieces in step.sends.items():
                    diff = [a != b for a, b in zip(_mixed_digits(radices, me), _mixed_digits(radices, peer))]
                    assert diff.count(True) == 1 and diff.index(True) == step.level
                    theirs = next(s for s in plans[peer][k] if s.stream == step.stream)
                    assert theirs.recvs[me] == pieces and theirs.level == step.level
                    for p in pieces:
                        if step.gather:
                            final[peer][step.stream].add(p)
                        else:
                            new[peer][step.stream][p] = new[peer][step.stream][p] | contrib[me][step.stream][p]
                            new[me][step.stream].pop(p, None)
        contrib = new
        if k == levels - 1:
            for me in range(n):
                for t in range(streams):
                    assert contrib[me][t] == {me: set(range(n))}
                    final[me][t] = {me}
    assert all(final[me][t] == set(range(n)) for me in range(n) for t in range(streams))


@pytest.mark.parametrize("radices", [[2, 2], [4, 2], [2, 3], [3, 2, 2], [2, 2, 2, 2], [5]])
@pytest.mark.parametrize("streams", [1, 2])
def test_nested_schedule_goes_innermost_first_and_is_complete(radices, streams):
    n = 1
    for a in radices:
        n *= a
    plans = [nested_schedule(radices, me, streams) for me in range(n)]
    for row in plans[0]:
        assert len({step.level for step in row}) == 1          # every stream on the same level
    assert [row[0].level for row in plans[0]] == list(range(len(radices))) + list(reversed(range(len(radices))))
    _play(radices, plans, streams)


def test_the_cube_is_the_digit_schedule_with_rotated_orders():
    assert cube_schedule(3, 2, 4) == digit_schedule([3, 3], [[0, 1], [1, 0]], 4)


@pytest.mark.parametrize("profile_name, radices", [("two_racks", [4, 2]), ("multi_nic", [2, 2]),
                                                   ("wan_two_sites", [2, 2]), ("homogeneous8", [8]),
                                                   ("asymmetric_2_3", None), ("uneven_three_racks", None)])
def test_regular_trees_give_the_radices_of_their_ranks(profile_name, radices):
    from syncplane.exchanges.tree.tree import from_profile

    assert from_profile(load_profile(profile_name)).radices() == radices


def test_radices_need_leaves_in_rank_order_and_levels_of_one_degree():
    from syncplane.exchanges.tree.tree import from_host_sizes, from_nested

    assert from_host_sizes([3, 3, 3]).radices() == [3, 3]
    assert from_nested([[[0, 1], [2, 3]], [[4, 5], [6, 7]]]).radices() == [2, 2, 2]
    assert from_nested([[0, 2], [1, 3]]).radices() is None            # ranks not numbered host by host
    assert from_nested([[[0, 1], [2, 3]], [4, 5]]).radices() is None    # a rack of ranks beside racks of hosts


def test_nested_pattern_puts_only_the_last_level_on_the_uplink():
    """On two racks of four, across the uplink each rank sends M/8 each way (M per uplink
    and direction in all: the network's bound); the flat mesh sends 4x that."""
    profile = load_profile("two_racks")
    model, payload = CostModel(profile), 100e6
    nested = nested_allreduce([4, 2], payload)
    cross = [(s, d, b) for phase in nested for s, d, b in phase if (s < 4) != (d < 4)]
    assert sum(b for s, _, b in cross if s < 4) == pytest.approx(payload)
    assert all(b == pytest.approx(payload / 8) for _, _, b in cross)
    bound = allreduce_network_bound(profile, payload)
    across = nested[1:3]                          # the cross-rack reduce-scatter and all-gather
    assert model.bound(across) == pytest.approx(bound.seconds, rel=1e-9)
    # the intra-rack phases (3/4·M on each 400 Mbit NIC, twice) come on top, not overlapped
    assert model.bound(nested) == pytest.approx(bound.seconds + 2 * 0.75 * payload / (400e6 / 8))
    assert model.bound(ring_allreduce(8, payload)) > 1.25 * model.bound(nested)


def test_canary_is_priced_nested_where_ranks_are_grouped_and_as_a_mesh_on_request():
    from syncplane.algorithms import strategy_times
    from syncplane.algorithms.spec import CostOptions

    model, payload = CostModel(load_profile("two_racks")), 97.5 * 2**20
    nested = strategy_times(model, "canary", payload)
    mesh = strategy_times(model, "canary", payload, CostOptions(pattern="mesh"))
    assert mesh.bound_s > 2.5 * nested.bound_s
