"""ATC / AWC / H-ATC / H-AWC through Lightning's Trainer on real gloo processes.

Why ATC with a fully-connected uniform graph equals DDP: see test_strategy_base -- with
identical replicas, averaging after a linear (SGD-momentum) step equals stepping with
the averaged gradient, and the uniform graph's ``Aᵀ X`` is exactly that average.

For the general case each rank records, per step, its parameters ``xᵢ(t)``, its batch
and its gradient ``gᵢ(t)``; the test then checks the paper's update rules against the
dense reference with the schedule's mixing matrix ``M_t``:
ATC ``X(t+1) = M_tᵀ (X(t) − γ G(t))``, AWC ``X(t+1) = M_tᵀ X(t) − γ G(t)``, and that
``gᵢ(t)`` is the gradient at ``xᵢ(t)`` (recomputed here from the recorded batch).
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from lightning.pytorch import Callback

from syncplane.strategies.replicas import load_replicas
from tests.dist.test_averaging import rank_matrix
from tests.helpers.distributed import run_distributed

LR = 0.05


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


class Recorder(Callback):
    """xᵢ(t) at batch start (after finishing any exchange still in flight), the batch, gᵢ(t)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.strategy.finish_pending_sync()
        self.params.append(_flat(pl_module.parameters()))
        self.batches.append(tuple(b.clone() for b in batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(_flat(p.grad for p in pl_module.parameters()))


def _strategy(name: str, **kwargs):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    from syncplane.strategies import strategy_class

    env = TorchElasticEnvironment()
    if name == "ddp":
        return DDPStrategy(cluster_environment=env)
    return strategy_class(name)(cluster_environment=env, **kwargs)


def _train(rank: int, world: int, tmp_dir: str, name: str, kwargs: dict, steps: int, momentum: float,
           record: bool = False, data_seed_per_rank: bool = True):
    import torch

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    torch.manual_seed(123)
    model = TinyRegressor(lr=LR, momentum=momentum)
    recorder = Recorder()
    trainer = trainer_for(_strategy(name, **kwargs), tmp_dir, max_steps=steps, limit_val_batches=0,
                          callbacks=[recorder] if record else [])
    trainer.fit(model, RegressionData(seed=rank if data_seed_per_rank else 0))
    final = _flat(model.parameters())
    return final, recorder.params, recorder.grads, recorder.batches


def _atc_vs_ddp(rank: int, world: int, tmp_dir: str):
    ddp = _train(rank, world, tmp_dir, "ddp", {}, 5, 0.9, data_seed_per_rank=False)[0]
    atc = _train(rank, world, tmp_dir, "atc", {"schedule": "static", "topology": "FullyConnectedGraph"}, 5, 0.9,
                 data_seed_per_rank=False)[0]
    return ddp, atc


@pytest.mark.parametrize("world", [2, 3])
def test_atc_fully_connected_equals_ddp_with_momentum(world, tmp_path):
    for ddp, atc in run_distributed(_atc_vs_ddp, world, str(tmp_path), timeout=240):
        torch.testing.assert_close(atc, ddp, rtol=1e-6, atol=1e-6)


def _gradient_at(params: torch.Tensor, batch) -> torch.Tensor:
    from tests.helpers.models import TinyRegressor

    model = TinyRegressor().double()
    torch.nn.utils.vector_to_parameters(params.clone(), model.parameters())
    x, y = batch
    torch.nn.functional.mse_loss(model.net(x.double()), y.double()).backward()
    return _flat(p.grad for p in model.parameters())


@pytest.mark.parametrize("name,schedule,local", [
    ("atc", "one_peer", 1), ("awc", "static", 1), ("h_atc", "static", 2), ("h_awc", "one_peer", 2),
])
def test_update_rule_matches_dense_reference(name, schedule, local, tmp_path):
    world, steps = 4, 5
    hierarchical = name.startswith("h_")
    kwargs = {"schedule": schedule, "topology": "RingGraph"}
    if hierarchical:
        kwargs["ranks_per_machine"] = local
    results = run_distributed(_train, world, str(tmp_path), name, kwargs, steps, 0.0, True, timeout=240)
    x = torch.stack([r[1][0] for r in results])                    # X(0): identical replicas
    for t in range(steps):
        grads = torch.stack([r[2][t] for r in results])
        for i, r in enumerate(results):                              # gᵢ(t) is the gradient at xᵢ(t)
            torch.testing.assert_close(grads[i], _gradient_at(r[1][t], r[3][t]), rtol=1e-4, atol=1e-6)
        m = torch.from_numpy(rank_matrix(schedule, t, world, local, hierarchical))   # from the definitions
        x = m.T @ (x - LR * grads) if name.endswith("atc") else m.T @ x - LR * grads
        got = torch.stack([r[1][t + 1] for r in results]) if t + 1 < steps else torch.stack([r[0] for r in results])
        torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-6)
    if not hierarchical:   # (two machines mix exactly: their replicas agree)
        assert not torch.allclose(x[0], x[1]), "replicas on different data should differ (decentralized)"


class Perturb(Callback):
    """Different replicas at the start (after the initial broadcast), for consensus tests."""

    def on_train_start(self, trainer, pl_module):
        g = torch.Generator().manual_seed(trainer.global_rank)
        with torch.no_grad():
            for p in pl_module.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def _consensus(rank: int, world: int, tmp_dir: str, schedule: str, steps: int):
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    torch.manual_seed(0)
    model = TinyRegressor(lr=0.0, momentum=0.0)
    recorder = Recorder()
    strategy = _strategy("atc", schedule=schedule, topology="RingGraph")
    trainer_for(strategy, tmp_dir, max_steps=steps, limit_val_batches=0, callbacks=[Perturb(), recorder]).fit(
        model, RegressionData(seed=rank))
    return recorder.params + [_flat(model.parameters())]


def test_lr_zero_converges_at_the_rate_of_lambda2(tmp_path):
    from syncplane.comm import topology
    from syncplane.algorithms.decentralized.schedule import StaticSchedule

    world, steps = 4, 6
    results = run_distributed(_consensus, world, str(tmp_path), "static", steps, timeout=180)
    schedule = StaticSchedule(topology.RingGraph(world))
    a = torch.from_numpy(nx.to_numpy_array(topology.RingGraph(world)))   # BlueFog's Y = Aᵀ X, not the schedule's
    lam = schedule.lambda2()
    assert lam == pytest.approx(1 / 3)
    x0 = torch.stack([r[0] for r in results])
    mean = x0.mean(dim=0)
    deviation0 = (x0 - mean).norm()
    for t in range(1, steps + 1):
        xt = torch.stack([r[t] for r in results])
        torch.testing.assert_close(xt, torch.linalg.matrix_power(a.T, t) @ x0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xt.mean(dim=0), mean, rtol=1e-5, atol=1e-6)   # the mean is preserved
        assert (xt - mean).norm() / deviation0 == pytest.approx(lam ** t, rel=1e-3)


def test_lr_zero_one_peer_reaches_the_exact_mean_in_one_period(tmp_path):
    world = 4                                      # period log2(4) = 2 steps
    results = run_distributed(_consensus, world, str(tmp_path), "one_peer", 2, timeout=180)
    x0 = torch.stack([r[0] for r in results])
    for r in results:
        torch.testing.assert_close(r[2], x0.mean(dim=0), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(results[0][1], results[1][1]), "one step alone is not the mean"


def _resume(rank: int, world: int, tmp_dir: str, name: str):
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    def fit(epochs: int, ckpt: str | None = None):
        torch.manual_seed(5)
        model = TinyRegressor()
        trainer = trainer_for(_strategy(name), tmp_dir, max_epochs=epochs, limit_val_batches=0)
        trainer.fit(model, RegressionData(n=72, seed=rank), ckpt_path=ckpt)
        return trainer, model

    _, model = fit(3)
    uninterrupted = _flat(model.parameters())
    trainer, _ = fit(1)                            # 3 steps: stops mid-period of the one-peer schedule
    trainer.save_checkpoint(f"{tmp_dir}/{name}.ckpt")
    _, model = fit(3, f"{tmp_dir}/{name}.ckpt")
    return uninterrupted, _flat(model.parameters())


@pytest.mark.parametrize("name", ["atc", "awc"])
def test_resume_mid_schedule_equals_uninterrupted(name, tmp_path):
    for uninterrupted, resumed in run_distributed(_resume, 3, str(tmp_path), name, timeout=240):
        torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=1e-6)
    checkpoint = torch.load(tmp_path / f"{name}.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3 and len(load_replicas(tmp_path / f"{name}.ckpt")) == 3


def _bad_machine_size(rank: int, world: int, tmp_dir: str):
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    try:
        trainer_for(_strategy("h_atc", ranks_per_machine=2), tmp_dir, max_steps=1).fit(TinyRegressor(),
                                                                                        RegressionData())
    except ValueError as exc:
        return str(exc)
    return None


def test_machine_size_that_does_not_divide_the_world_is_an_error(tmp_path):
    for message in run_distributed(_bad_machine_size, 3, str(tmp_path)):
        assert message == "world size 3 is not a multiple of ranks_per_machine 2"


def test_unknown_topology_names_the_allowed_ones():
    from syncplane.strategies import strategy_class

    with pytest.raises(ValueError, match="unknown topology 'Torus'; allowed values: ExponentialTwoGraph"):
        strategy_class("atc")(topology="Torus")


def _batchnorm_stats(rank: int, world: int, tmp_dir: str, name: str):
    from torch import nn

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    torch.manual_seed(0)
    model = TinyRegressor(lr=0.01, momentum=0.0)
    model.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    trainer_for(_strategy(name), tmp_dir, max_steps=4, limit_val_batches=0).fit(model, RegressionData(seed=rank))
    return model.net[1].running_mean.clone(), model.net[1].running_var.clone()


@pytest.mark.parametrize("name", ["atc", "awc"])
def test_batchnorm_running_statistics_are_kept_and_mixed(name, tmp_path):
    """The forward updates BatchNorm's running statistics after AWC's exchange started; an
    AWC that wrote the exchanged snapshot back would erase them (eval would use the
    initial mean 0 / variance 1 forever)."""
    (mean0, var0), (mean1, var1) = run_distributed(_batchnorm_stats, 2, str(tmp_path), name, timeout=120)
    assert mean0.abs().max() > 1e-3 and (var0 - 1).abs().max() > 1e-3
    torch.testing.assert_close(mean0, mean1)      # two ranks, one peer: the mix is the exact mean
    torch.testing.assert_close(var0, var1)


class StrayReads(torch.nn.Module):
    """A parent whose forward uses its child's weight directly (the child's forward never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.child = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.child.weight, self.child.bias)


def _stray_reads(rank: int, world: int, tmp_dir: str):
    """ATC on a model that reads parameters outside their modules' forwards: a scale read
    in ``training_step`` and a child weight read by its parent. Each value the step reads
    must already be the mixed one (what the optimizer sees after every wait)."""
    import torch.nn.functional as F

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    class Model(TinyRegressor):
        def __init__(self) -> None:
            super().__init__(lr=LR, momentum=0.0)
            self.head = StrayReads()
            self.scale = torch.nn.Parameter(torch.ones(1))
            self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.append((self.scale.detach().clone(), self.head.child.weight.detach().clone()))
            return F.mse_loss(self.scale * self.head(x) + self.net(x), y)

    class Probe(Callback):
        def __init__(self) -> None:
            self.at_update: list[tuple[torch.Tensor, torch.Tensor]] = []
            self.after_step: list[torch.Tensor] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            # every bucket has been waited for here (ATC's before_parameter_update)
            self.at_update.append((pl_module.scale.detach().clone(), pl_module.head.child.weight.detach().clone()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.after_step.append(pl_module.scale.detach().clone())   # local update, exchange in flight

    torch.manual_seed(5)
    model, probe = Model(), Probe()
    strategy = _strategy("atc", schedule="one_peer", topology="ExponentialTwoGraph", bucket_mb=1e-5,
                         consensus_every=0)
    trainer_for(strategy, tmp_dir, max_steps=4, limit_val_batches=0, callbacks=[probe]).fit(
        model, RegressionData(seed=rank))
    return model.seen, probe.at_update, probe.after_step


def test_atc_waits_before_reads_outside_the_owning_forward(tmp_path):
    results = run_distributed(_stray_reads, 2, str(tmp_path), timeout=240)
    for seen, at_update, after_step in results:
        for t, ((scale, weight), (scale_u, weight_u)) in enumerate(zip(seen, at_update)):
            torch.testing.assert_close(scale, scale_u, rtol=0, atol=0, msg=f"step {t}: training_step read a stale scale")
            torch.testing.assert_close(weight, weight_u, rtol=0, atol=0, msg=f"step {t}: parent read a stale weight")
        # the test can fail: the mixing does change what a stale read would have seen
        assert any(not torch.equal(after_step[t - 1], at_update[t][0]) for t in range(1, len(at_update)))
