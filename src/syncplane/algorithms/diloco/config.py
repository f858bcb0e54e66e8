"""DiLoCo's settings, validated once (the strategy builds this at construction, so a bad
value fails before the first step, naming the key), and checked against a checkpoint's on resume."""

from __future__ import annotations

from collections.abc import Mapping
import logging
import warnings
from dataclasses import dataclass, fields
from typing import Any, Literal

from syncplane.algorithms.diloco.adaptive import WEIGHTINGS
from syncplane.algorithms.diloco.dealing import TIME_SAMPLES
from syncplane.algorithms.diloco.exchange import check_exchange, delta_codec
from syncplane.algorithms.diloco.layout import check_replica
from syncplane.algorithms.diloco.outer import check_outer
from syncplane.algorithms.diloco.streaming import streaming_mix_alpha
from syncplane.comm.codecs import Codec, check_sparse_options

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiLoCoConfig:
    """DiLoCo's settings, with their defaults.

    Args:
        sync_every: H, inner steps per round.
        outer_optimizer, outer_kwargs: the outer torch optimizer's class path and arguments (None: ``outer``'s).
        streams: concurrent gloo streams of the exchange (bound to the host's NICs in turn), or ``auto``:
            from the job's cluster profile (``cost.resolve_streams``). Old name: ``shards``.
        compression: ``none`` (exact fp32), ``int8`` (blockwise scale + error feedback) or ``sparse``
            (SparseLoCo's chunked top-k with error feedback, ``comm.codecs``: needs the ``gather``
            exchange, which ``auto`` picks; the floating buffers travel beside it as exact fp32).
        block_size: values per int8 scale.
        density, bits, chunk: sparse: the fraction of each chunk sent, in (0, 1] (SparseLoCo:
            0.01-0.03); bits per sent value, 2, 4 or 8; values per chunk (one top-k and scale each).
        error_feedback_beta: sparse: β of the accumulator ``e ← β·e + Δ``.
        outer: SGD's default ``outer_kwargs``: ``nesterov`` (DiLoCo's: lr 0.7, momentum 0.9, Nesterov)
            or ``sparseloco`` (SparseLoCo's: lr 1, no momentum; on dense Δ, the mean).
        sync_timeout_s: an exchange slower than this is discarded on every rank.
        fragments, overlap_steps, mix_alpha: Streaming DiLoCo's P (1 = plain DiLoCo; at most H), τ
            (inner steps a fragment's exchange runs in the background; below H // P) and the merge's α,
            ``θ_local ← α·θ_local + (1 − α)·θ_g`` (None: 0.5, the paper's, with overlap; else 0).
        exchange, topology: the all-reduce of Δ (``auto``, ``mesh`` (old name ``owner``), ``tree`` or
            ``gather``) and the tree, as FlexReduce's (``auto``, a cluster profile name / YAML path, or
            a list of ranks per host).
        replica, inner: what a replica is (``layout``): ``rank``, ``node`` or ``auto``; inside a
            node, ``ddp`` or ``fsdp``.
        inner_steps: ``fixed`` (H per replica per round) or ``time``: each replica computes on as many
            of the round's H batches as fit its time budget (``adaptive``; fragments 1, no overlap).
        round_budget_s, time_weighting, time_samples: ``time``: the round's budget in seconds (None: H x
            the median step time); Δ weighted by the ``samples`` each processed or by ``fednova``'s
            normalized averaging (with ``fixed`` both are the plain mean); the batches a slow replica
            has no time for ``share``d (one stream dealt as the replicas compute) or ``drop``ped.
        membership, min_replicas, grace_s: elastic rounds: ``fixed`` (members decided at the round's
            start, the Lighthouse waiting ``join_timeout_s`` for every live replica) or ``quorum``
            (decided as replicas finish their inner steps: the round commits with those in within
            ``grace_s`` of the first ``min_replicas``, torchft also wanting more than half of the live
            ones; a late replica's Δ is carried over)."""

    sync_every: int = 10
    outer_optimizer: str = "torch.optim.SGD"
    outer_kwargs: dict[str, Any] | None = None
    streams: int | Literal["auto"] = 1
    compression: Literal["none", "int8", "sparse"] = "none"
    block_size: int = 256
    density: float = 0.02
    bits: int = 2
    chunk: int = 4096
    error_feedback_beta: float = 0.95
    outer: Literal["nesterov", "sparseloco"] = "nesterov"
    sync_timeout_s: float = 600.0
    fragments: int = 1
    overlap_steps: int = 0
    mix_alpha: float | None = None
    exchange: Literal["auto", "mesh", "owner", "tree", "gather"] = "auto"
    topology: str | list[int] = "auto"
    replica: Literal["rank", "node", "auto"] = "rank"
    inner: Literal["ddp", "fsdp"] = "ddp"
    inner_steps: Literal["fixed", "time"] = "fixed"
    round_budget_s: float | None = None
    time_weighting: Literal["samples", "fednova"] = "samples"
    time_samples: Literal["share", "drop"] = "drop"
    membership: Literal["fixed", "quorum"] = "fixed"
    min_replicas: int = 1
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {self.sync_every}")
        if self.streams != "auto" and (isinstance(self.streams, bool) or not isinstance(self.streams, int)
                                       or self.streams < 1):
            raise ValueError(f"streams must be an integer of at least 1, or 'auto', got {self.streams!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        check_sparse_options(self.density, self.bits, self.chunk)   # whatever the compression: a typo
        beta = self.error_feedback_beta
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"error_feedback_beta: must be in [0, 1] (SparseLoCo: 0.95), got {beta!r}")
        self.codec()   # validates the codec's own settings
        check_outer(self.outer_optimizer, self.outer_kwargs, self.outer)
        if self.sync_timeout_s <= 0:
            raise ValueError(f"sync_timeout_s must be positive, got {self.sync_timeout_s}")
        check_exchange(self.exchange, self.compression)
        if not isinstance(self.topology, str) and (not isinstance(self.topology, (list, tuple)) or not self.topology
                                                   or any(not isinstance(n, int) or n < 1 for n in self.topology)):
            raise ValueError(f"topology: expected auto, a profile name / path, or a list of ranks per host "
                             f"(each >= 1), got {self.topology!r}")
        self.alpha   # validates the streaming options
        check_replica(self.replica, self.inner, exchange=self.exchange)
        for key, allowed in (("inner_steps", ("fixed", "time")), ("time_weighting", tuple(WEIGHTINGS)),
                             ("time_samples", TIME_SAMPLES), ("membership", ("fixed", "quorum"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}: allowed values: {', '.join(allowed)}; got {getattr(self, key)!r}")
        if self.round_budget_s is not None and self.round_budget_s <= 0:   # read by inner_steps=time only
            raise ValueError(f"round_budget_s: a positive number of seconds (or null), got {self.round_budget_s!r}")
        if self.inner_steps == "time" and (self.fragments != 1 or self.overlap_steps != 0):
            raise ValueError(f"inner_steps=time runs plain DiLoCo rounds: fragments must be 1 and overlap_steps 0, "
                             f"got fragments={self.fragments}, overlap_steps={self.overlap_steps}")
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"min_replicas: an integer of at least 1, got {self.min_replicas!r}")
        if isinstance(self.grace_s, bool) or not isinstance(self.grace_s, (int, float)) or self.grace_s <= 0:
            raise ValueError(f"grace_s: a positive number of seconds, got {self.grace_s!r}")

    @classmethod
    def names(cls) -> set[str]:
        """The settings' names."""
        return {f.name for f in fields(cls)}

    @classmethod
    def pick(cls, settings: Mapping[str, Any]) -> DiLoCoConfig:
        """The config from a strategy's arguments: the keys that are its fields."""
        settings = dict(settings)
        if settings.get("shards") is not None:   # the old name of ``streams``
            warnings.warn("diloco: 'shards' is now called 'streams' (the gloo streams of the exchange; "
                          "FSDP's shards are another thing); set strategy.kwargs.streams", DeprecationWarning,
                          stacklevel=3)
            log.warning("diloco: shards=%s is deprecated: set streams=%s", settings["shards"], settings["shards"])
            settings["streams"] = settings["shards"]
        try:
            return cls(**{name: settings[name] for name in cls.names() & settings.keys()})
        except ValueError as exc:
            if settings.get("shards") is not None and str(exc).startswith("streams"):
                raise ValueError(f"shards (the old name of streams): {exc}") from None
            raise

    def codec(self) -> Codec:
        """What carries Δ on the wire (``compression`` and its settings)."""
        return delta_codec(self.compression, self.block_size, self.density, self.bits, self.chunk)

    @property
    def error_feedback(self) -> float:
        """β of the exchange's residuals: SparseLoCo's decay for ``sparse``, else 1 (int8 keeps all)."""
        return float(self.error_feedback_beta) if self.compression == "sparse" else 1.0

    @property
    def alpha(self) -> float:
        """The effective merge α (see ``mix_alpha``)."""
        return streaming_mix_alpha(self.sync_every, self.fragments, self.overlap_steps, self.mix_alpha)


def check_mode(config: DiLoCoConfig, elastic: bool, timeouts: Mapping[str, float], lighthouse_host: str) -> None:
    """The settings beside ``DiLoCoConfig``: what elastic mode can run with (``diloco_elastic.py``
    checks its own), and the elastic timeouts and Lighthouse address, in either mode (a typo)."""
    if elastic and config.inner_steps == "time" and config.time_samples == "share":
        raise ValueError("time_samples=share with elastic=true: the deal hands a fixed set of ranks the "
                         "dataset's batches, a quorum's members change; use time_samples=drop")
    if config.membership == "quorum" and not elastic:
        raise ValueError("membership=quorum decides each round's replicas by a torchft quorum: it needs "
                         "elastic=true (without it every rank is in every round)")
    for key, value in timeouts.items():
        if value <= 0:
            raise ValueError(f"{key} must be positive, got {value}")
    if not lighthouse_host or any(c.isspace() for c in lighthouse_host):
        raise ValueError(f"lighthouse_host must be an address or host name, got {lighthouse_host!r}")


#: The exchange settings a checkpoint records as they ran, and what a re-plan switches (``SPEC.switch``).
EXCHANGE_KEYS: tuple[str, ...] = ("streams", "exchange", "compression")

#: What a checkpoint written before these round settings existed implies.
BEFORE_STREAMING: dict[str, Any] = {"fragments": 1, "overlap_steps": 0, "inner_steps": "fixed"}


def check_resumed(state: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """A checkpoint's round settings must be this run's, or the rounds would not line up."""
    for key in ("sync_every", *BEFORE_STREAMING):
        saved, ours = state.get(key, BEFORE_STREAMING.get(key)), settings[key]
        if saved != ours:
            raise ValueError(f"the checkpoint was written with {key}={saved}, this run has "
                             f"{key}={ours}: rounds would not line up")


def check_exchange_resumed(state: Mapping[str, Any], running: Mapping[str, Any]) -> None:
    """A checkpoint's exchange settings (``exchange_ran``) must be this run's: refused, not adopted, since
    a re-plan may have switched them and the residuals and outer state were written by the other one."""
    saved = dict(state.get("exchange_ran") or {})
    if not saved:
        return
    if "shards" in saved:   # written before ``shards`` was renamed ``streams``
        saved.setdefault("streams", saved.pop("shards"))
    differ = [k for k in EXCHANGE_KEYS if saved.get(k) != running[k]]
    if differ:
        ran = ", ".join(f"{k}={saved[k]}" for k in differ)
        ours = ", ".join(f"{k}={running[k]}" for k in differ)
        fix = " ".join(f"strategy.kwargs.{k}={saved[k]}" for k in EXCHANGE_KEYS)
        raise ValueError(f"the checkpoint's exchange ran {ran} (a re-plan may have switched it), this run has "
                         f"{ours}: the resume would not be bit-identical. Resume with strategy=diloco {fix}, or "
                         f"with the strategy.kwargs.replan_every_s that wrote it (its re-plan state restores "
                         f"the switch)")
