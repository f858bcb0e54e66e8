"""Canary's bounded staleness in one process: data-parallel SGD on the ``digits`` recipe
with every step's mean gradient applied s steps late, as Canary's GEI schedules it
(``GEI.due``: the synchronous warm-up, then step k applies step k - s's aggregate), and
the optimizer's momentum compensated as the strategy does it (``MomentumCompensation``).

Why a simulation: the remedy for s > 0 under momentum (issue 14) was chosen by sweeping
it here, where a 15-epoch run takes seconds and no process group is needed; the real
4-rank runs (``scripts/canary_convergence.py``) confirm the chosen default. The sketch
codec is left out (s = 0 with it is within 0.6 point of ddp), so this isolates the delay.

    python scripts/canary_staleness_sim.py                      # the table in docs/strategies/canary.md
    python scripts/canary_staleness_sim.py --only s2_default --seeds 42
    python scripts/canary_staleness_sim.py --stability          # why momentum must drop while stale

Ranks are simulated faithfully where it matters: each rank's 32-sample batch goes
through the model on its own (batch-norm statistics per rank), the loss is the mean over
ranks, the LR schedule is the recipe's cosine over 15 epochs of 11 steps.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import torch
import torch.nn.functional as F
from torch.distributed import HashStore

from syncplane.algorithms.canary import GEI, MomentumCompensation
from syncplane.comm.board import StoreBoard
from syncplane.recipes.digits import DigitsData, DigitsSettings, small_cnn

# name: (staleness, momentum, warmup_steps, momentum_compensation)
SETTINGS = {
    "sync_m0.9": (0, 0.9, 0, False),            # what ddp does (the reference)
    "s2_m0.9_plain": (2, 0.9, 0, False),        # staleness before issue 14
    "s2_m0.5_plain": (2, 0.5, 0, False),
    "s2_m0_plain": (2, 0.0, 0, False),
    "s2_compensated": (2, 0.9, 0, True),        # compensation alone
    "s2_warmup_only": (2, 0.9, 50, False),      # warm-up alone
    "s2_default": (2, 0.9, 50, True),           # warm-up 50 + compensation (the shipped default is 100)
    "s1_default": (1, 0.9, 50, True),
    "s3_default": (3, 0.9, 50, True),
}


def simulate(staleness: int, momentum: float, warmup_steps: int, compensation: bool, seed: int,
             ranks: int = 4, epochs: int = 15) -> float:
    """Validation accuracy after ``epochs`` of delayed-gradient training."""
    settings = DigitsSettings()
    data = DigitsData(settings)
    data.setup("fit")
    assert data.train_set is not None and data.val_set is not None
    x_train, y_train = data.train_set.tensors
    x_val, y_val = data.val_set.tensors
    torch.manual_seed(seed)
    model = small_cnn(settings.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=momentum,
                                weight_decay=settings.weight_decay)
    per_epoch = len(y_train) // ranks // settings.batch_size
    total = per_epoch * epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: 0.5 * (1 + math.cos(math.pi * min(1.0, k / total))))
    # the production schedule (a one-rank board: nothing to wait for in one process)
    gei = GEI(1, staleness, None, StoreBoard(0, 1, HashStore()), warmup_steps=warmup_steps) if staleness else None
    compensate = MomentumCompensation(staleness)
    produced: dict[int, list[torch.Tensor]] = {}
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        shards = [order[r::ranks] for r in range(ranks)]
        for b in range(per_epoch):
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss = sum(F.cross_entropy(model(x_train[idx]), y_train[idx])
                       for idx in (shard[b * settings.batch_size:(b + 1) * settings.batch_size] for shard in shards))
            (loss / ranks).backward()
            produced[step] = [p.grad.clone() for p in model.parameters()]
            due = step if gei is None else gei.due(step)
            if due is not None:
                for p, g in zip(model.parameters(), produced.pop(due)):
                    p.grad = g
                stale = gei is not None and gei.stale_at(step)
                if stale and compensation:
                    compensate.apply(optimizer.param_groups)
                optimizer.step()
                compensate.restore()
            produced = {k: v for k, v in produced.items() if due is None or k > due}
            scheduler.step()
            step += 1
    model.eval()
    with torch.no_grad():
        return float((model(x_val).argmax(1) == y_val).float().mean())


def max_stable_step(momentum: float, staleness: int) -> float:
    """The largest η·λ for which heavy-ball with an s-step delay is stable on a quadratic of
    curvature λ: ``w[k+1] = w[k] + μ (w[k] - w[k-1]) - η λ w[k-s]``, whose characteristic
    polynomial is ``z^(s+2) - (1+μ) z^(s+1) + μ z^s + ηλ z`` (bisection on its largest root)."""
    import numpy as np

    def stable(h: float) -> bool:
        coefficients = np.zeros(staleness + 3)
        coefficients[0], coefficients[1], coefficients[2] = 1.0, -(1.0 + momentum), momentum
        coefficients[staleness + 1] += h
        return float(np.max(np.abs(np.roots(coefficients)))) < 1.0

    low, high = 0.0, 4.0
    for _ in range(50):
        low, high = ((low + high) / 2, high) if stable((low + high) / 2) else (low, (low + high) / 2)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SETTINGS), help="comma-separated settings")
    parser.add_argument("--seeds", default="42,1,2", help="comma-separated seeds (mean reported)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stability", action="store_true",
                        help="only print the largest stable η·λ and η·λ/(1-μ) per momentum and staleness")
    args = parser.parse_args()
    if args.stability:
        for staleness in (0, 1, 2, 3):
            print(f"s={staleness}  " + "  ".join(
                f"μ={mu}: {max_stable_step(mu, staleness):.3f} ({max_stable_step(mu, staleness) / (1 - mu):.2f})"
                for mu in (0.0, 0.233, 0.5, 0.7, 0.9)))
        return
    torch.set_num_threads(args.threads)
    # a step with nothing due skips optimizer.step(), which torch's scheduler warns about
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
    seeds = [int(s) for s in args.seeds.split(",")]
    for name in args.only.split(","):
        start = time.time()
        accs = [simulate(*SETTINGS[name], seed=seed) for seed in seeds]
        print(f"{name:>16}  mean val_acc {sum(accs) / len(accs):.4f}  per seed "
              + " ".join(f"{a:.4f}" for a in accs) + f"  ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
