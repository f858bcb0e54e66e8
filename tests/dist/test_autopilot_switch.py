"""``strategy=auto`` switches to another strategy while it trains, on real gloo ranks: DDP's
all-reduce to FlexReduce's (exact class), and to torch's fp16 all-reduce (approximate class).

Four ranks start with the choice ``ddp`` (accept ``exact``), as ``SwitchableDDP``. At each step
boundary they re-probe for real (loopback, as two hosts of two ranks), then each rank puts its
own fresh noise on what it measured and one host's NIC drops to 100 Mbit: the plan then prices
FlexReduce ~1.5x faster than DDP, and torch_fp16 faster still but outside the exact class.
Every rank must switch at the same step to FlexReduce (and its hook must then really run), the
model must stay one model, equal to plain DDP's within float reordering, and a resume from a
checkpoint written after the switch must keep FlexReduce and continue bit-identically.
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


def two_hosts() -> Any:
    hosts = [{"name": f"h{i}", "nic_mbit": 1000, "ranks": 2} for i in range(2)]
    return parse_profile({"name": "two_hosts", "racks": [{"name": "r0", "hosts": hosts}]})


def slow_host_probe() -> Any:
    """The real collective re-probe, then each rank's own noise and h1's NIC at 100 Mbit."""
    from tests.helpers.reprobe import changed_reprobe

    noise = random.Random()

    def slow_h1(host: dict[str, Any]) -> None:
        host["nic_mbit"] = (100.0 if host["name"] == "h1" else 1000.0) * noise.uniform(0.9, 1.1)
    return changed_reprobe(two_hosts(), slow_h1)


def _rank(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from syncplane.runtime import replan
    from syncplane.runtime.autopilot import torch_broadcast
    from syncplane.strategies import switching
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    calls = {"flexreduce": 0}

    class Counted(switching.FlexReduceHook):
        def hook(self, state, bucket):  # type: ignore[no-untyped-def]
            calls["flexreduce"] += 1
            return super().hook(state, bucket)

    switching.FlexReduceHook = Counted      # this rank's process only
    probe = slow_host_probe()

    def fit(tag: str, ckpt: str | None = None) -> dict[str, Any]:
        auto = {"accept": "exact", "choice": {"strategy": "ddp", "kwargs": {}},
                "inputs": {"cluster": "two_hosts", "world_size": world, **asdict(PlanInputs(PAYLOAD, 0.0))}}
        replanner = replan.Replanner(auto, 1e-9, probe, torch_broadcast(), rank)   # due at every step
        strategy = replanner.build(TorchElasticEnvironment(), None)
        assert isinstance(strategy, switching.SwitchableDDP)
        torch.manual_seed(7)
        model = TinyRegressor()
        keep = ModelCheckpoint(dirpath=tmp_dir, filename=f"{tag}-{{epoch}}", every_n_epochs=1, save_top_k=-1,
                               save_on_train_epoch_end=True)
        calls["flexreduce"] = 0
        trainer_for(strategy, tmp_dir, max_epochs=2, limit_train_batches=2, limit_val_batches=0,
                    enable_checkpointing=True, callbacks=[replanner, keep]).fit(model, RegressionData(),
                                                                              ckpt_path=ckpt)
        return {"replans": [(r["step"], r["current"]["strategy"], r["best"]["strategy"], r["best"]["step_s"],
                             r["current"]["step_s"]) for r in auto["replans"]],
                "checks": auto["replan"]["checks"], "running": (strategy.current, replanner.strategy),
                "hooked": calls["flexreduce"], "params": [p.detach().clone() for p in model.parameters()]}

    whole = fit("whole")
    resumed = fit("resumed", ckpt=f"{tmp_dir}/whole-epoch=0.ckpt")
    torch.manual_seed(7)
    model = TinyRegressor()
    trainer_for(DDPStrategy(cluster_environment=TorchElasticEnvironment()), tmp_dir, max_epochs=2,
                limit_train_batches=2, limit_val_batches=0).fit(model, RegressionData())
    return {"whole": whole, "resumed": resumed, "ddp": [p.detach().clone() for p in model.parameters()]}


def test_every_rank_switches_from_ddp_to_flexreduce_alike_and_keeps_ddps_model(tmp_path) -> None:
    results = run_distributed(_rank, 4, str(tmp_path), timeout=240.0)
    first = results[0]["whole"]
    # one decision, at the first step boundary: ddp -> flexreduce (fp16 is faster but not exact)
    assert first["replans"][0][:3] == (1, "ddp", "flexreduce") and len(first["replans"]) == 1, first["replans"]
    assert first["replans"][0][3] * 1.2 <= first["replans"][0][4]
    assert first["checks"] == 4
    for r in results:
        whole, resumed = r["whole"], r["resumed"]
        assert whole["replans"] == first["replans"]
        assert whole["running"] == resumed["running"] == ("flexreduce", "flexreduce")
        assert whole["hooked"] > 0 and resumed["hooked"] > 0, "FlexReduce's hook must run after the switch"
        # one model on every rank, plain DDP's up to the order of the float sums
        for a, b, ref in zip(whole["params"], first["params"], r["ddp"]):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6)
        # the resume (after epoch 0, past the switch) keeps FlexReduce: bit-identical
        assert resumed["replans"] == whole["replans"]
        assert all(torch.equal(a, b) for a, b in zip(whole["params"], resumed["params"]))


def _fp16_rank(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    """Two ranks, ``accept=approximate``, starting with ``ddp`` on one host pair whose re-probe
    finds 100 Mbit NICs: fp16's all-reduce (half the bytes) is then the fastest of the hooks."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from syncplane.runtime import replan
    from syncplane.runtime.autopilot import torch_broadcast
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for
    from tests.helpers.reprobe import changed_reprobe

    pair = parse_profile({"name": "pair", "racks": [{"name": "r0", "hosts": [
        {"name": f"h{i}", "nic_mbit": 1000} for i in range(2)]}]})
    probe = changed_reprobe(pair, lambda host: host.update(nic_mbit=100.0 * random.uniform(0.9, 1.1)))

    auto = {"accept": "approximate", "choice": {"strategy": "ddp", "kwargs": {}},
            "inputs": {"cluster": "pair", "world_size": world,
                       **asdict(PlanInputs(PAYLOAD, 0.0, strategies=("ddp", "flexreduce", "torch_fp16")))}}
    replanner = replan.Replanner(auto, 1e-9, probe, torch_broadcast(), rank)
    strategy = replanner.build(TorchElasticEnvironment(), None)
    torch.manual_seed(7)
    model = TinyRegressor()
    trainer_for(strategy, tmp_dir, max_steps=4, limit_val_batches=0, callbacks=[replanner]).fit(model, RegressionData())
    return {"replans": [(r["step"], r["best"]["strategy"]) for r in auto["replans"]], "running": strategy.current,
            "sent": strategy.comm_meter.bytes_sent, "params": [p.detach().clone() for p in model.parameters()]}


def test_an_approximate_job_switches_from_ddp_to_fp16s_all_reduce_and_keeps_one_model(tmp_path) -> None:
    first, second = run_distributed(_fp16_rank, 2, str(tmp_path))
    assert first["replans"] == second["replans"] == [(1, "torch_fp16")]
    assert first["running"] == second["running"] == "torch_fp16"
    # the bytes a ring sends of the model's 49 gradients: one step in fp32 under DDP, then three in fp16
    assert first["sent"] == second["sent"] == 49 * 4 + 3 * 49 * 2
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"])), "one model on every rank"
