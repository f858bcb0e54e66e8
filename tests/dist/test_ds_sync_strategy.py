"""The ``ds_sync`` strategy through Lightning's Trainer on real gloo processes.

Resume must continue exactly: 6 steps in one go == 3 steps, checkpoint, 3 more steps
(per-rank replicas, the schedule position and every rank's SWA model all come back).
With SWA the final model is the global mean of the per-rank SWA models.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]

PROFILE = {"name": "test_2x2", "racks": [
    {"name": "r0", "uplink_mbit": 100, "hosts": [{"name": "a0", "nic_mbit": 400}, {"name": "a1", "nic_mbit": 400}]},
    {"name": "r1", "uplink_mbit": 100, "hosts": [{"name": "b0", "nic_mbit": 400}, {"name": "b1", "nic_mbit": 400}]},
]}


def _strategy(profile: str):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from syncplane.strategies.ds_sync import DSSyncStrategy

    return DSSyncStrategy(topology=profile, ema=True, ema_decay=0.5, adjust_every=2,
                          cluster_environment=TorchElasticEnvironment())


def _state(model, strategy):
    return {"params": [p.detach().clone() for p in model.parameters()],
            "ema": [t.clone() for t in strategy._ema_model], "step": strategy.runtime.step}


def _resume(rank: int, world: int, tmp_dir: str, profile: str):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    torch.manual_seed(7)
    model, strategy = TinyRegressor(), _strategy(profile)
    trainer_for(strategy, tmp_dir, max_steps=6, limit_val_batches=0).fit(model, RegressionData())
    straight = _state(model, strategy)

    torch.manual_seed(7)
    model, strategy = TinyRegressor(), _strategy(profile)
    ckpt = ModelCheckpoint(dirpath=f"{tmp_dir}/ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer_for(strategy, tmp_dir, max_steps=3, limit_val_batches=0, enable_checkpointing=True,
                callbacks=[ckpt]).fit(model, RegressionData())
    path = f"{tmp_dir}/ckpt/epoch=0-step=3.ckpt"
    saved = torch.load(path, weights_only=True)               # tensors and containers only
    torch.manual_seed(99)                                     # the checkpoint must restore everything
    model, strategy = TinyRegressor(), _strategy(profile)
    trainer_for(strategy, tmp_dir, max_steps=6, limit_val_batches=0).fit(model, RegressionData(), ckpt_path=path)
    return straight, _state(model, strategy), saved["syncplane"]["state"]["schedule"]["step"]


@pytest.mark.slow
def test_resume_continues_exactly_and_ema_ensemble_is_the_global_mean(tmp_path):
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    results = run_distributed(_resume, 4, str(tmp_path), str(profile), timeout=240)
    for straight, resumed, saved_step in results:
        assert saved_step == 3 and straight["step"] == resumed["step"] == 6
        for a, b in zip(straight["params"] + straight["ema"], resumed["params"] + resumed["ema"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # replicas differ in their EMA models; the final model is their mean, on every rank
    ema = [r[0]["ema"] for r in results]
    assert any(not torch.equal(a, b) for a, b in zip(ema[0], ema[1]))
    for t, final in enumerate(results[0][0]["params"]):
        torch.testing.assert_close(final, torch.stack([s[t] for s in ema]).mean(0), rtol=1e-6, atol=1e-6)
        for straight, _, _ in results:
            torch.testing.assert_close(straight["params"][t], final, rtol=0, atol=0)


class _RecordValidatedModel:
    """Records, at every validation, the parameters the validation sees."""

    def __init__(self) -> None:
        from lightning.pytorch.callbacks import Callback

        seen = self.seen = []

        class Record(Callback):
            def on_validation_epoch_start(self, trainer, pl_module):
                seen.append([p.detach().clone() for p in pl_module.parameters()])

        self.callback = Record()


def _ema_delivered(rank: int, world: int, tmp_dir: str, profile: str):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    torch.manual_seed(7)
    model, strategy, record = TinyRegressor(), _strategy(profile), _RecordValidatedModel()
    ckpt = ModelCheckpoint(dirpath=f"{tmp_dir}/ckpt", save_last=True, save_top_k=0)
    trainer_for(strategy, tmp_dir, max_epochs=2, limit_train_batches=3, limit_val_batches=1,
                enable_checkpointing=True, callbacks=[ckpt, record.callback]).fit(model, RegressionData(seed=rank))
    return [p.detach().clone() for p in model.parameters()], record.seen


def test_the_ema_ensemble_is_what_validation_checkpoint_and_final_model_hold(tmp_path):
    """With ``ema``, the model the run delivers (the mean of the ranks' EMAs) is the one the
    last validation scores and ``last.ckpt`` holds -- not the pre-ensemble replicas."""
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    results = run_distributed(_ema_delivered, 4, str(tmp_path), str(profile), timeout=240)
    final = results[0][0]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    for final_rank, seen in results:
        for a, b in zip(final, final_rank):
            torch.testing.assert_close(a, b, rtol=0, atol=0)                 # every rank ends on the ensemble
        for a, b in zip(final, seen[-1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)           # the last validation saw it
    for a, key in zip(final, ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]):
        torch.testing.assert_close(saved[key], a, rtol=1e-6, atol=1e-7)        # and the checkpoint holds it


def _mismatch(rank: int, world: int, tmp_dir: str, profile: str):
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    trainer_for(_strategy(profile), tmp_dir, max_steps=1, limit_val_batches=0).fit(TinyRegressor(), RegressionData())


def test_profile_of_another_size_is_an_error_naming_both(tmp_path):
    from tests.helpers.distributed import RemoteError

    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    with pytest.raises(RemoteError, match="has 4 ranks but the job has 2 processes"):
        run_distributed(_mismatch, 2, str(tmp_path), str(profile))


@pytest.mark.slow
def test_digits_with_4_ranks_is_within_1_5_points_of_ddp(tmp_path):
    """4 ranks as 2 racks of 2 hosts: each step only the two representatives average (the
    other two keep their own replica), so convergence rests on the shuffle.

    Margin from the measured spread (digits, 15 epochs, 1 image = 0.28 points), DS-Sync − DDP
    in points: seed 42: −0.56 (DS-Sync 0.9861), seed 1: −0.28 (0.9889), seed 2: −0.28
    (0.9889); DDP 0.9917 for all three (this machine, issue 18). Mean −0.37, sd 0.16, so
    mean − 3 sd = −0.85; another CPU's vector ISA moved DiLoCo by 0.56 points on one seed
    (``tests/e2e/test_diloco_convergence.py``), so the margin is 0.85 + 0.56 ≈ 1.5 points.
    """
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    acc = {}
    for name, extra in (("ddp", []), ("ds_sync", [f"strategy.kwargs.topology={profile}"])):
        run = tmp_path / name
        result = subprocess.run([sys.executable, "train.py", f"strategy={name}", "trainer.devices=4", *extra,
                                 f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        acc[name] = yaml.safe_load((run / "summary.json").read_text())["metrics"]["val_acc"]
    print(f"digits val_acc with 4 ranks: {acc}")
    assert acc["ds_sync"] >= acc["ddp"] - 0.015, acc
