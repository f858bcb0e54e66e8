"""Time-budgeted DiLoCo rounds (``inner_steps: time``), Lightning-free: the plan from the step
times, the weights, and the decision with a mocked transport."""

from __future__ import annotations

import pytest

from syncplane.algorithms.diloco.adaptive import TimedRounds, check_weighting, fednova_scale, plan_round, weight_scale
from syncplane.algorithms.diloco.config import DiLoCoConfig


def test_a_replica_at_half_speed_computes_half_the_slots_and_equal_ones_keep_all() -> None:
    assert plan_round([0.1, 0.2, 0.1, 0.1], slots=10) == [10, 5, 10, 10]
    # noise among equal speeds (within SLACK) changes nothing
    assert plan_round([0.100, 0.108, 0.095, 0.102], slots=10) == [10, 10, 10, 10]
    # an explicit budget; at least one step, at most the round's slots
    assert plan_round([0.1, 0.2, 5.0], slots=10, budget_s=0.5) == [5, 2, 1]
    assert plan_round([0.01, 0.02], slots=10, budget_s=100.0) == [10, 10]


def test_half_the_replicas_slow_the_median_budget_idles_the_fast_ones_the_fastest_does_not() -> None:
    # time_samples=drop paces by the median: the slow ones keep 8 slots, the fast ones wait
    assert plan_round([0.2, 0.2, 0.4, 0.4], slots=10) == [10, 10, 8, 8]
    # time_samples=share paces by the fastest: their batches are dealt to the others, nobody waits
    assert plan_round([0.2, 0.2, 0.4, 0.4], slots=10, pace="fastest") == [10, 10, 5, 5]
    assert plan_round([0.2, 0.2, 0.4, 0.4], slots=10, budget_s=3.0, pace="fastest") == [10, 10, 8, 8]


def test_the_scales_make_the_plain_mean_the_sample_weighted_mean() -> None:
    steps = [10, 5, 10, 10]
    deltas = [1.0, 2.0, 3.0, 4.0]
    plain_mean_of_scaled = sum(weight_scale(steps, r) * d for r, d in enumerate(deltas)) / len(deltas)
    assert plain_mean_of_scaled == pytest.approx(sum(n * d for n, d in zip(steps, deltas)) / sum(steps))
    assert [weight_scale([4, 4, 4], r) for r in range(3)] == [1.0, 1.0, 1.0]


def test_the_fednova_scales_make_the_plain_mean_the_normalized_average() -> None:
    steps = [10, 5, 10, 8]
    deltas = [1.0, 2.0, 3.0, 4.0]
    plain_mean_of_scaled = sum(fednova_scale(steps, r) * d for r, d in enumerate(deltas)) / len(deltas)
    tau_eff = sum(steps) / len(steps)           # Σ p_i τ_i, p_i = 1/m
    assert plain_mean_of_scaled == pytest.approx(tau_eff * sum(d / n for n, d in zip(steps, deltas)) / len(steps))
    assert [fednova_scale([4, 4, 4], r) for r in range(3)] == [1.0, 1.0, 1.0]


def test_a_fednova_round_state_is_checkpointed_and_a_changed_weighting_is_refused() -> None:
    timed = TimedRounds(4, 3, 1, weighting="fednova")
    timed.steps = [4, 2, 4]
    assert timed.scale() == pytest.approx((10 / 3) / 2)
    restored = TimedRounds(4, 3, 1, weighting="fednova")
    restored.load_state_dict(timed.state_dict())
    assert restored.steps == [4, 2, 4] and restored.scale() == timed.scale()
    with pytest.raises(ValueError, match="time_weighting: the checkpoint's rounds were averaged with 'fednova'"):
        TimedRounds(4, 3, 1).load_state_dict(timed.state_dict())
    # a checkpoint from before the option averaged by samples
    TimedRounds(4, 3, 1).load_state_dict({"steps": [4, 2, 4], "decisions": 1})


def test_every_rank_decides_the_same_from_the_gathered_times_and_checkpoints_it() -> None:
    gathered = [0.1, 0.2, 0.1]
    calls: list[float] = []

    def gather(value: float) -> list[float]:
        calls.append(value)
        return gathered

    ranks = [TimedRounds(4, 3, rank) for rank in range(3)]
    assert [[r.computes(s) for s in range(4)] for r in ranks][1] == [True] * 4   # round 1: all slots
    for rank, timed in enumerate(ranks):
        for t in (0.1, 0.3, gathered[rank]):
            timed.record(t)
    decisions = [timed.decide(gather) for timed in ranks]
    assert calls == [0.1, 0.2, 0.1]       # each rank sends its own median
    assert decisions == [[4, 2, 4]] * 3
    assert [ranks[1].computes(s) for s in range(4)] == [True, True, False, False]
    assert ranks[1].scale() == pytest.approx(2 * 3 / 10)
    restored = TimedRounds(4, 3, 1)
    restored.load_state_dict(ranks[1].state_dict())
    assert restored.steps == [4, 2, 4] and restored.decisions == 1
    # a rank that measured nothing (resumed at the boundary) keeps the agreed counts
    assert restored.decide(lambda v: [0.1, v, 0.1]) == [4, 2, 4]
    with pytest.raises(ValueError, match="plan is for 3 replicas, this job has 2"):
        TimedRounds(4, 2, 0).load_state_dict(ranks[0].state_dict())


@pytest.mark.parametrize("kwargs,message", [
    ({"inner_steps": "sometimes"}, "inner_steps: allowed values: fixed, time"),
    ({"inner_steps": "time", "round_budget_s": 0.0}, "round_budget_s: a positive number"),
    ({"round_budget_s": -1.0}, "round_budget_s: a positive number"),
    ({"inner_steps": "time", "sync_every": 4, "fragments": 2}, "inner_steps=time runs plain DiLoCo rounds"),
    ({"inner_steps": "time", "time_weighting": "steps"}, "time_weighting: allowed values: samples, fednova"),
])
def test_bad_inner_steps_settings_name_the_key(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        DiLoCoConfig(**kwargs)


def test_fednova_with_fixed_inner_steps_is_the_plain_mean() -> None:
    """Every replica runs H steps: FedNova's factor is 1, as the samples' is (no refusal)."""
    assert DiLoCoConfig(time_weighting="fednova").time_weighting == "fednova"


def test_time_keys_are_inert_with_fixed_inner_steps() -> None:
    """As every mode's own keys are outside it (time_samples, the codecs' settings, grace_s)."""
    assert DiLoCoConfig(round_budget_s=2.0, time_samples="share").round_budget_s == 2.0
    assert [fednova_scale([4] * 3, r) for r in range(3)] == [weight_scale([4] * 3, r) for r in range(3)] == [1.0] * 3


def test_time_budgeted_rounds_run_elastic_but_deal_no_shared_stream() -> None:
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from syncplane.strategies.diloco import DiLoCo

    assert DiLoCo(cluster_environment=TorchElasticEnvironment(), inner_steps="time", elastic=True).elastic
    with pytest.raises(ValueError, match="time_samples=share with elastic=true"):
        DiLoCo(cluster_environment=TorchElasticEnvironment(), inner_steps="time", time_samples="share", elastic=True)
    with pytest.raises(ValueError, match="inner_steps=time with membership=quorum"):
        DiLoCo(cluster_environment=TorchElasticEnvironment(), inner_steps="time", elastic=True, membership="quorum")


def test_fednova_is_refused_for_a_model_with_floating_buffers() -> None:
    """Its factors do not sum to the replica count: buffers averaged as values would be scaled."""
    with pytest.raises(ValueError, match="time_weighting=fednova.*2 floating buffer"):
        check_weighting("fednova", 2)
    check_weighting("fednova", 0)
    check_weighting("samples", 3)


def test_a_node_replica_computes_on_its_slowest_ranks_slots_and_weighs_by_its_samples():
    """``replica: node`` with ``inner_steps: time``: a node's ranks train one model, so they take
    the same slots (the slowest rank's count), and a node's weight is its ranks' batches together."""
    from syncplane.algorithms.diloco.adaptive import TimedRounds

    nodes = [[0, 1], [2]]
    rounds = [TimedRounds(8, 3, rank, replicas=nodes) for rank in range(3)]
    times = [0.1, 0.2, 0.1]       # rank 1 is slow: node 0 computes on rank 1's share of the budget
    for timed in rounds:
        assert timed.decide(lambda value: times) == [4, 4, 8]
    counts = rounds[0].steps
    samples = [counts[0] + counts[1], counts[2]]                      # node 0: 2 ranks x 4 batches
    for rank, timed in enumerate(rounds):
        mine = 0 if rank < 2 else 1
        assert timed.scale() == pytest.approx(samples[mine] * 2 / sum(samples))
    assert TimedRounds(8, 3, 0).decide(lambda value: times) == [8, 4, 8]   # a replica per rank: its own
