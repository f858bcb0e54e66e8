"""How many TCP connections a two-rank group swaps over, chosen by measuring real syncs.

A pair (DS-Sync's inter-rack group with two racks, a slow NIC's group) can split its
swap over several connections per direction (``GroupSet.pair_streams``). Whether that
helps depends on the link, and only a measurement tells: next to foreign traffic TCP
shares the link per connection, so k streams get k/(k+1) of it instead of ½; on a link
of its own one stream is faster (``docs/design-notes.md`` has the numbers). A short probe at setup misleads (new connections' slow start behind a full
queue), and so do a pattern's first syncs (every rotating pair's connections are used
for the first time). So ``"auto"`` runs a trial on the real payload: one period of the
group pattern to warm every pair up, one period with one stream, one with K -- so every
pair is timed with both counts -- then compares their sums on rank 0 (the same pairs, from every
rank's times, gathered) and keeps the faster for the rest of the run; every rank adopts
the choice at the same step.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from syncplane.comm.collectives import rank0_decides
from syncplane.comm.groups import GroupSet
from syncplane.comm.process_groups import control_group

#: Most connections per direction a pair may use.
MAX_PAIR_STREAMS = 4
#: ``auto``: the speed-up K streams must show to be kept (below it, one stream is the
#: simpler choice, and the fair one on a shared link).
MIN_STREAM_GAIN = 1.25
#: Trial phases, a pattern period each: warm-up, one stream, K streams.
TRIAL_PHASES = 3

PairStreams = int | str       # a count, or "auto"

log = logging.getLogger(__name__)


def check_pair_streams(value: PairStreams) -> PairStreams:
    """``value`` if it is ``"auto"`` or a count ≥ 1; a clear error otherwise."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"pair_streams must be 'auto' or an integer >= 1, got {value!r}")


def connections(setting: PairStreams) -> int:
    """Connections per direction to create for ``setting``: all ``auto`` may try, or the count."""
    return MAX_PAIR_STREAMS if check_pair_streams(setting) == "auto" else int(setting)


def choose_pair_streams(one_stream_s: Sequence[float], many_streams_s: Sequence[float], many: int,
                        min_gain: float = MIN_STREAM_GAIN) -> int:
    """``many`` if the same pairs' syncs (``one_stream_s[i]`` and ``many_streams_s[i]``, timed with
    one stream and with ``many``) took at least ``min_gain`` times as long in all with one, else 1.
    In all, not the median pair's speed-up: a run's time is the sum of its syncs, and the pairs
    gain unevenly (beside a greedy flow on ``two_racks_contended`` two of four took 13 s with one
    stream, two 20 s; with four all took 11-13 s)."""
    if not one_stream_s or len(one_stream_s) != len(many_streams_s):
        return 1
    return many if sum(one_stream_s) >= min_gain * sum(many_streams_s) else 1


class PairStreamTuner:
    """Drives ``groups.pair_streams`` for a sync loop: a trial of ``TRIAL_PHASES`` pattern
    periods from ``start()`` on (fixed counts skip it), then the decision. Call
    ``before(step)`` and ``after(step, seconds, in_pair)`` around every sync, on every rank
    (``after`` is a collective on the trial's last step)."""

    def __init__(self, groups: GroupSet, setting: PairStreams) -> None:
        self.groups, self.auto = groups, check_pair_streams(setting) == "auto"
        self.period = 1
        self.trial_from: int | None = None
        self.times: list[float] = []          # this rank's pair-swap seconds in the trial (nan: not in a pair)
        self.decisions: list[tuple[int, float, float, int]] = []   # (step, 1-stream s, K-stream s, kept)

    @property
    def trial_length(self) -> int:
        return TRIAL_PHASES * self.period

    def start(self, step: int, period: int) -> None:
        """Begin a trial at ``step`` for a pattern of ``period`` steps (``auto`` only; at
        setup and after the network changed)."""
        if self.auto and self.groups.max_pair_streams > 1:
            self.trial_from, self.period, self.times = step, period, []

    def before(self, step: int) -> None:
        """Collective during a trial: each trial sync starts together on every rank, so it is
        timed alone -- back to back, one step's pair would still hold the uplink while the
        next step's pair starts."""
        if self.trial_from is not None:
            phase = (step - self.trial_from) // self.period        # 0 warm-up, 1 one stream, 2 K streams
            self.groups.pair_streams = self.groups.max_pair_streams if phase == 2 else 1
            dist.barrier(group=control_group())

    def after(self, step: int, seconds: float, in_pair: bool) -> None:
        if self.trial_from is None:
            return
        self.times.append(seconds if in_pair else math.nan)
        if step - self.trial_from + 1 == self.trial_length:
            self._decide(step)

    def _decide(self, step: int) -> None:
        """Collective: per position in the period (the same pairs), the slowest pair's time
        with one stream and with K; rank 0 compares them and broadcasts the count."""
        p = self.period

        def faster(gathered: torch.Tensor) -> list[float]:
            slowest = gathered.nan_to_num(nan=-1.0).amax(0).tolist()   # per sync; -1: no pair
            matched = [(slowest[p + k], slowest[2 * p + k]) for k in range(p)
                       if min(slowest[p + k], slowest[2 * p + k]) >= 0]
            one, many = [a for a, _ in matched], [b for _, b in matched]
            kept = choose_pair_streams(one, many, self.groups.max_pair_streams)
            return [kept, statistics.fmean(one) if one else -1.0, statistics.fmean(many) if many else -1.0]

        choice = rank0_decides(torch.tensor(self.times, dtype=torch.float64), faster, 3, group=control_group())
        self.groups.pair_streams = int(choice[0])
        self.trial_from, self.times = None, []
        if choice[1] >= 0 and choice[2] >= 0:
            self.decisions.append((step, float(choice[1]), float(choice[2]), int(choice[0])))
        if dist.get_rank() == 0:
            log.info(self.describe())

    def describe(self) -> str:
        """One line for the log: the stream count and why."""
        if self.trial_from is not None:
            return (f"pairs: trying 1 and {self.groups.max_pair_streams} streams per direction on "
                    f"{self.trial_length} syncs from step {self.trial_from} (warm-up, 1, "
                    f"{self.groups.max_pair_streams}: a pattern period each)")
        line = f"pairs swap over {self.groups.pair_streams} stream(s) per direction"
        if self.decisions:
            _, one, many, _ = self.decisions[-1]
            line += f" (mean sync with 1 stream {one:.3f} s, with {self.groups.max_pair_streams}: {many:.3f} s)"
        return line

    def state_dict(self) -> dict[str, Any]:
        return {"pair_streams": self.groups.pair_streams, "period": self.period,
                "trial_from": -1 if self.trial_from is None else self.trial_from,
                "trial_times": torch.tensor(self.times, dtype=torch.float64)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "pair_streams" not in state:          # a checkpoint from before streams existed: try again
            return
        if self.auto:
            self.groups.pair_streams = min(int(state["pair_streams"]), self.groups.max_pair_streams)
            self.trial_from = None if int(state["trial_from"]) < 0 else int(state["trial_from"])
            self.period = int(state["period"])
            self.times = [float(t) for t in state["trial_times"]]
