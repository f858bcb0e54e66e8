"""``bench --matrix`` without a cluster: its bookkeeping (which cells remain, how a failed or
interrupted run is kept, the table) with the launch replaced by a fake worker, and the drop
counters read from ``tc -s`` text. The real run is tests/cluster/test_bench_matrix.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from rich.progress import Progress

from syncplane.bench import matrix
from syncplane.bench.matrix import MatrixSettings, markdown_table, pending_cells, run_matrix
from syncplane.cli import main as cli_main
from syncplane.cluster import parse_profile
from syncplane.cluster.emulator import parse_root_drops, uplink_drops
from syncplane.config import ConfigError
from syncplane.exchanges.cpu import ADD
from syncplane.runtime.launcher import JobStopped, LaunchError
from tests.helpers.scripts import load_script

TC_STATS = """\
qdisc noqueue 0: dev lo root refcnt 2
 Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
qdisc tbf 8001: dev upl0r root refcnt 2 rate 100Mbit burst 125000b lat 100ms
 Sent 1234 bytes 10 pkt (dropped 7, overlimits 3 requeues 0)
 backlog 0b 0p requeues 0
qdisc htb 1: dev upl1c root refcnt 2 r2q 10 default 0x2 direct_packets_stat 0 direct_qlen 1000
 Sent 999 bytes 9 pkt (dropped 5, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
qdisc pfifo 8010: dev upl1c parent 1:1000 limit 1000p
 Sent 99 bytes 1 pkt (dropped 5, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
qdisc tbf 8002: dev hp0n0 root refcnt 2 rate 400Mbit burst 500000b lat 100ms
 Sent 5 bytes 1 pkt (dropped 2, overlimits 0 requeues 0)
"""

PROFILE_SPEC = {"name": "fake_racks", "racks": [
    {"name": "r0", "uplink_mbit": 50, "hosts": [{"name": "a0", "nic_mbit": 200}, {"name": "a1", "nic_mbit": 200}]},
    {"name": "r1", "uplink_mbit": 50, "hosts": [{"name": "b0", "nic_mbit": 200}]}]}
PROFILE = parse_profile(PROFILE_SPEC)


def test_drops_are_read_from_the_shaping_root_qdiscs_only():
    drops = parse_root_drops(TC_STATS)
    assert drops == {"upl0r": 7, "upl1c": 5, "hp0n0": 2}       # no noqueue, no htb child counted twice
    assert uplink_drops(drops) == 12
    assert uplink_drops({"hp0n0": 3}) is None                   # no uplinks: no number, not 0


def measured(names: list[str], seconds: dict[str, float]) -> dict:
    """What the bench worker writes for ``names``: 3 ranks, 2 steps each."""
    return {n: {"step_s": [seconds[n]] * 2, "comm_bytes": [1e6] * 3, "nic_tx_bytes": [1.1e6] * 3,
                "switch_drops": {"upl0r": 1.0, "upl1r": 0.0, "hp0n0": 4.0}} for n in names}


class FakeBench:
    """``run_bench`` with a scripted worker: each call finishes its strategies in order and
    stops at the first one named in ``fail`` (a LaunchError) or ``interrupt`` (raising
    ``stop``: Ctrl-C, or the launcher's JobStopped on SIGTERM)."""

    def __init__(self, fail: set[str] = frozenset(), interrupt: str | None = None,
                 stop: BaseException = KeyboardInterrupt(), slower: tuple[float, ...] = (1.0,),
                 interrupt_call: int = 0) -> None:
        self.fail, self.interrupt, self.stop, self.calls = set(fail), interrupt, stop, []
        self.slower, self.interrupt_call = slower, interrupt_call   # per call: its times' factor; when to stop

    def __call__(self, profile, order, payload_bytes, *, out_dir: Path, echo_to, **kwargs):
        self.calls.append(list(order))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").unlink(missing_ok=True)
        factor = self.slower[(len(self.calls) - 1) % len(self.slower)]
        seconds = {name: s * factor for name, s in {"ddp": 0.4, "atc": 0.2, "awc": 0.8, "canary": 0.1}.items()}
        done = []
        for name in order:
            if name == self.interrupt and len(self.calls) > self.interrupt_call:
                raise self.stop
            if name in self.fail:
                raise LaunchError(f"rank 1 failed (exit code 1) while running {name}")
            done.append(name)
            (out_dir / "results.json").write_text(json.dumps({"results": measured(done, seconds)}))
            echo_to.write(f"bench: {name} median {seconds[name]:.3f} s/step\n")
        rows = matrix.report_rows(profile, order, payload_bytes, measured(order, seconds))
        return {"cluster": profile.name, "world_size": profile.world_size, "payload_bytes": payload_bytes,
                "steps": 2, "compute_ms": 0.0, "results": rows}


def settings(tmp_path: Path, strategies: list[str]) -> MatrixSettings:
    return MatrixSettings(profiles=[PROFILE], strategies=strategies, payload_bytes=2**20, out_dir=tmp_path,
                          steps=2, warmup=0, command="syncplane bench --matrix (test)")


def table_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("|")]


def test_a_matrix_writes_a_well_formed_json_and_table_per_profile(tmp_path, monkeypatch):
    fake = FakeBench()
    monkeypatch.setattr(matrix, "run_bench", fake)
    reports = run_matrix(settings(tmp_path, ["atc", "awc"]))
    assert fake.calls == [["ddp", "atc", "awc"]]                 # ddp beside, in the same run
    report = json.loads((tmp_path / "fake_racks.json").read_text())
    assert reports["fake_racks"] == report
    rows = {r["strategy"]: r for r in report["results"]}
    assert list(rows) == ["ddp", "atc", "awc"]
    assert rows["atc"]["speedup_vs_ddp"] == pytest.approx(2.0) and rows["atc"]["ddp_sync_s"] == pytest.approx(0.4)
    assert rows["atc"]["uplink_drops"] == 1.0
    assert rows["atc"]["model_error"] == pytest.approx(rows["atc"]["predicted_s"] / 0.2 - 1)
    assert report["meta"]["command"] == "syncplane bench --matrix (test)"
    lines = table_lines(tmp_path / "fake_racks.md")
    assert len(lines) == 2 + 3 and len({line.count("|") for line in lines}) == 1   # header, rule, a row each
    assert (tmp_path / "fake_racks.png").stat().st_size > 0


def test_a_failed_strategy_gets_a_row_and_the_rest_of_the_profile_still_runs(tmp_path, monkeypatch):
    fake = FakeBench(fail={"atc"})
    monkeypatch.setattr(matrix, "run_bench", fake)
    rows = {r["strategy"]: r for r in run_matrix(settings(tmp_path, ["atc", "awc", "canary"]))["fake_racks"]["results"]}
    assert fake.calls == [["ddp", "atc", "awc", "canary"], ["ddp", "awc", "canary"]]
    assert rows["atc"]["status"].startswith("failed: rank 1 failed") and "atc" in matrix.misses(rows["atc"])
    assert rows["awc"]["status"] == rows["canary"]["status"] == rows["ddp"]["status"] == "ok"
    # the next invocation retries only the failed cell
    fake.fail.clear()
    retry = dataclasses.replace(settings(tmp_path, ["atc", "awc", "canary"]), command="syncplane bench --matrix (retry)")
    run_matrix(retry)
    assert fake.calls[-1] == ["ddp", "atc"]
    report = json.loads((tmp_path / "fake_racks.json").read_text())
    assert all(r["status"] == "ok" for r in report["results"])
    # both runs are said, in order, in the JSON and in the table's heading
    assert [run["command"] for run in report["meta"]["runs"]] == ["syncplane bench --matrix (test)",
                                                                 "syncplane bench --matrix (retry)"]
    heading = (tmp_path / "fake_racks.md").read_text().splitlines()[2]
    assert heading.startswith("Runs: ") and heading.index("(test)") < heading.index("(retry)")
    # which machine, and the emulated hosts' congestion control (the profile's)
    assert heading.count(f", {matrix.machine()}, TCP cubic: ") == 2 and " cores, torch CPU " in matrix.machine()
    assert report["meta"]["tcp"] == "cubic"
    # a file from before the runs were kept: its one run, from its meta; from before the
    # emulator set the congestion control: the machine's, which nobody recorded
    legacy = {"created": "2026-01-01T10:00:00", "commit": "abc1234", "command": "syncplane bench --matrix"}
    assert matrix.run_history(legacy) == [legacy] and matrix.run_history({}) == []
    assert matrix.tcp_words(legacy) == "TCP: the machine's default (not recorded)"


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), JobStopped("stopped by SIGTERM; the ranks were ended")])
def test_an_interrupted_matrix_keeps_what_finished_and_resumes_the_rest(stop, tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "run_bench", FakeBench(interrupt="awc", stop=stop))
    with pytest.raises(type(stop)):
        run_matrix(settings(tmp_path, ["atc", "awc", "canary"]))
    kept = json.loads((tmp_path / "fake_racks.json").read_text())
    assert [r["strategy"] for r in kept["results"]] == ["ddp", "atc"]
    assert pending_cells(kept, ["atc", "awc", "canary"]) == ["awc", "canary"]
    fake = FakeBench()
    monkeypatch.setattr(matrix, "run_bench", fake)
    run_matrix(settings(tmp_path, ["atc", "awc", "canary"]))
    assert fake.calls == [["ddp", "awc", "canary"]]
    report = json.loads((tmp_path / "fake_racks.json").read_text())
    assert [r["strategy"] for r in report["results"]] == ["ddp", "atc", "awc", "canary"]
    run_matrix(settings(tmp_path, ["atc", "awc", "canary"]))       # nothing left: no run at all
    assert len(fake.calls) == 1


def test_repeat_keeps_each_cells_median_run_with_the_range_of_its_runs(tmp_path, monkeypatch):
    fake = FakeBench(slower=(1.0, 1.5, 0.8))
    monkeypatch.setattr(matrix, "run_bench", fake)
    with Progress(disable=True) as progress:
        task = progress.add_task("", total=6)
        report = matrix.run_profile(PROFILE, dataclasses.replace(settings(tmp_path, ["atc", "awc"]), repeat=3),
                                    progress, task)
        assert progress.tasks[0].completed == 6                 # each run's cells advance the bar
    assert fake.calls == [["ddp", "atc", "awc"]] * 3
    rows = {r["strategy"]: r for r in report["results"]}
    assert rows["atc"]["sync_s_median"] == pytest.approx(0.2)            # the median run: the first
    assert rows["atc"]["repeats"] == pytest.approx([0.2, 0.3, 0.16])     # every run's, in run order
    assert rows["atc"]["ddp_sync_s"] == pytest.approx(0.4)               # against its own run's ddp
    assert rows["atc"]["model_error"] == pytest.approx(rows["atc"]["predicted_s"] / 0.2 - 1)
    assert len({r["measured"] for r in report["results"]}) == 1
    text = (tmp_path / "fake_racks.md").read_text()
    assert "| `atc` | 0.200 (0.160–0.300) | 2.00× |" in text and "the median of 3 runs" in text
    assert "Rows from" not in text                                      # one invocation, not a resumed matrix


def test_a_repeated_cell_that_fails_in_some_runs_is_the_median_of_the_others():
    ok = [{"strategy": "atc", "status": "ok", "sync_s_median": s, "measured": "t"} for s in (0.3, 0.1)]
    failed = matrix.failed_row("atc", "rank 1 failed")
    rows = matrix.median_rows([[ok[0]], [failed], [ok[1]]])
    assert rows == [{**ok[1], "repeats": [0.3, 0.1]}]        # the lower middle of two
    assert matrix.median_rows([[failed], [failed]]) == [failed]
    assert matrix.median_rows([[ok[0]]]) == [ok[0]]          # one run: no repeats


def test_a_stop_in_a_later_run_keeps_the_runs_so_far(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "run_bench", FakeBench(interrupt="awc", interrupt_call=1, slower=(1.0, 2.0)))
    with pytest.raises(KeyboardInterrupt):
        run_matrix(dataclasses.replace(settings(tmp_path, ["atc", "awc"]), repeat=3))
    report = json.loads((tmp_path / "fake_racks.json").read_text())
    rows = {r["strategy"]: r for r in report["results"]}
    assert rows["atc"]["repeats"] == pytest.approx([0.2, 0.4]) and rows["awc"]["repeats"] == pytest.approx([0.8])
    assert report["meta"]["stopped"] == "stopped in run 2 of 3"              # the heading says how far it got
    assert "(stopped in run 2 of 3)" in (tmp_path / "fake_racks.md").read_text().splitlines()[2]


def test_a_resumed_profile_says_its_rows_come_from_several_runs():
    rows = [{"strategy": "ddp", "status": "ok", "measured": "2026-01-01T10:00:00"},
            {"strategy": "atc", "status": "ok", "measured": "2026-01-01T09:00:00"}]
    text = markdown_table({"cluster": "x", "world_size": 2, "payload_bytes": 2**20, "results": rows})
    assert "Rows from 2 runs" in text


def test_the_heading_names_only_the_runs_that_still_hold_a_row():
    """A profile measured again in full: its heading names that run alone and says the earlier
    ones hold no row; the JSON keeps the whole history."""
    runs = [{"created": f"2026-01-0{d}T10:00:00", "commit": f"c{d}", "command": f"run {d}"} for d in (1, 2, 3)]
    rows = [{"strategy": s, "status": "ok", "measured": runs[2]["created"]} for s in ("ddp", "atc")]
    report = {"cluster": "x", "world_size": 2, "payload_bytes": 2**20, "results": rows,
              "meta": {**runs[2], "runs": runs}}
    heading = markdown_table(report).splitlines()[2]
    assert "`run 3`" in heading and "`run 1`" not in heading and "`run 2`" not in heading
    assert "2 earlier run(s) hold no row now" in heading
    rows[1]["measured"] = runs[0]["created"]
    heading = markdown_table(report).splitlines()[2]
    assert heading.startswith("Runs: ") and "`run 1`" in heading and "`run 3`" in heading and "`run 2`" not in heading


def test_an_output_of_another_payload_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "run_bench", FakeBench())
    run_matrix(settings(tmp_path, ["atc"]))
    other = MatrixSettings(profiles=[PROFILE], strategies=["atc"], payload_bytes=2**21, out_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"fake_racks.json holds another matrix: payload_bytes 1048576"):
        run_matrix(other)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--matrix", "--json", "x.json"], "give --out DIR instead of --json"),
    (["bench", "--matrix", "--clusters", "nope"], "unknown profile 'nope'"),
    (["bench", "--matrix", "--strategies", "ddp,nope"], "--strategies: unknown nope"),
    (["bench", "--matrix", "--period", "3"], "not with --period"),
    (["bench", "--strategies", "ddp"], "--cluster is required"),
    (["bench", "--matrix", "--repeat", "0"], "--repeat must be at least 1, got 0"),
    (["bench", "--cluster", "local", "--json", "x.json", "--repeat", "3"], "--repeat belong to --matrix"),
])
def test_bad_matrix_arguments_fail_before_launch_naming_the_key(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(matrix, "run_bench", None)              # would fail loudly if reached
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_progress_counts_each_cell_once():
    with Progress(disable=True) as progress:
        task = progress.add_task("", total=2)
        echo = matrix.CellProgress(progress, task, "p", {"atc", "ddp"})
        echo.write("bench: ddp median 0.1 s/step\nother line\nbench: ddp med")
        echo.write("ian 0.1 s/step\nbench: atc median 0.2 s/step\n")
        assert progress.tasks[0].completed == 2 and echo.cells == set()


def test_the_scoreboard_script_puts_one_section_at_the_top_of_the_docs_and_replaces_it(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "run_bench", FakeBench(fail={"awc"}))
    run_matrix(settings(tmp_path, ["atc", "awc"]))
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nIntro.\n\n## Training\n\nOld notes.\n")
    scoreboard = load_script("scoreboard")
    assert scoreboard.main([str(tmp_path), "--docs", str(docs), "--no-png"]) == 0
    once = docs.read_text()
    assert once.index("## Scoreboard") < once.index("## Training") and once.startswith("# Benchmarks\n\nIntro.")
    assert "### `fake_racks` (3 ranks, 1.0 MB)" in once and "failed: rank 1 failed" in once
    assert "cells miss one" in once
    assert scoreboard.main([str(tmp_path), "--docs", str(docs), "--no-png"]) == 0
    assert docs.read_text() == once                                 # replaced in place, not added twice
    assert (tmp_path / "scoreboard.md").exists()


def test_make_figures_redraws_each_profile_chart_from_its_json_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "run_bench", FakeBench(fail={"awc"}))
    run_matrix(settings(tmp_path, ["atc", "awc"]))
    png, table = tmp_path / "fake_racks.png", tmp_path / "fake_racks.md"
    png.unlink()
    table.write_text("kept")
    assert load_script("scoreboard").main([str(tmp_path), "--png-only"]) == 0
    assert png.read_bytes().startswith(b"\x89PNG") and table.read_text() == "kept"   # charts only
    fig = matrix.scoreboard_chart(json.loads((tmp_path / "fake_racks.json").read_text()))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["vs DDP (×, higher is faster)", "bound ratio", "model error (%)"]
    labels = [t.get_text() for t in fig.axes[1].texts]
    assert len(labels) == 3 and labels[-1] == "n/a"                 # ddp, atc, then the failed awc
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_table_says_what_the_planner_would_have_picked_per_class_and_how_it_measured():
    """Per class, the pick is the fastest *predicted* measured row, held against the fastest
    *measured* one of that class; predictions beyond 15 % are named. Approximate rows never
    enter the exact class."""
    def row(name: str, measured: float, predicted: float) -> dict:
        return {"strategy": name, "status": "ok", "sync_s_median": measured, "predicted_s": predicted,
                "model_error": predicted / measured - 1}

    report = {"results": [row("ddp", 1.0, 1.05), row("flexreduce", 1.2, 0.9), row("diloco", 0.2, 0.1),
                          row("ds_sync", 0.5, 0.5), {"strategy": "canary", "status": "failed: x"}]}
    exact, approximate = matrix.planner_check(report)
    assert (exact["pick"], exact["best"], exact["pick_ok"]) == ("flexreduce", "ddp", False)
    assert exact["pick_slower"] == pytest.approx(0.2)
    assert set(exact["prediction_misses"]) == {"flexreduce"}
    assert (approximate["pick"], approximate["best"], approximate["pick_ok"]) == ("diloco", "diloco", True)
    assert set(approximate["prediction_misses"]) == {"flexreduce", "diloco"}
    lines = matrix.planner_lines(report)
    assert "`flexreduce`" in lines[0] and "+20 % against `ddp`" in lines[0] and "beyond 10 %" in lines[0]
    assert "the best" in lines[1]
    table = matrix.planner_table([{"cluster": "fake", **report}])
    assert "| fake | exact | `flexreduce` (0.900) | `ddp` (1.000) | 1.200 | **no** (+20 %) |" in table
    assert "within 10 % of the best measured of its class in 1 of 2 cells" in table
    assert "2 of 4 measured rows are predicted within ±15 %." in table     # flexreduce and diloco miss
    # a row of several runs whose range holds its prediction says so, in the planner and in its misses
    report["results"][2] = {**row("diloco", 0.2, 0.1), "repeats": [0.2, 0.09, 0.25]}
    approximate = matrix.planner_check(report)[1]
    assert approximate["inside_runs"] == {"diloco"} and "`diloco` -50 % (inside its runs)" in matrix.planner_lines(report)[1]
    assert "2 of 4 measured rows are predicted within ±15 %, and 1 more inside the range of their runs." in \
        matrix.planner_table([{"cluster": "fake", **report}])
    assert matrix.misses(report["results"][2]).endswith("(3 runs spread 80 %, the prediction inside them)")
    narrow = {**report["results"][2], "repeats": [0.2, 0.19, 0.21]}
    assert not matrix.within_runs(narrow) and matrix.misses(narrow).endswith("(3 runs spread 10 %)")


def test_reprice_keeps_the_measurements_and_prices_them_again_with_the_model_as_it_is(tmp_path, monkeypatch):
    import yaml

    from syncplane.cluster import load_profile

    monkeypatch.setattr(matrix, "run_bench", FakeBench())
    run_matrix(settings(tmp_path, ["atc", "awc"]))
    path = tmp_path / "fake_racks.json"
    report = json.loads(path.read_text())
    priced = {r["strategy"]: r["predicted_s"] for r in report["results"]}
    for row in report["results"]:          # as an older model had priced them
        row["predicted_s"], row["model_error"] = 99.0, 0.0
    path.write_text(json.dumps(report))
    (tmp_path / "fake_racks.yaml").write_text(yaml.safe_dump(PROFILE_SPEC))    # its profile, found beside it
    assert load_script("scoreboard").main([str(tmp_path), "--reprice", "--no-png"]) == 0
    again = json.loads(path.read_text())
    rows = {r["strategy"]: r for r in again["results"]}
    assert {name: r["predicted_s"] for name, r in rows.items()} == pytest.approx(priced)
    assert rows["atc"]["sync_s_median"] == pytest.approx(0.2)          # the measurement is kept
    assert rows["atc"]["model_error"] == pytest.approx(priced["atc"] / 0.2 - 1)
    assert again["meta"]["repriced"]["at"] and again["meta"]["command"] == report["meta"]["command"]
    with pytest.raises(ConfigError, match="profile 'two_racks' has 8 ranks, its report 3"):
        matrix.reprice(report, load_profile("two_racks"))


def test_reprice_prices_each_row_with_the_tcp_its_hosts_ran(monkeypatch) -> None:
    """A row is priced with the TCP measured under the congestion control of the run that
    measured it (``meta.runs``), whatever the profile says now; a run that does not say ran
    the machine's default, bbr on the VM image of every committed report."""
    from syncplane.cluster import cost, load_profile
    from syncplane.cluster.cost import IDEAL, LinkTcp

    asked = []

    def fake(congestion: str) -> LinkTcp:
        asked.append(congestion)
        return {"bbr": LinkTcp(goodput=0.5), "cubic": IDEAL}[congestion]

    monkeypatch.setattr(cost, "emulated_tcp", fake)
    old = {"created": "2026-11-30T01:00:00", "command": "bench --matrix"}
    new = {**old, "created": "2026-12-01T01:00:00", "tcp": "cubic"}
    rows = [{"strategy": "ddp", "status": "ok", "sync_s_median": 1.0, "measured": run["created"]} for run in (old, new)]
    report = {"cluster": "two_racks", "world_size": 8, "payload_bytes": 8 * 2**20, "results": rows,
              "meta": {**new, "runs": [old, new]}, "tcp_congestion": "cubic",
              "cpu_rates": {"per_element": {ADD: 1e-9}, "sharing": 4.0}}
    under_bbr, under_cubic = matrix.reprice(report, load_profile("two_racks"))["results"]
    assert sorted(asked) == ["bbr", "cubic"]
    wire = under_cubic["predicted_s"] - under_cubic["priced_above_bound"]["latency_s"]
    assert under_bbr["predicted_s"] - under_bbr["priced_above_bound"]["latency_s"] == pytest.approx(2 * wire)
    assert [matrix.ran_under(report, r) for r in rows] == ["bbr", "cubic"] and matrix.ran_under(report) == "cubic"
    assert matrix.ran_under({"results": []}) == "bbr"


def test_reprice_prices_the_cpu_work_at_the_rates_the_report_keeps() -> None:
    """A report keeps the CPU rates its predictions used (``cpu_rates``); a reprice on another
    machine prices at those, not at its own, and keeps them."""
    from syncplane.cluster import load_profile

    profile = load_profile("two_racks")
    row = {"strategy": "diloco", "status": "ok", "sync_s_median": 0.1}
    report = {"cluster": "two_racks", "world_size": 8, "payload_bytes": 2**20, "results": [row]}
    slow, fast = ({**report, "cpu_rates": {"per_element": {ADD: add}, "sharing": 4.0}} for add in (1e-6, 1e-9))
    priced = {name: matrix.reprice(r, profile) for name, r in (("slow", slow), ("fast", fast))}
    cpu = {name: r["results"][0]["predicted_cpu_s"] for name, r in priced.items()}
    assert cpu["slow"] == pytest.approx(1000 * cpu["fast"]) and cpu["fast"] > 0
    assert priced["slow"]["cpu_rates"]["per_element"][ADD] == 1e-6 and priced["slow"]["cpu_rates"]["sharing"] == 4.0
    mine = matrix.reprice(report, profile)           # none kept: this machine's, then kept
    assert mine["cpu_rates"]["per_element"][ADD] > 0
    # rows of two machines in one file: each priced at the rates of the machine that ran it
    both = {**fast, "results": [{**row, "cpu_rates": slow["cpu_rates"]}, {**row, "strategy": "diloco"}]}
    mixed = [r["predicted_cpu_s"] for r in matrix.reprice(both, profile)["results"]]
    assert mixed == pytest.approx([cpu["slow"], cpu["fast"]])


def test_what_the_model_prices_above_the_bound_adds_up_and_names_a_bound_miss() -> None:
    """The prediction over the bound, split into the per-phase latency, TCP's sharing of the
    links and the CPU work: the terms sum to the gap, the latency is α per phase, and a row
    below the bound's target names them, largest first."""
    from syncplane.cluster import load_profile
    from syncplane.cluster.cost import DEFAULT_ALPHA_S

    profile = load_profile("two_racks")
    rows = [{"strategy": name, "status": "ok", "sync_s_median": 10.0} for name in ("ddp", "diloco")]
    report = {"cluster": "two_racks", "world_size": 8, "payload_bytes": 25 * 2**20, "results": rows,
              "cpu_rates": {"per_element": {ADD: 1e-8}, "sharing": 4.0}}
    ddp, diloco = matrix.reprice(report, profile)["results"]
    for row in (ddp, diloco):
        above = row["priced_above_bound"]
        assert sum(above.values()) == pytest.approx(row["predicted_s"] - row["bound_s"])
        assert above["tcp_s"] > 0 and above["latency_s"] > 0
    assert ddp["priced_above_bound"]["latency_s"] == pytest.approx(2 * 7 * DEFAULT_ALPHA_S)   # a ring of 8: 14 phases
    assert ddp["priced_above_bound"]["cpu_s"] == pytest.approx(0.0) and diloco["priced_above_bound"]["cpu_s"] > 0
    tcp = ddp["priced_above_bound"]["tcp_s"]
    assert matrix.misses({**ddp, "bound_ratio": 0.5}).endswith(f"(priced above the bound: TCP sharing {tcp:.3g} s)")
    assert "priced above" not in matrix.misses({**ddp, "bound_ratio": 0.9, "model_error": -0.5})
    # a pessimistic model on a row that meets the bound: where its excess sits, not counted as a cause
    pessimistic = {**ddp, "bound_ratio": 0.9, "sync_s_median": ddp["bound_s"] + 0.01,
                   "model_error": ddp["predicted_s"] / (ddp["bound_s"] + 0.01) - 1}
    gap = ddp["predicted_s"] - ddp["bound_s"]
    assert f"priced {gap:.3g} s above the bound where 0.01 s was measured: TCP sharing {tcp:.3g} s" in \
        matrix.misses(pessimistic)
    assert not matrix.explained(pessimistic)


def test_the_machines_cpu_shares_come_from_proc_stat_ticks():
    from syncplane.bench.worker import machine_cpu_shares, machine_cpu_ticks

    before = machine_cpu_ticks("cpu  100 0 50 800 10 0 40 0 0 0\ncpu0 1 2 3\n")
    after = machine_cpu_ticks("cpu  160 10 70 810 10 0 90 0 0 0\ncpu0 1 2 3\n")
    # 150 ticks passed: 70 user (with nice), 70 kernel (20 system + 50 softirq), 10 idle
    assert machine_cpu_shares(before, after) == pytest.approx({"busy": 140 / 150, "user": 70 / 150,
                                                               "kernel": 70 / 150})
    assert machine_cpu_shares(before, before)["busy"] == 0.0
    live = machine_cpu_ticks()                               # this machine's, read for real
    assert set(live) == {"user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"}
    assert live["idle"] > 0


@pytest.mark.parametrize("warmup, sync_warmup, steps, period", [(1, 0, 3, 10), (0, 1, 3, 10), (2, 0, 5, 3),
                                                                   (1, 0, 5, 1), (0, 0, 3, 10), (12, 0, 20, 10)])
def test_a_periodic_syncs_warmup_runs_a_whole_round_and_the_timed_steps_whole_rounds(warmup, sync_warmup, steps, period):
    from syncplane.bench.worker import step_counts

    untimed, timed = step_counts(warmup, sync_warmup, steps, period)
    rounds = [s for s in range(untimed + timed) if (s + 1) % period == 0]   # where DiLoCo's rounds fall
    assert untimed % period == 0 and timed % period == 0 and timed >= steps
    assert len([s for s in rounds if s >= untimed]) == timed // period      # the timed steps: whole rounds
    if max(warmup, sync_warmup) > 0:                  # a warm-up asked for: the first round is in it
        assert rounds[0] < untimed
    else:
        assert untimed == 0


@pytest.mark.parametrize("busy, drops, error, cause", [
    (0.97, None, 0.0, "bound ratio < 0.8 (CPU 97 % busy: ranks 3.2 core-s/step, kernel 41 %)"),
    (0.97, 12.0, 0.3, "bound ratio < 0.8; model error beyond ±10 % (CPU 97 % busy: ranks 3.2 core-s/step, "
                      "kernel 41 %; 12 uplink drops/step)"),
    (0.50, 12.0, 0.0, "bound ratio < 0.8 (12 uplink drops/step)"),
    (0.50, 0.0, 0.0, "bound ratio < 0.8"),
])
def test_a_miss_names_what_was_measured_beside_it(busy, drops, error, cause):
    row = {"status": "ok", "bound_ratio": 0.5, "model_error": error, "rank_cpu_s": 3.2, "uplink_drops": drops,
           "machine_cpu": {"busy": busy, "user": busy - 0.41, "kernel": 0.41, "cores": 2},
           "sync_s_median": 4.0, "bound_s": 2.0}     # 2 s above the bound, 1.6 s of the ranks' CPU per core
    assert matrix.misses(row) == cause
    assert matrix.misses({**row, "bound_ratio": 0.9, "model_error": 0.0}) == ""    # no miss: nothing to explain
    text = markdown_table({"cluster": "x", "world_size": 2, "payload_bytes": 2**20,
                           "results": [{**row, "strategy": "canary", "sync_s_median": 1.0}]})
    assert f" {busy * 100:.0f} % | {cause} |" in text


def test_ranks_cpu_that_fills_the_gap_to_the_bound_is_named_when_the_cores_are_not_saturated():
    row = {"status": "ok", "bound_ratio": 0.67, "model_error": 0.0, "rank_cpu_s": 1.6, "uplink_drops": None,
           "machine_cpu": {"busy": 0.82, "user": 0.66, "kernel": 0.15, "cores": 2},
           "sync_s_median": 1.726, "bound_s": 1.16}
    assert matrix.misses(row) == ("bound ratio < 0.8 (ranks' CPU 1.6 core-s/step, 0.80 s on 2 cores: more than "
                                  "the 0.57 s above the bound)")
    assert matrix.misses({**row, "rank_cpu_s": 1.0}) == "bound ratio < 0.8"     # 0.50 s: not enough to say


def test_bytes_left_by_one_nic_of_several_are_named():
    row = {"status": "ok", "bound_ratio": 0.63, "model_error": 0.0,
           "nic_bytes_by_host": {"n0": {"eth0": 77e6, "eth1": 400.0}, "n1": {"eth0": 76e6, "eth1": 300.0}}}
    assert matrix.misses(row) == "bound ratio < 0.8 (one NIC of 2 sent 100 % of a host's bytes)"
    spread = {"n0": {"eth0": 40e6, "eth1": 37e6}, "n1": {"eth0": 39e6, "eth1": 38e6}}
    assert matrix.misses({**row, "nic_bytes_by_host": spread}) == "bound ratio < 0.8"
    assert matrix.misses({**row, "nic_bytes_by_host": {"a": {"eth0": 1e6}}}) == "bound ratio < 0.8"   # one NIC each
    uneven = {**row["nic_bytes_by_host"], "n2": {"eth0": 70e6}}     # a host of one NIC: gloo lists one on every rank
    assert matrix.misses({**row, "nic_bytes_by_host": uneven}) == "bound ratio < 0.8"
