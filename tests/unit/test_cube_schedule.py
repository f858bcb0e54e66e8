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
from syncplane.cluster.cost import CostModel, bcube_cube_allreduce, ring_allreduce
from syncplane.comm.cube import cube_schedule


def _digits(alpha: int, beta: int, x: int) -> list[int]:
    return [(x // alpha ** lv) % alpha for lv in range(beta)]


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
