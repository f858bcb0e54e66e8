"""Emulated slow compute: a rank whose steps take longer, as on an older, throttled or
shared GPU.

Two sources, combined per rank: the ``compute_speed`` of the rank's host in the cluster
profile (a rank on a host at 0.5 while the fastest runs at 1.0 takes 2x as long, from the
first step), and ``fault={kind:slow,rank:R,factor:F,step:S}`` (rank R's steps take F times as
long from step S on). The slowdown is a timed wait after each step, proportional to the
rank's own measured step time (the median of its recent steps, the waits left out), so it
behaves like a slower accelerator -- every step stretched by the same factor while the CPU
stays free -- rather than like a loaded CPU, which would slow the other ranks sharing it too.

An emulated accelerator (``trainer.emulated_step_s = E > 0``), for measuring stragglers on a
machine with fewer cores than ranks: every computed batch then takes E x the rank's slowdown
in all, as if a GPU ran its forward and backward for that long while the CPU idles; the rank's
real compute (batch start to just before the optimizer step, so a sync's wait for its peers is
not counted as compute) is part of it and a timed wait fills the rest. Every rank waits, slowed
or not. A batch whose real compute alone exceeds its nominal time is an *overrun*: counted in
``summary.json`` (``compute.overran_steps`` of ``compute.emulated_steps``), since a run with
many of them measures the CPU, not the emulated accelerator.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from syncplane.algorithms.spec import SKIPPED_BATCH
from syncplane.runtime.settings import FaultSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slowdown:
    """How many times as long one rank's steps take: ``base`` from the first step (its host's
    compute speed against the fastest host's), times ``factor`` from step ``from_step`` on."""

    base: float = 1.0
    factor: float = 1.0
    from_step: int = 0

    def at(self, step: int) -> float:
        """The slowdown of step ``step`` (0 = the first)."""
        return self.base * (self.factor if step >= self.from_step else 1.0)

    def as_dict(self) -> dict[str, Any]:
        return {"base": self.base, "factor": self.factor, "from_step": self.from_step}


def plan_slowdowns(speeds: Sequence[float] | None, faults: Sequence[FaultSettings]) -> dict[int, Slowdown]:
    """The ranks that run slower than nominal and by how much: ``speeds`` is every rank's
    ``compute_speed`` (None: no profile, all nominal), ``faults`` the job's fault list (its
    ``slow`` entries count). The fastest host sets the pace; the same on every rank."""
    speeds = list(speeds or [])
    fastest = max(speeds, default=1.0)
    plan = {rank: Slowdown(base=fastest / speed) for rank, speed in enumerate(speeds) if speed != fastest}
    for fault in faults:
        if fault.kind == "slow":
            assert fault.factor is not None   # FaultSettings.validate requires it
            base = plan.get(fault.rank, Slowdown()).base
            plan[fault.rank] = Slowdown(base=base, factor=fault.factor, from_step=fault.step)
    return plan


def skipped(outputs: Any) -> bool:
    """Whether the strategy skipped the batch (it marks its output: ``spec.SKIPPED_BATCH``)."""
    return isinstance(outputs, Mapping) and outputs.get(SKIPPED_BATCH) is True


class SlowCompute(Callback):
    """Stretches this rank's steps by ``slowdown.at(step)``: after each training batch it waits
    (slowdown - 1) x the median of its last ``window`` measured batches. The first batch has
    nothing to measure against but itself. ``waited_s`` is the total wait (``summary.json``).
    With ``nominal_s`` > 0 (an emulated accelerator) it waits instead until the batch's real
    compute plus the wait make ``nominal_s`` x slowdown, and counts the batches that overran."""

    def __init__(self, slowdown: Slowdown, window: int = 16, clock: Callable[[], float] = time.perf_counter,
                 wait: Callable[[float], None] = time.sleep, nominal_s: float = 0.0) -> None:
        self.slowdown = slowdown
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.clock, self.wait = clock, wait
        self.nominal_s = nominal_s
        self.waited_s = 0.0
        self.steps = 0      # batches computed (emulated accelerator)
        self.overruns = 0   # of which the real compute alone took longer than the nominal time
        self.busy_s = 0.0   # the emulated accelerator's compute: nominal_s x slowdown per computed batch
        self._start = 0.0
        self._computed = 0.0   # the clock when the batch's compute ended (before its optimizer step)
        self._step = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step = trainer.global_step   # the step this batch belongs to (0 = the first)
        self._start = self._computed = self.clock()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._computed = self.clock()   # forward and backward done; the step (and a sync in it) follows

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if skipped(outputs):   # a skipped batch cost the slow GPU nothing
            return
        if self.nominal_s > 0:
            self.emulate(self._computed - self._start, self._step)
        else:
            self.after_batch(self.clock() - self._start, self._step)

    def emulate(self, compute_s: float, step: int) -> float:
        """Emulated accelerator: a batch of ``step`` whose real compute took ``compute_s`` lasts
        ``nominal_s`` x the slowdown; waits the rest and returns the wait."""
        self.steps += 1
        self.busy_s += self.nominal_s * self.slowdown.at(step)
        extra = self.nominal_s * self.slowdown.at(step) - compute_s
        if extra <= 0:
            self.overruns += 1
            return 0.0
        self.wait(extra)
        self.waited_s += extra
        return extra

    def after_batch(self, took_s: float, step: int) -> float:
        """Record a batch of ``step`` that took ``took_s`` and wait; returns the wait."""
        self.recent.append(took_s)
        extra = (self.slowdown.at(step) - 1.0) * statistics.median(self.recent)
        if extra > 0:
            self.wait(extra)
            self.waited_s += extra
        return extra


@dataclass
class ComputeReport:
    """What ``summary.json`` says about emulated compute (its ``compute`` entry): every rank's
    ``compute_speed`` (null without a profile), each slowed rank's slowdown and total wait, and
    the emulated accelerator's nominal step (0: off) with its batches and overruns, all ranks'."""

    speeds: list[float] | None
    slowdowns: dict[int, Slowdown]
    rank: int                       # this rank (the replica in an elastic job)
    own: SlowCompute | None = None  # this rank's callback, when it is slowed or emulated
    emulated_step_s: float = 0.0

    def waits(self, world_size: int) -> list[float]:
        """A vector, the same length on every rank, that the report sums over the ranks: this
        rank's total wait in its slot, then its emulated batches and overruns."""
        waits = [0.0] * max([world_size, len(self.speeds or []), *(r + 1 for r in self.slowdowns)])
        if self.own is not None:
            waits[self.rank] = self.own.waited_s
        return [*waits, float(self.own.steps if self.own else 0), float(self.own.overruns if self.own else 0)]

    def compute_seconds(self, measured_s: float) -> float:
        """This rank's compute for ``compute_utilization``, given its measured forward and backward
        seconds: the emulated accelerator's busy time when there is one (an overrun batch counts
        its nominal time: the CPU, not the accelerator, was slow), else the measured seconds
        plus a slowed rank's wait (its slower GPU's extra compute)."""
        if self.own is None:
            return measured_s
        if self.own.nominal_s > 0:
            return self.own.busy_s
        return measured_s + self.own.waited_s

    def as_dict(self, summed: Sequence[float]) -> dict[str, Any]:
        """The summary entry from ``waits`` summed over the ranks."""
        *waited_s, steps, overruns = summed
        return {"compute_speeds": self.speeds,
                "slowed": [{"rank": r, **s.as_dict(), "waited_s": round(float(waited_s[r]), 3)}
                           for r, s in sorted(self.slowdowns.items())],
                "emulated_step_s": self.emulated_step_s,
                "emulated_steps": int(steps), "overran_steps": int(overruns)}
