"""Mixing schedules: which neighbours each rank averages with at training step ``t``.

A decentralized optimizer (ATC/AWC) mixes once per step. A *schedule* answers, for any
step, every rank's weights -- by formula, so all ranks agree without communicating and
a resumed run continues at ``global_step`` exactly where it stopped. Two kinds:

- ``StaticSchedule``: the same graph every step (``Y = Aᵀ X`` with ``A`` from the graph).
- ``OnePeerSchedule``: BlueFog's dynamic one-peer exponential graph -- each rank sends to
  one peer at distance ``2^(t mod K)`` and keeps half of its own value. It moves one
  payload per rank per step, and for ``n = 2^K`` ranks one period of ``K`` steps averages
  exactly.

``matrix(t)`` gives the dense mixing matrix of step ``t`` (rows = senders), which
tests use as the reference and ``check`` uses to refuse a schedule that never mixes.
"""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np

from syncplane.algorithms.late_peers import RankPlan
from syncplane.comm import topology


class Schedule:
    """A periodic sequence of mixing steps over ``size`` participants (ranks or machines)."""

    size: int
    period: int

    def plan(self, step: int, rank: int) -> RankPlan:
        raise NotImplementedError

    def matrix(self, step: int) -> np.ndarray:
        """``A`` of step ``step`` with ``A[j, i]`` = weight rank i gives rank j's tensor."""
        a = np.zeros((self.size, self.size))
        for i in range(self.size):
            plan = self.plan(step, i)
            a[i, i] = plan.self_weight
            for j, w in plan.src_weights.items():
                a[j, i] = w * self.plan(step, j).dst_weights[i]
        return a

    def period_product(self) -> np.ndarray:
        """The mixing of one whole period (``Aᵀ`` of the last step applied last)."""
        product = np.eye(self.size)
        for t in range(self.period):
            product = self.matrix(t).T @ product
        return product

    def check(self) -> None:
        """Refuse schedules whose steps are not averages or whose period never reaches consensus."""
        for t in range(self.period):
            a = self.matrix(t)
            if not np.allclose(a.sum(axis=0), 1.0, atol=1e-9) or (a < -1e-12).any():
                raise ValueError(f"step {t} of the schedule is not an average: each rank's weights must be "
                                 f"non-negative and sum to 1, got column sums {a.sum(axis=0).round(6).tolist()}")
        if self.size > 1:
            moduli = np.sort(np.abs(np.linalg.eigvals(self.period_product())))[::-1]
            if moduli[1] > 1 - 1e-9:
                raise ValueError(f"the schedule never reaches consensus: |λ₂| of one period's mixing is "
                                 f"{moduli[1]:.6f} (the graph is not connected over a period)")


class StaticSchedule(Schedule):
    """The same weighted graph every step (BlueFog's static ``neighbor_allreduce``)."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self.graph = graph
        self.size = graph.number_of_nodes()
        self.period = 1
        self._plans = [RankPlan(*topology.static_weights(graph, r)) for r in range(self.size)]

    def plan(self, step: int, rank: int) -> RankPlan:
        return self._plans[rank]

    def lambda2(self) -> float:
        """Second-largest eigenvalue modulus: consensus error shrinks like ``λ₂^t``."""
        return 1.0 - topology.spectral_gap(self.graph)


class OnePeerSchedule(Schedule):
    """Dynamic one-peer exponential (``topology.one_peer_exponential``), weights ½ / ½."""

    def __init__(self, size: int) -> None:
        self.size = size
        if size == 1:
            self.period = 1
            self._plans = [[RankPlan(1.0, {}, {})]]
            return
        self.period = max(1, (size - 1).bit_length())   # ⌈log₂ n⌉ distinct peers
        self._plans = []
        for rank in range(size):
            steps = itertools.islice(topology.one_peer_exponential(size, rank), self.period)
            self._plans.append([RankPlan(0.5, {src[0]: 0.5}, {dst[0]: 1.0}) for dst, src in steps])

    def plan(self, step: int, rank: int) -> RankPlan:
        return self._plans[rank][step % self.period]


SCHEDULES = ("one_peer", "static")


def build_schedule(kind: str, graph: nx.DiGraph) -> Schedule:
    """``kind`` is ``one_peer`` (dynamic, on ``graph``'s size) or ``static`` (``graph`` itself)."""
    if kind == "one_peer":
        schedule: Schedule = OnePeerSchedule(graph.number_of_nodes())
    elif kind == "static":
        schedule = StaticSchedule(graph)
    else:
        raise ValueError(f"unknown schedule {kind!r}; allowed values: {', '.join(SCHEDULES)}")
    schedule.check()
    return schedule


def build_graph(name: str, participants: int, **kwargs: object) -> nx.DiGraph:
    """The static graph ``name`` (a builder of ``syncplane.comm.topology``, e.g.
    ``ExponentialTwoGraph``) over ``participants`` ranks or machines."""
    builder = getattr(topology, name, None)
    if builder is None:
        raise ValueError(f"topology: unknown graph {name!r}")
    return builder(participants, **kwargs)
