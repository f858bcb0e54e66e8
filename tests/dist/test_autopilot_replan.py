"""``strategy=auto`` re-plans while it trains (``replan_every_s``), on real gloo ranks.

Two ranks train DiLoCo (H = 2, Nesterov outer) as ``strategy=auto`` chose it, with the mesh
exchange; at each round boundary they re-probe for real (loopback), and then each rank adds its
own fresh random noise to what it measured and caps every flow at 50 Mbit (the link changed). The
sparse gather then prices far faster than the mesh: every rank must switch at the same step to
the same settings (rank 0's decision), the switch must change neither the model nor the outer
optimizer's state, and after it the replicas stay one model (bit-identical on every rank, so
equal to their mean) with the outer state identical on every rank.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from typing import Any

import torch

from syncplane.algorithms.plan import PlanInputs
from syncplane.cluster import parse_profile
from tests.helpers.distributed import run_distributed

PAYLOAD = 40_000_000
CHOICE = {"sync_every": 2, "streams": 1, "exchange": "mesh"}


def pair_profile(per_flow_mbit: float | None) -> Any:
    hosts = [{"name": f"h{i}", "nic_mbit": 1000, "per_flow_mbit": per_flow_mbit} for i in range(2)]
    return parse_profile({"name": "pair", "racks": [{"name": "r0", "hosts": hosts}]})


def changed_link_probe(probed: list[float]) -> Any:
    """The real collective re-probe (loopback), then the changed link: each rank's own fresh
    noise on the NIC rates (appended to ``probed``) and every flow capped at 50 Mbit."""
    from tests.helpers.reprobe import changed_reprobe

    noise = random.Random()           # fresh, different on every rank

    def capped(host: dict[str, Any]) -> None:
        host["nic_mbit"] *= noise.uniform(0.7, 1.3)
        host["per_flow_mbit"] = 50.0
        probed.append(host["nic_mbit"])
    return changed_reprobe(pair_profile(per_flow_mbit=None), capped)


def _tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state dict, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state.clone()]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _rank(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from syncplane.runtime import replan
    from syncplane.runtime.autopilot import torch_broadcast
    from syncplane.strategies.diloco import DiLoCo
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    probed: list[float] = []
    probe = changed_link_probe(probed)

    auto = {"choice": {"strategy": "diloco", "kwargs": dict(CHOICE)},
            "inputs": {"cluster": "pair", "world_size": world,
                       **asdict(PlanInputs(PAYLOAD, 0.05, period=2, strategies=("diloco",)))}}
    replanner = replan.Replanner(auto, 1e-9, probe, torch_broadcast(), rank)   # due at every round boundary
    switches: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    switch = DiLoCo.switch_settings    # what the family's switch (``SPEC.switch``) calls

    def recorded(strategy: Any, changes: Any) -> None:
        before = [p.detach().clone() for p in strategy.lightning_module.parameters()] + \
            _tensors(strategy.engine.state_dict())
        switch(strategy, changes)
        after = [p.detach().clone() for p in strategy.lightning_module.parameters()] + \
            _tensors(strategy.engine.state_dict())
        switches.append((before, after))

    DiLoCo.switch_settings = recorded   # this process's only (a spawned rank)
    torch.manual_seed(123)
    model = TinyRegressor()
    strategy = DiLoCo(cluster_environment=TorchElasticEnvironment(), **CHOICE)
    trainer_for(strategy, tmp_dir, max_steps=6, limit_val_batches=0, callbacks=[replanner]).fit(model, RegressionData())
    return {"replans": auto["replans"], "checks": auto["replan"]["checks"], "probed": probed,
            "switches": switches, "exchange": strategy.details["exchange"], "config": asdict(strategy.config),
            "params": [p.detach().clone() for p in model.parameters()],
            "outer": _tensors(strategy.engine.state_dict()), "rounds": strategy.rounds}


def test_every_rank_switches_alike_and_keeps_one_model(tmp_path) -> None:
    results = run_distributed(_rank, 2, str(tmp_path))
    first, second = results
    assert first["probed"] != second["probed"], "each rank must see its own noise"
    # one decision: a switch at the first round boundary, mesh -> the sparse gather; none after
    assert first["checks"] == second["checks"] == 3
    assert [(r["step"], r["current"]["kwargs"], r["best"]["kwargs"]) for r in first["replans"]] == \
        [(r["step"], r["current"]["kwargs"], r["best"]["kwargs"]) for r in second["replans"]]
    (record,) = first["replans"]
    assert record["step"] == 2 and record["switch"]
    assert record["current"]["kwargs"] == CHOICE
    assert record["best"]["kwargs"]["exchange"] == "gather" and record["best"]["kwargs"]["compression"] == "sparse"
    assert record["best"]["step_s"] * 1.2 <= record["current"]["step_s"]
    for r in results:
        assert r["config"]["exchange"] == "gather" and r["config"]["compression"] == "sparse"
        assert r["config"]["streams"] == record["best"]["kwargs"]["streams"]
        assert r["rounds"] == 3
        (before, after), = r["switches"]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a switch must not move the model or outer state"
    # the replicas are one model (so equal to their mean), the outer state one state, before and after
    for key in ("params", "outer"):
        assert all(torch.equal(a, b) for a, b in zip(first[key], second[key])), key
    assert all(torch.equal(a, b) for a, b in zip(first["switches"][0][0], second["switches"][0][0]))


def _resume_rank(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    """3 epochs of 3 steps uninterrupted (the switch at step 2), then the same run resumed from
    the checkpoint after epoch 1 (step 3: after the switch, mid-round); then resumed by jobs
    without ``replan_every_s`` (no Replanner): with the start-up settings (refused), and with the
    settings the error names."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.callbacks import ModelCheckpoint

    from syncplane.runtime import replan
    from syncplane.runtime.autopilot import torch_broadcast
    from syncplane.strategies.diloco import DiLoCo
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    probe = changed_link_probe([])

    def fit(tag: str, ckpt: str | None = None, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """``settings``: a job without re-planning that runs DiLoCo with these."""
        auto = {"choice": {"strategy": "diloco", "kwargs": dict(CHOICE)},
                "inputs": {"cluster": "pair", "world_size": world,
                           **asdict(PlanInputs(PAYLOAD, 0.05, period=2, strategies=("diloco",)))}}
        replanner = [replan.Replanner(auto, 1e-9, probe, torch_broadcast(), rank)] if settings is None else []
        torch.manual_seed(123)
        model = TinyRegressor()
        strategy = DiLoCo(cluster_environment=TorchElasticEnvironment(), **(settings or CHOICE))
        keep = ModelCheckpoint(dirpath=tmp_dir, filename=f"{tag}-{{epoch}}", every_n_epochs=1, save_top_k=-1,
                               save_on_train_epoch_end=True)
        trainer_for(strategy, tmp_dir, max_epochs=3, limit_train_batches=3, limit_val_batches=0,
                    enable_checkpointing=True, callbacks=[*replanner, keep]).fit(model, RegressionData(), ckpt_path=ckpt)
        return {"replans": [(r["step"], r["best"]["kwargs"]) for r in auto.get("replans", [])],
                "checks": auto.get("replan", {}).get("checks"), "config": asdict(strategy.config),
                "params": [p.detach().clone() for p in model.parameters()],
                "outer": _tensors(strategy.engine.state_dict()),
                "residuals": _tensors(strategy.rank_state_dict()), "rounds": strategy.rounds}

    whole = fit("whole")
    path = f"{tmp_dir}/whole-epoch=0.ckpt"
    torch.load(path, weights_only=True)          # plain data only, as a user's resume reads it
    resumed = fit("resumed", ckpt=path)
    try:
        fit("plain", ckpt=path, settings=dict(CHOICE))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    ran = {k: whole["config"][k] for k in ("streams", "exchange", "compression")}
    return {"whole": whole, "resumed": resumed, "refused": refused,
            "named": fit("named", ckpt=path, settings={"sync_every": CHOICE["sync_every"], **ran})}


def test_a_resume_after_a_switch_keeps_the_switch_or_is_refused_never_reverts(tmp_path) -> None:
    """With the Replanner the switch carries over; a job without ``replan_every_s`` never
    silently goes back to the start-up exchange: it is refused with the keys and values to
    pass, and with those it is bit-identical too."""
    for r in run_distributed(_resume_rank, 2, str(tmp_path)):
        whole, resumed, named, refused = r["whole"], r["resumed"], r["named"], r["refused"]
        assert whole["replans"][0][0] == 2 and whole["config"]["compression"] == "sparse"
        # the switched settings, the record and the clock's checks carry over; no second switch
        assert resumed["config"] == whole["config"]
        assert resumed["replans"] == whole["replans"] and resumed["checks"] == whole["checks"]
        assert resumed["rounds"] == whole["rounds"]
        assert len(resumed["residuals"]) == len(whole["residuals"]) > 0
        for key in ("params", "outer", "residuals"):
            assert all(torch.equal(a, b) for a, b in zip(whole[key], resumed[key])), key
        assert "the checkpoint's exchange ran" in refused and "exchange=gather" in refused, refused
        assert "compression=sparse" in refused and "this run has" in refused and "exchange=mesh" in refused
        assert f"strategy.kwargs.streams={whole['config']['streams']}" in refused
        assert named["rounds"] == whole["rounds"]
        for key in ("params", "outer", "residuals"):
            assert all(torch.equal(a, b) for a, b in zip(whole[key], named[key])), key
