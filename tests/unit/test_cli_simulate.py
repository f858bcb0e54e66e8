"""``syncplane simulate``: the cost model from the command line, every knob it depends on stated."""

from __future__ import annotations

import json

import pytest

from syncplane import cli


def simulate(tmp_path, *extra: str) -> dict:
    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--cluster", "two_racks", "--strategies", "ddp,diloco,canary",
                     "--payload-mb", "16", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_period_and_streams_are_inputs_and_are_reported(tmp_path):
    one = simulate(tmp_path, "--period", "1")
    ten = simulate(tmp_path, "--period", "10")
    assert (one["period"], ten["period"], ten["streams"]) == (1, 10, 1)
    rows = {r["strategy"]: r for r in ten["results"]}
    rows_one = {r["strategy"]: r for r in one["results"]}
    assert rows["ddp"]["bound_s"] == pytest.approx(rows_one["ddp"]["bound_s"])          # not periodic
    assert rows["diloco"]["bound_s"] == pytest.approx(rows_one["diloco"]["bound_s"] / 10)  # one round per H
    # the network's all-reduce bound: the same per round for both, amortized over DiLoCo's rounds
    assert rows["ddp"]["network_bound_s"] == pytest.approx(rows_one["diloco"]["network_bound_s"])
    assert rows["diloco"]["network_bound_s"] == pytest.approx(rows["ddp"]["network_bound_s"] / 10)
    assert rows["ddp"]["network_bound_ratio"] == pytest.approx(rows["ddp"]["network_bound_s"] /
                                                               rows["ddp"]["predicted_s"])
    assert rows["ddp"]["network_binding"].startswith("uplink of")
    # canary with --exchange owner: its mesh is DiLoCo's owner exchange every step, of the
    # sketched payload (~0.26 of fp32); by default (auto) the nested exchange over the racks,
    # which puts a quarter of the mesh's bytes on the uplinks
    from syncplane.algorithms.canary import sketch_ratio

    ratio = sketch_ratio(16 * 2**20 // 4, one["world_size"])
    assert 0.25 < ratio < 0.3
    owner = {r["strategy"]: r for r in simulate(tmp_path, "--period", "1", "--exchange", "mesh")["results"]}
    assert owner["canary"]["bound_s"] == pytest.approx(ratio * owner["diloco"]["bound_s"], rel=0.02)
    assert rows["canary"]["bound_s"] < owner["canary"]["bound_s"] / 2
    assert rows["canary"]["bound_s"] < rows["ddp"]["bound_s"]


def test_bad_period_is_a_config_error(tmp_path, capsys):
    assert cli.main(["simulate", "--cluster", "two_racks", "--period", "0"]) == 2
    assert "--period and --streams must be at least 1, got 0 and 1" in capsys.readouterr().err


def test_plan_prints_flexreduces_reduce_calls_and_link_bytes(tmp_path, capsys):
    assert cli.main(["simulate", "--cluster", "asymmetric_2_3", "--strategies", "ddp,flexreduce",
                     "--payload-mb", "25", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "flexreduce plan:" in out and "reduce calls; per learner" in out and "owned after reduce-scatter" in out


def test_without_period_diloco_is_priced_at_its_own_sync_every(tmp_path, capsys):
    """One H (issue 38): simulate and train.py agree on DiLoCo's H unless --period is given."""
    from syncplane.algorithms.diloco.config import DiLoCoConfig

    h = DiLoCoConfig.sync_every
    default, given = simulate(tmp_path), simulate(tmp_path, "--period", str(h))
    assert default["period"] is None and default["periods"] == {"diloco": h}
    rows = {r["strategy"]: r for r in default["results"]}
    assert rows["diloco"]["period"] == h and rows["ddp"]["period"] is None
    assert rows == {r["strategy"]: r for r in given["results"]}
    assert f"period diloco {h} (their defaults" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("streams", ["1", "2"])
def test_every_row_is_priced_as_plan_prices_it_and_streams_are_diloco_and_ds_syncs_only(tmp_path, streams):
    """``--streams`` is DiLoCo's shards and DS-Sync's pair streams; Canary opens one stream per
    NIC whatever it says (on ``multi_nic``: two), as ``plan`` and the bench price it (DiLoCo's
    exchange: auto, the tree on this profile)."""
    from syncplane.algorithms.plan import PlanInputs, make_plan
    from syncplane.cluster import load_profile

    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--cluster", "multi_nic", "--strategies", "ddp,canary,diloco,ds_sync",
                     "--payload-mb", "8", "--streams", streams, "--json", str(out)]) == 0
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["results"]}
    plan = make_plan(load_profile("multi_nic"), PlanInputs(8 * 2**20, 0.0))

    def planned(strategy: str, **kwargs) -> float:
        return next(c.sync_s for c in plan.candidates if c.strategy == strategy and
                    all(c.kwargs.get(k) == v for k, v in kwargs.items()))

    assert rows["canary"]["predicted_s"] == pytest.approx(planned("canary", exchange="nested"))
    assert rows["diloco"]["predicted_s"] == pytest.approx(planned("diloco", streams=int(streams), exchange="tree"))
    assert rows["ddp"]["predicted_s"] == pytest.approx(planned("ddp"))
