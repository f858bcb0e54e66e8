"""The α-β pattern of DiLoCo's exchange: a ring's bytes per rank, once per H steps."""

from __future__ import annotations

import pytest

from syncplane.cluster import load_profile
from syncplane.algorithms import CostOptions, strategy_time
from syncplane.cluster.cost import CostModel, owner_exchange

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
