"""``strategy=auto`` decides once for the job: real gloo ranks, each with its own fresh random
probe noise (compute time and link rates), must not split the decision (issue 36)."""

from __future__ import annotations

import random

from syncplane.algorithms.plan import PlanInputs, make_plan
from syncplane.cluster import load_profile, parse_profile
from syncplane.runtime.autopilot import AutoSettings, decide, torch_broadcast
from tests.helpers.distributed import run_distributed

PAYLOAD = 25_557_032 * 4     # ResNet-50's parameters


def boundary() -> float:
    """A compute time where the approximate winner on two_racks changes (bisected, not assumed):
    noise around it splits decisions taken alone."""
    profile = load_profile("two_racks")

    def winner(compute_s: float) -> str:
        return make_plan(profile, PlanInputs(PAYLOAD, compute_s)).best("approximate").label

    lo, hi = 0.001, 2.0
    first = winner(lo)
    assert winner(hi) != first, f"no change of winner between {lo} and {hi} s of compute: widen the bracket"
    for _ in range(10):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if winner(mid) == first else (lo, mid)
    return (lo + hi) / 2


def _rank(rank: int, world_size: int, base_compute_s: float) -> dict:
    noise = random.Random()      # fresh, different on every rank
    data = load_profile("two_racks").to_dict()
    for rack in data["racks"]:
        for host in rack["hosts"]:
            host["nic_mbit"] *= noise.uniform(0.95, 1.05)
    profile = parse_profile(data)
    # ranks on both sides of the boundary: alone, they would disagree
    compute_s = base_compute_s * (1 + (-1) ** rank * noise.uniform(0.2, 0.5))
    settings = AutoSettings(accept="approximate")
    alone = make_plan(profile, PlanInputs(PAYLOAD, compute_s)).best("approximate").label
    agreed = decide(settings, profile, PAYLOAD, compute_s, torch_broadcast())
    return {"alone": alone, "agreed": agreed, "compute_s": compute_s}


def test_ranks_with_different_noise_make_one_decision() -> None:
    results = run_distributed(_rank, 3, boundary())
    assert len({r["alone"] for r in results}) > 1, "the noise must be able to split decisions taken alone"
    assert len({r["compute_s"] for r in results}) == 3
    decisions = [(r["agreed"]["choice"]["label"], r["agreed"]["runner_up"]["label"]) for r in results]
    assert decisions == [decisions[0]] * 3
    # the agreed inputs are rank 0's measurement, and the choice is the plan's best on them
    agreed = results[0]["agreed"]
    assert all(r["agreed"]["inputs"]["compute_s"] == results[0]["compute_s"] for r in results)
    assert agreed["choice"]["label"] == results[0]["alone"]
    assert agreed["candidates"][0]["step_s"] <= agreed["runner_up"]["step_s"]
