"""The CPU term of the cost model (``syncplane.exchanges.cpu``): its calibration (measured once,
cached, read back) and that it is added to the price of the strategies that pay it. Rates in
the pricing tests are made up, so no assert depends on this machine's speed."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict

import pytest

from syncplane.algorithms import spec_for, strategy_times
from syncplane.algorithms.plan import PlanInputs
from syncplane.algorithms.spec import CostOptions
from syncplane.bench.runner import report_rows
from syncplane.cluster import load_profile
from syncplane.cluster.cost import EMULATED_TCP, CostModel
from syncplane.comm import ChunkedTopK, make_codec
from syncplane.exchanges import cpu, digit, gather, mesh
from syncplane.exchanges.cpu import ADD, CpuRates, CpuWork, calibrate, decode_op, encode_op

SPARSE = ChunkedTopK(density=0.01)
INT8 = make_codec("int8")


def made_up_rates(work: CpuWork, sharing: float = 1.0) -> CpuRates:
    """1 ns per element for every op ``work`` names, 2 ns for encoding."""
    return CpuRates({op: (2e-9 if op.startswith("encode:") else 1e-9) for op in work.elements}, sharing)


def test_calibration_measures_add_and_each_codec_then_reads_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "rates.json"
    work = cpu.coded(SPARSE, 1, 1) + cpu.coded(INT8, 1, 1) + cpu.coded(make_codec("none"), 1, 1)
    rates = calibrate(work, cache=cache, numel=4096)
    assert set(rates.per_element) == {ADD, encode_op(SPARSE), decode_op(SPARSE), encode_op(INT8), decode_op(INT8)}
    assert all(s > 0 for s in rates.per_element.values())
    assert json.loads(cache.read_text())[cpu.machine_key()] == rates.per_element

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although the cache holds every rate")

    monkeypatch.setattr(cpu, "measure", no_measuring)
    again = calibrate(cpu.coded(SPARSE, 1, 1), cache=cache, sharing=3.0)
    assert again.per_element == {op: rates.per_element[op] for op in (ADD, decode_op(SPARSE), encode_op(SPARSE))}
    assert again.sharing == 3.0


def test_another_processor_under_the_same_host_name_is_measured_again(tmp_path, monkeypatch):
    """Two VMs from one image share a host name; their rates must not be shared."""
    cache = tmp_path / "rates.json"
    calibrate(cpu.coded(INT8, 1, 1), cache=cache, numel=1024)
    monkeypatch.setattr(cpu, "cpu_model", lambda: "Another CPU")
    calibrate(cpu.coded(INT8, 1, 1), cache=cache, numel=1024)
    keys = list(json.loads(cache.read_text()))
    assert len(keys) == 2 and cpu.machine_key() in keys and "|Another CPU|" in cpu.machine_key()


def test_a_broken_cache_is_measured_again(tmp_path):
    cache = tmp_path / "rates.json"
    cache.write_text("not json")
    assert calibrate(cpu.coded(INT8, 1, 1), cache=cache, numel=1024).per_element[encode_op(INT8)] > 0
    assert encode_op(INT8) in json.loads(cache.read_text())[cpu.machine_key()]


def test_seconds_is_elements_times_rates_times_sharing_and_names_a_missing_rate():
    work = cpu.feedback_encoded(INT8, 100) + CpuWork.adds(50)
    assert work.elements == {encode_op(INT8): 100, decode_op(INT8): 100, ADD: 350}
    rates = CpuRates({encode_op(INT8): 3.0, decode_op(INT8): 2.0, ADD: 1.0})
    assert rates.seconds(work) == pytest.approx(300 + 200 + 350)
    assert rates.shared(4).seconds(work) == pytest.approx(4 * 850)
    assert rates.shared(0.5).seconds(work) == pytest.approx(850)        # a core per rank at most
    with pytest.raises(KeyError, match="encode:ChunkedTopK"):
        rates.seconds(cpu.coded(SPARSE, 1, 1))


def test_exchange_work_follows_what_each_exchange_runs():
    m = 1000.0
    # the nested exchange on hosts of 2 in 2 racks, the in-host level exact: only the rack
    # level's half of the held values and the owned mean are encoded; every piece decoded at the end
    nested = digit.nested_cpu_work([2, 2], m, SPARSE, exact_levels=[0]).elements
    assert nested == {encode_op(SPARSE): 500, decode_op(SPARSE): 1750, ADD: 4250}
    assert digit.cube_cpu_work(3, 2, m, SPARSE).elements == digit.nested_cpu_work([3, 3], m, SPARSE).elements
    # the gather decodes all n pieces, each a pass over the buffer
    assert gather.cpu_work(4, m, SPARSE).elements[decode_op(SPARSE)] == 1000 + 4 * 1000
    # exact fp32 codes nothing: sums and copies only
    assert set(mesh.cpu_work(4, m, make_codec("none")).elements) == {ADD}
    assert mesh.cpu_work(1, m, INT8).elements == {}


def test_the_cpu_term_is_added_to_the_price_of_the_strategies_that_pay_it():
    profile = load_profile("wan_two_sites")
    model = CostModel(profile, tcp=EMULATED_TCP)
    payload = 5 * 2**20
    options = CostOptions(period=10, pattern="gather", compression="sparse", density=0.01)
    work = spec_for("diloco").cpu("diloco", profile, payload, options)
    assert work.elements[encode_op(SPARSE)] == payload // 4
    rates = made_up_rates(work, sharing=2.0)
    wire = strategy_times(model, "diloco", payload, options)
    both = strategy_times(model, "diloco", payload, options, rates)
    assert wire.cpu_s == 0.0
    assert both.cpu_s == pytest.approx(rates.seconds(work) / 10)          # one round per period of 10 steps
    assert both.predicted_s == pytest.approx(wire.predicted_s + both.cpu_s)
    assert (both.bound_s, both.network_bound_s) == (wire.bound_s, wire.network_bound_s)   # bounds stay the wire's
    ddp = strategy_times(model, "ddp", payload, CostOptions(), rates)
    assert ddp.cpu_s == 0.0
    canary = spec_for("canary").cpu("canary", load_profile("two_racks"), payload, CostOptions())
    assert any(op.startswith("encode:GradientSketch") for op in canary.elements)


def test_canary_colayers_in_flight_overlap_their_cpu_work_with_the_wire():
    """ResNet-50's payload in colayers, two in flight: the longer of the wire (the rack's hops
    under the uplink's, ``CostModel.pipelined``) and the CPU work, plus the first colayer's
    share of the shorter; one in flight (or one colayer): their sum."""
    from syncplane.algorithms import overlapped
    from syncplane.algorithms.plan import cost_options

    profile = load_profile("two_racks")
    model = CostModel(profile, tcp=EMULATED_TCP)
    payload = 97.49 * 2**20
    rates = made_up_rates(spec_for("canary").cpu("canary", profile, payload, CostOptions()))
    assert overlapped(3.0, 1.0, 4) == 3.25 and overlapped(1.0, 3.0, 4) == 3.25 and overlapped(3.0, 1.0, 1) == 4.0
    inputs = PlanInputs(payload, cpu=rates)
    piped, serial = (strategy_times(model, "canary", payload, cost_options("canary", kwargs, inputs), rates)
                     for kwargs in ({}, {"colayers_in_flight": 1}))
    # what stands outside the pipeline is the first colayer's share (4 of 97.49 MiB by default)
    assert cost_options("canary", {}, inputs).parts == pytest.approx(97.49 / 4)
    assert cost_options("canary", {"first_bucket_cap_mb": 25}, inputs).parts == pytest.approx(97.49 / 25)
    assert cost_options("canary", {"colayers_in_flight": 1}, inputs).parts == 1
    assert cost_options("canary", {}, inputs).lanes == 2 and cost_options("canary", {"colayers_in_flight": 1}, inputs).lanes == 1
    (phases,) = spec_for("canary").cost("canary", profile, payload, cost_options("canary", {}, inputs))
    wire = model.pipelined(phases, 2, 4 / 97.49)
    assert wire < serial.predicted_s - serial.cpu_s == pytest.approx(model.time(phases))
    assert piped.cpu_s == serial.cpu_s > 0
    assert piped.predicted_s == pytest.approx(max(wire, piped.cpu_s) + min(wire, piped.cpu_s) * 4 / 97.49)
    assert piped.bound_s < serial.bound_s == pytest.approx(model.bound(phases))
    one = 2 * 2**20                                               # one colayer: nothing to overlap
    assert cost_options("canary", {}, PlanInputs(one, cpu=rates)).parts == 1


def test_the_bench_row_shows_the_cpu_part_and_the_wire_only_error():
    profile, payload = load_profile("wan_two_sites"), 5 * 2**20
    options = {"compression": "sparse", "exchange": "gather", "density": 0.01}
    work = spec_for("diloco").cpu("diloco", profile, payload, CostOptions(period=10, pattern="gather",
                                                                          compression="sparse", density=0.01))
    measured = {"diloco": {"step_s": [0.02] * 10, "comm_bytes": [1.0] * 4, "nic_tx_bytes": [1.0] * 4}}
    (wire,) = report_rows(profile, ["diloco"], payload, measured, period=10, **options)
    (row,) = report_rows(profile, ["diloco"], payload, measured, period=10, cpu=made_up_rates(work), **options)
    assert row["predicted_cpu_s"] > 0 and wire["predicted_cpu_s"] == 0
    assert row["predicted_s"] == pytest.approx(wire["predicted_s"] + row["predicted_cpu_s"])
    assert row["model_error_wire"] == pytest.approx(wire["model_error"])


def test_plan_inputs_read_back_their_rates():
    inputs = PlanInputs(2**20, cpu=CpuRates({ADD: 1e-9}, 2.0))
    assert PlanInputs(**asdict(inputs)).cpu == inputs.cpu


def test_a_timed_op_is_measured_once_by_its_own_timer_then_read_from_the_cache(tmp_path):
    cache, calls = tmp_path / "rates.json", []

    def timer(numel: int) -> float:
        calls.append(numel)
        return 7e-9

    work = CpuWork(Counter({"hook:x": 10}), timers={"hook:x": timer}) + CpuWork.adds(5)
    assert set(work.timers) == {"hook:x"} and work.elements == {"hook:x": 10, ADD: 5}
    rates = calibrate(work, cache=cache, numel=4096)
    assert rates.per_element["hook:x"] == 7e-9 and calls == [10]      # timed on the elements it prices
    assert calibrate(work, cache=cache, numel=4096).per_element["hook:x"] == 7e-9
    assert calls == [10]          # the cache answered
    assert rates.seconds(work) == pytest.approx(70e-9 + 5 * rates.per_element[ADD])
