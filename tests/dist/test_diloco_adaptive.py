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
    from syncplane.algorithms.diloco.engine import DiLoCoEngine, parameter_module
    from syncplane.algorithms.diloco.layout import ReplicaLayout
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
    engine = DiLoCoEngine(parameter_module(tensors), config, JobContext(rank=rank, world_size=world),
                          ReplicaLayout.of_sizes([1] * world))
    for t, mine in zip(tensors, replicas[rank]):
        t.copy_(mine)
    engine.launch(tensors, 0, due=4, background=False, meter=CommMeter(), scale=timed.scale())
    assert engine.merge(tensors, engine.pop(0), alpha=0.0)
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
            timed.decide = lambda *a: self.decided.append(decide(*a)) or self.decided[-1]

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


# ---------------------------------------------------------------- time_samples=share


def _indexed(n: int = 96):
    """TinyRegressor on one regression set (the same on every rank) whose batches carry the
    samples' indices, recorded by the training steps that compute on them."""
    from lightning.pytorch import LightningDataModule
    from torch.utils.data import DataLoader, TensorDataset

    from tests.helpers.models import TinyRegressor

    class Indexed(TinyRegressor):
        def __init__(self):
            super().__init__()
            self.seen: list[tuple[int, int, list[int]]] = []     # (epoch, step, sample indices)

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            self.seen.append((self.current_epoch, self.global_step, idx.tolist()))
            return super().training_step((x, y), batch_idx)

    class Data(LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(3)
            x = torch.randn(n, 4, generator=g)
            return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin(), torch.arange(n)), batch_size=8)

    return Indexed(), Data()


def _train_shared(rank: int, world: int, tmp_dir: str, epochs: int, stop_at: int | None):
    from tests.helpers.models import trainer_for

    def fit(ckpt: str | None = None, **limits):
        torch.manual_seed(5)
        (model, data), strategy = _indexed(), _scripted([1.0, 2.0, 1.0], sync_every=3, time_samples="share")
        scales = []
        strategy._launch = _recording(strategy._launch, lambda: scales.append(strategy._timed.scale(
            strategy._dealer.round_counts(strategy.step // 3))))
        trainer = trainer_for(strategy, tmp_dir, limit_val_batches=0, **limits)
        trainer.fit(model, data, ckpt_path=ckpt)
        return trainer, model, strategy, scales

    _, model, strategy, scales = fit(max_epochs=epochs)
    out = {"decided": strategy.decided, "seen": model.seen, "scales": scales,
           "params": [p.detach().clone() for p in model.parameters()], "outer": strategy.outer_params}
    if stop_at is not None:
        trainer, _, _, _ = fit(max_epochs=epochs, max_steps=stop_at)
        trainer.save_checkpoint(f"{tmp_dir}/stopped.ckpt")
        _, model, strategy, scales = fit(f"{tmp_dir}/stopped.ckpt", max_epochs=epochs)
        out["resumed"] = ([p.detach().clone() for p in model.parameters()], strategy.outer_params)
        out["resumed_seen"], out["resumed_scales"] = model.seen, scales
    return out


def _recording(launch, record):
    def wrapped(*args, **kwargs):
        record()
        return launch(*args, **kwargs)
    return wrapped


def test_shared_samples_deal_every_sample_once_an_epoch_and_weigh_by_the_batches_dealt(tmp_path):
    results = run_distributed(_train_shared, 3, str(tmp_path), 3, None, timeout=240)
    assert results[0]["decided"] == results[1]["decided"] == results[2]["decided"]
    assert results[0]["decided"][0] == [3, 1, 3]          # rank 1 at half speed: one slot a round
    seen = [(epoch, step, i) for r in results for epoch, step, batch in r["seen"] for i in batch]
    for epoch in range(3):
        indices = sorted(i for e, _, i in seen if e == epoch)
        assert indices == list(range(96)), f"epoch {epoch}: every sample exactly once"
    first_batch = [[i for e, step, i in seen if e == epoch][:8] for epoch in range(3)]
    assert first_batch[0] != first_batch[1] != first_batch[2]     # a fresh permutation each epoch
    # the fast replicas took the slow one's batches: 12 batches of 8, rank 1 computes about 1 in 3 slots
    per_rank = [len(r["seen"]) for r in results]
    assert sum(per_rank) == 36 and per_rank[1] < min(per_rank[0], per_rank[2])
    # epoch 0: round 0 deals 9 batches, round 1's first slot the last 3; epoch 1 starts mid-round
    # (slots 4, 5: ranks 0 and 2 only) and ends on slot 9, where only rank 0 gets the last batch
    assert sorted({step for e, step, _ in seen if e == 0}) == [0, 1, 2, 3]
    assert sorted({step for e, step, _ in seen if e == 1}) == [4, 5, 6, 7, 8, 9]
    assert [step for _, step, _ in results[1]["seen"]][:5] == [0, 1, 2, 3, 6]
    # each round's weights are the batches each replica was dealt in it
    for rank, r in enumerate(results):
        for round_, scale in enumerate(r["scales"]):
            counts = [sum(1 for _, step, _ in other["seen"] if step // 3 == round_) for other in results]
            assert scale == pytest.approx(counts[rank] * 3 / sum(counts))
    assert torch.equal(results[0]["outer"], results[1]["outer"]) and torch.equal(results[0]["outer"], results[2]["outer"])


@pytest.mark.parametrize("stop_at", [4, 10])   # the ends of epochs 0 and 1, both in the middle of a round
def test_a_shared_samples_resume_deals_the_same_batches_and_is_bit_identical(tmp_path, stop_at):
    results = run_distributed(_train_shared, 3, str(tmp_path), 3, stop_at, timeout=240)
    state = torch.load(tmp_path / "stopped.ckpt", weights_only=True)["syncplane"]["state"]
    assert [slot for slot, _ in state["dealt"]["dealt"]] == list(range(stop_at - stop_at % 3, stop_at))
    for r in results:
        assert r["resumed_seen"] == [seen for seen in r["seen"] if seen[1] >= stop_at]   # the same deal
        assert r["resumed_scales"] == r["scales"][-len(r["resumed_scales"]):]
        params, outer = r["resumed"]
        assert torch.equal(outer, r["outer"])
        for a, b in zip(params, r["params"]):
            assert torch.equal(a, b)
