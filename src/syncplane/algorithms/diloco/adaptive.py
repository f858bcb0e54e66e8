"""Time-budgeted rounds (``inner_steps: time``): a slow replica must not set everyone's pace.

A round is H *slots* (the batches every rank's loader hands out, so all ranks stay on the same
``global_step``, epoch and checkpoint); replica i computes on the first
``n_i = min(H, max(1, ⌊T·(1 + SLACK) / t_i⌋))`` of them and skips the rest, ``t_i`` its median
step time in the last round, ``T`` the budget (``round_budget_s``, else H x the median ``t_i``;
with ``time_samples: share`` H x the fastest, no replica idling), so every replica reaches the
exchange after about T seconds. Δ is averaged by ``time_weighting``: ``samples``,
``Σ n_i Δ_i / Σ n_i``; ``fednova`` (Wang et al., NeurIPS 2020), ``τ_eff Σ p_i Δ_i / n_i`` with
``p_i = 1/m`` and ``τ_eff = Σ p_i n_i`` (the paper's rule for SGD inner steps; for momentum or
Adam its normalization by step count, ``a_i = n_i``). The counts are decided at each round
boundary from the all-gathered step times, with the same arithmetic on every rank."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from syncplane.algorithms.spec import SKIPPED_BATCH
from syncplane.comm.process_groups import control_group

log = logging.getLogger(__name__)

#: How much longer than the budget a replica may take before it skips a slot: step times of
#: equally fast replicas differ by noise, and they should all keep every slot.
SLACK = 0.1

#: ``gather(value) -> every rank's value, in rank order`` (a collective, same order everywhere).
Gather = Callable[[float], list[float]]


def plan_round(step_s: Sequence[float], slots: int, budget_s: float | None = None, pace: str = "median") -> list[int]:
    """Every replica's inner steps of the next round's H ``slots``, from their median step times (> 0)
    in the last; ``budget_s``: the round's budget, None = H x the ``pace`` (``median``, ``fastest``)."""
    if budget_s is None:
        budget_s = slots * (min(step_s) if pace == "fastest" else statistics.median(step_s))
    return [min(slots, max(1, math.floor(budget_s * (1 + SLACK) / t))) for t in step_s]


def weight_scale(steps: Sequence[int], rank: int) -> float:
    """Rank ``rank``'s factor on its Δ, so that the plain mean is ``Σ n_i Δ_i / Σ n_i``."""
    return steps[rank] * len(steps) / sum(steps)


def fednova_scale(steps: Sequence[int], rank: int) -> float:
    """Rank ``rank``'s factor on its Δ, so that the plain mean is FedNova's ``τ_eff Σ p_i Δ_i / n_i``."""
    return sum(steps) / len(steps) / steps[rank]


#: ``time_weighting`` -> the per-rank factor on Δ (rank's factor from every replica's step count).
WEIGHTINGS: dict[str, Callable[[Sequence[int], int], float]] = {"samples": weight_scale, "fednova": fednova_scale}


def check_weighting(weighting: str, floating_buffers: int) -> None:
    """``fednova``'s factors do not sum to the replica count: floating buffers, averaged as values
    with them, would come out scaled."""
    if weighting == "fednova" and floating_buffers:
        raise ValueError(f"time_weighting=fednova normalizes the parameters' Δ by each replica's steps; this model "
                         f"has {floating_buffers} floating buffer(s) (e.g. BatchNorm statistics), averaged as values, "
                         f"which its factors would scale: use time_weighting=samples")


def skipped_step_output() -> dict[str, Any]:
    """A skipped slot's training step: a zero loss that reaches no parameter (Lightning refuses None
    in distributed training; after its zero_grad the inner optimizer leaves every parameter as is)."""
    return {"loss": torch.zeros((), requires_grad=True), SKIPPED_BATCH: True}


class TimedRounds:
    """This rank's side of the time-budgeted rounds: the decided step counts, the step times
    measured in the current round, and the decision at its end.

    Args:
        slots, world_size, rank: H, the replicas and this one.
        budget_s, pace, weighting: ``plan_round``'s; ``time_weighting`` (``WEIGHTINGS``).
        replicas: the ranks of each replica (``replica: node``: a node's ranks compute on the same
            slots, the slowest rank's count); None: a replica per rank."""

    def __init__(self, slots: int, world_size: int, rank: int, budget_s: float | None = None,
                 weighting: str = "samples", pace: str = "median",
                 replicas: Sequence[Sequence[int]] | None = None) -> None:
        self.slots, self.world_size, self.rank, self.budget_s, self.pace = slots, world_size, rank, budget_s, pace
        self.replicas = [list(r) for r in replicas] if replicas and any(len(r) > 1 for r in replicas) else None
        self.weighting = weighting
        self.steps = [slots] * world_size   # the first round: every replica every slot
        self.round: int | None = 0          # the round ``steps`` belong to (None: unknown, an old checkpoint)
        self.decisions = 0
        self.measured: list[float] = []

    def computes(self, slot: int) -> bool:
        """Whether this replica computes on slot ``slot`` (0..H-1) of the round."""
        return slot < self.steps[self.rank]

    def record(self, step_s: float) -> None:
        """A computed step's duration (skipped slots are not recorded)."""
        self.measured.append(step_s)

    def scale(self, processed: Sequence[int] | None = None) -> float:
        """This rank's factor on its Δ for the round now ending, from the batches each rank ``processed``
        in it (default: the agreed counts). Node replicas: the node's factor over the nodes, its
        samples its ranks' batches together (``fednova``: its step count, times its rank count's weight)."""
        counts = self.steps if processed is None else processed
        if self.replicas is None:
            return WEIGHTINGS[self.weighting](counts, self.rank)
        mine = next(i for i, ranks in enumerate(self.replicas) if self.rank in ranks)
        if self.weighting == "samples":
            return weight_scale([sum(counts[r] for r in ranks) for ranks in self.replicas], mine)
        sizes = [len(ranks) for ranks in self.replicas]
        steps = [counts[ranks[0]] for ranks in self.replicas]
        return fednova_scale(steps, mine) * sizes[mine] * len(sizes) / sum(sizes)

    def counts_for(self, round_: int) -> list[int]:
        """The agreed counts of round ``round_``, which must be the decided one (the deal asks for them,
        and must not read ahead of the decision)."""
        if self.round is not None and round_ != self.round:
            raise RuntimeError(f"inner_steps=time: round {round_}'s step counts were asked for while round "
                               f"{self.round}'s are the decided ones (the training data loader reads too far ahead)")
        return self.steps

    def decide(self, gather: Gather, round_: int | None = None) -> list[int]:
        """At a round boundary, on every rank: gather the step times, plan the next round (``round_``)."""
        times = gather(statistics.median(self.measured) if self.measured else 0.0)
        self.measured = []
        self.round = round_
        if min(times) <= 0:   # a replica measured nothing (a resume at the boundary): keep the counts
            return self.steps
        steps = plan_round(times, self.slots, self.budget_s, self.pace)
        for ranks in self.replicas or []:   # a node's ranks compute on the same slots: its slowest's
            slowest = min(steps[r] for r in ranks)
            for r in ranks:
                steps[r] = slowest
        if steps != self.steps:
            log.info("diloco inner_steps=time: round %d, step times %s s -> inner steps %s of %d",
                     self.decisions + 1, ", ".join(f"{t:.3f}" for t in times), steps, self.slots)
        self.steps = steps
        self.decisions += 1
        return steps

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "decisions": self.decisions, "weighting": self.weighting,
                **({} if self.round is None else {"round": self.round})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        steps = [int(n) for n in state["steps"]]
        if len(steps) != self.world_size:
            raise ValueError(f"the checkpoint's inner_steps=time plan is for {len(steps)} replicas, this job has "
                             f"{self.world_size}")
        saved = state.get("weighting", "samples")   # checkpoints from before the option: samples
        if saved != self.weighting:
            raise ValueError(f"time_weighting: the checkpoint's rounds were averaged with {saved!r}, this job "
                             f"asks for {self.weighting!r}; resume with time_weighting={saved}")
        self.steps, self.decisions, self.measured = steps, int(state["decisions"]), []
        self.round = int(state["round"]) if "round" in state else None


def gather_floats(world_size: int, rank: int) -> Gather:
    """``TimedRounds.decide``'s transport: one float per rank over the job's gloo control group (a sum
    of one-hot vectors: exact, and every rank gets the same list)."""

    def gather(value: float) -> list[float]:
        every = torch.zeros(world_size, dtype=torch.float64)
        every[rank] = value
        if world_size > 1:
            dist.all_reduce(every, group=control_group())
        return every.tolist()

    return gather
