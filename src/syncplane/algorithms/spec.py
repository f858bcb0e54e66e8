"""What an algorithm family declares, once, for every tool that needs to know it.

Before this existed, adding an algorithm meant editing seven parallel tables in four files
(the registry, the bench's step / overlap / name tables, the cost model's pattern tables).
Now a family's package (``syncplane.algorithms.<family>``) exports one ``AlgorithmSpec``;
the Lightning registry (descriptions), ``syncplane bench`` (steps, overlap windows),
``syncplane simulate`` and the bench's bound (cost patterns) and ``syncplane info`` all read
it through ``syncplane.algorithms``; so does the runtime, which names no family: its launch
checks (``check_launch``), elastic launch (``elastic``) and re-plan switch (``switch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from syncplane.cluster.cost import Phase, bucket_streams
from syncplane.cluster.profile import ClusterProfile
from syncplane.comm.buckets import DEFAULT_BUCKET_BYTES
from syncplane.comm.meter import CommMeter
from syncplane.exchanges.cpu import CpuWork
from syncplane.job import JobContext


class SyncStep(Protocol):
    """One training step's communication on a flat payload (what ``syncplane bench`` times).

    A step that can overlap compute also has ``launch(payload, step, meter)`` and ``wait()``;
    a periodic one has ``period`` (the worker then reports the mean over whole periods); one
    that needs a warm-up (a trial) has ``warmup``; one that leaves messages in flight has
    ``finish()`` (called after the timed steps); ``describe()`` adds a line to the log.
    """

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None: ...


@dataclass(frozen=True)
class CostOptions:
    """The knobs a cost pattern may depend on besides the cluster and the payload."""

    period: int = 4      # steps per round of a periodic algorithm (DiLoCo's H, torch's averager period)
    streams: int = 1     # parallel connections (DiLoCo's shards, DS-Sync's pair streams); 0: one per NIC
    pattern: str = "auto"   # the exchange of a family that has a choice (``syncplane.exchanges.NAMES``)
    compression: str = "none"   # DiLoCo's codec of Δ: none | int8 | sparse (at ``density`` and ``bits``)
    density: float = 0.02
    bits: int = 2
    replica: str = "rank"   # DiLoCo's replica: rank | node | auto (``diloco.layout``)
    parts: float = 1   # a round over its first part, whose CPU work alone stands outside the wire (``AlgorithmSpec.parts``)
    rank: int = 1    # PowerSGD's matrix_approximation_rank
    lanes: int = 1   # parts of a round in flight at once, each through the pattern's phases (``AlgorithmSpec.lanes``)


#: (strategy name, cluster, payload bytes, options) -> the phases of every step of one period
#: (an idle step is an empty list): a step costs the period's mean.
CostPattern = Callable[[str, ClusterProfile, float, CostOptions], list[list[Phase]]]
#: (strategy name, bench options, the job's shape) -> the step the bench times.
#: (strategy name, cluster, payload bytes, options) -> one rank's CPU work in one round
#: (``syncplane.exchanges.cpu``: encoding, decoding, sums, copies), priced by measured rates.
CpuPattern = Callable[[str, ClusterProfile, float, CostOptions], CpuWork]
StepFactory = Callable[[str, Mapping[str, Any], JobContext], SyncStep]


#: (strategy name, its checked kwargs, the job's context as planned) -> None, or ConfigError /
#: ValueError naming the key: the settings whose validity depends on the ranks, checked before launch.
JobCheck = Callable[[str, Mapping[str, Any], JobContext], None]

#: The key a strategy's ``training_step`` output carries (True) for a batch it skipped without
#: computing it (a replica whose round budget is spent): the runtime's report and emulated
#: compute count no samples and no compute time for it.
SKIPPED_BATCH = "skipped_batch"


@dataclass(frozen=True)
class LaunchSettings:
    """What the job decides beside the strategy's own settings, for ``AlgorithmSpec.check_launch``."""

    emulated: bool          # the ranks run in an emulated cluster's host namespaces (``cluster=...``)
    resume: str | None      # the checkpoint the job resumes from
    max_restarts: int       # ``trainer.max_restarts``


#: (strategy name, its checked kwargs, the launch's settings) -> None, or ConfigError naming the
#: key: a combination of the strategy's settings with the launch's that cannot run.
LaunchCheck = Callable[[str, Mapping[str, Any], LaunchSettings], None]


class QuorumService(Protocol):
    """A running quorum service: its address (what the replicas dial) and its end."""

    address: str

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class ElasticLaunch:
    """A job of independent replicas (each a Lightning job of one process) around a quorum
    service, instead of one process group: how the launcher (``runtime.entry``) starts it.

    Attributes:
        enabled: the strategy's kwargs -> whether they ask for this launch.
        setting: how a user asks for it, for messages (``strategy.kwargs.elastic=true``).
        start: (the one address to bind, keywords ``min_replicas``, ``join_timeout_s``,
            ``heartbeat_timeout_s``) -> the service, running in this process.
        timeouts: the strategy's kwargs -> the keywords of ``start`` the service runs with
            (``min_replicas``, ``join_timeout_s``, ``heartbeat_timeout_s``: its membership rule).
        bind: the strategy's kwargs -> the address a local job's service binds (an emulated
            cluster's binds host 0's first NIC).
        per_host: (the strategy's kwargs, the ranks of each host) -> whether a replica is the
            ranks of a host (one Lightning job of that many processes; they fail, restart and
            rejoin together) rather than one rank.
    """

    enabled: Callable[[Mapping[str, Any]], bool]
    setting: str
    start: Callable[..., QuorumService]
    timeouts: Callable[[Mapping[str, Any]], dict[str, float]]
    bind: Callable[[Mapping[str, Any]], str]
    per_host: Callable[[Mapping[str, Any], Sequence[int]], bool] = lambda kwargs, sizes: False


@dataclass(frozen=True)
class Switch:
    """What a re-plan (``runtime.replan``) may change while one of the family's strategies
    trains: ``keys``, the ``strategy.kwargs`` it switches at a round boundary; ``refuse``, the
    running kwargs -> why these cannot switch (None: they can); ``apply``, a collective on
    every rank: (the trainer's strategy, the new kwargs) -> the strategy runs with the new
    ``keys`` from the next round on, the model and the state that does not depend on them kept."""

    keys: tuple[str, ...]
    apply: Callable[[Any, Mapping[str, Any]], None]
    refuse: Callable[[Mapping[str, Any]], str | None] = lambda kwargs: None



def payload_buckets(payload_bytes: float) -> int:
    """How many of DDP's buckets (``DEFAULT_BUCKET_BYTES``) the payload fills, at least one."""
    return max(1, math.ceil(payload_bytes / DEFAULT_BUCKET_BYTES))


def payload_bucket_streams(profile: ClusterProfile, payload_bytes: float) -> int:
    """The pinned streams the payload's DDP-sized buckets (``payload_buckets``, one
    asynchronous all-reduce each) make on the NICs gloo lists (``cluster.cost.bucket_streams``,
    ``gloo_nics``): how DDP, torch's hooks and DS-Sync's groups spread over a host's NICs."""
    return bucket_streams(payload_buckets(payload_bytes), profile.gloo_nics)

@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm family (ATC/AWC/H-ATC/H-AWC are one family; so are torch's averagers).

    Attributes:
        family: the package name under ``syncplane.algorithms``.
        strategies: every name the family answers to -> a one-line description (the
            Lightning registry and ``syncplane info`` show it).
        bench_step: builds the step ``syncplane bench`` times for one of those names.
        cost: the α-β communication pattern (``syncplane simulate``, the bench's bound).
        overlap: name -> the part of a training step its sync runs behind
            (``backward``, ``forward`` or ``step``); absent names block.
        periodic: communicates once per ``period`` steps (whole rounds are benchmarked).
        default_period: name -> the period it runs at unless a tool is given one (DiLoCo's
            own default ``sync_every``), so ``bench`` and ``simulate`` price what training runs.
        streams: bench options -> the number of parallel connections the pattern assumes.
        pattern: bench options -> ``CostOptions.pattern`` (which pattern the step runs).
        peer: a peer from another project, benchmarked beside ours (no syncplane strategy).
        check_job: the settings that depend on the job's ranks (a profile to load, a tree
            the exchange needs), checked in the launching process before any rank starts.
        exact: the names whose result is DDP's (same averaged gradient every step, no codec);
            ``syncplane plan`` and ``strategy=auto`` rank them apart from the approximate ones.
        variants: name -> the settings (``strategy.kwargs``) ``syncplane plan`` prices, each
            one candidate (absent: the defaults only). Bench option names are the kwargs' own,
            so ``streams`` and ``pattern`` read a variant as they read the bench's options.
        period_key: the ``strategy.kwargs`` key of a periodic algorithm's period (DiLoCo's H).
        cpu: the CPU work of one round beside the wire (absent: none modelled), priced with
            the rates ``syncplane.exchanges.cpu.calibrate`` measures on the machine.
        parts: (bench options, payload bytes) -> a round's size over its first part's, where
            it goes in parts, one part's CPU work running while the previous one is on the
            wire (Canary's colayers in flight; equal parts: their count); 1: the CPU work and
            the wire add up.
        lanes: (bench options) -> the parts in flight at once, each on its own connections
            through the pattern's phases (Canary's ``colayers_in_flight``): one part's hop on
            one link runs beside another's on another (``CostModel.pipelined``); 1: the
            phases add up.
        alpha_hidden: the names whose step is a chain of small collectives between CPU work
            that the other ranks sharing the machine's cores fill: their wire is priced without
            the per-message latency α (its bytes, and the queue behind a background flow, add to
            the CPU work; measured: torch's PowerSGD, ``torch_hooks``).
        trial: (bench options, a price of settings: the wire's seconds of each step of one
            period of the pattern) -> the settings a run-time trial settles on, by the trial's
            own rule applied to the prices of the steps it times (DS-Sync's ``pair_streams:
            auto``); the prediction prices those. Default: the options as given.
        check_launch: the settings that cannot run with the launch's (a resume, an emulated
            cluster, restarts), checked in the launching process before any rank starts.
        elastic: how to launch a job of independent replicas, where the family has that mode
            (None: every job is one process group).
        switch: what a re-plan may change while a job trains (None: nothing; the hooked DDP
            strategies switch among themselves through ``strategies.switching`` instead).
    """

    family: str
    strategies: Mapping[str, str]
    bench_step: StepFactory
    cost: CostPattern
    overlap: Mapping[str, str] = field(default_factory=dict)
    periodic: bool = False
    default_period: Mapping[str, int] = field(default_factory=dict)
    streams: Callable[[Mapping[str, Any]], int] = lambda options: 1
    pattern: Callable[[Mapping[str, Any]], str] = lambda options: "auto"
    peer: bool = False
    check_job: JobCheck = lambda name, kwargs, job: None
    exact: tuple[str, ...] = ()
    variants: Mapping[str, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    period_key: str | None = None
    cpu: CpuPattern = lambda name, profile, payload_bytes, options: CpuWork()
    parts: Callable[[Mapping[str, Any], float], float] = lambda options, payload_bytes: 1
    lanes: Callable[[Mapping[str, Any]], int] = lambda options: 1
    alpha_hidden: tuple[str, ...] = ()
    trial: Callable[[Mapping[str, Any], Callable[[Mapping[str, Any]], list[float]]], Mapping[str, Any]] = \
        lambda options, price: options
    check_launch: LaunchCheck = lambda name, kwargs, launch: None
    elastic: ElasticLaunch | None = None
    switch: Switch | None = None


def compute_split(window: str | None, compute_s: float) -> tuple[float, float, float]:
    """(before launch, between launch and wait, after wait) seconds of one step's compute,
    forward : backward = 1 : 2 (their FLOP ratio), for a sync that runs behind ``window``
    (an ``AlgorithmSpec.overlap`` value): ``backward`` (DDP's buckets), ``forward`` (ATC:
    waited per module in the next forward), ``step`` (AWC: forward and backward) or None
    (blocking). The bench's workers split their timed wait by it; the bench's prediction
    and ``syncplane plan`` take the middle part as the compute a sync hides behind."""
    forward, backward = compute_s / 3, 2 * compute_s / 3
    return {None: (compute_s, 0.0, 0.0), "backward": (forward, backward, 0.0),
            "forward": (0.0, forward, backward), "step": (0.0, compute_s, 0.0)}[window]
