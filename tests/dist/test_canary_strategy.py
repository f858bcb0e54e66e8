"""``strategy=canary`` through Lightning's Trainer on real gloo processes: exact (identity
codec) it trains like DDP; with the sketch every replica stays bit-identical and each rank's
error-feedback residuals are in its rank state (what checkpoints gather); colayers are
exchanged during the backward, and after it under gradient accumulation (same result as
exchanging the accumulated gradient)."""

from __future__ import annotations

import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.strategies import fit_digits


def _train(rank: int, world: int, tmp_dir: str, name: str, kwargs: dict, **trainer: object
           ) -> tuple[torch.Tensor, dict]:
    strategy, model = fit_digits(name, kwargs, tmp_dir, **trainer)
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    state = strategy.rank_state_dict() if name == "canary" else {}
    if name == "canary" and kwargs.get("staleness"):
        gei = strategy.gei
        state["gei"] = (gei.step, gei.dropped, gei.max_lag)
        # updates with the momentum compensated, and the recipe's momentum afterwards
        state["momentum"] = (strategy._compensation.updates, strategy.optimizers[0].param_groups[0]["momentum"])
    if name == "canary":
        assert strategy.comm_meter.calls > 0, "the canary exchange never ran"
        # exchanges started by the gradient hooks while the backward ran (none under accumulation)
        overlapped = strategy.overlapped_colayers
        assert overlapped > 0 if trainer.get("accumulate_grad_batches", 1) == 1 else overlapped == 0
    return flat, state


def _all(rank: int, world: int, tmp_dir: str):  # type: ignore[no-untyped-def]
    ddp = _train(rank, world, tmp_dir, "ddp", {})
    # a first colayer smaller than the rest, as by default: still DDP's result
    exact = _train(rank, world, tmp_dir, "canary", {"compression": "none", "bucket_cap_mb": 0.01,
                                                    "first_bucket_cap_mb": 0.001})
    sketch = _train(rank, world, tmp_dir, "canary", {"bucket_cap_mb": 0.01})
    ddp_acc = _train(rank, world, tmp_dir, "ddp", {}, accumulate_grad_batches=2)
    exact_acc = _train(rank, world, tmp_dir, "canary", {"compression": "none"}, accumulate_grad_batches=2)
    stale = _train(rank, world, tmp_dir, "canary", {"bucket_cap_mb": 0.01, "staleness": 2, "warmup_steps": 1})
    return ddp, exact, sketch, ddp_acc, exact_acc, stale


def test_canary_trains_like_ddp_and_keeps_replicas_identical(tmp_path) -> None:
    results = run_distributed(_all, 2, str(tmp_path), timeout=400)
    for (ddp, _), (exact, exact_state), (sketch, state), (ddp_acc, _), (exact_acc, _), (stale, stale_state) in results:
        # staleness 2 after 1 synchronous step: 5 steps entered, step 0's aggregate applied at
        # step 0, steps 1-2's at 3-4 with the momentum compensated, replicas identical
        assert torch.equal(stale, results[0][5][0]) and not torch.equal(stale, sketch)
        assert stale_state["gei"][0] == 4 and stale_state["gei"][1] == 0 and stale_state["gei"][2] <= 2
        assert stale_state["momentum"] == (2, 0.9)
        torch.testing.assert_close(exact, ddp, rtol=1e-5, atol=1e-5)
        first, *rest = exact_state["canary"]["sizes"]
        assert first * 4 <= 0.001 * 2**20 < max(rest) * 4                # the first colayer cut at its own cap
        torch.testing.assert_close(exact_acc, ddp_acc, rtol=1e-5, atol=1e-5)
        assert not torch.equal(exact_acc, exact)                         # accumulation did change the run
        assert torch.equal(sketch, results[0][2][0])                     # replicas bit-identical
        assert not torch.equal(sketch, exact)                            # the sketch did change the run
        assert (sketch - exact).norm() / exact.norm() < 0.05
        residuals = state["canary"]["transport"]["residuals"]
        assert residuals.shape == (2, exact.numel()) and residuals.abs().sum() > 0
        assert len(state["canary"]["sizes"]) > 1                          # several colayers (0.01 MiB cap)
    # each rank keeps its own residuals
    assert not torch.equal(results[0][2][1]["canary"]["transport"]["residuals"],
                           results[1][2][1]["canary"]["transport"]["residuals"])
