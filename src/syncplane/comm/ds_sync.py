"""DS-Sync's runtime: one group average per step, on a schedule that adapts to contention.

``DSSync`` owns the schedule position, the process groups of every candidate pattern
(created once, at construction), and the adjustment loop of the paper's Pseudo Code 1:
every ``adjust_every`` steps the ranks' measured sync times are gathered; when a group
that could be split (three or more ranks) is much slower than the bandwidth estimate
says it should be, relative to the other groups, the links are probed again and the
pattern that splits the new bottleneck off (§III-B2/B3) is adopted. Rank 0 decides from
the gathered numbers and broadcasts the choice, so every rank switches at the same step.

Pairs (the inter-rack group with two racks, a slow NIC's group) can swap over several TCP
connections per direction. Whether that helps depends on the link: next to foreign
traffic k streams take k/(k+1) of it instead of ½; on a link of their own one stream is
faster. With ``pair_streams="auto"`` the pairs time both at setup and after every re-probe
(``tune_pair_streams``) and keep the faster.

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

from syncplane.comm import make_buckets
from syncplane.comm.buckets import Bucket
from syncplane.comm.group_pattern import Candidates, GroupPattern, candidate_patterns, ring_time_s
from syncplane.comm.groups import MAX_PAIR_STREAMS, GroupSet
from syncplane.comm.meter import CommMeter

#: ``pair_streams="auto"``: bytes each pair swaps to time one stream against several, and
#: the speed-up several must show to be adopted (a short transfer flatters parallel
#: streams a little: they leave slow start sooner).
STREAM_PROBE_BYTES = 8 * 2**20
MIN_STREAM_GAIN = 1.25

PairStreams = int | str       # a count, or "auto"

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


def check_pair_streams(value: PairStreams) -> PairStreams:
    """``value`` if it is ``"auto"`` or a count ≥ 1; a clear error otherwise."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"pair_streams must be 'auto' or an integer >= 1, got {value!r}")


def choose_pair_streams(one_stream_s: Sequence[float], many_streams_s: Sequence[float], many: int,
                        min_gain: float = MIN_STREAM_GAIN) -> int:
    """``many`` if the pairs' median speed-up with ``many`` streams over one is at least
    ``min_gain``, else 1. Inputs: each pair's swap time (its slower member's) both ways."""
    gains = [one / max(multi, 1e-12) for one, multi in zip(one_stream_s, many_streams_s)]
    return many if gains and statistics.median(gains) >= min_gain else 1


class DSSync:
    """Collective construction (creates the process groups). Call ``sync_`` once per step on every rank."""

    def __init__(self, racks: Sequence[Sequence[int]], bandwidth: np.ndarray, slow_ranks: Sequence[int] = (),
                 slow_racks: Sequence[int] = (), *, adjust_every: int = 0, imbalance: float = 1.5,
                 reprobe: Reprobe | None = None, pair_streams: PairStreams = "auto") -> None:
        if adjust_every < 0:
            raise ValueError(f"adjust_every must be >= 0 (0 = never adjust), got {adjust_every}")
        if imbalance <= 1.0:
            raise ValueError(f"imbalance must be > 1, got {imbalance}")
        world = dist.get_world_size()
        size = sum(len(r) for r in racks)
        if size != world:
            raise ValueError(f"the topology has {size} ranks but the process group has {world}")
        self.candidates = candidate_patterns(racks, slow_ranks, slow_racks)
        self.auto_streams = check_pair_streams(pair_streams) == "auto"
        self.groups = GroupSet(self.candidates.communicating_groups(),
                               MAX_PAIR_STREAMS if self.auto_streams else int(pair_streams))
        self.bandwidth = np.asarray(bandwidth, dtype=float)
        self.adjust_every, self.imbalance, self.reprobe = adjust_every, imbalance, reprobe
        self.rank = dist.get_rank()
        self.step = 0
        self.current = 0
        self.q_ref: float | None = None
        self._window: list[float] = []
        self.adjustments: list[tuple[int, str]] = []     # (step, candidate key) for the log
        self.stream_trials: list[tuple[int, float, float, int]] = []    # (step, 1-stream s, k-stream s, chosen)
        if self.auto_streams:
            self.tune_pair_streams()

    @property
    def pattern(self) -> GroupPattern:
        return self.candidates.patterns[self.current]

    def describe_streams(self) -> str:
        """One line for the log: the pairs' stream count, and why (rank 0 holds the timings)."""
        line = f"ds_sync: pairs swap over {self.groups.pair_streams} stream(s) per direction"
        if self.stream_trials:
            _, one, many, _ = self.stream_trials[-1]
            line += (f" (timed {STREAM_PROBE_BYTES / 2**20:.0f} MB: 1 stream {one:.3f} s, "
                     f"{self.groups.max_pair_streams} streams {many:.3f} s)")
        return line

    def tune_pair_streams(self, nbytes: int = STREAM_PROBE_BYTES) -> int:
        """Collective: the pairs of the pattern's first step that has any swap ``nbytes`` over
        one stream and over all of them (fastest of two tries each, everybody else idle);
        rank 0 compares and every rank adopts its choice (``choose_pair_streams``)."""
        many = self.groups.max_pair_streams
        steps = [self.pattern.groups_at(self.step + s) for s in range(self.pattern.period)]
        pairs = next(([g for g in groups if len(g) == 2] for groups in steps if any(len(g) == 2 for g in groups)), [])
        if many == 1 or not pairs:
            return self.groups.pair_streams
        mine = next((g for g in pairs if self.rank in g), None)
        buckets = make_buckets([torch.zeros(max(1, nbytes // 4))])
        best = torch.full((2,), float("inf"), dtype=torch.float64)
        for _ in range(2):
            for i, streams in enumerate((1, many)):
                self.groups.pair_streams = streams
                dist.barrier()
                if mine is not None:
                    start = time.perf_counter()
                    self.groups.group_average_(buckets, mine)
                    best[i] = min(float(best[i]), time.perf_counter() - start)
        gathered = [torch.zeros_like(best) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, best)
        choice = torch.ones(1, dtype=torch.int64)
        if self.rank == 0:
            one = [max(float(gathered[r][0]) for r in pair) for pair in pairs]
            multi = [max(float(gathered[r][1]) for r in pair) for pair in pairs]
            choice[0] = choose_pair_streams(one, multi, many)
            self.stream_trials.append((self.step, statistics.median(one), statistics.median(multi), int(choice[0])))
        dist.broadcast(choice, 0)
        self.groups.pair_streams = int(choice[0])
        return self.groups.pair_streams

    def sync_(self, buckets: Sequence[Bucket], meter: CommMeter | None = None) -> None:
        """Average ``buckets`` within this rank's group of the current step, then advance."""
        group = self.pattern.group_of(self.rank, self.step)
        start = time.perf_counter()
        self.groups.group_average_(buckets, group, meter)
        self._window.append(time.perf_counter() - start)
        self.step += 1
        if self.adjust_every and self.step % self.adjust_every == 0:
            self._adjust(sum(b.nbytes for b in buckets))

    def _adjust(self, payload_bytes: float) -> None:
        times = torch.tensor(self._window, dtype=torch.float64)
        self._window = []
        gathered = [torch.zeros_like(times) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, times)
        first = self.step - len(times)
        decision = torch.zeros(2, dtype=torch.float64)
        if self.rank == 0:
            flagged, q = flagged_steps(torch.stack(gathered, 1).numpy(), self.pattern, first, self.bandwidth,
                                       payload_bytes, self.imbalance, self.q_ref)
            decision[0] = float(flagged * 2 >= len(times) and self.reprobe is not None)
            decision[1] = q
        dist.broadcast(decision, 0)
        if self.q_ref is None:
            self.q_ref = float(decision[1])
        if not decision[0]:
            return
        assert self.reprobe is not None
        self.bandwidth, slow_ranks, slow_racks = self.reprobe()          # collective, same on every rank
        choice = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            choice[0] = choose_candidate(self.candidates, slow_ranks, slow_racks)
        dist.broadcast(choice, 0)
        self.current = int(choice[0])
        self.q_ref = None
        self.adjustments.append((self.step, self.candidates.keys[self.current]))
        if self.auto_streams:
            self.tune_pair_streams()           # the contention that triggered this may favour more streams

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "current": self.current, "q_ref": -1.0 if self.q_ref is None else self.q_ref,
                "bandwidth": torch.from_numpy(np.nan_to_num(self.bandwidth, posinf=1e300).copy()),
                "window": torch.tensor(self._window, dtype=torch.float64)}

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

