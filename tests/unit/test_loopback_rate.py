"""A host's loopback rate, timed on this machine (``syncplane.algorithms.ddp.timing``) and read
by the cost model in place of a constant: where it is measured, what it prices, and that
the timing is a real gloo group's. Pricing asserts use made-up rates, so none depends on
this machine's speed."""

from __future__ import annotations

import pytest

from syncplane.algorithms import plan
from syncplane.algorithms.ddp import timing
from syncplane.algorithms.plan import PlanInputs, make_plan, with_loopback
from syncplane.bench.runner import report_rows
from syncplane.cluster import load_profile
from syncplane.cluster.cost import DEFAULT_LOOPBACK_BPS, EMULATED_TCP, CostModel
from syncplane.exchanges.cpu import ADD, LOOPBACK_ELEMENTS, CpuRates, CpuWork, loopback_op, loopback_ranks

PAYLOAD = 97.5e6


def rates_with_loopback(bytes_per_s: float, ranks: int = 4) -> CpuRates:
    return CpuRates({ADD: 1e-10, loopback_op(ranks): 4.0 / bytes_per_s}, sharing=2.0)


def test_the_op_is_named_by_its_size_and_group_and_prices_no_cpu_work() -> None:
    assert loopback_op(4) == f"loopback@{LOOPBACK_ELEMENTS}x4" != loopback_op(3)
    assert [loopback_ranks(n) for n in (1, 2, 4, 8, 12)] == [2, 2, 4, 8, 8]
    work = timing.loopback_work(4)
    assert set(work.timers) == {loopback_op(4)} and not any(work.elements.values())
    rates = rates_with_loopback(5e9)
    assert rates.seconds(work) == 0.0                       # a capacity, not CPU seconds
    assert rates.loopback_bytes_per_s(4) == pytest.approx(5e9)
    assert rates.loopback_bytes_per_s(3) is None            # timed with another group: not read
    assert CpuRates({ADD: 1e-10}).loopback_bytes_per_s(4) is None


def test_only_a_cluster_with_several_ranks_on_a_host_times_its_loopback(monkeypatch) -> None:
    asked: list[CpuWork] = []
    monkeypatch.setattr(plan, "calibrate", lambda work, sharing: asked.append(work) or CpuRates({}, sharing))
    inputs = PlanInputs(int(PAYLOAD))
    plan.measured_cpu(load_profile("local"), [("ddp", {})], inputs, 2.0)              # 4 ranks on one host
    plan.measured_cpu(load_profile("uneven_hosts"), [("ddp", {})], inputs, 5.0)       # hosts of 3, 2 and 1
    plan.measured_cpu(load_profile("homogeneous8"), [("ddp", {})], inputs, 4.0)       # one rank per host
    assert [set(w.timers) for w in asked] == [{loopback_op(4)}, {loopback_op(3)}, set()]


def test_the_model_prices_a_hosts_loopback_at_the_rate_its_rates_hold() -> None:
    """DDP on one host is loopback only: twice the rate, half the wire (α apart)."""
    profile = load_profile("local")
    model = CostModel(profile, tcp=EMULATED_TCP)
    assert with_loopback(model, None) is model and with_loopback(model, CpuRates({ADD: 1e-10})) is model
    slow = make_plan(profile, PlanInputs(int(PAYLOAD), strategies=("ddp",), cpu=rates_with_loopback(2e9)))
    fast = make_plan(profile, PlanInputs(int(PAYLOAD), strategies=("ddp",), cpu=rates_with_loopback(4e9)))
    ddp_slow, ddp_fast = (next(c for c in p.candidates if c.strategy == "ddp") for p in (slow, fast))
    wire = [c.sync_s - c.cpu_s for c in (ddp_slow, ddp_fast)]
    assert wire[0] == pytest.approx(2 * wire[1], rel=0.1)
    assert ddp_slow.bound_s == pytest.approx(2 * ddp_fast.bound_s, rel=0.1)
    # without a measured rate the model keeps its default
    default = make_plan(profile, PlanInputs(int(PAYLOAD), strategies=("ddp",), cpu=CpuRates({ADD: 1e-10}, 2.0)))
    assert next(c for c in default.candidates if c.strategy == "ddp").bound_s == pytest.approx(
        ddp_slow.bound_s * 2e9 / DEFAULT_LOOPBACK_BPS, rel=0.1)


def test_a_bench_row_is_priced_at_the_loopback_of_the_machine_that_measured_it() -> None:
    profile, measured = load_profile("local"), {"step_s": [0.2], "comm_bytes": [0.0], "nic_tx_bytes": [0.0] * 4}
    rows = [report_rows(profile, ["ddp"], int(PAYLOAD), {"ddp": measured}, cpu=rates_with_loopback(rate))[0]
            for rate in (2e9, 4e9)]
    assert rows[0]["bound_s"] == pytest.approx(2 * rows[1]["bound_s"], rel=0.1)
    assert rows[0]["model_error"] > rows[1]["model_error"]


def test_the_loopback_is_timed_in_a_real_gloo_group_of_child_processes() -> None:
    """Two children on loopback run the baseline's bucketed all-reduce: a rate, not a stub."""
    seconds = timing.seconds_per_element(2, numel=1 << 18)
    assert 0 < seconds < 1e-6              # 4 bytes per element: more than 4 MB/s
