"""Canary's settings, validated once: the strategy builds this at construction, so a bad
value fails on every rank before the first step, with the field's name in the message."""

from __future__ import annotations

from dataclasses import dataclass

from syncplane.algorithms.canary.compensation import check_schedule
from syncplane.algorithms.canary.gei import check_bounds
from syncplane.comm.codecs import CODEC_NAMES, Codec, GradientSketch, make_codec
from syncplane.config import ConfigError
from syncplane.exchanges import normalize


#: how the pieces travel (``CanaryConfig.exchange``; the vocabulary is ``syncplane.exchanges.NAMES``)
EXCHANGES = ("auto", "mesh", "nested", "cube")


@dataclass(frozen=True)
class CanaryConfig:
    """Args:
        compression: ``sketch`` (the gradient sketch, ~1/4 of fp32), ``int8`` (uniform
            blockwise) or ``none`` (exact fp32: the exchange is then DDP's mean, bit for bit
            independent of the NIC count).
        exact_fraction: share of each piece's largest-magnitude values the sketch sends exactly.
        quantile_weight: the sketch's boundaries: this times the sample quantiles plus the
            rest times a uniform grid (1 = the paper's equal-count buckets).
        nics: gloo groups (one per NIC, pieces spread over them); ``auto`` = one per name
            in ``GLOO_SOCKET_IFNAME`` (two per name for the nested exchange on hosts of
            several ranks, which overlaps the in-host hop of one with the wire of the other).
        exchange: ``auto`` (the cube exchange on a BCube profile; the nested exchange where
            ranks are grouped in hosts or racks of equal size -- reduce-scatter inside the
            host, then the rack, then across, so slow uplinks carry only the last level's
            share; else the flat piece mesh), ``mesh`` (the paper's mesh: piece j of every
            rank straight to rank j), ``nested`` (an error where the ranks are not grouped) or
            ``cube`` (an error off a BCube profile).
        compress_in_host: whether the nested exchange also sketches what ranks of one host
            send each other (default no: raw fp32 through memory costs no wire, and
            encoding it would cost CPU and accuracy for nothing).
        colayers_in_flight: colayers exchanged at once, each on its own gloo groups (all the
            streams, one per NIC): colayer k+1's encoding and in-host hop then run while
            colayer k is on the wire; 1 = one after another. The result is the same bits
            either way (each colayer keeps its own residuals).
        bucket_cap_mb: colayer size: gradients grouped in backward order up to this many MiB.
        first_bucket_cap_mb: the first colayer's size (the last layers' gradients, exchanged
            first), smaller, as torch DDP's first bucket: the wire starts after a short
            encode instead of a whole colayer's (measured in docs/design-notes.md).
        sync_timeout_s: an exchange slower than this fails the step (on every rank).
        staleness: s, a step's aggregate is applied s steps later (a rank waits only for a
            straggler more than s steps behind); 0 = synchronous (``gei.py``).
        proportion: p in (0, 1]: at the bound, if fewer than p of the due step's colayers
            have arrived the late ones are dropped (re-sent later); None = never drop.
        warmup_steps: with ``staleness`` > 0, this many optimizer steps run synchronously
            first (then every rank switches to s at the same global step); 0 = stale from
            the first step. Without it a delayed gradient under momentum diverges early
            (``compensation.py``; measured in docs/strategies/canary.md).
        momentum_compensation: with ``staleness`` > 0, lower the optimizer's momentum while
            stale by the momentum the delay adds, ``μ' = max(0, μ - s/(s+1))``
            (Mitliagkas et al. 2016), for each update only (checkpoints keep the recipe's).
    """

    compression: str = "sketch"
    exact_fraction: float = 0.01
    quantile_weight: float = 0.3
    nics: int | str = "auto"
    exchange: str = "auto"
    compress_in_host: bool = False
    colayers_in_flight: int = 2
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 4.0
    sync_timeout_s: float = 600.0
    staleness: int = 0
    proportion: float | None = None
    warmup_steps: int = 100
    momentum_compensation: bool = True

    def __post_init__(self) -> None:
        if self.compression not in CODEC_NAMES:
            raise ConfigError(f"compression: allowed values: {', '.join(CODEC_NAMES)}; got {self.compression!r}")
        if not 0.0 <= self.exact_fraction <= 1.0:
            raise ConfigError(f"exact_fraction: must be in [0, 1], got {self.exact_fraction}")
        if not 0.0 <= self.quantile_weight <= 1.0:
            raise ConfigError(f"quantile_weight: must be in [0, 1], got {self.quantile_weight}")
        if not (self.nics == "auto" or (isinstance(self.nics, int) and not isinstance(self.nics, bool)
                                         and self.nics >= 1)):
            raise ConfigError(f"nics: expected auto or an integer >= 1, got {self.nics!r}")
        try:
            exchange = normalize(self.exchange, allowed=EXCHANGES)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        object.__setattr__(self, "exchange", exchange)
        if isinstance(self.colayers_in_flight, bool) or not isinstance(self.colayers_in_flight, int) \
                or self.colayers_in_flight < 1:
            raise ConfigError(f"colayers_in_flight: expected an integer >= 1, got {self.colayers_in_flight!r}")
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if not self.sync_timeout_s > 0:
            raise ConfigError(f"sync_timeout_s: must be positive, got {self.sync_timeout_s}")
        check_bounds(self.staleness, self.proportion)
        check_schedule(self.warmup_steps, self.momentum_compensation)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_cap_mb * 2**20)

    @property
    def first_bucket_bytes(self) -> int:
        """The first colayer's cap (never above the others')."""
        return min(self.bucket_bytes, int(self.first_bucket_cap_mb * 2**20))

    def codec(self) -> Codec:
        if self.compression == "sketch":
            return GradientSketch(exact_fraction=self.exact_fraction, quantile_weight=self.quantile_weight)
        return make_codec(self.compression)
