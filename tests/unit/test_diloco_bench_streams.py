"""The bench times DiLoCo on the streams it prices: a row's own ``diloco[streams=S]`` over the
command's ``--streams`` (old name ``--shards``), for the measurement and the cost model alike."""

from __future__ import annotations

from syncplane import algorithms
from syncplane.algorithms.diloco.bench import stream_count
from syncplane.cli import build_parser


def test_a_rows_own_streams_win_over_the_commands():
    assert stream_count({"shards": 1, "streams": 4}) == 4
    assert stream_count({"shards": 3}) == 3
    assert stream_count({}) == 1


def test_the_cost_model_prices_the_streams_the_bench_times():
    spec = algorithms.spec_for("diloco")
    for options in ({"shards": 1, "streams": 4}, {"shards": 3}, {}):
        assert spec.streams(options) == stream_count(options)


def test_bench_takes_streams_and_its_old_name_shards():
    parser = build_parser()
    assert parser.parse_args(["bench", "--cluster", "two_racks", "--streams", "8", "--json", "o.json"]).shards == 8
    assert parser.parse_args(["bench", "--cluster", "two_racks", "--shards", "2", "--json", "o.json"]).shards == 2


def test_the_bench_step_opens_the_rows_streams(monkeypatch):
    from types import SimpleNamespace

    from syncplane.algorithms.diloco import bench

    opened = []
    monkeypatch.setattr(bench, "build_exchange",
                        lambda job, streams, *a, **k: (opened.append(streams) or SimpleNamespace(), "mesh"))
    bench.DiLoCoStep({"shards": 1, "streams": 4, "period": 2}, job=None)
    bench.DiLoCoStep({"shards": 3, "period": 2}, job=None)
    assert opened == [4, 3]
