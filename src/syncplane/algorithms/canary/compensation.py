"""What bounded staleness does to the optimizer, and how Canary compensates.

Applying step k - s's aggregate at step k is SGD with a delayed gradient. Under the
recipes' heavy momentum (SGD, momentum 0.9) that diverges early and never fully recovers
(digits, 4 ranks, s = 2: 0.794 validation accuracy against ddp's 0.992; with the two
remedies below 0.989). Both are on by default when ``staleness`` > 0, chosen by measurement
(``scripts/canary_staleness_sim.py``; numbers in docs/strategies/canary.md):

1. **Momentum compensation.** Asynchrony begets momentum (Mitliagkas et al., 2016): a
   gradient s steps old behaves, in expectation, like an extra momentum term of
   ``s / (s + 1)``. So while stale, the optimizer's explicit momentum is lowered by that
   much, ``μ' = max(0, μ - s / (s + 1))`` (0.9 -> 0.233 for s = 2), keeping the total near
   the recipe's. The multiplicative reading (keeping ``(1 - μ)`` times ``1/(s+1)``
   constant, 0.9 -> 0.7) is far worse in simulation (``docs/design-notes.md``).
   Why lower momentum at all: the largest stable step of heavy-ball with an s-step delay,
   ``η·λ/(1 - μ)``, is nearly independent of μ (0.5-0.6 for s = 2; 38 for μ = 0.9
   without delay): at a fixed LR, dropping μ from 0.9 to 0.233 once the delay starts
   widens the stable ``η·λ`` range ninefold (0.051 -> 0.455;
   ``scripts/canary_staleness_sim.py --stability``).
2. **Synchronous warm-up.** The first ``warmup_steps`` optimizer steps run at s = 0, then
   every rank switches to s at the same step (the global step, so a resume does not redo
   it). Early training is where a delayed gradient hurts most: with compensation alone
   the simulated digits run reaches 0.967, with 50 synchronous steps first
   0.990 (synchronous: 0.991). A warm-up without compensation does not help (0.62: momentum
   0.9 with the delay is as unstable after the warm-up as before it) -- the two are
   needed together. An LR ramp instead of the synchronous warm-up does
   not help either (0.957-0.970). Default 100 steps: on fashion_mnist (1 epoch, 234 steps)
   50 left 3.3 points to ddp, 100 leaves 0.77; digits is 0.989 with either.

The compensation is applied to the optimizer's param groups for one update only and put
back right after it (``MomentumCompensation``), so LR schedulers, logs and checkpoints
always see the recipe's momentum, and ``staleness: 0`` changes nothing. Only param groups
with a ``momentum`` entry (SGD, RMSprop) are compensated; Adam-style ``betas`` are left as
they are (not measured), which the start-up log line says.

Lightning-free: the glue (``strategies/canary.py``) calls ``apply`` / ``restore`` around the
optimizer's update.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from syncplane.config import ConfigError


def implicit_momentum(staleness: int) -> float:
    """The momentum an s-step delay adds (Mitliagkas et al. 2016): ``s / (s + 1)``."""
    return staleness / (staleness + 1)


def compensated_momentum(momentum: float, staleness: int) -> float:
    """The explicit momentum to use while gradients are ``staleness`` steps old:
    ``max(0, momentum - s / (s + 1))``; ``momentum`` itself for s = 0."""
    if staleness == 0:
        return momentum
    return max(0.0, momentum - implicit_momentum(staleness))


def check_warmup(warmup_steps: int) -> None:
    """Raise ``ConfigError`` naming the field for a bad warm-up length."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"warmup_steps: expected an integer >= 0 (synchronous steps before staleness "
                          f"starts; 0 = stale from the first step), got {warmup_steps!r}")


def check_schedule(warmup_steps: int, momentum_compensation: bool) -> None:
    """Raise ``ConfigError`` naming the field for a bad warm-up or compensation switch."""
    check_warmup(warmup_steps)
    if not isinstance(momentum_compensation, bool):
        raise ConfigError(f"momentum_compensation: expected true or false, got {momentum_compensation!r}")


class MomentumCompensation:
    """Lowers every param group's ``momentum`` for one optimizer update, then puts it back.

    Args:
        staleness: s, how old the applied gradients are while stale.
    """

    def __init__(self, staleness: int) -> None:
        self.staleness = staleness
        self._saved: list[tuple[MutableMapping[str, Any], float]] = []
        self.updates = 0     # updates that ran with a compensated momentum

    def plan(self, param_groups: Sequence[MutableMapping[str, Any]]) -> list[tuple[float, float] | None]:
        """Per param group: (recipe momentum, momentum while stale), or None where the group
        has no ``momentum`` entry (not compensated)."""
        return [(float(g["momentum"]), compensated_momentum(float(g["momentum"]), self.staleness))
                if "momentum" in g else None for g in param_groups]

    def apply(self, param_groups: Sequence[MutableMapping[str, Any]]) -> None:
        """Set the compensated momentum; ``restore`` must follow the update. A second call
        before the restore (a closure evaluated twice) changes nothing: the momentum is
        lowered once, from the recipe's value."""
        if self._saved:
            return
        for group in param_groups:
            if "momentum" in group:
                self._saved.append((group, group["momentum"]))
                group["momentum"] = compensated_momentum(float(group["momentum"]), self.staleness)
        self.updates += bool(self._saved)

    def restore(self) -> None:
        """Put back exactly the values ``apply`` replaced (a no-op if nothing was applied)."""
        for group, momentum in self._saved:
            group["momentum"] = momentum
        self._saved = []

    @property
    def active(self) -> bool:
        return bool(self._saved)
