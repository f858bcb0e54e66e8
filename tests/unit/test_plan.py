"""``syncplane plan`` (``syncplane.algorithms.plan``): every strategy and its settings priced by
the cost model ``simulate`` uses, the compute its overlap window hides taken off, ranked, exact
and approximate apart; what cannot run is excluded with its reason (issue 36)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from syncplane import algorithms
from syncplane.algorithms.plan import PlanInputs, check_accept, make_plan
from syncplane.algorithms.spec import CostOptions
from syncplane.cli import main
from syncplane.cluster import load_profile
from syncplane.cluster.cost import EMULATED_TCP, CostModel
from syncplane.config import ConfigError

MB = 2**20


def test_every_registered_strategy_is_priced_exact_and_approximate_apart() -> None:
    plan = make_plan(load_profile("two_racks"), PlanInputs(100 * MB, compute_s=0.3))
    priced = {c.strategy for c in plan.candidates}
    assert priced == set(algorithms.strategy_names())
    assert {c.strategy for c in plan.candidates if c.exact} == {"ddp", "flexreduce"}
    steps = [c.step_s for c in plan.candidates]
    assert steps == sorted(steps)
    assert plan.best("exact").strategy == "flexreduce"    # the uneven uplink: FlexReduce's tree beats the ring
    # the variants: DiLoCo's streams x exchanges at its H, DS-Sync's pair streams
    diloco = [c for c in plan.candidates if c.strategy == "diloco"]
    assert {(c.kwargs["streams"], c.kwargs["exchange"]) for c in diloco} == \
        {(s, e) for s in (1, 2, 4, 8, 16) for e in ("mesh", "tree", "gather")}
    assert all(c.kwargs["sync_every"] == 10 and c.period == 10 for c in diloco)
    assert {c.kwargs["pair_streams"] for c in plan.candidates if c.strategy == "ds_sync"} == {1, 2, 4}


def test_prices_are_simulates_minus_the_compute_the_overlap_window_hides() -> None:
    profile, compute = load_profile("two_racks"), 0.9
    plan = make_plan(profile, PlanInputs(50 * MB, compute_s=compute))
    by = {c.label: c for c in plan.candidates}
    model = CostModel(profile, tcp=EMULATED_TCP)        # the plan's default: TCP as measured on the emulator
    ddp_sync = algorithms.strategy_times(model, "ddp", 50 * MB).predicted_s
    ideal = make_plan(profile, PlanInputs(50 * MB, compute_s=compute, tcp="ideal"))   # simulate's formula
    ideal_ddp = {c.label: c for c in ideal.candidates}["ddp"].sync_s
    assert ideal_ddp == pytest.approx(algorithms.strategy_times(CostModel(profile), "ddp", 50 * MB).predicted_s)
    assert ideal_ddp < ddp_sync
    assert by["ddp"].sync_s == pytest.approx(ddp_sync)
    assert by["ddp"].hidden_s == pytest.approx(2 * compute / 3)        # behind the backward
    assert by["ddp"].step_s == pytest.approx(compute + max(0.0, ddp_sync - 2 * compute / 3))
    assert by["awc"].hidden_s == pytest.approx(compute)               # behind forward and backward
    tree4 = by["diloco sync_every=10 streams=4 exchange=tree"]
    assert tree4.overlap is None and tree4.hidden_s == 0.0
    expected = algorithms.strategy_times(model, "diloco", 50 * MB, CostOptions(10, 4, "tree")).predicted_s
    assert tree4.sync_s == pytest.approx(expected) and tree4.step_s == pytest.approx(compute + expected)


def test_the_predicted_step_takes_the_slowest_ranks_compute() -> None:
    """mixed_gpus: two hosts at compute_speed 0.5, so a 0.1 s step (at speed 1) is 0.2 s on
    them, and every strategy waits for them; an equal-speed profile keeps 0.1 s."""
    profile, compute = load_profile("mixed_gpus"), 0.1
    assert min(profile.compute_speeds()) == 0.5
    by = {c.label: c for c in make_plan(profile, PlanInputs(50 * MB, compute_s=compute)).candidates}
    slowest = compute / 0.5
    for label in ("ddp", "atc", "awc"):
        c = by[label]
        assert c.hidden_s == pytest.approx({"ddp": 2 * slowest / 3, "atc": slowest / 3, "awc": slowest}[label])
        assert c.step_s == pytest.approx(slowest + max(0.0, c.sync_s - c.hidden_s))
    even = {c.label: c for c in make_plan(load_profile("homogeneous8"), PlanInputs(50 * MB, compute)).candidates}
    assert even["ddp"].step_s == pytest.approx(compute + max(0.0, even["ddp"].sync_s - 2 * compute / 3))


def test_a_longer_period_amortizes_the_round() -> None:
    profile = load_profile("wan_two_sites")
    h10, h20 = (make_plan(profile, PlanInputs(40 * MB, 0.1, period=h, strategies=("diloco",))) for h in (10, 20))
    first = h10.candidates[0].label.replace("sync_every=10", "sync_every=20")
    assert {c.label: c.sync_s for c in h20.candidates}[first] == pytest.approx(h10.candidates[0].sync_s / 2)


def test_what_cannot_run_is_excluded_with_its_reason() -> None:
    flat = make_plan(load_profile("two_racks"), PlanInputs(10 * MB, 0.01, strategies=("canary",)))
    assert [(e.strategy, e.kwargs) for e in flat.excluded] == [("canary", {"exchange": "cube"})]
    assert "cube needs a BCube cluster profile" in flat.excluded[0].reason
    cube = make_plan(load_profile("bcube_3_2"), PlanInputs(10 * MB, 0.01, strategies=("canary",)))
    assert "canary exchange=cube" in {c.label for c in cube.candidates}


def test_no_candidate_in_the_accepted_class_names_each_exclusion() -> None:
    plan = make_plan(load_profile("two_racks"), PlanInputs(10 * MB, 0.01, strategies=("canary",)))
    with pytest.raises(ConfigError, match=r"no exact candidate can run on this job \(8 ranks on 'two_racks'\); "
                                          r"excluded: canary exchange=cube: exchange: cube needs .*; "
                                          r"canary: approximate \(accept=approximate allows it\)"):
        plan.best("exact")
    assert plan.best("approximate").label == "canary exchange=nested"


def test_accept_is_checked_by_name() -> None:
    assert check_accept("approximate") == "approximate"
    with pytest.raises(ConfigError, match=r"strategy.kwargs.accept: allowed values: exact, approximate; got 'exakt'"):
        check_accept("exakt")
    with pytest.raises(ConfigError, match="strategies: unknown nope"):
        make_plan(load_profile("two_racks"), PlanInputs(MB, strategies=("nope",)))


def test_the_cli_writes_table_json_png_and_the_winners_command(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    # not torch's hooks: their step is timed in a group of 8 at this payload (~40 s); the next test prices them
    assert main(["plan", "--cluster", "two_racks", "--mb", "resnet50", "--compute-ms", "300", "--json", str(out),
                 "--strategies", "ddp,flexreduce,ds_sync,atc,diloco,canary"]) == 0
    text = capsys.readouterr().out
    assert "best exact: flexreduce" in text and "best approximate: " in text and "│ ddp " in text
    data = json.loads(out.read_text())
    assert data["best_exact"]["strategy"] == "flexreduce"
    assert data["best_exact"]["command"] == "python train.py strategy=flexreduce cluster=two_racks trainer.devices=8"
    assert data["inputs"]["compute_s"] == pytest.approx(0.3) and data["world_size"] == 8
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert main(["plan", "--cluster", "two_racks", "--compute-ms", "3"]) == 2
    assert "give the payload as --mb MB" in capsys.readouterr().err
    assert main(["plan", "--cluster", "two_racks", "--mb", "1", "--compute-ms", "3", "--strategies", "canary"]) == 2
    assert "no exact candidate can run on this job" in capsys.readouterr().err


def test_the_cli_prices_the_cpu_work_as_asked_and_as_the_bench_does(tmp_path: Path) -> None:
    """``--cpu``: every rank of the cluster on this machine's cores (the default with
    ``--cluster``: the bench's pricing, so its table's *plan's pick* is this command's), each
    host's ranks on cores like these (``host``), or no CPU term (``none``)."""
    import os

    from syncplane.bench.runner import emulator_cpu_rates, price_row

    profile, cores = load_profile("uneven_hosts"), len(os.sched_getaffinity(0))

    def planned(*extra: str) -> dict:
        out = tmp_path / "plan.json"
        assert main(["plan", "--cluster", "uneven_hosts", "--mb", "8", "--compute-ms", "0", "--json", str(out),
                     "--strategies", "ddp,canary,torch_powersgd", *extra]) == 0
        return json.loads(out.read_text())

    emulated, host, none = planned(), planned("--cpu", "host"), planned("--cpu", "none")
    assert emulated["inputs"]["cpu"]["sharing"] == pytest.approx(profile.world_size / cores)
    assert host["inputs"]["cpu"]["sharing"] == pytest.approx(max(h.spec.ranks for h in profile.hosts) / cores)
    assert none["inputs"]["cpu"] is None and all(c["cpu_s"] == 0 for c in none["candidates"])
    by = {mode: {c["label"]: c for c in plan["candidates"]} for mode, plan in
          (("emulated", emulated), ("host", host), ("none", none))}
    for label in ("canary exchange=mesh", "torch_powersgd"):
        assert by["emulated"][label]["cpu_s"] > by["host"][label]["cpu_s"] > 0
        assert by["none"][label]["sync_s"] < by["emulated"][label]["sync_s"]
    # the bench prices each row as this plan does: the same number for the same strategy
    rates = emulator_cpu_rates(profile, ["ddp", "canary", "torch_powersgd"], 8 * MB, None, {})
    for name in ("ddp", "torch_powersgd"):
        row: dict = {}
        price_row(row, CostModel(profile, tcp=EMULATED_TCP), name, 8 * MB, 0.0, None, {}, rates)
        assert row["predicted_s"] == pytest.approx(by["emulated"][name]["sync_s"])
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", "uneven_hosts", "--mb", "8", "--compute-ms", "0", "--cpu", "gpu"])


def test_ddp_is_kept_unless_another_is_predicted_clearly_faster() -> None:
    """``choose_candidate``: the fastest, unless DDP is predicted within ``BASELINE_MARGIN`` of
    it (the model's own error on DDP); ``Plan.best`` and the bench's planner check both use it."""
    from syncplane.algorithms.plan import BASELINE_MARGIN, choose_candidate
    from syncplane.bench.matrix import planner_check

    def pick(steps: dict[str, float]) -> str:
        ranked = sorted(steps.items(), key=lambda kv: kv[1])
        return choose_candidate(ranked, lambda kv: kv[1], lambda kv: kv[0])[0]

    near = 1 - BASELINE_MARGIN / 2
    assert pick({"flexreduce": near, "ddp": 1.0}) == "ddp"
    assert pick({"flexreduce": 1 - 2 * BASELINE_MARGIN, "ddp": 1.0}) == "flexreduce"
    assert pick({"flexreduce": near, "diloco": 0.5}) == "diloco"                  # no DDP among them
    assert pick({"ddp": 1.0, "flexreduce": 1.2}) == "ddp"
    rows = [{"strategy": "ddp", "status": "ok", "predicted_s": 1.0, "sync_s_median": 1.0, "model_error": 0.0},
            {"strategy": "flexreduce", "status": "ok", "predicted_s": near, "sync_s_median": 1.3, "model_error": 0.0}]
    exact = next(c for c in planner_check({"results": rows}) if c["accept"] == "exact")
    assert exact["pick"] == "ddp" and exact["pick_ok"]
