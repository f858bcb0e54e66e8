"""``syncplane.Auto(replan_every_s=...)`` in a plain Lightning Trainer re-plans while it trains,
as ``train.py strategy=auto`` does, on real gloo ranks.

Two ranks fit a module of ≈ 10 MB of parameters with ``Auto(cluster=<a pair of 100 Gbit
hosts>, strategies="diloco", period=2, replan_every_s=...)``. Its choice (fp32: the link is
fast) is re-planned at each round boundary on a re-probe (the real collective one
over loopback) after which the link has changed: every flow capped at 50 Mbit, as the replan
tests of ``train.py`` do (``tests/dist/test_autopilot_replan.py``). The sparse gather then
prices far faster: every rank switches at the same step, and the run report records it
(``summary.json``'s ``strategy_details.auto.replans``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers.distributed import run_distributed

#: the module's width: 6 · WIDTH parameters, ≈ 10 MB of fp32
WIDTH = 400_000


def fast_pair() -> Any:
    """Two hosts on a 100 Gbit link: the plan's fp32 mesh beats compressing 10 MB."""
    from syncplane.cluster import parse_profile

    hosts = [{"name": f"h{i}", "nic_mbit": 100_000} for i in range(2)]
    return parse_profile({"name": "fast_pair", "racks": [{"name": "r0", "hosts": hosts}]})


def _rank(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    import syncplane
    from syncplane.runtime import replan
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for
    from tests.helpers.reprobe import changed_reprobe

    def capped(host: dict[str, Any]) -> None:
        host["per_flow_mbit"] = 50.0

    # the network changes once training runs: each re-probe (Auto's, through the Replanner) sees the cap
    probe = changed_reprobe(fast_pair(), capped)   # made before the patch: the real one
    replan.Reprobe = lambda declared, group: probe   # this process's only (a spawned rank)
    strategy = syncplane.Auto(cluster=fast_pair(), accept="approximate", strategies="diloco",
                              period=2, compute_ms=50.0, replan_every_s=1e-9,
                              cluster_environment=TorchElasticEnvironment())
    report = syncplane.RunReport(Path(tmp_dir) / "report", "auto", "regressor")
    trainer = trainer_for(strategy, tmp_dir, max_steps=6, limit_val_batches=0, callbacks=[report])
    trainer.fit(TinyRegressor(width=WIDTH), RegressionData())
    running = trainer.strategy
    return {"config": {k: getattr(running.config, k) for k in ("exchange", "compression", "streams")},
            "replans": [(r["step"], r["best"]["kwargs"]) for r in running.details["auto"]["replans"]]}


def test_auto_in_a_plain_trainer_replans_alike_on_every_rank_and_reports_it(tmp_path) -> None:
    first, second = run_distributed(_rank, 2, str(tmp_path))
    assert first == second, (first, second)   # one decision, one switch, at one step
    ((step, best),) = first["replans"]
    assert step == 2 and best["exchange"] == "gather" and best["compression"] == "sparse"
    assert first["config"]["exchange"] == "gather" and first["config"]["compression"] == "sparse"
    auto = json.loads((tmp_path / "report" / "summary.json").read_text())["strategy_details"]["auto"]
    assert auto["choice"]["kwargs"].get("compression") != "sparse"   # the start-up choice: fp32, on the fast link
    assert auto["replan"]["refused"] is None and auto["replan"]["checks"] == 3
    (record,) = auto["replans"]
    assert record["switch"] and record["step"] == 2 and record["best"]["kwargs"] == best
    assert record["best"]["step_s"] * 1.2 <= record["current"]["step_s"]


def _hooked_rank(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    import syncplane
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    strategy = syncplane.Auto(cluster=fast_pair(), strategies="ddp,flexreduce", compute_ms=5.0, replan_every_s=1e-9,
                              cluster_environment=TorchElasticEnvironment())
    trainer = trainer_for(strategy, tmp_dir, max_steps=4, limit_val_batches=0)
    trainer.fit(TinyRegressor(), RegressionData())
    auto = trainer.strategy.details["auto"]
    return {"class": type(trainer.strategy).__name__, "checks": auto["replan"]["checks"],
            "strategies": auto["replan"]["strategies"], "running": trainer.strategy.current}


def test_an_exact_choice_runs_as_a_hook_a_replan_can_swap(tmp_path) -> None:
    """Chosen among the hooked strategies, Auto becomes ``SwitchableDDP`` (as ``train.py``'s
    worker builds it) and re-plans at every step boundary."""
    first, second = run_distributed(_hooked_rank, 2, str(tmp_path))
    assert first == second
    assert first["class"] == "SwitchableDDP" and first["running"] in ("ddp", "flexreduce")
    assert first["checks"] == 4 and first["strategies"] == ["ddp", "flexreduce"]
