"""Canary's bounded staleness (paper 004, §5.3) on real gloo processes, rank 2 three times
slower than the others.

- ``staleness=2``: on a linear model, every rank's trajectory equals the hand-computed
  delayed-gradient reference ``w[k+1] = w[k] - lr * mean_r grad_r(w[k-2]; batch[r, k-2])``
  (nothing applied in the first two steps), every rank applies identical aggregates, and
  right after a rank settles step k's aggregate no rank is more than 2 steps behind it
  (read on the GEI's step counters: an event order, not a timing).
- ``staleness=2`` after a 2-step synchronous warm-up, SGD momentum 0.9 compensated while
  stale (``MomentumCompensation``, 0.9 - 2/3): the trajectory equals the float64
  reference of heavy-ball with the recipe's momentum on the warm-up's own gradients, then
  nothing for 2 steps, then ``k - 2``'s gradient with the lowered momentum.
- ``staleness=1, proportion=1``: late colayers are dropped, the same ones on every rank,
  and nothing is lost: what was applied, what is still in flight and what the ranks carry
  for their next exchange add up to every gradient produced.
"""

from __future__ import annotations

import time

import torch

from tests.helpers.distributed import run_distributed

SEED = 1234
WORLD, SLOW = 3, 2
SIZES = [5, 4, 3]            # colayers of the linear model's weight vector
D, B, LR, STEPS = sum(SIZES), 6, 0.05, 8


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED * 100 + rank * 10_000 + step)
    return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randn(B, generator=g, dtype=torch.float64)


def _grad(w: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return x.T @ (x @ w - y) / B


def _reference(s: int, warmup: int = 0, momentum: float = 0.0) -> list[torch.Tensor]:
    """w after every step, float64, from the definition of a delayed gradient: step k
    applies its own gradient in the warm-up (k < warmup), then that of step k - s (none
    if k - s < warmup); heavy-ball v = mu v + g (v = g the first time, as torch's SGD),
    mu lowered by s / (s + 1) (not below 0) once stale."""
    ws, grads, v = [torch.zeros(D, dtype=torch.float64)], [], None
    for k in range(STEPS):
        grads.append(torch.stack([_grad(ws[k], r, k) for r in range(WORLD)]).mean(0))
        due = k if k < warmup else k - s
        if due < warmup and k >= warmup:
            ws.append(ws[k].clone())
            continue
        mu = momentum if k < warmup else max(0.0, momentum - s / (s + 1))
        v = grads[due] if v is None else mu * v + grads[due]
        ws.append(ws[k] - LR * v)
    return ws[1:]


def _run(rank: int, world: int, s: int, p: float | None, fixed_grads: bool, warmup: int = 0,
         momentum: float | None = None):
    from syncplane.algorithms.canary import GEI, BackwardPipeline, CanaryConfig, CanaryEngine, MomentumCompensation
    from syncplane.algorithms.canary.exchange import make_transport
    from syncplane.job import JobContext
    from syncplane.comm.board import StoreBoard

    transport = make_transport(CanaryConfig(compression="none", nics=1, sync_timeout_s=60), JobContext.from_environment())
    board = StoreBoard(rank, world)
    gei = GEI(len(SIZES), s, p, board, timeout_s=60, warmup_steps=warmup)
    current: dict[str, torch.Tensor] = {}
    offsets = [sum(SIZES[:i]) for i in range(len(SIZES))]
    pipe = BackwardPipeline(CanaryEngine(SIZES, world, transport),
                            lambda i: current["g"][offsets[i]:offsets[i] + SIZES[i]], gei=gei)
    w = torch.zeros(D, dtype=torch.float32)
    if momentum is not None:                                # the strategy's optimizer path
        param = torch.nn.Parameter(w)
        optimizer, compensation = torch.optim.SGD([param], lr=LR, momentum=momentum), MomentumCompensation(s)
    trajectory, applied, lags, produced = [], [], [], torch.zeros(D, dtype=torch.float64)
    pause = 0.03 * (3 if rank == SLOW else 1)
    for k in range(STEPS):
        pipe.begin()
        time.sleep(pause)                                   # the forward
        g = (torch.randn(D, generator=torch.Generator().manual_seed(SEED + 7 * k + rank))
             if fixed_grads else _grad(w.double(), rank, k))
        produced += g
        current["g"] = g.float()
        for i in range(len(SIZES)):                         # the backward, colayer by colayer
            time.sleep(pause / 3)
            pipe.ready(i)
        pipe.end_backward()
        settled = pipe.settle()
        entered = board.entered()
        lags.append((k + 1) - min(entered))                 # steps this rank is ahead of the slowest
        if settled is not None:
            due, out = settled
            applied.append((due, {i: v.clone() for i, v in out.items()}))
            if momentum is None:
                for i, v in out.items():
                    w[offsets[i]:offsets[i] + SIZES[i]] -= LR * v
            else:
                param.grad = torch.cat([out[i] for i in range(len(SIZES))])
                if gei.stale_at():
                    compensation.apply(optimizer.param_groups)
                optimizer.step()
                compensation.restore()
        trajectory.append(w.clone())
    pipe.close()
    transport.close()
    return {"trajectory": trajectory, "applied": applied, "lags": lags, "dropped": gei.dropped,
            "carry": {i: v.double() for i, v in pipe.carry.items()}, "produced": produced,
            "unapplied": {key: v.double() for key, v in pipe.unapplied().items()}}


def _both(rank: int, world: int) -> tuple[dict, dict]:
    """Both scenarios in one set of processes (spawning them is most of the cost)."""
    return (_run(rank, world, 2, None, False), _run(rank, world, 1, 1.0, True),
            _run(rank, world, 2, None, False, warmup=2, momentum=0.9))


def _same_aggregates(results: list[dict]) -> None:
    for other in results[1:]:
        assert len(other["applied"]) == len(results[0]["applied"])
        for (due_a, out_a), (due_b, out_b) in zip(results[0]["applied"], other["applied"]):
            assert due_a == due_b and out_a.keys() == out_b.keys()
            for i in out_a:
                assert torch.equal(out_a[i], out_b[i])


def test_bounded_staleness_on_real_gloo() -> None:
    print("seed", SEED)
    both = run_distributed(_both, WORLD, timeout=150)
    _check_delayed_gradient([a for a, _, _ in both], _reference(2))
    _check_drops([b for _, b, _ in both])
    _check_delayed_gradient([c for _, _, c in both], _reference(2, warmup=2, momentum=0.9))


def _check_delayed_gradient(results: list[dict], reference: list[torch.Tensor]) -> None:
    s = 2
    _same_aggregates(results)
    for rank, out in enumerate(results):
        assert [due for due, _ in out["applied"]] == list(range(STEPS - s))
        for k, (got, want) in enumerate(zip(out["trajectory"], reference)):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6, msg=f"rank {rank} step {k}")
        assert max(out["lags"]) <= s, out["lags"]           # never more than s steps ahead
        assert out["dropped"] == 0
    assert max(max(out["lags"]) for r, out in enumerate(results) if r != SLOW) >= 1   # they did run ahead


def _check_drops(results: list[dict]) -> None:
    _same_aggregates(results)
    dropped = {out["dropped"] for out in results}
    assert len(dropped) == 1 and dropped.pop() > 0           # the slow rank's late colayers were dropped
    offsets = [sum(SIZES[:i]) for i in range(len(SIZES))]
    delivered = torch.zeros(D, dtype=torch.float64)
    for _, out in results[0]["applied"]:
        for i, v in out.items():
            delivered[offsets[i]:offsets[i] + SIZES[i]] += v.double()
    for (_, i), v in results[0]["unapplied"].items():
        delivered[offsets[i]:offsets[i] + SIZES[i]] += v
    carried = torch.zeros(D, dtype=torch.float64)
    for out in results:
        assert max(out["lags"]) <= 1
        for i, v in out["carry"].items():
            carried[offsets[i]:offsets[i] + SIZES[i]] += v
    produced = sum(out["produced"] for out in results)
    torch.testing.assert_close(delivered * WORLD + carried, produced, rtol=1e-5, atol=1e-5)
