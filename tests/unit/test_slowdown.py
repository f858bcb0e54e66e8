"""Emulated slow compute (issue 37): the plan every rank makes from the profile's
``compute_speed`` and ``fault.kind=slow``, and the wait that stretches a rank's steps."""

from __future__ import annotations

import pytest

from syncplane.cluster import load_profile, parse_profile
from syncplane.config import ConfigError
from syncplane.runtime.settings import FaultSettings, parse_faults
from syncplane.runtime.slowdown import ComputeReport, SlowCompute, Slowdown, plan_slowdowns

HETEROGENEOUS = {"name": "mixed", "racks": [{"name": "r0", "hosts": [
    {"name": "a", "nic_mbit": 400, "ranks": 2}, {"name": "b", "nic_mbit": 400, "compute_speed": 0.5},
    {"name": "c", "nic_mbit": 400, "compute_speed": 1.0}]}]}


def test_the_fastest_host_sets_the_pace_and_a_slow_fault_multiplies() -> None:
    speeds = parse_profile(HETEROGENEOUS).compute_speeds()
    assert speeds == [1.0, 1.0, 0.5, 1.0]
    assert plan_slowdowns(speeds, []) == {2: Slowdown(base=2.0)}
    slow = parse_faults([{"kind": "slow", "rank": 2, "factor": 1.5, "step": 4},
                         {"kind": "kill", "rank": 0, "step": 9}])
    plan = plan_slowdowns(speeds, slow)
    assert plan == {2: Slowdown(base=2.0, factor=1.5, from_step=4)}
    assert [plan[2].at(step) for step in (0, 3, 4, 50)] == [2.0, 2.0, 3.0, 3.0]
    # speeds are relative: all hosts at 0.5 is a nominal job; no profile, no base
    assert plan_slowdowns([0.5, 0.5], []) == {}
    assert plan_slowdowns(None, parse_faults({"kind": "slow", "rank": 1, "factor": 2.0, "step": 0})) == {
        1: Slowdown(factor=2.0)}


def test_a_slowed_rank_waits_in_proportion_to_its_own_measured_steps() -> None:
    waits: list[float] = []
    slow = SlowCompute(Slowdown(factor=3.0, from_step=2), window=3, wait=waits.append)
    # step 0 and 1 are nominal; from step 2, (3 - 1) x the median of the last 3 measured
    assert [slow.after_batch(took, step) for step, took in enumerate([0.10, 0.30, 0.20, 0.40, 0.10])] == \
        pytest.approx([0.0, 0.0, 0.40, 0.60, 0.40])
    assert waits == pytest.approx([0.40, 0.60, 0.40]) and slow.waited_s == pytest.approx(1.40)


def test_the_summary_entry_names_every_slowed_rank_and_its_wait() -> None:
    plan = {2: Slowdown(base=2.0, factor=1.5, from_step=4)}
    own = SlowCompute(plan[2], wait=lambda s: None)
    own.after_batch(0.5, 10)
    report = ComputeReport([1.0, 1.0, 0.5, 1.0], plan, rank=2, own=own)
    assert report.waits(4) == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert report.as_dict([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]) == {"compute_speeds": [1.0, 1.0, 0.5, 1.0], "slowed": [
        {"rank": 2, "base": 2.0, "factor": 1.5, "from_step": 4, "waited_s": 1.0}],
        "emulated_step_s": 0.0, "emulated_steps": 0, "overran_steps": 0}
    # every rank sends a vector of the same length, its own wait in its slot
    assert ComputeReport(None, {3: Slowdown(factor=2.0)}, rank=0).waits(2) == [0.0] * 6


def test_an_emulated_accelerator_fills_each_batch_to_its_nominal_time_and_counts_overruns() -> None:
    waits: list[float] = []
    nominal = SlowCompute(Slowdown(), wait=waits.append, nominal_s=0.2)
    slow = SlowCompute(Slowdown(factor=2.0, from_step=1), wait=waits.append, nominal_s=0.2)
    # the real compute is part of the nominal step; a batch slower than it waits nothing, counted
    assert [nominal.emulate(took, step) for step, took in enumerate([0.05, 0.15, 0.25])] == \
        pytest.approx([0.15, 0.05, 0.0])
    assert (nominal.steps, nominal.overruns) == (3, 1) and nominal.waited_s == pytest.approx(0.20)
    # a slowed rank's nominal step is the factor times as long
    assert [slow.emulate(took, step) for step, took in enumerate([0.05, 0.05, 0.30])] == \
        pytest.approx([0.15, 0.35, 0.10])
    assert waits == pytest.approx([0.15, 0.05, 0.15, 0.35, 0.10])
    # the summary: every rank's batches and overruns summed; the nominal step named
    report = ComputeReport(None, {1: slow.slowdown}, rank=0, own=nominal, emulated_step_s=0.2)
    assert report.waits(2) == pytest.approx([0.20, 0.0, 3.0, 1.0])
    summary = report.as_dict([0.20, 0.60, 6.0, 1.0])
    assert (summary["emulated_step_s"], summary["emulated_steps"], summary["overran_steps"]) == (0.2, 6, 1)
    assert summary["slowed"] == [{"rank": 1, "base": 1.0, "factor": 2.0, "from_step": 1, "waited_s": 0.6}]


@pytest.mark.parametrize("value", [-0.1, 61])
def test_a_bad_emulated_step_names_the_key(value) -> None:
    from syncplane.config import parse_dataclass
    from syncplane.runtime.settings import TrainerSettings

    with pytest.raises(ConfigError, match=r"trainer.emulated_step_s: must be between 0 \(off\) and 60"):
        parse_dataclass(TrainerSettings, {"emulated_step_s": value}, "trainer")


@pytest.mark.parametrize("fault,message", [
    ({"kind": "slow", "rank": 1, "factor": 0, "step": 0}, r"fault.factor: kind=slow needs a factor > 0"),
    ({"kind": "slow", "rank": 1, "factor": -2, "step": 0}, r"fault.factor: kind=slow needs a factor > 0"),
    ({"kind": "slow", "rank": 1, "step": 0}, r"fault.factor: kind=slow needs a factor > 0"),
    ({"kind": "slow", "rank": 1, "factor": 0.5, "step": 0}, r"fault.factor: must be >= 1"),
    ({"kind": "slow", "rank": 1, "factor": 2, "step": -1}, r"fault.step: must be >= 0"),
    ({"kind": "kill", "rank": 1, "factor": 2, "step": 3}, r"fault.factor: only kind=slow takes a factor"),
    ([{"kind": "slow", "rank": 1, "factor": 2, "step": 0}, {"kind": "slow", "rank": 1, "factor": 3, "step": 5}],
     r"fault: rank\(s\) 1 given more than one slow fault"),
])
def test_bad_slow_faults_name_the_key(fault, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_faults(fault)


def test_a_straggler_may_also_fail() -> None:
    assert parse_faults([{"kind": "slow", "rank": 1, "factor": 2, "step": 0}, {"kind": "kill", "rank": 1, "step": 5}]) \
        == [FaultSettings("slow", 1, 0, 2.0), FaultSettings("kill", 1, 5)]


@pytest.mark.parametrize("speed", [0, -0.5])
def test_a_compute_speed_must_be_positive(speed) -> None:
    data = {**HETEROGENEOUS, "racks": [{"name": "r0", "hosts": [{"name": "a", "nic_mbit": 400, "compute_speed": speed}]}]}
    with pytest.raises(ConfigError, match=r"cluster.racks\[0\].hosts\[0\].compute_speed: must be positive"):
        parse_profile(data)


def test_the_shipped_mixed_gpus_profile_has_two_hosts_at_half_speed() -> None:
    assert plan_slowdowns(load_profile("mixed_gpus").compute_speeds(), []) == {2: Slowdown(base=2.0),
                                                                               3: Slowdown(base=2.0)}


def test_a_batch_time_budgeted_diloco_skipped_is_neither_slowed_nor_counted() -> None:
    from syncplane.algorithms.diloco.adaptive import skipped_step_output
    from syncplane.runtime.slowdown import skipped

    assert skipped(skipped_step_output()) and not skipped({"loss": 1.0}) and not skipped(None)
