"""Canary's momentum compensation while stale (``algorithms/canary/compensation.py``):
the exact compensated values, an SGD update with it equals the hand-computed heavy-ball
update with the lowered momentum, the recipe's momentum is back right after (so a
checkpoint, loaded with ``weights_only=True``, holds it), and bad settings are named."""

from __future__ import annotations

import io

import pytest
import torch

from syncplane.algorithms.canary import CanaryConfig, MomentumCompensation, compensated_momentum
from syncplane.config import ConfigError

SEED = 14


@pytest.mark.parametrize("momentum, s, want", [(0.9, 0, 0.9), (0.9, 1, 0.4), (0.9, 2, 0.9 - 2 / 3),
                                               (0.9, 3, 0.15), (0.5, 2, 0.0), (0.0, 4, 0.0)])
def test_compensated_momentum_is_the_recipes_minus_what_the_delay_adds(momentum, s, want) -> None:
    assert compensated_momentum(momentum, s) == pytest.approx(want, abs=1e-15)


def _model_and_optimizer() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(SEED)
    model = torch.nn.Linear(4, 3).double()
    groups = [{"params": [model.weight], "momentum": 0.9}, {"params": [model.bias], "momentum": 0.5}]
    return model, torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)


def test_a_compensated_update_is_heavy_ball_with_the_lowered_momentum_then_restored() -> None:
    print("seed", SEED)
    model, optimizer = _model_and_optimizer()
    compensation = MomentumCompensation(2)
    assert compensation.plan(optimizer.param_groups) == [(0.9, 0.9 - 2 / 3), (0.5, 0.0)]
    w, v = model.weight.detach().clone(), torch.zeros_like(model.weight)
    g = torch.Generator().manual_seed(SEED)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in (model.weight, model.bias)]
        model.weight.grad, model.bias.grad = grads
        stale = step >= 1                                  # step 0: the warm-up, recipe momentum
        if stale:
            compensation.apply(optimizer.param_groups)
            assert compensation.active
            assert [gr["momentum"] for gr in optimizer.param_groups] == [0.9 - 2 / 3, 0.0]
        optimizer.step()
        compensation.restore()
        assert [gr["momentum"] for gr in optimizer.param_groups] == [0.9, 0.5]   # exactly the recipe's
        mu = 0.9 - 2 / 3 if stale else 0.9
        d = grads[0] + 0.01 * w                            # torch's SGD: decay, then v = mu v + d
        v = d if step == 0 else mu * v + d
        w = w - 0.1 * v
        torch.testing.assert_close(model.weight.detach(), w, rtol=1e-12, atol=1e-12)
    assert compensation.updates == 2
    compensation.apply(optimizer.param_groups)
    compensation.apply(optimizer.param_groups)         # a closure run twice: lowered once, not twice
    assert [gr["momentum"] for gr in optimizer.param_groups] == [0.9 - 2 / 3, 0.0] and compensation.updates == 3
    compensation.restore()
    assert [gr["momentum"] for gr in optimizer.param_groups] == [0.9, 0.5]


def test_checkpoint_holds_the_recipes_momentum_and_loads_with_weights_only() -> None:
    model, optimizer = _model_and_optimizer()
    compensation = MomentumCompensation(2)
    model.weight.grad, model.bias.grad = torch.ones_like(model.weight), torch.ones_like(model.bias)
    compensation.apply(optimizer.param_groups)
    optimizer.step()
    compensation.restore()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert [gr["momentum"] for gr in loaded["param_groups"]] == [0.9, 0.5]
    _, fresh = _model_and_optimizer()
    fresh.load_state_dict(loaded)
    assert [gr["momentum"] for gr in fresh.param_groups] == [0.9, 0.5]
    torch.testing.assert_close(fresh.state_dict()["state"][0]["momentum_buffer"],
                               optimizer.state_dict()["state"][0]["momentum_buffer"], rtol=0, atol=0)


def test_groups_without_momentum_are_left_alone() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    adam = torch.optim.Adam([param], betas=(0.9, 0.99))
    compensation = MomentumCompensation(2)
    assert compensation.plan(adam.param_groups) == [None]
    compensation.apply(adam.param_groups)
    assert not compensation.active and adam.param_groups[0]["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("field, value", [("warmup_steps", -3), ("warmup_steps", "50"), ("warmup_steps", 1.0),
                                          ("momentum_compensation", "yes"), ("momentum_compensation", 1)])
def test_bad_schedule_settings_name_the_field(field, value) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: "):
        CanaryConfig(staleness=2, **{field: value})


def test_defaults_warm_up_and_compensate() -> None:
    config = CanaryConfig(staleness=2)
    assert config.warmup_steps == 100 and config.momentum_compensation is True
