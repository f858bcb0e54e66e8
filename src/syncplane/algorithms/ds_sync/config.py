"""DS-Sync's settings, validated once: by the strategy at construction (so a bad value fails
before the first step, naming the key) and by the engine, from the same rules."""

from __future__ import annotations

from dataclasses import dataclass

from syncplane.algorithms.ds_sync.pair_streams import PairStreams, check_pair_streams
from syncplane.algorithms.late_peers import check_late_peer_options


@dataclass(frozen=True)
class DSSyncConfig:
    """Args:
        topology: ``auto`` (the launcher's cluster profile, else a probe), ``probe``, or a
            cluster profile name / YAML path.
        adjust_every: steps between contention checks (0: never adjust).
        imbalance: a group this many times slower than its peers (relative to the
            bandwidth estimate) is a bottleneck.
        slow_factor: a NIC or uplink below this fraction of the median is slow.
        probe_mb: bytes each pair exchanges per probe.
        ema: keep a per-rank exponential moving average of the parameters; the final model
            is the global mean of the ranks' averages (the paper's "SWA ensemble", which is
            an EMA: every step ``ema ← decay·ema + (1 − decay)·params``).
        ema_decay: the EMA's decay.
        pair_streams: TCP connections per direction for a group of two, or ``auto`` (a
            trial on the first syncs keeps the faster of one and several).
        max_staleness: go on without a late group member (0: every member waits for the
            slowest, the group all-reduce): each group averages over point-to-point messages
            (``late_peers``), and a member whose message has not arrived ``late_after_s`` into
            the combine counts with its newest arrived one, at most this many of its messages
            old to this rank. A pair then swaps over one connection per direction
            (``pair_streams``: ``auto`` or 1).
        late_after_s: the grace a member's message gets before the member counts as late.
    """

    topology: str = "auto"
    adjust_every: int = 100
    imbalance: float = 1.5
    slow_factor: float = 0.5
    probe_mb: float = 1.0
    ema: bool = False
    ema_decay: float = 0.99
    pair_streams: PairStreams = "auto"
    max_staleness: int = 0
    late_after_s: float = 0.05

    def __post_init__(self) -> None:
        if self.adjust_every < 0:
            raise ValueError(f"adjust_every must be >= 0 (0 = never adjust), got {self.adjust_every}")
        if self.imbalance <= 1:
            raise ValueError(f"imbalance must be > 1, got {self.imbalance}")
        if not 0 < self.slow_factor < 1:
            raise ValueError(f"slow_factor must be in (0, 1), got {self.slow_factor}")
        if self.probe_mb <= 0:
            raise ValueError(f"probe_mb must be positive, got {self.probe_mb}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        check_pair_streams(self.pair_streams)
        check_late_peer_options(self.max_staleness, self.late_after_s)
        if self.max_staleness and self.pair_streams not in ("auto", 1):
            raise ValueError(f"pair_streams={self.pair_streams!r} with max_staleness={self.max_staleness}: "
                             "late-peer averaging swaps a pair's messages point to point, over one connection "
                             "per direction; use pair_streams=1 (or auto), or max_staleness=0")

    @property
    def streams(self) -> PairStreams:
        """The pair streams the runtime uses: one under ``max_staleness`` (``auto`` has no choice there)."""
        return 1 if self.max_staleness else self.pair_streams

    @property
    def probe_bytes(self) -> int:
        return int(self.probe_mb * 2**20)
