"""Bench argument parsing and report schema (no cluster needed)."""

from __future__ import annotations

import pytest

from syncplane.bench.runner import parse_payload, parse_strategies, plot, report_rows, run_bench
from syncplane.cluster.bound import allreduce_network_bound
from syncplane.cluster import load_profile
from syncplane.config import ConfigError

SCHEMA = {"strategy", "sync_s_median", "sync_s_p90", "bytes_sent_per_rank", "bound_s", "bound_ratio",
          "network_bound_s", "network_bound_ratio", "speedup_vs_ddp"}


def test_payload_presets_are_real_model_sizes():
    assert parse_payload("resnet50") == 25_557_032 * 4
    assert parse_payload("bert_large") == 335_141_888 * 4
    assert parse_payload("1.5") == int(1.5 * 2**20)
    with pytest.raises(ConfigError, match="--payload-mb: expected a number or one of resnet50, bert_large"):
        parse_payload("huge")


def test_strategy_names_are_checked():
    assert parse_strategies("ddp, atc") == ["ddp", "atc"]
    with pytest.raises(ConfigError, match="--strategies: unknown foo; allowed values: ddp, atc"):
        parse_strategies("ddp,foo")


@pytest.mark.parametrize("value", ["0", "four", "-1"])
def test_pair_streams_are_checked_before_anything_launches(tmp_path, value):
    from syncplane.bench.runner import main_bench

    with pytest.raises(ConfigError, match=f"--pair-streams: 'auto' or an integer >= 1, got '{value}'"):
        main_bench("two_racks", "ddp,ds_sync", "1", 1, 0, 0.0, str(tmp_path / "r.json"), None, False,
                   pair_streams=value)


def test_unimplemented_strategies_are_reported_not_skipped(tmp_path, monkeypatch):
    from syncplane import algorithms

    if not algorithms.PLANNED:    # every product strategy has landed: check the path with a stand-in
        monkeypatch.setitem(algorithms.PLANNED, "future", "a promised strategy")
    missing = list(algorithms.PLANNED)[:2]   # never launches the emulator
    report = run_bench(load_profile("two_racks"), missing, 2**20, out_dir=tmp_path)
    assert {"cluster", "world_size", "payload_bytes", "results"} <= set(report)
    assert [r["strategy"] for r in report["results"]] == missing
    for row in report["results"]:
        assert SCHEMA <= set(row) and row["status"] == "not implemented" and row["sync_s_median"] is None
    plot(report, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 1000


def test_wandb_logging_is_offline_and_grouped(tmp_path):
    from syncplane.bench.runner import log_wandb

    report = {"cluster": "two_racks", "payload_bytes": 2**20, "created": "2026-01-01T00:00:00", "results": [
        {"strategy": "ddp", "status": "ok", "step_s": [0.5, 0.6], "sync_s_median": 0.55},
        {"strategy": "atc", "status": "not implemented", "sync_s_median": None}]}
    log_wandb(report, tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1          # one per measured strategy


def test_every_row_reports_the_network_bound_next_to_its_own(tmp_path):
    """Rows from given measurements (no emulator): both bounds and both ratios, the network
    one amortized over DiLoCo's period and the same for every exact or inexact strategy."""
    profile, payload = load_profile("two_racks"), 25 * 2**20
    hosts = len(profile.hosts)
    measured = {name: {"step_s": [seconds] * 3, "comm_bytes": [1.0] * 8, "nic_tx_bytes": [1.0] * hosts}
                for name, seconds in (("ddp", 4.0), ("atc", 3.0), ("diloco", 2.0))}
    rows = {r["strategy"]: r for r in report_rows(profile, ["ddp", "atc", "diloco"], payload, measured, period=4)}
    network = allreduce_network_bound(profile, payload).seconds
    assert rows["ddp"]["network_bound_s"] == pytest.approx(network)
    assert rows["atc"]["network_bound_s"] == pytest.approx(network)
    assert rows["diloco"]["network_bound_s"] == pytest.approx(network / 4)
    for name, seconds in (("ddp", 4.0), ("atc", 3.0), ("diloco", 2.0)):
        assert SCHEMA <= set(rows[name])
        assert rows[name]["network_bound_ratio"] == pytest.approx(rows[name]["network_bound_s"] / seconds)
        assert rows[name]["bound_ratio"] == pytest.approx(rows[name]["bound_s"] / seconds)
    assert rows["ddp"]["network_bound_s"] < rows["ddp"]["bound_s"]        # the ring crosses the uplink 1.75×


def test_periodic_strategies_run_at_their_own_h_unless_period_is_given(tmp_path, monkeypatch, capsys):
    """One H (issue 38): without --period the bench runs and prices DiLoCo at its own
    sync_every (what ``train.py strategy=diloco`` runs), in whole rounds, and says so in the
    JSON and the table's title; --period sets every periodic strategy's."""
    import json

    from syncplane.runtime import launcher
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.bench.runner import main_bench
    from syncplane.bench.worker import step_counts

    h = DiLoCoConfig.sync_every
    specs = []

    def fake_launch(command, profile, log_dir, **kwargs):   # the workers' results, without the emulator
        spec = json.loads(open(command[-1]).read())
        specs.append(spec)
        hosts = len(profile.hosts)
        timed = {n: step_counts(0, 0, spec["steps"], spec["periods"].get(n, 1))[1] for n in spec["strategies"]}
        results = {n: {"step_s": [1.0] * (timed[n] // spec["periods"].get(n, 1)), "comm_bytes": [1.0] * 8,
                       "nic_tx_bytes": [1.0] * hosts, "steps": timed[n]} for n in spec["strategies"]}
        (log_dir.parent / "results.json").write_text(json.dumps({"results": results}))

    monkeypatch.setattr(launcher, "launch_on_cluster", fake_launch)
    out = tmp_path / "r.json"
    report = main_bench("two_racks", "ddp,diloco,torch_periodic", "1", 5, 0, 0.0, str(out), None, False)
    assert specs[-1]["periods"] == report["periods"] == {"diloco": h, "torch_periodic": 4}
    # the steps asked go to every strategy; each periodic one times whole rounds of its own (not of lcm(10, 4))
    assert report["period"] is None and specs[-1]["steps"] == report["steps"] == 5
    rows = {r["strategy"]: r for r in report["results"]}
    assert (rows["ddp"]["timed_steps"], rows["diloco"]["timed_steps"], rows["torch_periodic"]["timed_steps"]) == (5, h, 8)
    assert (rows["diloco"]["period"], rows["ddp"]["period"]) == (h, None)
    at_h = {r["strategy"]: r for r in report_rows(load_profile("two_racks"), ["diloco"], 2**20, {}, period=h)}
    assert rows["diloco"]["bound_s"] == pytest.approx(at_h["diloco"]["bound_s"])
    assert f"period diloco {h}, torch_periodic 4" in " ".join(capsys.readouterr().out.split())
    given = main_bench("two_racks", "ddp,diloco", "1", 5, 0, 0.0, str(out), None, False, period=3)
    assert given["periods"] == {"diloco": 3} and given["period"] == 3 and specs[-1]["steps"] == 5
    assert "period 3 (--period)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("args,message", [
    ({"compression": "sparse", "density": 0.0}, "--density: must be in"),
    ({"compression": "sparse", "bits": 3}, "--bits"),
    ({"compression": "sparse", "exchange": "mesh"}, "--compression sparse rides the gather only"),
    ({"compression": "zip"}, "--compression: allowed values: none, int8, sparse"),
])
def test_sparse_bench_options_are_checked_before_anything_launches(tmp_path, args, message):
    from syncplane.bench.runner import main_bench

    with pytest.raises(ConfigError, match=message):
        main_bench("two_racks", "ddp,diloco", "1", 1, 0, 0.0, str(tmp_path / "r.json"), None, False, **args)


def test_diloco_is_priced_at_its_codec_size():
    """The gather's price follows the density; int8 on the mesh costs about a quarter of fp32."""
    profile = load_profile("two_racks")
    payload = 25 * 2**20

    def predicted(**options):
        rows = report_rows(profile, ["diloco"], payload, {}, period=10, **options)
        return rows[0]["predicted_s"]

    fp32, int8 = predicted(exchange="mesh"), predicted(exchange="mesh", compression="int8")
    dense, sparse = predicted(compression="sparse", density=0.03), predicted(compression="sparse", density=0.01)
    assert 0.2 < int8 / fp32 < 0.35
    assert sparse < dense < int8
