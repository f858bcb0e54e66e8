"""DS-Sync's runtime: one group average per step, on a schedule that adapts to contention.

``DSSync`` owns the schedule position, the process groups of every candidate pattern
(created once, at construction), and the adjustment loop of the paper's Pseudo Code 1:
every ``adjust_every`` steps the ranks' measured sync times are gathered; when a group
that could be split (three or more ranks) is much slower than the bandwidth estimate
says it should be, relative to the other groups, the links are probed again and the
pattern that splits the new bottleneck off (§III-B2/B3) is adopted. Rank 0 decides from
the gathered numbers and broadcasts the choice, so every rank switches at the same step.

Pairs (the inter-rack group with two racks, a slow NIC's group) can swap over several TCP
connections per direction; with ``pair_streams="auto"`` the first syncs (and those after
every re-probe) try one and several, and the faster is kept (``comm.pair_streams``).

With ``max_staleness`` > 0 a late group member does not hold its group up: each group
averages as a clique of point-to-point messages (``syncplane.algorithms.late_peers``, the
mixer ATC/AWC use, with ``group_plan``'s weights ``1/|g|``), and a member whose message has
not arrived ``late_after_s`` into the combine counts with its newest arrived message, at
most ``max_staleness`` of its messages to this rank old. What is kept:

- **nobody late**: the group mean, within float tolerance, not bit for bit: the combine
  rounds the float64 sum of ``x_j/|g|`` once (correctly rounded) where the all-reduce
  rounds a float32 ring sum; for a pair both are ``round(a + b)/2``, bit for bit (barring
  subnormals). Members of a group of three or more may differ by an ulp (each sums in its
  own order);
- **a late member** (bounded-delay averaging): ``y_i = (x_i + Σ_j x_j(t_j))/|g|`` with
  ``t_j`` among j's last ``max_staleness + 1`` messages to i -- every value one j really
  held, but the group's mass is not conserved for that step (its mean moves by
  ``(x_j(t_j) − x_j(t))/|g|`` per stale member) and its members leave with different values;
- **run-ahead**: at most ``max_staleness + 1`` sends in flight per destination, so a rank
  runs at most that many messages ahead of a group mate; a member held longer still sets
  its mates' pace. The contention check (``adjust_every``) is a collective: every rank
  meets there, the late one included, once per ``adjust_every`` steps.

Used by the ``ds_sync`` strategy (parameters after each local step) and by
``syncplane bench`` (a flat payload) -- the same code in both.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from syncplane.comm.buckets import Bucket
from syncplane.comm.collectives import rank0_decides
from syncplane.algorithms.ds_sync.config import DSSyncConfig
from syncplane.algorithms.ds_sync.pattern import Candidates, GroupPattern, candidate_patterns, ring_time_s
from syncplane.comm.groups import GroupSet
from syncplane.comm.meter import CommMeter
from syncplane.algorithms.ds_sync.pair_streams import PairStreams, PairStreamTuner, connections
from syncplane.algorithms.late_peers import LatePeerMixer, group_plan
from syncplane.comm.p2p import DEFAULT_TIMEOUT_S
from syncplane.comm.process_groups import control_group

#: Re-measures the pairwise bandwidth (a collective); returns (bandwidth n×n, slow ranks, slow racks),
#: the slow lists ordered worst first.
Reprobe = Callable[[], tuple[np.ndarray, list[int], list[int]]]


def flagged_steps(times: np.ndarray, pattern: GroupPattern, first_step: int, bandwidth: np.ndarray,
                  payload_bytes: float, imbalance: float, q_ref: float | None) -> tuple[int, float]:
    """(number of window steps with a splittable bottleneck group, median slowdown q).

    ``times[s, r]`` is rank r's sync seconds at step ``first_step + s``. A group's time is
    its slowest member's; its slowdown q = time / α-free ring estimate. A group of three or
    more is a bottleneck when its q exceeds ``imbalance`` × the step's median q (or the
    reference q of an earlier window, which catches a single-group pattern slowing down).
    """
    flagged, all_q = 0, []
    for s in range(times.shape[0]):
        qs = []
        for g in pattern.groups_at(first_step + s):
            if len(g) > 1:
                expected = ring_time_s(g, payload_bytes, bandwidth)
                qs.append((g, float(times[s, list(g)].max()) / max(expected, 1e-12)))
        if not qs:
            continue
        ref = statistics.median(q for _, q in qs)
        if q_ref is not None:
            ref = min(ref, q_ref)
        all_q += [q for _, q in qs]
        flagged += any(len(g) > 2 and q > imbalance * ref for g, q in qs)
    return flagged, statistics.median(all_q) if all_q else 1.0


def choose_candidate(candidates: Candidates, slow_ranks: Sequence[int], slow_racks: Sequence[int]) -> int:
    """The candidate that splits off the first (worst) bottleneck not already handled by the
    base pattern -- ranks first, each list ordered worst first; the base when there is none."""
    for key in [f"rank{r}" for r in slow_ranks] + [f"rack{k}" for k in slow_racks]:
        if key in candidates.keys:
            return candidates.index(key)
    return 0


class DSSync:
    """Collective construction (creates the process groups). Call ``sync_`` once per step on
    every rank; with ``max_staleness``, ``drain`` where every rank is at the same step
    (checkpoints, the end of a fit) and ``close`` at the end."""

    def __init__(self, racks: Sequence[Sequence[int]], bandwidth: np.ndarray, slow_ranks: Sequence[int] = (),
                 slow_racks: Sequence[int] = (), *, adjust_every: int = 0, imbalance: float = 1.5,
                 reprobe: Reprobe | None = None, pair_streams: PairStreams = "auto", max_staleness: int = 0,
                 late_after_s: float = 0.05, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        pair_streams = DSSyncConfig(adjust_every=adjust_every, imbalance=imbalance, pair_streams=pair_streams,
                                    max_staleness=max_staleness, late_after_s=late_after_s).streams   # validates
        world = dist.get_world_size()
        size = sum(len(r) for r in racks)
        if size != world:
            raise ValueError(f"the topology has {size} ranks but the process group has {world}")
        self.candidates = candidate_patterns(racks, slow_ranks, slow_racks)
        self.groups = GroupSet(self.candidates.communicating_groups(), connections(pair_streams))
        self.streams = PairStreamTuner(self.groups, pair_streams)
        self.bandwidth = np.asarray(bandwidth, dtype=float)
        self.adjust_every, self.imbalance, self.reprobe = adjust_every, imbalance, reprobe
        self.rank = dist.get_rank()
        self.step = 0
        self.current = 0
        self.q_ref: float | None = None
        self._window: list[float] = []
        self.adjustments: list[tuple[int, str]] = []     # (step, candidate key) for the log
        self.late = LatePeerMixer(max_staleness, late_after_s, timeout_s=timeout_s) if max_staleness else None
        self._try_pair_streams()

    @property
    def pattern(self) -> GroupPattern:
        return self.candidates.patterns[self.current]

    def _try_pair_streams(self) -> None:
        """Start a stream-count trial from this step if the current pattern has pairs at all
        (without pairs the count does not matter, and the trial's barriers would hide lag)."""
        if any(len(g) == 2 for groups in self.pattern.iterations for g in groups):
            self.streams.start(self.step, self.pattern.period)

    def sync_(self, buckets: Sequence[Bucket], meter: CommMeter | None = None) -> None:
        """Average ``buckets`` within this rank's group of the current step, then advance."""
        group = self.pattern.group_of(self.rank, self.step)
        self.streams.before(self.step)
        start = time.perf_counter()
        if self.late is None:
            self.groups.group_average_(buckets, group, meter)
        else:
            self._late_average_(buckets, group, meter)
        self._window.append(time.perf_counter() - start)
        self.streams.after(self.step, self._window[-1], in_pair=len(group) == 2)
        self.step += 1
        if self.adjust_every and self.step % self.adjust_every == 0:
            self._adjust(sum(b.nbytes for b in buckets))

    def _late_average_(self, buckets: Sequence[Bucket], group: Sequence[int], meter: CommMeter | None) -> None:
        """``group_average_`` that goes on without a late member (the module docstring's rule)."""
        assert self.late is not None
        if len(group) < 2:
            return
        self.late.meter = meter
        self.late.launch(self.step, group_plan(group, self.rank), [b.pack() for b in buckets])()
        for bucket in buckets:
            bucket.unpack()

    def drain(self) -> None:
        """Wait for every late-peer message in flight (no-op without ``max_staleness``)."""
        if self.late is not None:
            self.late.drain()

    def close(self) -> None:
        if self.late is not None:
            self.late.close()

    def _adjust(self, payload_bytes: float) -> None:
        """Every ``adjust_every`` steps: did a splittable group lag in most of the window?
        If so, probe again and adopt the candidate pattern that splits the new bottleneck."""
        times = torch.tensor(self._window, dtype=torch.float64)
        self._window = []
        first = self.step - len(times)

        def lagging(gathered: torch.Tensor) -> tuple[float, float]:
            flagged, q = flagged_steps(gathered.T.numpy(), self.pattern, first, self.bandwidth,
                                       payload_bytes, self.imbalance, self.q_ref)
            return float(flagged * 2 >= len(times) and self.reprobe is not None), q

        decision = rank0_decides(times, lagging, 2, group=control_group())
        if self.q_ref is None:
            self.q_ref = float(decision[1])
        if not decision[0]:
            return
        assert self.reprobe is not None
        self.bandwidth, slow_ranks, slow_racks = self.reprobe()          # collective, same on every rank
        choice = rank0_decides(torch.zeros(1), lambda _: [choose_candidate(self.candidates, slow_ranks, slow_racks)],
                               1, group=control_group())
        self.current = int(choice[0])
        self.q_ref = None
        self.adjustments.append((self.step, self.candidates.keys[self.current]))
        self._try_pair_streams()               # the contention behind this may favour more streams

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "current": self.current, "q_ref": -1.0 if self.q_ref is None else self.q_ref,
                "bandwidth": torch.from_numpy(np.nan_to_num(self.bandwidth, posinf=1e300).copy()),
                "window": torch.tensor(self._window, dtype=torch.float64), "streams": self.streams.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not 0 <= int(state["current"]) < len(self.candidates.keys):
            raise ValueError(f"saved pattern index {state['current']} does not exist here "
                             f"({len(self.candidates.keys)} candidate patterns): was the topology different?")
        bandwidth = state["bandwidth"].numpy()
        if bandwidth.shape != self.bandwidth.shape:
            raise ValueError(f"saved bandwidth matrix is {bandwidth.shape}, this job has {self.bandwidth.shape}")
        self.step, self.current = int(state["step"]), int(state["current"])
        self.q_ref = None if float(state["q_ref"]) < 0 else float(state["q_ref"])
        self.bandwidth = bandwidth
        self._window = [float(x) for x in state["window"]]
        self.streams.load_state_dict(state.get("streams", {}))

