"""The α-β pattern of DiLoCo's exchange: a ring's bytes per rank, once per H steps."""

from __future__ import annotations

import pytest

from syncplane.cluster import load_profile
from syncplane.algorithms import CostOptions, strategy_time
from syncplane.cluster.cost import CostModel
from syncplane.exchanges.mesh import cost as owner_exchange

MB = 2**20


def test_owner_exchange_sends_a_rings_bytes_per_rank():
    phases = owner_exchange(4, 8 * MB)
    assert len(phases) == 2
    for rank in range(4):
        sent = sum(b for phase in phases for src, _, b in phase if src == rank)
        assert sent == pytest.approx(2 * 3 / 4 * 8 * MB)
    assert owner_exchange(1, MB) == []


@pytest.mark.parametrize("period", [1, 4, 10])
def test_diloco_bound_is_the_ring_bound_divided_by_h_on_single_rank_hosts(period):
    model = CostModel(load_profile("homogeneous8"))
    _, ring_bound = strategy_time(model, "ddp", 16 * MB)
    _, bound = strategy_time(model, "diloco", 16 * MB, CostOptions(period=period))
    assert bound == pytest.approx(ring_bound / period)


def test_auto_prices_the_tree_on_racks_and_the_owner_exchange_on_a_flat_network():
    """two_racks (8 single-rank hosts in 2 racks): auto is FlexReduce's tree, one round per H;
    homogeneous8 (one switch, one level): the owner exchange, as before."""
    racks = CostModel(load_profile("two_racks"))
    tree = strategy_time(racks, "diloco", 16 * MB, CostOptions(period=4))
    owner = strategy_time(racks, "diloco", 16 * MB, CostOptions(period=4, pattern="mesh"))
    explicit = strategy_time(racks, "diloco", 16 * MB, CostOptions(period=4, pattern="tree"))
    flexreduce = strategy_time(racks, "flexreduce", 16 * MB)
    assert tree == explicit
    assert tree[0] == pytest.approx(flexreduce[0] / 4)     # the same pipelined pattern, once per 4 steps
    assert owner[0] > 3 * tree[0]                           # 4·M vs M across the 100 Mbit uplink
    flat = CostModel(load_profile("homogeneous8"))
    assert strategy_time(flat, "diloco", 16 * MB) == strategy_time(flat, "diloco", 16 * MB,
                                                                   CostOptions(pattern="mesh"))


def test_tree_streams_carry_slices_of_the_same_link_loads():
    """S streams: S flows of 1/S of the bytes on each link (the per-flow cap of a WAN is
    then S times less binding); without a cap the busiest link's load is unchanged."""
    from syncplane.exchanges.tree.exchange import cost as tree_exchange

    profile = load_profile("two_racks")
    one, four = tree_exchange(profile, 16 * MB, 1), tree_exchange(profile, 16 * MB, 4)
    def total(phases):
        return sum(b for phase in phases for _, _, b in phase)
    assert total(four) == pytest.approx(total(one), rel=1e-3)   # plan rounding per stream
    assert max(len(p) for p in four) == 4 * max(len(p) for p in one)
    wan = CostModel(load_profile("wan_two_sites"))
    s1 = strategy_time(wan, "diloco", 32 * MB, CostOptions(period=1, streams=1))
    s8 = strategy_time(wan, "diloco", 32 * MB, CostOptions(period=1, streams=8))
    assert s8[0] < s1[0] / 2    # 100 Mbit flows: 8 per pair fill the 1 Gbit site link, 1 cannot


def test_a_stream_is_pinned_to_one_nic_however_many_flows_its_ranks_send():
    """multi_nic: 2 hosts of 2 ranks, 2 × 100 Mbit NICs each. ``StreamRunner`` binds stream
    s to NIC s mod 2, so the two ranks of a host sending on one stream share one NIC (the
    emulator measured 1.476 s for DiLoCo's S = 1 round of 16 MB: one NIC's 1.34 s floor, not
    two NICs' 0.67 s); flows not pinned (gloo's collectives rotating over the devices) spread."""
    import numpy as np

    from syncplane.cluster.cost import MBIT, FlowArray

    model = CostModel(load_profile("multi_nic"), alpha_s=0.0)
    src, dst = np.array([0, 1]), np.array([2, 3])        # 1 MB from each rank of host 0 to host 1
    one_nic = 2e6 / (100 * MBIT)
    for streams, nics in ((1, 1), (2, 2), (3, 1.5), (4, 2)):    # 3 streams: two share one NIC
        pinned = FlowArray(src, dst, np.full(2, 1e6 / streams), np.full(2, streams), pinned=True)
        assert model.phase_time(pinned) == pytest.approx(one_nic / nics), (streams, nics)
    assert model.phase_time(FlowArray(src, dst, np.full(2, 1e6))) == pytest.approx(one_nic / 2)   # 2 flows, 2 NICs
    one, two = (strategy_time(model, "diloco", 16 * MB, CostOptions(period=1, streams=s))[1] for s in (1, 2))
    assert one == pytest.approx(16 * MB / (100 * MBIT), rel=0.02)    # M through one NIC per host
    assert two == pytest.approx(one / 2, rel=0.02)


def test_the_gather_sends_each_piece_to_every_other_rank_and_prices_the_sparse_codec():
    """The gather: (n−1)·piece per rank, one phase; DiLoCo's ``gather`` (what a sparse DiLoCo
    runs) is priced at the sparse codec's piece, far below the fp32 mesh across the uplink."""
    from syncplane.comm import ChunkedTopK
    from syncplane.exchanges.gather import cost as gather_exchange, groups_of

    phases = gather_exchange(4, MB)
    assert len(phases) == 1
    for rank in range(4):
        assert sum(b for src, _, b in phases[0] if src == rank) == pytest.approx(3 * MB)
    assert gather_exchange(1, MB) == []
    profile = load_profile("two_racks")
    racks = CostModel(profile)
    piece = ChunkedTopK().nbytes(16 * MB // 4)     # DiLoCo's defaults: 2 %, 2 bits, chunks of 4096
    by_rack = racks.bound(gather_exchange(profile.world_size, piece, 2, groups_of(profile)))
    flat = racks.bound(gather_exchange(profile.world_size, piece, 2))
    assert by_rack < flat / 2      # a rack's block crosses the uplink once, not once per remote rank
    _, bound = strategy_time(racks, "diloco", 16 * MB, CostOptions(period=4, streams=2, pattern="gather"))
    assert bound == pytest.approx(by_rack / 4)
    _, mesh = strategy_time(racks, "diloco", 16 * MB, CostOptions(period=4, streams=2, pattern="mesh"))
    assert bound < mesh / 10


@pytest.mark.parametrize("groups", [((0,), (1,), (2,)), ((0, 1, 2, 3),), ((0, 3), (1,), (2, 4, 5))])
def test_the_gather_routes_bring_every_piece_to_every_rank_and_cross_groups_once(groups):
    from syncplane.exchanges.gather import routes

    n = sum(len(g) for g in groups)
    have = {r: {r} for r in range(n)}
    crossings: dict[tuple[int, int], int] = {}
    group_of = {r: i for i, g in enumerate(groups) for r in g}
    for step in routes(groups):
        arrived = []
        for m in step:
            assert set(m.carries) <= have[m.src], "a rank forwards only what it already holds"
            arrived.append((m.dst, m.carries))
            if group_of[m.src] != group_of[m.dst]:
                for r in m.carries:
                    key = (r, group_of[m.dst])
                    crossings[key] = crossings.get(key, 0) + 1
        for dst, carries in arrived:
            have[dst] |= set(carries)
    assert all(have[r] == set(range(n)) for r in range(n))
    assert all(count == 1 for count in crossings.values())
    assert len(crossings) == n * (len(groups) - 1)
