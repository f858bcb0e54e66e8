"""``replica: node`` priced: a node sends M per round per direction across (two nodes), over L x S
connections, DDP inside the node on loopback every step; in ``simulate``, the plan and the bench's
rows (``NAME[key=value]`` labels)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from syncplane import algorithms, cli
from syncplane.algorithms.decentralized.bench import NeighborAveragingStep
from syncplane.algorithms.diloco.exchange import delta_codec
from syncplane.algorithms.diloco.layout import ReplicaLayout
from syncplane.algorithms.diloco.cost import node_cost
from syncplane.algorithms.plan import PlanInputs, make_plan
from syncplane.algorithms.spec import CostOptions
from syncplane.bench.runner import parse_strategies, report_rows
from syncplane.cluster import load_profile
from syncplane.cluster.bound import allreduce_network_bound
from syncplane.cluster.cost import CostModel, columns_of
from syncplane.config import ConfigError

M = 16 * 2**20


def crossing(profile, phases) -> tuple[float, int]:
    """(bytes host 0 sends to other hosts, its concurrent connections to them) over ``phases``."""
    host = np.repeat(np.arange(len(profile.hosts)), [h.spec.ranks for h in profile.hosts])
    sent, connections = 0.0, 0
    for phase in phases:
        src, dst, nbytes, copies = columns_of(phase)
        out = (host[src] == 0) & (host[dst] != 0)
        sent += float((nbytes * copies)[out].sum())
        connections = max(connections, int(copies[out].sum()))
    return sent, connections


@pytest.mark.parametrize("streams", [1, 2])
def test_a_node_sends_m_per_round_per_direction_over_l_times_s_connections(streams):
    profile = load_profile("multi_nic")                 # 2 hosts of 2 ranks, 2 NICs each
    layout = ReplicaLayout(tuple(tuple(h.ranks) for h in profile.hosts))
    steps = node_cost(layout, M, 4, streams, delta_codec("none"))
    assert len(steps) == 4
    sent, connections = crossing(profile, steps[0])
    assert sent == pytest.approx(M)                      # 2(N-1)/N M, N = 2 nodes
    assert connections == 2 * streams                    # L shard groups x S streams, at once
    for step in steps[1:]:                               # the other steps: DDP inside the node only
        assert crossing(profile, step)[0] == 0 and step
    int8, _ = crossing(profile, node_cost(layout, M, 1, streams, delta_codec("int8"))[0])
    assert 0.25 < int8 / M < 0.27                        # int8 with its scales


def test_node_beats_rank_on_two_nics_and_the_network_bound_counts_only_rounds():
    profile = load_profile("multi_nic")
    model = CostModel(profile)
    rank = algorithms.strategy_times(model, "diloco", M, CostOptions(period=1))
    node = algorithms.strategy_times(model, "diloco", M, CostOptions(period=1, replica="node"))
    auto = algorithms.strategy_times(model, "diloco", M, CostOptions(period=1, replica="auto"))
    assert node == auto                                  # auto is node where hosts run several ranks
    assert node.predicted_s < 0.6 * rank.predicted_s     # two NICs busy at once, M across instead of 1.5 M
    assert node.bound_s >= allreduce_network_bound(profile, M).seconds
    at_h4 = algorithms.strategy_times(model, "diloco", M, CostOptions(period=4, replica="node"))
    assert at_h4.network_bound_s == pytest.approx(allreduce_network_bound(profile, M).seconds / 4)


def test_uneven_nodes_are_priced_and_one_rank_hosts_refused_naming_replica():
    layout = ReplicaLayout.of_sizes([2, 1])
    steps = node_cost(layout, M, 1, 1, delta_codec("none"))
    # the lone rank of node 1 owns both shards: two connections from node 0's ranks, M/2 each way
    src, dst, nbytes, copies = columns_of(steps[0][-3])
    assert float((nbytes * copies).sum()) == pytest.approx(M)
    with pytest.raises(ConfigError, match="replica='node' on a job of one rank per host"):
        algorithms.strategy_times(CostModel(load_profile("two_racks")), "diloco", M, CostOptions(replica="node"))


def test_the_plan_offers_node_replicas_where_hosts_run_several_ranks():
    plan = make_plan(load_profile("multi_nic"), PlanInputs(M, strategies=("diloco",)))
    node = [c for c in plan.candidates if c.kwargs.get("replica") == "node"]
    assert len(node) == 5 and "strategy.kwargs.replica=node" in node[0].overrides()
    flat = make_plan(load_profile("two_racks"), PlanInputs(M, strategies=("diloco",)))
    assert not [c for c in flat.candidates if c.kwargs.get("replica") == "node"]
    excluded = [e for e in flat.excluded if e.kwargs.get("replica") == "node"]
    assert len(excluded) == 5 and all("replica='node'" in e.reason for e in excluded)


def test_bench_and_simulate_take_a_strategy_with_its_settings(tmp_path):
    assert parse_strategies("ddp, diloco[replica=node,shards=2],diloco") == \
        ["ddp", "diloco[replica=node,shards=2]", "diloco"]
    assert algorithms.variant("diloco[replica=node,shards=2]") == ("diloco", {"replica": "node", "shards": 2})
    assert algorithms.variant("atc[one_way_links=False,bucket_mb=0.5]") == \
        ("atc", {"one_way_links": False, "bucket_mb": 0.5})
    with pytest.raises(ConfigError, match="one_way_links: expected true or false"):    # never read as on
        NeighborAveragingStep({"one_way_links": "off"}, job=None)
    for bad, message in (("dilocco[replica=node]", "unknown dilocco"), ("diloco,diloco", "twice"),
                         ("diloco[replica]", "not key=value")):
        with pytest.raises(ConfigError, match=message):
            parse_strategies(bad)
    with pytest.raises(ConfigError, match="strategy names only"):          # chaos --matrix, soak
        parse_strategies("ddp,diloco[replica=node]", variants=False)
    profile = load_profile("multi_nic")
    per_nic = [{"eth0": M / 2, "eth1": M / 2}] * 2 + [{"eth0": M / 2 + 1, "eth1": M / 2}] * 2   # a host's ranks agree
    measured = {"diloco[replica=node]": {"step_s": [1.0], "comm_bytes": [M] * 4, "nic_tx_bytes": [M] * 4,
                                         "nic_tx_by_nic": per_nic}}
    rows = {r["strategy"]: r for r in report_rows(profile, ["diloco", "diloco[replica=node]"], M, measured, period=1)}
    assert rows["diloco[replica=node]"]["predicted_s"] < 0.6 * rows["diloco"]["predicted_s"]
    assert rows["diloco[replica=node]"]["nic_bytes_by_host"] == {"n0": per_nic[0], "n1": per_nic[2]}
    assert "nic_bytes_by_host" not in rows["diloco"]                   # not measured
    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--cluster", "multi_nic", "--strategies", "diloco,diloco[replica=node,sync_every=5]",
                     "--payload-mb", "16", "--tcp", "ideal", "--json", str(out)]) == 0
    sim = {r["strategy"]: r for r in json.loads(out.read_text())["results"]}
    node = algorithms.strategy_times(CostModel(profile), "diloco", M, CostOptions(period=5, replica="node"))
    assert sim["diloco[replica=node,sync_every=5]"]["predicted_s"] == pytest.approx(node.predicted_s)


def test_sparse_node_rounds_are_priced_as_the_shards_gathers():
    profile = load_profile("multi_nic")
    layout = ReplicaLayout(tuple(tuple(h.ranks) for h in profile.hosts))
    codec = delta_codec("sparse", density=0.02, bits=2)
    round_ = node_cost(layout, M, 1, 1, codec, gather=True)[0]
    sent, connections = crossing(profile, round_)
    shards = layout.bounds(M // 4)
    assert sent == pytest.approx(sum(codec.nbytes(b - a) for a, b in shards))   # every encoded shard, once
    assert connections == 2 and sent < M / 100
    model = CostModel(profile)
    sparse = algorithms.strategy_times(model, "diloco", M, CostOptions(period=1, replica="node", compression="sparse"))
    dense = algorithms.strategy_times(model, "diloco", M, CostOptions(period=1, replica="node"))
    assert sparse.bound_s < dense.bound_s / 10
