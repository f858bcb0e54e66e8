"""FlexReduce's cost pattern (Eq. 4–6 as phases) on the shipped profiles, against the
closed forms of the issue: level by level on two_racks 2·0.75·M over the 400 Mbit NICs
plus M over the 100 Mbit uplink; pipelined, the uplink's M plus fill and drain."""

from __future__ import annotations

import pytest

from syncplane.exchanges.tree.cost import flexreduce_phases
from syncplane.exchanges.tree.tree import from_profile
from syncplane.algorithms import strategy_time
from syncplane.cluster.cost import MBIT, CostModel
from syncplane.cluster.profile import load_profile

M = 25 * 2**20


def test_two_racks_levelwise_is_the_closed_form() -> None:
    profile = load_profile("two_racks")
    _, bound = strategy_time(CostModel(profile), "flexreduce_levelwise", M)
    assert bound == pytest.approx(2 * 0.75 * M / (400 * MBIT) + M / (100 * MBIT), rel=1e-6)
    _, ring = strategy_time(CostModel(profile), "ddp", M)
    assert ring / bound == pytest.approx(1.75 / 1.375, rel=1e-3)


def test_two_racks_pipelined_approaches_the_uplink_bound() -> None:
    profile = load_profile("two_racks")
    model, tree = CostModel(profile), from_profile(profile)
    uplink = M / (100 * MBIT)
    chunks = [model.bound(flexreduce_phases(tree, M, chunk_bytes=M // k)) for k in (4, 16, 64)]
    assert chunks[0] > chunks[1] > chunks[2] > uplink
    assert chunks[2] <= uplink * (64 + 3) / 64 * 1.001
    _, ring = strategy_time(model, "ddp", M)
    assert ring / chunks[2] > 1.7


def test_asymmetric_2_3_root_link_carries_m_each_way() -> None:
    profile = load_profile("asymmetric_2_3")
    model, tree = CostModel(profile, loopback_bytes_per_s=float("inf")), from_profile(profile)
    phases = flexreduce_phases(tree, M, chunk_bytes=0)
    assert model.bound(phases) == pytest.approx(M / (400 * MBIT), rel=1e-6)   # M/2 up, then M/2 down
    _, ring = strategy_time(model, "ddp", M)
    assert ring / model.bound(phases) == pytest.approx(1.6, rel=1e-3)
