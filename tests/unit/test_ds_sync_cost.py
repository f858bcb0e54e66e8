"""DS-Sync in the α-β cost model: concurrent group all-reduces, one period averaged."""

from __future__ import annotations

import pytest

from syncplane.cluster import load_profile
from syncplane.algorithms import CostOptions, spec_for, strategy_time
from syncplane.cluster.cost import EMULATED_TCP_BBR, MBIT, CostModel, concurrent_group_allreduces

M = 100 * 2**20


def test_concurrent_rings_add_up_only_where_they_share_links():
    phases = concurrent_group_allreduces([(0, 1, 2), (3,), (4, 5)], M)
    assert len(phases) == 4                                     # the longest ring: 2(3-1) phases
    per_link: dict[tuple[int, int], float] = {}
    for phase in phases:
        for src, dst, nbytes in phase:
            per_link[(src, dst)] = per_link.get((src, dst), 0.0) + nbytes
    assert per_link[(0, 1)] == pytest.approx(2 * 2 / 3 * M)      # ring of 3: 2(n-1)/n of the payload
    assert per_link[(4, 5)] == pytest.approx(M) and per_link[(5, 4)] == pytest.approx(M)
    assert not any(3 in link for link in per_link)               # a group of one sends nothing


def test_two_racks_bound_is_the_uplink_pair_and_beats_the_ring_by_7_over_4():
    model = CostModel(load_profile("two_racks"))
    _, ds_bound = strategy_time(model, "ds_sync", M)
    _, ddp_bound = strategy_time(model, "ddp", M)
    assert ds_bound == pytest.approx(M / (100 * MBIT))             # the representatives' pair on the uplink
    assert ddp_bound / ds_bound == pytest.approx(1.75)


def test_slow_nic_pairs_the_slow_host():
    model = CostModel(load_profile("slow_nic"))
    _, bound = strategy_time(model, "ds_sync", M)
    assert bound == pytest.approx(M / (100 * MBIT))                # the slow NIC carries the payload once


def test_pair_streams_take_their_fair_share_of_a_contended_uplink():
    """k streams next to one greedy foreign flow get k/(k+1) of the uplink (TCP fair share):
    the cross-rack pair's bound shrinks from M/(½·100 Mbit) to M/(k/(k+1)·100 Mbit); an
    uncontended uplink gains nothing."""
    contended = CostModel(load_profile("two_racks_contended"))
    for k in (1, 2, 4):
        _, bound = strategy_time(contended, "ds_sync", M, CostOptions(streams=k))
        assert bound == pytest.approx(M / (k / (k + 1) * 100 * MBIT))
    quiet = CostModel(load_profile("two_racks"))
    assert strategy_time(quiet, "ds_sync", M, CostOptions(streams=4)) == pytest.approx(strategy_time(quiet, "ds_sync", M))


def _sent_per_rank(phases) -> dict[int, float]:
    sent: dict[int, float] = {}
    for phase in phases:
        for src, _, nbytes in phase:
            sent[src] = sent.get(src, 0.0) + nbytes
    return sent


def test_max_staleness_prices_every_group_as_a_clique(tmp_path):
    """The late-peer exchange sends the payload to each of |g|−1 mates: a rack of four hosts
    sends 3·M per member where the ring sends 1.5·M, and its NIC-bound time doubles; every
    tool (plan, simulate, bench's bound) reaches it through the spec's pattern."""
    import yaml

    from syncplane.algorithms import plan, spec_for
    from syncplane.algorithms.ds_sync.cost import CLIQUE, ds_sync_steps

    path = tmp_path / "rack4.yaml"
    path.write_text(yaml.safe_dump({"name": "rack4", "racks": [{"name": "r0", "uplink_mbit": 1000, "hosts": [
        {"name": f"h{i}", "nic_mbit": 100} for i in range(4)]}]}))
    profile = load_profile(str(path))
    ring = ds_sync_steps("ds_sync", profile, M, CostOptions())
    clique = ds_sync_steps("ds_sync", profile, M, CostOptions(pattern=CLIQUE))
    assert len(ring) == len(clique)   # one group of four every step of the period
    for ring_step, clique_step in zip(ring, clique):
        assert _sent_per_rank(ring_step) == pytest.approx({r: 1.5 * M for r in range(4)})
        assert _sent_per_rank(clique_step) == pytest.approx({r: 3 * M for r in range(4)})
    model = CostModel(profile)
    _, ring_bound = strategy_time(model, "ds_sync", M)
    _, clique_bound = strategy_time(model, "ds_sync", M, CostOptions(pattern=CLIQUE))
    assert clique_bound / ring_bound == pytest.approx(2.0)
    family = spec_for("ds_sync")
    assert (family.pattern({"max_staleness": 2}), family.streams({"max_staleness": 2})) == (CLIQUE, 1)
    assert (family.pattern({}), family.pattern({"max_staleness": 0})) == ("auto", "auto")
    options = plan.cost_options("ds_sync", {"max_staleness": 2}, plan.PlanInputs(M, compute_s=0.0))
    assert (options.pattern, options.streams) == (CLIQUE, 1)


def test_simulate_prices_a_max_staleness_row_as_the_clique(tmp_path):
    """On ``two_racks`` the groups of three inside a rack send 2·M per member instead of
    4/3·M; the cross-rack pair (the bound) is the same swap either way."""
    import json

    from syncplane import cli

    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--cluster", "two_racks", "--strategies", "ds_sync,ds_sync[max_staleness=2]",
                     "--payload-mb", "8", "--alpha-ms", "0", "--tcp", "ideal", "--json", str(out)]) == 0
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["results"]}
    ring, clique = rows["ds_sync"], rows["ds_sync[max_staleness=2]"]
    assert clique["network_bound_s"] == pytest.approx(ring["network_bound_s"])   # the uplink pair binds
    model = CostModel(load_profile("two_racks"), alpha_s=0.0)
    assert clique["predicted_s"] == pytest.approx(strategy_time(model, "ds_sync", 8 * 2**20,
                                                                CostOptions(pattern="clique"))[0])


def test_pair_streams_auto_is_priced_as_what_its_trial_keeps():
    """``auto`` times one stream against ``MAX_PAIR_STREAMS`` and keeps the many only if they are
    ``MIN_STREAM_GAIN`` faster: priced so, on TCP as measured under bbr, a quiet uplink keeps one
    stream (more flows lose more to drops; under cubic they lose nothing more, and one is kept too) and one next to a greedy foreign flow keeps four (k/(k+1) of it)."""
    from syncplane.algorithms import plan
    from syncplane.algorithms.ds_sync.pair_streams import MAX_PAIR_STREAMS

    inputs = plan.PlanInputs(M, compute_s=0.0)
    for cluster, kept in (("two_racks", 1), ("two_racks_contended", MAX_PAIR_STREAMS)):
        model = CostModel(load_profile(cluster), tcp=EMULATED_TCP_BBR)
        prices = {n: plan.price(model, "ds_sync", {"pair_streams": n}, inputs).sync_s for n in (1, MAX_PAIR_STREAMS)}
        assert prices[1] != pytest.approx(prices[MAX_PAIR_STREAMS])
        auto = plan.price(model, "ds_sync", {"pair_streams": "auto"}, inputs)
        assert auto.sync_s == pytest.approx(prices[kept]) and auto.kwargs == {"pair_streams": "auto"}
    # a fixed count, and the late-peer cliques (one connection), are priced as given
    family = plan.spec_for("ds_sync")
    assert family.trial({"pair_streams": 2}, lambda settings: [0.0]) == {"pair_streams": 2}
    assert family.trial({"max_staleness": 2}, lambda settings: [0.0]) == {"max_staleness": 2}


def test_the_priced_trial_judges_the_steps_with_a_pair_as_the_trial_times_them():
    """The run-time trial times the pair swaps only, step by step; a period's mean would dilute
    a pair's gain with the steps that have no pair (here 1.12× over the period, 1.6× per pair)."""
    from syncplane.algorithms.ds_sync.pair_streams import MAX_PAIR_STREAMS

    def price(settings):
        return [1.0, 1.0, 1.0, 1.0, 1.6 if settings["pair_streams"] == 1 else 1.0]
    family = spec_for("ds_sync")
    assert family.trial({"pair_streams": "auto"}, price)["pair_streams"] == MAX_PAIR_STREAMS
    assert family.trial({"pair_streams": "auto"}, lambda settings: [1.0, 1.0])["pair_streams"] == 1   # no pair


def test_a_pairs_pieces_take_a_hosts_nics_in_turn():
    """A pair's pieces carry a tag each, which gloo maps to a host's NICs in turn: one stream
    per direction is priced as DDP's pinned streams beside the rings of a larger group."""
    model = CostModel(load_profile("multi_nic"), tcp=EMULATED_TCP_BBR)
    for group in ([0, 2], [0, 1, 2, 3]):
        spread = model.time(concurrent_group_allreduces([group], M, nic_streams=2))
        assert spread < 0.7 * model.time(concurrent_group_allreduces([group], M))
    pair = [[0, 2]]
    assert model.time(concurrent_group_allreduces(pair, M, pair_streams=4, nic_streams=2)) == \
        pytest.approx(model.time(concurrent_group_allreduces(pair, M, pair_streams=4)))   # 4 streams: 2 per NIC
