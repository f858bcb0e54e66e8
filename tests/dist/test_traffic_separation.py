"""Model data and control traffic kept apart: every strategy trains while the model-data
group refuses anything but model data (``tests/helpers/traffic.py``), so none of its
control collectives -- topology check, consensus distance, DS-Sync adjustment, replica
and state gathers, run totals -- rides the group that is NCCL on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

STRATEGIES = {
    "ddp": {}, "atc": {}, "awc": {}, "h_atc": {"ranks_per_machine": 1}, "h_awc": {"ranks_per_machine": 1},
    "ds_sync": {"adjust_every": 2, "swa": True}, "diloco": {"sync_every": 2, "compression": "int8"},
}


def _train_all(rank: int, world: int, tmp_dir: str, names: list[str]):
    from pathlib import Path

    from tests.dist.test_decentralized import _strategy
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for
    from tests.helpers.traffic import refuse_control_on_data_group

    finals = {}
    with refuse_control_on_data_group():
        for name in names:
            kwargs = dict(STRATEGIES[name])
            if name != "ddp":
                kwargs["consensus_every"] = 2
            if name == "ds_sync":   # the bandwidth probe (CPU tensors) rides the control group too
                kwargs["topology"] = "probe"
            torch.manual_seed(0)
            model = TinyRegressor(lr=0.05)
            trainer = trainer_for(_strategy(name, **kwargs), tmp_dir, max_steps=6, limit_val_batches=1,
                                  val_check_interval=3)
            trainer.fit(model, RegressionData(seed=rank))
            trainer.save_checkpoint(str(Path(tmp_dir) / f"{name}.ckpt"))   # replica / state gathers
            finals[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return finals


@pytest.mark.parametrize("names", [["ddp", "atc", "awc", "h_atc"], ["h_awc", "ds_sync", "diloco"]])
def test_every_strategy_trains_with_a_data_group_that_refuses_control(names, tmp_path):
    results = run_distributed(_train_all, 2, str(tmp_path), names, timeout=400)
    for name in names:
        assert all(torch.isfinite(r[name]).all() for r in results), name


def _control_on_data_group(rank: int, world: int):
    import syncplane.comm.check as check
    from tests.helpers.traffic import ControlOnDataGroup, refuse_control_on_data_group

    check.control_group = lambda group=None: group      # what the code did before: the default group
    with refuse_control_on_data_group():
        try:
            check.check_plan([1 - rank], [1 - rank])
        except ControlOnDataGroup as exc:
            return str(exc)
    return None


def test_the_harness_fails_a_control_collective_on_the_data_group():
    for message in run_distributed(_control_on_data_group, 2):
        assert message == "syncplane.comm.check sent a torch.float64 tensor with dist.all_reduce on the model-data group"
