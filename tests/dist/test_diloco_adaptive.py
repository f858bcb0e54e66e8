"""Time-budgeted DiLoCo (``inner_steps: time``, issue 37) on real gloo processes.

- The engine's weighted round against a dense reference: 3 ranks with unequal sample counts,
  fresh random replicas, outer SGD(lr 1, no momentum): θ_g ← Σ n_i θ_i / Σ n_i.
- The same with ``time_weighting: fednova``: θ_g ← θ_g + τ_eff Σ (θ_i − θ_g) / (m n_i),
  τ_eff = mean(n_i) (FedNova's normalized averaging with equal data weights).
- Through Lightning on 3 ranks with scripted step times (rank 1 at half speed): every rank
  makes the same decision, rank 1 skips the slots beyond its budget (its batches are not
  processed), every round ends on the same step everywhere, and a resume from a mid-round
  checkpoint is bit-identical to the uninterrupted run.
- With equal (measured, not scripted) speeds every rank makes the same decisions.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _weighted_round(rank: int, world: int, seed: int, steps: list[int], weighting: str = "samples"):
    from syncplane.algorithms.diloco.adaptive import TimedRounds
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.comm.meter import CommMeter
    from syncplane.job import JobContext

    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(7, generator=g), torch.randn(5, generator=g)]           # θ_g, the same everywhere
    replicas = [[torch.randn(7, generator=g), torch.randn(5, generator=g)] for _ in range(world)]
    tensors = [t.clone() for t in start]
    config = DiLoCoConfig(sync_every=4, outer_kwargs={"lr": 1.0, "momentum": 0.0}, inner_steps="time",
                          time_weighting=weighting)
    timed = TimedRounds(4, world, rank, weighting=config.time_weighting)
    timed.steps = steps
    engine = DiLoCoEngine(tensors, 12, config, JobContext(rank=rank, world_size=world))
    for t, mine in zip(tensors, replicas[rank]):
        t.copy_(mine)
    engine.launch(tensors, 0, due=4, background=False, meter=CommMeter(), scale=timed.scale)
    assert engine.merge(tensors, engine.outer.pop(0), alpha=0.0)
    engine.close()
    if weighting == "samples":
        dense = [sum(n * replica[i] for n, replica in zip(steps, replicas)) / sum(steps) for i in range(2)]
    else:
        tau_eff = sum(steps) / world
        dense = [start[i] + tau_eff * sum((replica[i] - start[i]) / n for n, replica in zip(steps, replicas)) / world
                 for i in range(2)]
    return tensors, dense


@pytest.mark.parametrize("seed", [11, 12])
def test_the_weighted_round_is_the_sample_weighted_mean_of_the_replicas(seed):
    for merged, dense in run_distributed(_weighted_round, 3, seed, [5, 2, 3], timeout=120):
        for got, want in zip(merged, dense):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", [21, 22])
def test_the_fednova_round_is_the_step_normalized_average_of_the_replicas(seed):
    for merged, dense in run_distributed(_weighted_round, 4, seed, [5, 2, 3, 5], "fednova", timeout=120):
        for got, want in zip(merged, dense):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _scripted(speeds: list[float] | None, **kwargs):
    """A time-budgeted DiLoCo whose replicas report ``speeds[rank]`` seconds per step (None:
    the measured times), recording every decision and the slots it computed on."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from syncplane.strategies.diloco import DiLoCo

    class Scripted(DiLoCo):
        def setup_sync(self, job):
            super().setup_sync(job)
            timed, self.decided, self.computed = self._timed, [], []
            if speeds is not None:
                timed.record = lambda seconds: timed.measured.append(speeds[self.global_rank])
            decide = timed.decide
            timed.decide = lambda gather: self.decided.append(decide(gather)) or self.decided[-1]

        def training_step(self, *args, **kw):
            out = super().training_step(*args, **kw)
            if not isinstance(out, dict):      # the recipe's loss, not the skip marker
                self.computed.append(self.step)
            return out

    return Scripted(cluster_environment=TorchElasticEnvironment(), inner_steps="time", **kwargs)


def _train_scripted(rank: int, world: int, tmp_dir: str, speeds: list[float] | None, epochs: int):
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    torch.manual_seed(5)
    model, strategy = TinyRegressor(), _scripted(speeds, sync_every=3)
    trainer = trainer_for(strategy, tmp_dir, max_epochs=epochs, limit_val_batches=0)
    trainer.fit(model, RegressionData(seed=rank))
    # Lightning's per-step SIGTERM broadcast (a collective every inner step) is dropped
    no_per_step_collective = "_broadcast_sigterm_tensor" in vars(trainer.fit_loop.epoch_loop)
    return strategy.decided, strategy.computed, strategy.rounds, strategy.outer_params, no_per_step_collective


def test_a_half_speed_replica_skips_the_slots_beyond_its_budget_and_every_rank_agrees(tmp_path):
    results = run_distributed(_train_scripted, 3, str(tmp_path), [1.0, 2.0, 1.0], 3, timeout=180)
    decided = [r[0] for r in results]
    # 80 samples on 3 ranks: 4 steps an epoch, 12 in all, 4 rounds of H = 3
    assert decided[0] == decided[1] == decided[2] == [[3, 1, 3]] * 4
    assert results[0][1] == results[2][1] == list(range(12))
    assert results[1][1] == [0, 1, 2, 3, 6, 9]        # round 1 in full, then one slot a round
    assert [r[2] for r in results] == [4, 4, 4]
    assert torch.equal(results[0][3], results[1][3]) and torch.equal(results[0][3], results[2][3])
    assert all(r[4] for r in results)


def test_equal_speeds_give_every_rank_the_same_decisions(tmp_path):
    results = run_distributed(_train_scripted, 3, str(tmp_path), None, 3, timeout=180)
    assert len(results[0][0]) == 4
    assert results[0][0] == results[1][0] == results[2][0]


def _resume(rank: int, world: int, tmp_dir: str, weighting: str):
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    def fit(epochs: int, ckpt: str | None = None):
        torch.manual_seed(5)
        model, strategy = TinyRegressor(), _scripted([1.0, 2.0, 1.0], sync_every=3, compression="int8",
                                                     block_size=4, time_weighting=weighting)
        trainer = trainer_for(strategy, tmp_dir, max_epochs=epochs, limit_val_batches=0)
        trainer.fit(model, RegressionData(seed=rank), ckpt_path=ckpt)
        return trainer, model, strategy

    _, model, strategy = fit(4)
    uninterrupted = ([p.detach().clone() for p in model.parameters()], strategy.outer_params)
    trainer, _, _ = fit(2)
    trainer.save_checkpoint(f"{tmp_dir}/mid_round.ckpt")       # 8 steps: 2 of round 3's 3 slots
    _, model, strategy = fit(4, f"{tmp_dir}/mid_round.ckpt")
    return uninterrupted, ([p.detach().clone() for p in model.parameters()], strategy.outer_params)


@pytest.mark.parametrize("weighting", ["samples", "fednova"])
def test_a_resume_from_a_mid_round_checkpoint_is_bit_identical(tmp_path, weighting):
    results = run_distributed(_resume, 3, str(tmp_path), weighting, timeout=240)
    state = torch.load(tmp_path / "mid_round.ckpt", weights_only=True)["syncplane"]["state"]
    assert state["inner_steps"] == "time" and state["timed"]["steps"] == [3, 1, 3]
    assert state["timed"]["weighting"] == weighting
    for (params, outer), (resumed_params, resumed_outer) in results:
        assert torch.equal(outer, resumed_outer)
        for a, b in zip(params, resumed_params):
            assert torch.equal(a, b)
