"""The CPU outer optimizer: DiLoCo's Nesterov step, exactly as torch's SGD(nesterov=True)."""

from __future__ import annotations

import pytest
import torch

from syncplane.algorithms.diloco.outer import OuterOptimizer


def test_default_outer_step_is_nesterov_momentum_by_the_formula_and_by_torch():
    """m ← μ·m + Δ;  θ ← θ − lr·(Δ + μ·m)  with lr 0.7, μ 0.9 (DiLoCo's outer optimizer)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2, 2)]
    theta0 = [torch.randn(s, generator=g) for s in shapes]
    outer = OuterOptimizer(torch.cat([t.reshape(-1) for t in theta0]))
    per_tensor = [t.clone().requires_grad_(True) for t in theta0]
    reference = torch.optim.SGD(per_tensor, lr=0.7, momentum=0.9, nesterov=True)
    theta, momentum = torch.cat([t.reshape(-1) for t in theta0]), None
    for _ in range(6):
        deltas = [torch.randn(s, generator=g) for s in shapes]
        flat = torch.cat([d.reshape(-1) for d in deltas])
        outer.step(flat.clone())
        for p, d in zip(per_tensor, deltas):
            p.grad = d.clone()
        reference.step()
        momentum = flat.clone() if momentum is None else 0.9 * momentum + flat
        theta = theta - 0.7 * (flat + 0.9 * momentum)
    torch.testing.assert_close(outer.params, torch.cat([p.detach().reshape(-1) for p in per_tensor]),
                               rtol=0, atol=0)
    torch.testing.assert_close(outer.params, theta, rtol=1e-6, atol=1e-6)
    assert outer.params.grad is None


def test_pseudo_gradient_and_any_optimizer_by_class_path():
    outer = OuterOptimizer(torch.ones(4), "torch.optim.AdamW", {"lr": 0.1})
    assert isinstance(outer.optimizer, torch.optim.AdamW)
    local = torch.tensor([0.5, 1.0, 2.0, 1.0])
    assert torch.equal(outer.pseudo_gradient(local), torch.tensor([0.5, 0.0, -1.0, 0.0]))
    state = outer.state_dict()
    outer.step(torch.ones(4))
    again = OuterOptimizer(torch.zeros(4), "torch.optim.AdamW", {"lr": 0.1})
    again.load_state_dict(state)
    again.step(torch.ones(4))
    assert torch.equal(again.params, outer.params)


def test_bad_outer_configuration_names_the_value():
    with pytest.raises(ValueError, match="'torch.optim.Nope' is not an importable torch.optim.Optimizer"):
        OuterOptimizer(torch.zeros(2), "torch.optim.Nope")
    with pytest.raises(ValueError, match="'os.path' is not an importable"):
        OuterOptimizer(torch.zeros(2), "os.path")
    with pytest.raises(ValueError, match=r"outer_kwargs \{'lr': 1.0, 'nesterov': True\} rejected by torch.optim.SGD"):
        OuterOptimizer(torch.zeros(2), "torch.optim.SGD", {"lr": 1.0, "nesterov": True})
    with pytest.raises(ValueError, match="outer state holds 3 parameters, this model has 2"):
        OuterOptimizer(torch.zeros(2)).load_state_dict(OuterOptimizer(torch.zeros(3)).state_dict())
