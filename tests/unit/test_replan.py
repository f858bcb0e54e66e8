"""``strategy=auto``'s re-plan, without processes: the switch rule (at least 1.2x faster, among the
settings that can switch), what refuses to re-plan, and when the callback probes (round
boundaries, once rank 0's clock says so)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from syncplane.algorithms.plan import Candidate
from syncplane.cluster import load_profile
from syncplane.runtime.replan import FASTER, Replanner, choose_switch, keep_speeds, not_switchable


def cand(step_s: float, **kwargs: Any) -> Candidate:
    return Candidate(strategy="diloco", kwargs={"sync_every": 10, **kwargs}, exact=False, period=10, overlap=None,
                     sync_s=step_s, hidden_s=0.0, step_s=step_s, bound_s=0.0, network_bound_s=0.0,
                     network_binding="")


MESH = {"streams": 1, "exchange": "mesh"}
TREE = {"streams": 4, "exchange": "tree"}


@pytest.mark.parametrize("tree_s,switch", [(1.0 / FASTER, True), (1.0 / FASTER + 1e-6, False), (1.0, False)])
def test_switch_only_when_at_least_faster_by_the_factor(tree_s: float, switch: bool) -> None:
    decision = choose_switch(sorted([cand(1.0, **MESH), cand(tree_s, **TREE)], key=lambda c: c.step_s),
                             "diloco", {"sync_every": 10, **MESH})
    assert decision["switch"] is switch
    assert decision["current"]["kwargs"] == {"sync_every": 10, **MESH}


def test_candidates_that_change_a_fixed_setting_are_not_offered() -> None:
    other_h = Candidate(**{**cand(0.1, **TREE).__dict__, "kwargs": {"sync_every": 20, **TREE}})
    node = cand(0.1, replica="node", shards=1)
    decision = choose_switch([other_h, node, cand(1.0, **MESH)], "diloco", {"sync_every": 10, **MESH})
    assert not decision["switch"] and decision["best"]["kwargs"] == {"sync_every": 10, **MESH}
    with pytest.raises(ValueError, match="not among the plan's candidates"):
        choose_switch([cand(1.0, **TREE)], "diloco", {"sync_every": 10, **MESH})


def test_what_cannot_switch_says_why() -> None:
    assert not_switchable("diloco", {"streams": 1}) is None
    assert not_switchable("flexreduce", {}) is None and not_switchable("ddp", {}) is None
    assert "canary cannot be switched while it trains (only between ddp, flexreduce, torch_fp16 at a step " \
        "boundary, and diloco's streams/exchange/compression at a round boundary)" in not_switchable("canary", {})
    assert "torch_powersgd cannot be switched" in not_switchable("torch_powersgd", {})
    assert "replica=node" in not_switchable("diloco", {"replica": "node", "streams": 1})


def hooked(strategy: str, step_s: float, exact: bool = True) -> Candidate:
    return Candidate(**{**cand(step_s).__dict__, "strategy": strategy, "kwargs": {}, "exact": exact, "period": 1})


@pytest.mark.parametrize("accept,best", [("exact", "flexreduce"), ("approximate", "torch_fp16")])
def test_ddp_switches_to_another_hook_of_its_class_never_to_another_strategy(accept: str, best: str) -> None:
    candidates = [cand(0.1, **MESH), hooked("torch_powersgd", 0.2, False), hooked("torch_fp16", 0.3, False),
                  hooked("flexreduce", 0.5), hooked("ddp", 1.0)]
    decision = choose_switch(candidates, "ddp", {}, accept)
    assert decision["switch"] and decision["best"]["strategy"] == best
    assert decision["current"] == {"label": "ddp", "strategy": "ddp", "kwargs": {}, "step_s": 1.0, "sync_s": 1.0}
    # the running one is fastest of what it can reach: it stays
    assert not choose_switch(candidates[:2] + [hooked("ddp", 0.3), hooked("flexreduce", 0.5)], "ddp", {})["switch"]
    # and DiLoCo never reaches the hooks
    assert choose_switch([hooked("ddp", 0.01), cand(1.0, **MESH)], "diloco", {"sync_every": 10, **MESH})["best"][
        "strategy"] == "diloco"


def test_a_hooked_choice_runs_as_a_strategy_that_can_switch_and_others_as_named() -> None:
    from syncplane.strategies.switching import SwitchableDDP

    built = Fake("ddp", {}).replanner.build(None, None)
    assert isinstance(built, SwitchableDDP) and (built.current, built.settings) == ("ddp", {})
    assert Fake().replanner.build(None, None) is None              # diloco: built as named, switched in place
    assert Fake("canary", {}).replanner.build(None, None) is None   # refused: built as named
    with pytest.raises(ValueError, match="only topology, chunk_mb"):
        SwitchableDDP("flexreduce", {"bucket_cap_mb": 5})
    with pytest.raises(ValueError, match="torch_powersgd cannot run as a switchable DDP hook"):
        SwitchableDDP("torch_powersgd")


def test_a_resume_switches_to_the_checkpoints_strategy_or_refuses_one_it_cannot_reach() -> None:
    switched: list[tuple[str, dict]] = []
    fake = Fake("ddp", {})
    fake.replanner._trainer_strategy = SimpleNamespace(switch_to=lambda name, kw: switched.append((name, kw)))
    state = {**fake.replanner.state_dict(), "strategy": "flexreduce", "kwargs": {}}
    fake.replanner.load_state_dict(state)
    assert switched == [("flexreduce", {})] and fake.replanner.strategy == "flexreduce"
    for ran in ({"strategy": "diloco", "kwargs": {"sync_every": 10, **MESH}},
                {"strategy": "ddp", "kwargs": {"bucket_cap_mb": 5}}):
        with pytest.raises(ValueError, match=f"the checkpoint ran {ran['strategy']} .* this job chose flexreduce"):
            fake.replanner.load_state_dict({**state, **ran})


def test_a_reprobed_profile_keeps_the_declared_compute_speeds() -> None:
    from syncplane.cluster import parse_profile

    declared = load_profile("mixed_gpus")
    data = declared.to_dict()
    for rack in data["racks"]:
        for host in rack["hosts"]:
            host["compute_speed"], host["nic_mbit"] = 1.0, 123.0
    kept = keep_speeds(parse_profile(data), declared)
    assert kept.compute_speeds() == declared.compute_speeds() != parse_profile(data).compute_speeds()
    assert all(h["nic_mbit"] == 123.0 for r in kept.to_dict()["racks"] for h in r["hosts"])


class Fake:
    """A job of one rank: the broadcast is the identity, the clock and probe are counted."""

    def __init__(self, strategy: str = "diloco", kwargs: dict | None = None) -> None:
        self.now, self.probes = 0.0, 0
        self.auto = {"choice": {"strategy": strategy, "kwargs": {"sync_every": 10, **MESH} if kwargs is None else kwargs},
                     "inputs": {}}
        self.replanner = Replanner(self.auto, 30.0, self.probe, lambda obj: obj, 0, clock=lambda: self.now)
        self.replanner.replan = self.replan   # the re-probe and decision are the dist test's

    def probe(self) -> Any:
        self.probes += 1

    def replan(self, strategy: Any, step: int) -> None:
        self.probe()

    def step(self, global_step: int, now: float) -> None:
        self.now = now
        self.replanner.on_train_batch_end(SimpleNamespace(global_step=global_step, strategy=None), None, None, None, 0)


def test_probes_at_round_boundaries_once_the_time_has_passed() -> None:
    fake = Fake()
    fake.step(5, 100.0)     # inside a round: never
    fake.step(10, 20.0)     # a boundary, 20 s after the plan: not yet
    assert fake.probes == 0
    fake.step(20, 31.0)
    fake.step(20, 90.0)     # the same step again (a micro-batch of an accumulated step): once
    assert fake.probes == 1
    fake.step(30, 50.0)     # 19 s after the last re-plan
    assert fake.probes == 1
    fake.step(40, 62.0)
    assert fake.probes == 2


def test_a_strategy_that_cannot_switch_never_probes_and_says_so() -> None:
    fake = Fake("canary", {})
    fake.step(1, 1000.0)
    assert fake.probes == 0
    assert "canary cannot be switched" in fake.auto["replan"]["refused"]
    assert fake.auto["replans"] == []



def test_a_checkpoints_exchange_settings_are_checked_on_resume_and_old_ones_pass() -> None:
    """DiLoCo's checkpoint records the exchange it ran with: another one is refused naming the
    keys and the values to pass; a checkpoint from before the record is not checked."""
    from syncplane.algorithms.diloco.config import check_exchange_resumed

    ran = {"streams": 4, "exchange": "mesh", "compression": "none"}
    check_exchange_resumed({"exchange_ran": ran}, dict(ran))
    check_exchange_resumed({}, {"streams": 1, "exchange": "mesh", "compression": "none"})
    with pytest.raises(ValueError, match=r"ran streams=4 .*this run has streams=1.*strategy.kwargs.streams=4 "
                                         r"strategy.kwargs.exchange=mesh strategy.kwargs.compression=none"):
        check_exchange_resumed({"exchange_ran": ran}, {**ran, "streams": 1})


@pytest.mark.parametrize("accept,listed,offered", [
    ("exact", None, ("ddp", "flexreduce")), ("approximate", None, ("ddp", "flexreduce", "torch_fp16")),
    ("approximate", ("ddp", "torch_fp16"), ("ddp", "torch_fp16"))])
def test_a_replan_prices_what_the_job_may_switch_to_of_its_list_and_class(accept, listed, offered) -> None:
    fake = Fake("ddp", {})
    fake.replanner.auto.update(accept=accept, inputs={"strategies": listed})
    assert fake.replanner._offered() == offered
