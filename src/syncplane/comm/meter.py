"""Accounting of communication time and bytes, shared by every strategy.

Time is the *union* of in-flight intervals: overlapping asynchronous operations
(DDP buckets, concurrent groups) are not double counted, so ``seconds`` is the wall
time during which this rank had communication outstanding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from threading import Lock


def ring_allreduce_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce: reduce-scatter plus all-gather."""
    if world_size <= 1:
        return 0
    return int(2 * (world_size - 1) * payload_bytes / world_size)


@dataclass
class CommMeter:
    """Accumulates communication seconds, bytes sent and operation count for one rank."""

    seconds: float = 0.0
    bytes_sent: int = 0
    calls: int = 0
    _busy_until: float = field(default=0.0, repr=False)
    _lock: Lock = field(default_factory=Lock, repr=False, compare=False)

    def record(self, start: float, end: float, bytes_sent: int) -> None:
        """Add one operation that was in flight from ``start`` to ``end`` (perf_counter)."""
        with self._lock:
            self.seconds += max(0.0, end - max(start, self._busy_until))
            self._busy_until = max(self._busy_until, end)
            self.bytes_sent += int(bytes_sent)
            self.calls += 1

    @contextmanager
    def measure(self, bytes_sent: int) -> Iterator[None]:
        """Time a blocking block of communication code."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(start, time.perf_counter(), bytes_sent)


class PhaseProfile:
    """Wall seconds spent in each phase of an exchange, per phase name (thread-safe).

    Why: a round's total time says how far it is from its bound but not where the rest
    went -- copying, summing, posting messages, or waiting on the wire (per stream, per
    level). An exchange that is handed one (``StreamRunner.profile``) adds
    ``phase -> seconds`` and a count; off (None) it costs nothing. Names are free-form,
    e.g. ``wait/s3/L1-rs`` (stream 3, level 1's reduce-scatter)."""

    def __init__(self) -> None:
        self._lock = Lock()
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
            self.counts[phase] = self.counts.get(phase, 0) + 1

    @contextmanager
    def time(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def reset(self) -> None:
        with self._lock:
            self.seconds.clear()
            self.counts.clear()

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{phase: {"s": seconds, "n": count}}``, phases sorted by name."""
        with self._lock:
            return {k: {"s": round(self.seconds[k], 6), "n": self.counts[k]} for k in sorted(self.seconds)}
