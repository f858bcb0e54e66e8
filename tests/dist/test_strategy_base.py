"""``SyncplaneStrategy`` on real gloo processes, through Lightning's Trainer.

Why averaging every step must equal DDP: with identical replicas x, DDP applies
SGD-with-momentum to the mean gradient ḡ. Each replica here applies it to its own gᵢ
(momentum mᵢ ← μmᵢ + gᵢ, xᵢ ← x − η mᵢ) and then the replicas are averaged. Both
updates are linear in (gᵢ, mᵢ), so mean(xᵢ) = x − η(μ m̄ + ḡ) — exactly DDP's step —
and the mean momentum evolves like DDP's. Only float rounding differs.
"""

from __future__ import annotations

import pytest
import torch

from syncplane.strategies.replicas import load_replicas, shard_dir
from tests.helpers.distributed import run_distributed


def _params(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _ddp_vs_averaging(rank: int, world: int, tmp_dir: str, steps: int):
    import torch
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for
    from tests.helpers.strategies import EveryStepAveraging

    results = {}
    for name, strategy in [("ddp", DDPStrategy(cluster_environment=TorchElasticEnvironment())),
                           ("avg", EveryStepAveraging(cluster_environment=TorchElasticEnvironment()))]:
        torch.manual_seed(123)  # same initial weights for both runs
        model = TinyRegressor()
        trainer_for(strategy, tmp_dir, max_steps=steps, limit_val_batches=0).fit(model, RegressionData())
        results[name] = _params(model)
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_averaging_every_step_equals_ddp(world, tmp_path):
    results = run_distributed(_ddp_vs_averaging, world, str(tmp_path), 5, timeout=180)
    for rank_result in results:
        for ddp_param, avg_param in zip(rank_result["ddp"], rank_result["avg"]):
            torch.testing.assert_close(avg_param, ddp_param, rtol=1e-6, atol=1e-6)
    # and the run actually trained: parameters moved away from their initial values
    torch.manual_seed(123)
    from tests.helpers.models import TinyRegressor

    initial = _params(TinyRegressor())
    assert any(not torch.allclose(a, b) for a, b in zip(results[0]["avg"], initial))


def _initial_broadcast(rank: int, world: int, tmp_dir: str):
    import torch
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for
    from tests.helpers.strategies import NoSync

    torch.manual_seed(1000 + rank)  # every rank initializes differently on purpose
    model = TinyRegressor(lr=0.0, momentum=0.0)
    rank0_init = None
    if rank == 0:
        rank0_init = _params(model)
    trainer_for(NoSync(cluster_environment=TorchElasticEnvironment()), tmp_dir, max_steps=1,
                limit_val_batches=0).fit(model, RegressionData())
    return rank0_init, _params(model)


def test_initial_weights_are_broadcast_from_rank0(tmp_path):
    results = run_distributed(_initial_broadcast, 2, str(tmp_path))
    rank0_init = results[0][0]
    for _, params in results:
        for got, want in zip(params, rank0_init):
            assert torch.equal(got, want)


def _consensus_checkpoint(rank: int, world: int, tmp_dir: str):
    import torch
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for
    from tests.helpers.strategies import NoSync

    torch.manual_seed(7)
    model = TinyRegressor()
    strategy = NoSync(cluster_environment=TorchElasticEnvironment())
    trainer = trainer_for(strategy, tmp_dir, max_steps=4, limit_val_batches=0)
    trainer.fit(model, RegressionData(seed=rank))
    own = _params(model)
    trainer.save_checkpoint(f"{tmp_dir}/consensus.ckpt")   # collective: every rank calls it
    trainer.save_checkpoint(f"{tmp_dir}/consensus.ckpt")   # again: its replicas replace the first save's
    after_save = _params(model)
    replicas = [torch.cat([p.reshape(-1) for p in own])]
    gathered = [torch.empty_like(replicas[0]) for _ in range(world)]
    dist.all_gather(gathered, replicas[0])
    # validation swaps in the consensus and restores the replica afterwards
    trainer.validate(model, RegressionData(seed=rank), verbose=False)
    return own, after_save, gathered, _params(model)


def test_checkpoint_holds_the_consensus_and_replicas_are_kept(tmp_path):
    results = run_distributed(_consensus_checkpoint, 2, str(tmp_path))
    own0, own1 = results[0][0], results[1][0]
    assert any(not torch.allclose(a, b) for a, b in zip(own0, own1)), "replicas should have diverged"
    checkpoint = torch.load(tmp_path / "consensus.ckpt", weights_only=True)
    saved = list(checkpoint["state_dict"].values())
    for saved_tensor, a, b in zip(saved, own0, own1):
        torch.testing.assert_close(saved_tensor, (a + b) / 2, rtol=1e-6, atol=1e-7)
    for own, after_save, _, after_validate in results:
        for x, y, z in zip(own, after_save, after_validate):
            assert torch.equal(x, y) and torch.equal(x, z)
    assert checkpoint["syncplane"]["strategy"] == "NoSync"
    # each rank's own replica is kept beside the checkpoint for an exact resume: one file
    # per rank, of the save the checkpoint names (the first save's are gone)
    tag = checkpoint["syncplane"]["replica_shards"]["tag"]
    assert sorted(p.name for p in shard_dir(tmp_path / "consensus.ckpt").iterdir()) == [
        f"{tag}.rank0.pt", f"{tag}.rank1.pt"]
    for rank, (own, *_rest) in enumerate(results):
        saved_replica = list(load_replicas(tmp_path / "consensus.ckpt")[rank]["model"].values())
        for saved_tensor, own_tensor in zip(saved_replica, own):
            assert torch.equal(saved_tensor, own_tensor)


def _checkpoint_after_validation(rank: int, world: int, tmp_dir: str, edit: bool):
    import torch
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch import Callback

    from syncplane.runtime.checkpoint_io import LastCheckpoint
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for
    from tests.helpers.strategies import NoSync

    class EditRankOne(Callback):
        """Between the validation and the checkpoint (Lightning runs checkpoint callbacks
        last): changes rank 1's replica, so the validation's consensus is no longer one."""

        def on_train_epoch_end(self, trainer, pl_module):
            if edit and rank == 1:
                with torch.no_grad():
                    next(pl_module.parameters()).add_(1.0)

    torch.manual_seed(7)
    model = TinyRegressor()
    strategy = NoSync(cluster_environment=TorchElasticEnvironment())
    trainer = trainer_for(strategy, tmp_dir, max_epochs=1, limit_val_batches=2, enable_checkpointing=True,
                          callbacks=[EditRankOne(), LastCheckpoint(tmp_dir)])
    trainer.fit(model, RegressionData(seed=rank))
    return _params(model), strategy.phases.as_dict()


@pytest.mark.parametrize("edit", [False, True])
def test_checkpoint_after_validation_reuses_its_consensus_only_while_it_is_one(edit, tmp_path):
    """The checkpoint saved right after a validation shows the consensus that validation
    averaged (no second all-reduce) -- unless a replica changed in between."""
    (own0, phases), (own1, _) = run_distributed(_checkpoint_after_validation, 2, str(tmp_path), edit)
    saved = list(torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"].values())
    for saved_tensor, a, b in zip(saved, own0, own1):
        torch.testing.assert_close(saved_tensor, (a + b) / 2, rtol=1e-6, atol=1e-7)
    assert ("checkpoint/consensus" in phases) == edit and ("checkpoint/consensus_reused" in phases) != edit


def _resume(rank: int, world: int, tmp_dir: str):
    import torch
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for
    from tests.helpers.strategies import EveryStepAveraging

    def fresh():
        torch.manual_seed(5)
        return TinyRegressor(), EveryStepAveraging(cluster_environment=TorchElasticEnvironment())

    model, strategy = fresh()
    trainer_for(strategy, tmp_dir, max_epochs=4, limit_val_batches=0).fit(model, RegressionData())
    uninterrupted = _params(model)

    model, strategy = fresh()
    trainer = trainer_for(strategy, tmp_dir, max_epochs=2, limit_val_batches=0)
    trainer.fit(model, RegressionData())
    trainer.save_checkpoint(f"{tmp_dir}/half.ckpt")

    model, strategy = fresh()
    trainer_for(strategy, tmp_dir, max_epochs=4, limit_val_batches=0).fit(
        model, RegressionData(), ckpt_path=f"{tmp_dir}/half.ckpt")
    return uninterrupted, _params(model), strategy.rounds


def test_resume_continues_exactly_with_strategy_state(tmp_path):
    results = run_distributed(_resume, 2, str(tmp_path), timeout=180)
    checkpoint = torch.load(tmp_path / "half.ckpt", weights_only=True)
    steps_per_epoch = 80 // 2 // 8
    assert checkpoint["syncplane"]["state"] == {"rounds": 2 * steps_per_epoch}
    for uninterrupted, resumed, rounds in results:
        assert rounds == 4 * steps_per_epoch
        for a, b in zip(uninterrupted, resumed):
            assert torch.equal(a, b)
