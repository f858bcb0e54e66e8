"""``diloco`` through Lightning's Trainer on real gloo processes.

- H = 1, outer SGD(lr 1, momentum 0): θ_g ← θ_g − mean(θ_g − θᵢ) = mean θᵢ after every
  step, which is DDP's step (see test_strategy_base for why averaging = DDP, momentum
  included).
- H = 4, same outer optimizer: plain periodic averaging, i.e. torch's own
  ``PeriodicModelAverager`` with period 4 on the same data.
- Default outer optimizer (Nesterov): replaying the recorded replicas through
  ``torch.optim.SGD(nesterov=True)`` over the per-tensor parameters gives the same θ_g,
  with a straggler round discarded on every rank.
- A resume from a mid-round checkpoint (int8 + error feedback, Nesterov state) is
  bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import os

import pytest
import torch

from syncplane.strategies.replicas import load_replicas
from tests.helpers.distributed import run_distributed, straggle_after_peers_started

PLAIN_AVERAGING = {"outer_optimizer": "torch.optim.SGD", "outer_kwargs": {"lr": 1.0, "momentum": 0.0}}


def _params(module) -> list[torch.Tensor]:
    """This rank's parameters (its shard of each, under FSDP2), copied."""
    from syncplane.algorithms.sharded import local

    return [local(p.detach()).clone() for p in module.parameters()]


def _diloco(**kwargs):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from syncplane.strategies.diloco import DiLoCo

    return DiLoCo(cluster_environment=TorchElasticEnvironment(), **kwargs)


def _vs_ddp(rank: int, world: int, tmp_dir: str, steps: int, cluster: str | None = None,
            diloco_kwargs: dict | None = None):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    from syncplane.launch import CLUSTER_ENV
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    if cluster is not None:      # as the cluster launcher sets it
        os.environ[CLUSTER_ENV] = cluster
    results = {}
    for name, strategy in [("ddp", DDPStrategy(cluster_environment=TorchElasticEnvironment())),
                           ("diloco", _diloco(sync_every=1, **PLAIN_AVERAGING, **(diloco_kwargs or {})))]:
        torch.manual_seed(123)
        model = TinyRegressor()
        trainer_for(strategy, tmp_dir, max_steps=steps, limit_val_batches=0).fit(model, RegressionData())
        results[name] = _params(model)
    return results, strategy.rounds, strategy.comm_meter.bytes_sent, strategy.details


def test_h1_with_plain_outer_sgd_equals_ddp(tmp_path):
    results = run_distributed(_vs_ddp, 2, str(tmp_path), 5, timeout=180)
    for params, rounds, sent, _ in results:
        assert rounds == 5 and sent > 0
        for ddp, diloco in zip(params["ddp"], params["diloco"]):
            torch.testing.assert_close(diloco, ddp, rtol=1e-6, atol=1e-6)
    from tests.helpers.models import TinyRegressor

    torch.manual_seed(123)
    assert any(not torch.allclose(a, b) for a, b in zip(results[0][0]["diloco"], _params(TinyRegressor())))


WAN_PAIR = """name: wan_pair
racks:
  - {name: a, uplink_mbit: 1000, per_flow_mbit: 100, hosts: [{name: a0, nic_mbit: 10000, ranks: 1}]}
  - {name: b, uplink_mbit: 1000, per_flow_mbit: 100, hosts: [{name: b0, nic_mbit: 10000, ranks: 1}]}
"""


def test_auto_shards_come_from_the_launchers_profile_and_still_equal_ddp(tmp_path):
    """``shards: auto`` under a cluster profile (two sites, 100 Mbit per TCP flow on a 1 Gbit
    link: one pair needs ≥ 10 flows) runs the streams the cost model picks (two ranks: one
    level, so the owner exchange); H = 1 with plain outer SGD is still DDP."""
    from syncplane.algorithms.diloco.cost import auto_streams
    from syncplane.cluster import load_profile

    profile = tmp_path / "wan_pair.yaml"
    profile.write_text(WAN_PAIR)
    want, _ = auto_streams(load_profile(str(profile)))
    assert want == 16
    results = run_distributed(_vs_ddp, 2, str(tmp_path), 3, str(profile), {"streams": "auto"}, timeout=180)
    for params, rounds, _, details in results:
        assert rounds == 3 and details["streams"] == want and details["exchange"] == "mesh"
        for ddp, diloco in zip(params["ddp"], params["diloco"]):
            torch.testing.assert_close(diloco, ddp, rtol=1e-6, atol=1e-6)


def training_batches(rank: int, world: int, steps: int) -> list:
    """The batches Lightning feeds this rank for ``steps`` steps of ``RegressionData()``."""
    from torch.utils.data import DataLoader, DistributedSampler

    from tests.helpers.models import RegressionData

    data = RegressionData().data
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=0)   # what Lightning injects for training
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    batches = []
    for epoch in range(-(-steps // len(loader))):
        sampler.set_epoch(epoch)
        batches += list(loader)
    return batches


def _vs_periodic_averager(rank: int, world: int, tmp_dir: str, steps: int, period: int):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    torch.manual_seed(123)
    model = TinyRegressor()
    strategy = _diloco(sync_every=period, **PLAIN_AVERAGING)
    trainer_for(strategy, tmp_dir, max_steps=steps, limit_val_batches=0).fit(model, RegressionData())

    torch.manual_seed(123)
    reference = TinyRegressor()
    optimizer = reference.configure_optimizers()
    # torch averages when (step - warmup) % period == 0, counting from 0: a warm-up of
    # period - 1 puts the averages after steps period, 2·period, ... like DiLoCo's rounds
    averager = PeriodicModelAverager(period=period, warmup_steps=period - 1)
    batches = training_batches(rank, world, steps)
    for step in range(steps):
        optimizer.zero_grad()
        reference.training_step(batches[step], 0).backward()
        optimizer.step()
        averager.average_parameters(reference.parameters())
    return _params(model), _params(reference), strategy.rounds


def test_h4_with_plain_outer_sgd_equals_torch_periodic_model_averager(tmp_path):
    results = run_distributed(_vs_periodic_averager, 2, str(tmp_path), 10, 4, timeout=180)
    for ours, torch_avg, rounds in results:
        assert rounds == 2
        for a, b in zip(ours, torch_avg):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # mid-round (2 steps after the round at step 8) the replicas differ: it is local training
    assert any(not torch.allclose(a, b) for a, b in zip(results[0][0], results[1][0]))


def _recorded_nesterov(rank: int, world: int, tmp_dir: str, late_round: int):
    from syncplane.strategies.diloco import DiLoCo
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    class Recording(DiLoCo):
        """Keeps every round's local replica; one rank straggles in ``late_round``."""

        def outer_sync(self, fragment: int = 0) -> bool:
            local = [t.detach().clone() for t in self.lightning_module.parameters()]
            # only the late round has a short timeout, and its straggler waits until the
            # other rank is in the round: the commit list does not depend on the load
            self.engine.runners[0].timeout_s = 1.0 if len(self.log) == late_round else 60.0
            if len(self.log) == late_round:
                straggle_after_peers_started(f"diloco-late-{late_round}", rank == 1, self.engine.runners[0].timeout_s)
            committed = super().outer_sync(fragment)
            self.log.append((local, committed))
            return committed

    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    torch.manual_seed(9)
    model = TinyRegressor(lr=0.05)
    initial = _params(model)
    strategy = Recording(cluster_environment=TorchElasticEnvironment(), sync_every=2, sync_timeout_s=60.0)
    strategy.log = []
    trainer_for(strategy, tmp_dir, max_steps=8, limit_val_batches=0).fit(model, RegressionData(seed=rank))
    return initial, strategy.log, strategy.outer_params, _params(model), strategy.skipped


def test_default_outer_step_is_torch_nesterov_sgd_and_a_failed_round_is_skipped_everywhere(tmp_path):
    results = run_distributed(_recorded_nesterov, 2, str(tmp_path), 2, timeout=180)
    initial = results[0][0]
    rounds = len(results[0][1])
    assert rounds == 4
    commits = [[committed for _, committed in r[1]] for r in results]
    assert commits[0] == commits[1] == [True, True, False, True], "every rank skips the same round"
    assert all(r[4] == 1 for r in results)
    # replay: per-tensor parameters, torch's Nesterov SGD, dense mean of Δ in rank order
    theta = [p.clone().requires_grad_(True) for p in initial]
    outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True)
    for k in range(rounds):
        if not results[0][1][k][1]:
            continue
        locals_ = [r[1][k][0] for r in results]
        for i, g in enumerate(theta):
            delta = g.detach() - locals_[0][i]
            for other in locals_[1:]:
                delta += g.detach() - other[i]
            g.grad = delta / len(locals_)
        outer.step()
    want = torch.cat([g.detach().reshape(-1) for g in theta])
    for _, _, outer_params, model_params, _ in results:
        torch.testing.assert_close(outer_params, want, rtol=1e-6, atol=1e-6)
        # after the last (committed) round every replica holds θ_g
        assert torch.equal(torch.cat([p.reshape(-1) for p in model_params]), outer_params)


def resume_vs_uninterrupted(rank: int, world: int, tmp_dir: str, diloco_kwargs: dict, checkpoint: str):
    """4 epochs straight, and 2 epochs + ``checkpoint`` + 2 resumed epochs: (params, θ_g) of both."""
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    def fresh():
        torch.manual_seed(5)
        return TinyRegressor(), _diloco(**diloco_kwargs)

    model, strategy = fresh()
    trainer_for(strategy, tmp_dir, max_epochs=4, limit_val_batches=0).fit(model, RegressionData(seed=rank))
    uninterrupted = (_params(model), strategy.outer_params)

    model, strategy = fresh()
    trainer = trainer_for(strategy, tmp_dir, max_epochs=2, limit_val_batches=0)
    trainer.fit(model, RegressionData(seed=rank))
    trainer.save_checkpoint(f"{tmp_dir}/{checkpoint}")

    model, strategy = fresh()
    trainer_for(strategy, tmp_dir, max_epochs=4, limit_val_batches=0).fit(
        model, RegressionData(seed=rank), ckpt_path=f"{tmp_dir}/{checkpoint}")
    return uninterrupted, (_params(model), strategy.outer_params), strategy.rounds


def test_resume_from_a_mid_round_checkpoint_is_bit_identical(tmp_path):
    results = run_distributed(resume_vs_uninterrupted, 2, str(tmp_path),
                              {"sync_every": 3, "compression": "int8", "block_size": 4}, "mid_round.ckpt", timeout=240)
    checkpoint = torch.load(tmp_path / "mid_round.ckpt", weights_only=True)
    state = checkpoint["syncplane"]["state"]
    assert state["rounds"] == 3 and state["sync_every"] == 3
    # every rank's error feedback, not rank 0's only: per-rank state rides with the replicas
    residuals = [r["rank_state"]["exchange"]["residuals"] for r in load_replicas(tmp_path / "mid_round.ckpt")]
    assert len(residuals) == 2 and not torch.equal(residuals[0], residuals[1])
    assert "momentum_buffer" in state["outer"][0]["optimizer"]["state"][0]
    for (params, outer), (resumed_params, resumed_outer), rounds in results:
        assert rounds == 20 // 3
        assert torch.equal(outer, resumed_outer)
        for a, b in zip(params, resumed_params):
            assert torch.equal(a, b)


def test_sparseloco_resume_from_a_mid_round_checkpoint_is_bit_identical(tmp_path):
    """compression sparse on the gather (3 ranks on hosts of 2 and 1: a host's pieces forwarded
    as one block), SparseLoCo's outer rule: each rank's decayed accumulator rides in the
    checkpoint, and the resumed run continues bit for bit."""
    kwargs = {"sync_every": 3, "compression": "sparse", "density": 0.25, "bits": 2, "chunk": 8, "outer": "sparseloco",
              "topology": [2, 1]}
    results = run_distributed(resume_vs_uninterrupted, 3, str(tmp_path), kwargs, "sparse.ckpt", timeout=240)
    residuals = [r["rank_state"]["exchange"]["residuals"] for r in load_replicas(tmp_path / "sparse.ckpt")]
    assert len(residuals) == 3 and not torch.equal(residuals[0], residuals[1])
    assert all(r.abs().sum() > 0 for r in residuals)
    for (params, outer), (resumed_params, resumed_outer), rounds in results:
        assert rounds == 16 // 3       # 80 samples on 3 ranks: 4 steps per epoch
        assert torch.equal(outer, resumed_outer)
        for a, b in zip(params, resumed_params):
            assert torch.equal(a, b)


def test_bad_configuration_names_the_value():
    from syncplane.strategies.diloco import DiLoCo

    with pytest.raises(ValueError, match="sync_every must be at least 1, got 0"):
        DiLoCo(sync_every=0)
    with pytest.raises(ValueError, match="unknown compression 'fp8'"):
        DiLoCo(compression="fp8")
    with pytest.raises(ValueError, match="streams must be an integer of at least 1, or 'auto', got 0"):
        DiLoCo(shards=0)
    with pytest.raises(ValueError,
                       match="exchange: allowed values: auto, mesh, tree, gather \\(or the old owner\\); got 'ring'"):
        DiLoCo(exchange="ring")
    with pytest.raises(ValueError, match="exchange='tree' cannot carry compression='int8': .*exact fp32.*exchange='mesh'"):
        DiLoCo(exchange="tree", compression="int8")
    with pytest.raises(ValueError, match="exchange='tree' cannot carry compression='sparse'.*exchange='gather'"):
        DiLoCo(exchange="tree", compression="sparse")
    with pytest.raises(ValueError, match=r"topology: expected auto, .* got \[2, 0\]"):
        DiLoCo(topology=[2, 0])
