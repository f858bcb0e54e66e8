"""Canary's Gradient Exchange Index (paper 004, §5.2) and staleness bounding (§5.3).

The GEI row vector of a step is a bitmask of its colayers whose exchange has completed on
this rank (bit z: colayer z). A colayer's exchange is a collective over every rank, so
once one of a step's colayers has arrived anywhere, every rank has produced (part of) that
step's gradient: that is what bounds how far a rank runs ahead. The GEI matrix is the rows
of the steps still in flight, plus every rank's step counter on a ``Board`` (the largest is
the paper's row number ζ; ``staleness()`` is ζ minus this rank's step).

The policy, ``staleness: s`` and ``proportion: p``:

- At step k a rank applies the aggregate of step ``k - s`` (none for k < s): it never
  waits for a straggler unless that rank has not yet produced step ``k - s``'s gradient,
  i.e. it is more than s steps behind. ``s = 0`` is exactly synchronous.
- Bound reached (the first colayer of step ``k - s`` has arrived): if fewer than p of the
  step's colayers have arrived, the late ones are dropped rather than waited for. Which
  ones is agreed through the board (first proposal wins), so every rank applies the same
  colayers of the same step and replicas stay identical; a rank keeps what it sent in a
  dropped colayer and adds it to that colayer's next exchange (error feedback).
  ``proportion=None`` never drops (wait for every colayer at the bound).
- ``warmup_steps: W``: the first W steps are synchronous (each applies its own aggregate,
  never dropped), then staleness s starts; steps W .. W + s - 1 apply nothing (every
  aggregate before W is applied already), as the first s steps do without a warm-up. The
  switch is counted in global steps (``resume_at``), so every rank switches at the same
  step and a resume past W does not warm up again (``compensation.py`` says why).

Lightning-free; the board is injected (``syncplane.comm.board.StoreBoard`` in production,
an in-memory one in unit tests).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from syncplane.algorithms.canary.compensation import check_warmup
from syncplane.config import ConfigError


class Board(Protocol):
    """What the GEI needs from the other ranks: step counters and agreements."""

    def advance(self) -> int: ...

    def entered(self) -> list[int]: ...

    def agree(self, key: str, proposal: str) -> str: ...


def check_bounds(staleness: int, proportion: float | None) -> None:
    """Raise ``ConfigError`` naming the field for a bad ``staleness`` or ``proportion``."""
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ConfigError(f"staleness: expected an integer >= 0 (0 = synchronous), got {staleness!r}")
    if proportion is not None and (isinstance(proportion, bool) or not isinstance(proportion, (int, float))
                                   or not 0.0 < float(proportion) <= 1.0):
        raise ConfigError(f"proportion: expected a number in (0, 1] or null (never drop), got {proportion!r}")


class GEI:
    """The GEI rows of the steps in flight and the decision of what to apply.

    Args:
        colayers: colayers per step (k, the row vector's length).
        staleness: s, how many steps late an aggregate may be applied.
        proportion: p, see the module docstring (None: never drop).
        board: every rank's step counter and the agreements.
        timeout_s: the longest ``settle`` waits for an arrival (a lost peer fails the
            step instead of hanging it).
        warmup_steps: W, synchronous steps before the staleness starts (global steps).
    """

    def __init__(self, colayers: int, staleness: int, proportion: float | None, board: Board,
                 timeout_s: float = 600.0, warmup_steps: int = 0) -> None:
        check_bounds(staleness, proportion)
        check_warmup(warmup_steps)
        if colayers < 1:
            raise ConfigError(f"colayers: expected at least 1, got {colayers}")
        self.colayers, self.staleness_bound, self.proportion_bound = colayers, staleness, proportion
        self.board, self.timeout_s = board, timeout_s
        self.warmup_steps = warmup_steps
        self.sync_until = warmup_steps       # this GEI's steps before this one are synchronous
        self.full = (1 << colayers) - 1
        self.step = -1                       # the step this rank is in (entered, not yet settled)
        self.rows: dict[int, int] = {}       # step -> bitmask of arrived colayers
        self.failed: dict[int, BaseException] = {}
        self.dropped = 0                     # colayers dropped so far (every rank counts the same)
        self.max_lag = 0                     # largest ζ - step seen right after a settle
        self._restored: set[int] = set()     # steps before this GEI's first: made before a resume
        self._cond = threading.Condition()

    # --------------------------------------------------------------- progress

    def resume_at(self, global_step: int) -> None:
        """This GEI's step 0 is global step ``global_step`` (a resume): the warm-up left is
        what remains of ``warmup_steps``. Call before the first ``enter``; every rank
        passes the same step (restored from the same checkpoint)."""
        if self.step != -1:
            raise RuntimeError("resume_at() must come before the first step")
        self.sync_until = max(0, self.warmup_steps - global_step)

    def restored(self, step: int, arrived: int) -> None:
        """Step ``step`` (< 0) was made before the resume and its colayers ``arrived`` (a
        bitmask) are in hand: ``due`` returns it when the run that wrote the checkpoint would
        have applied it."""
        if step >= 0:
            raise ValueError(f"restored steps come before this GEI's first step (< 0), got {step}")
        with self._cond:
            self._restored.add(step)
            self.rows[step] = arrived
            self._cond.notify_all()

    def stale_at(self, step: int | None = None) -> bool:
        """Whether ``step`` (this one by default) applies a delayed aggregate (past the warm-up)."""
        return self.staleness_bound > 0 and (self.step if step is None else step) >= self.sync_until

    def enter(self) -> int:
        """This rank starts its next step (publishes it on the board); returns its index."""
        with self._cond:
            self.step += 1
            self.rows.setdefault(self.step, 0)
        self.board.advance()
        return self.step

    def arrived(self, step: int, index: int) -> None:
        """Colayer ``index`` of ``step`` has completed its exchange here (any thread)."""
        with self._cond:
            self.rows[step] = self.rows.get(step, 0) | (1 << index)
            self._cond.notify_all()

    def fail(self, step: int, error: BaseException) -> None:
        """An exchange of ``step`` failed: whoever waits on it raises ``error``."""
        with self._cond:
            self.failed[step] = error
            self._cond.notify_all()

    def due(self, step: int | None = None) -> int | None:
        """The step whose aggregate is applied at ``step`` (this one by default): itself in
        the warm-up, then ``step - s``; None when that was applied already (or never made)."""
        step = self.step if step is None else step
        if step < self.sync_until:
            return step
        due = step - self.staleness_bound
        return due if due >= self.sync_until or due in self._restored else None

    def staleness(self) -> int:
        """ζ minus this rank's step: how far the fastest rank is ahead of this one."""
        return max(self.board.entered()) - 1 - self.step

    def proportion(self, step: int) -> float:
        """Share of ``step``'s colayers that have arrived here."""
        with self._cond:
            return bin(self.rows.get(step, 0)).count("1") / self.colayers

    # --------------------------------------------------------------- decision

    def settle(self, step: int) -> int:
        """Wait for ``step``'s aggregate as the bounds say; return the bitmask of its
        colayers to apply (the same on every rank). Raises the exchange's error if it
        failed, TimeoutError after ``timeout_s`` without an arrival."""
        self._wait(step, lambda row: row != 0)          # the bound: every rank produced part of it
        if self.staleness_bound == 0 or self.proportion_bound is None or step < self.sync_until:
            decided = self.full                          # synchronous (or the warm-up): never drop
        else:
            row = self.rows[step]
            proposal = self.full if self.proportion(step) >= self.proportion_bound else row
            decided = int(self.board.agree(f"step/{step}", str(proposal)))
        self._wait(step, lambda row: row & decided == decided)
        with self._cond:
            self.rows.pop(step, None)
            self.failed.pop(step, None)
            self._restored.discard(step)
        self.dropped += bin(self.full & ~decided).count("1")
        self.max_lag = max(self.max_lag, self.staleness())
        return decided

    def _wait(self, step: int, condition: object) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not condition(self.rows.get(step, 0)):  # type: ignore[operator]
                if step in self.failed:
                    raise self.failed[step]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"canary: no exchange of step {step} arrived within {self.timeout_s:.0f} s "
                                       f"(a peer stopped?)")
                self._cond.wait(left)
