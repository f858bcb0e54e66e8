"""``syncplane.Auto(replan_every_s=...)`` in a plain Lightning Trainer re-plans while it trains,
as ``train.py strategy=auto`` does, on real gloo ranks.

Two ranks fit a module of ≈ 1 MB of parameters with ``Auto(cluster=<a pair of 100 Gbit
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

import torch

from tests.helpers.distributed import run_distributed

#: the module's width: 6 · WIDTH parameters, ≈ 1 MB of fp32
WIDTH = 40_000


def fast_pair() -> Any:
    """Two hosts on a 100 Gbit link: the plan's fp32 exchange beats compressing 1 MB."""
    from syncplane.cluster import parse_profile

    hosts = [{"name": f"h{i}", "nic_mbit": 100_000} for i in range(2)]
    return parse_profile({"name": "fast_pair", "racks": [{"name": "r0", "hosts": hosts}]})


def _fit(tmp_dir: str, tag: str = "", ckpt: str | None = None, **trainer: Any) -> dict[str, Any]:
    """One fit with ``Auto`` on ``fast_pair``, whose link is capped once training runs (each
    re-probe sees it); what it ran and switched, and its model."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.callbacks import ModelCheckpoint

    import syncplane
    from syncplane.runtime import replan
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for
    from tests.helpers.reprobe import changed_reprobe

    def capped(host: dict[str, Any]) -> None:
        host["per_flow_mbit"] = 50.0

    if not isinstance(replan.Reprobe, type(lambda: 0)):   # patched once per process (a spawned rank)
        probe = changed_reprobe(fast_pair(), capped)   # made before the patch: the real re-probe, then the cap
        replan.Reprobe = lambda declared, group: probe
    strategy = syncplane.Auto(cluster=fast_pair(), accept="approximate", strategies="diloco", period=2,
                              compute_ms=50.0, replan_every_s=1e-9, cluster_environment=TorchElasticEnvironment())
    callbacks: list[Any] = [syncplane.RunReport(Path(tmp_dir) / f"report{tag}", "auto", "regressor")]
    if tag:
        callbacks.append(ModelCheckpoint(dirpath=tmp_dir, filename=f"{tag}-{{epoch}}", every_n_epochs=1, save_top_k=-1,
                                         save_on_train_epoch_end=True))
    torch.manual_seed(123)
    model = TinyRegressor(lr=1e-4, momentum=0.0, width=WIDTH)   # wide: a smaller step keeps it finite
    fitted = trainer_for(strategy, tmp_dir, limit_val_batches=0, enable_checkpointing=bool(tag), callbacks=callbacks,
                         **trainer)
    fitted.fit(model, RegressionData(), ckpt_path=ckpt)
    running = fitted.strategy
    return {"config": {k: getattr(running.config, k) for k in ("exchange", "compression", "streams")},
            "replans": [(r["step"], r["best"]["kwargs"]) for r in running.details["auto"]["replans"]],
            "checks": running.details["auto"]["replan"]["checks"], "rounds": running.rounds,
            "params": [p.detach().clone() for p in model.parameters()]}


def _rank(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    ran = _fit(tmp_dir, max_steps=6)
    ran.pop("params")
    return ran


def test_auto_in_a_plain_trainer_replans_alike_on_every_rank_and_reports_it(tmp_path) -> None:
    first, second = run_distributed(_rank, 2, str(tmp_path))
    assert first == second, (first, second)   # one decision, one switch, at one step
    assert first["checks"] == 3
    ((step, best),) = first["replans"]
    assert step == 2 and best["exchange"] == "gather" and best["compression"] == "sparse"
    assert first["config"]["exchange"] == "gather" and first["config"]["compression"] == "sparse"
    auto = json.loads((tmp_path / "report" / "summary.json").read_text())["strategy_details"]["auto"]
    assert auto["choice"]["kwargs"].get("compression") != "sparse"   # the start-up choice: fp32, on the fast link
    assert auto["replan"]["refused"] is None and auto["replan"]["checks"] == 3
    (record,) = auto["replans"]
    assert record["switch"] and record["step"] == 2 and record["best"]["kwargs"] == best
    assert record["best"]["step_s"] * 1.2 <= record["current"]["step_s"]


def _hooked_fit(tmp_dir: str, tag: str, ckpt: str | None = None) -> dict[str, Any]:
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.callbacks import ModelCheckpoint

    import syncplane
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    strategy = syncplane.Auto(cluster=fast_pair(), strategies="ddp,flexreduce", compute_ms=5.0, replan_every_s=1e-9,
                              cluster_environment=TorchElasticEnvironment())
    keep = ModelCheckpoint(dirpath=tmp_dir, filename=f"{tag}-{{epoch}}", every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    trainer = trainer_for(strategy, tmp_dir, max_epochs=2, limit_train_batches=2, limit_val_batches=0,
                          enable_checkpointing=True, callbacks=[keep])
    trainer.fit(TinyRegressor(), RegressionData(), ckpt_path=ckpt)
    auto = trainer.strategy.details["auto"]
    return {"class": type(trainer.strategy).__name__, "checks": auto["replan"]["checks"],
            "strategies": auto["replan"]["strategies"], "running": trainer.strategy.current}


def _hooked_rank(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    whole = _hooked_fit(tmp_dir, "whole")
    return {"whole": whole, "resumed": _hooked_fit(tmp_dir, "resumed", f"{tmp_dir}/whole-epoch=0.ckpt")}


def test_an_exact_choice_runs_as_a_hook_a_replan_can_swap(tmp_path) -> None:
    """Chosen among the hooked strategies, Auto becomes ``SwitchableDDP`` (as ``train.py``'s
    worker builds it) and re-plans at every step boundary; resumed, its re-plan record goes on
    from the checkpoint's (Lightning restored the callbacks before Auto added this one)."""
    first, second = run_distributed(_hooked_rank, 2, str(tmp_path))
    assert first == second
    whole, resumed = first["whole"], first["resumed"]
    assert whole["class"] == "SwitchableDDP" and whole["running"] in ("ddp", "flexreduce")
    assert whole["checks"] == 4 and whole["strategies"] == ["ddp", "flexreduce"]
    assert resumed == whole   # 2 checks before the checkpoint, 2 after it


def _resume_rank(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    """3 epochs of 3 steps (the switch at step 2), then the same fit resumed from the checkpoint
    after epoch 1 (step 3: after the switch)."""
    whole = _fit(tmp_dir, "whole", max_epochs=3, limit_train_batches=3)
    return {"whole": whole, "resumed": _fit(tmp_dir, "resumed", f"{tmp_dir}/whole-epoch=0.ckpt", max_epochs=3,
                                            limit_train_batches=3)}


def test_a_resumed_fit_keeps_the_switch_and_its_record(tmp_path) -> None:
    """The switched settings, the record and the model carry over: the re-planning callback's
    state is restored before the strategy's own (DiLoCo refuses a checkpoint written by the
    switched exchange into the start-up one)."""
    for r in run_distributed(_resume_rank, 2, str(tmp_path)):
        whole, resumed = r["whole"], r["resumed"]
        assert whole["replans"][0][0] == 2 and whole["config"]["compression"] == "sparse"
        for key in ("config", "replans", "checks", "rounds"):
            assert resumed[key] == whole[key], key
        assert all(torch.equal(a, b) for a, b in zip(whole["params"], resumed["params"]))
