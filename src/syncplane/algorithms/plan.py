"""The plan: every strategy and its main settings, priced on one cluster for one job, ranked.

What ``syncplane plan`` prints and ``strategy=auto`` decides by. Each registered strategy is
one or more candidates: its defaults, or the settings its ``AlgorithmSpec.variants`` lists
(DiLoCo's streams x exchange, DS-Sync's pair streams, Canary's exchange), a periodic one at
its period (DiLoCo's H: its default, or the one given). Each is priced by the α-β cost model
exactly as the bench's prediction prices it (``strategy_times``; how TCP shares a link as
measured on the emulator unless ``PlanInputs.tcp`` says ``ideal``; the CPU work at
``PlanInputs.cpu``'s rates, ``plan_cpu``, where given, and a host's loopback at the rate
they hold for it, ``with_loopback``), then the part of the step's compute
it runs behind (its spec's ``overlap`` window, ``compute_split``) is taken off: predicted
step = compute + exposed sync.
The compute is the slowest rank's: ``compute`` is a step on the fastest host, and, as in the
emulation (``compute_speed``: the fastest host sets the pace), a host at speed ``s`` takes
``max speed / s`` times as long; every priced strategy synchronizes (every step, or every
round), so it waits for the slowest.
A candidate that cannot run on this job (its ``check_job``, an exchange ``choose`` refuses
on this cluster) is excluded with the reason. Candidates are split into **exact** (DDP's
result: ``AlgorithmSpec.exact``) and **approximate** (gossip, local SGD, compression).

A pure function of its inputs: every rank that computes it from the same inputs gets the
same ranking (ties broken by the catalogue's order).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

from syncplane.algorithms import SPECS, StrategyTimes, spec_for, step_prices, strategy_names, strategy_times
from syncplane.algorithms.ddp import BASELINE
from syncplane.algorithms.ddp.timing import loopback_work
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions, compute_split
from syncplane.cluster.cost import DEFAULT_ALPHA_S, IDEAL, CostModel, LinkTcp, emulated_tcp
from syncplane.cluster.profile import ClusterProfile
from syncplane.config import ConfigError
from syncplane.exchanges.choose import NAMES, JobShape, choose
from syncplane.exchanges.cpu import CpuRates, CpuWork, calibrate
from syncplane.job import JobContext

#: ``strategy.kwargs.accept`` / ``syncplane plan --accept``: which results the user accepts.
ACCEPT = ("exact", "approximate")

#: How much faster than ``ddp`` a candidate must be predicted to be chosen over it: about the
#: model's own error on DDP (within 13 % on 12 of the 15 profiles of the 8 MB matrix,
#: docs/design-notes.md). A smaller predicted gain is no evidence, and DDP is the baseline a
#: user knows: the 8 MB matrix measured FlexReduce 21–34 % slower than DDP on the two
#: profiles where it was predicted 1–3 % faster.
BASELINE_MARGIN = 0.10

#: ``PlanInputs.tcp``: how TCP flows share a shaped link, by the profile's congestion control.
#: ``emulated``: as measured on our emulator under it (``cluster.cost.emulated_tcp``: goodput by
#: link rate, the loss of concurrent flows, gloo's one NIC per op, the wait behind a greedy
#: flow's queue), what the bench's predictions use; ``ideal``: the plain α-β formula.
TCP_MODELS: dict[str, Callable[[str], LinkTcp]] = {"emulated": emulated_tcp, "ideal": lambda congestion: IDEAL}


def link_tcp(tcp: str, profile: ClusterProfile) -> LinkTcp:
    """The ``TCP_MODELS`` entry ``tcp`` for ``profile``'s hosts."""
    return TCP_MODELS[tcp](profile.tcp_congestion)


#: ``syncplane plan --cpu``: whose cores the ranks' CPU work (codecs, torch's hooks, sums)
#: runs on. ``emulated``: every rank of the cluster on this machine (the emulator, the bench);
#: ``host``: each host's ranks on its own cores, as many as this machine has (a CPU cluster of
#: machines like this one); ``none``: not priced (the work runs on GPUs).
CPU_MODES = ("emulated", "host", "none")


def check_accept(value: Any, key: str = "strategy.kwargs.accept") -> str:
    """``value`` if it is one of ``ACCEPT``; else a ConfigError naming ``key``."""
    if value not in ACCEPT:
        raise ConfigError(f"{key}: allowed values: {', '.join(ACCEPT)}; got {value!r}")
    return str(value)


def accepts(accept: str, exact: bool) -> bool:
    """Whether ``accept``'s class takes a candidate that is ``exact`` (DDP's result) or not."""
    return exact or accept == "approximate"


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on (written to ``strategy_details.auto.inputs``)."""

    payload_bytes: int
    compute_s: float = 0.0
    period: int | None = None            # every periodic strategy's period (None: each one's default)
    alpha_s: float = DEFAULT_ALPHA_S
    strategies: tuple[str, ...] | None = None   # None: every registered strategy
    cpu: CpuRates | None = None          # measured CPU rates (``exchanges.cpu.calibrate``); None: the wire only
    tcp: str = "emulated"                # how TCP shares a link (``TCP_MODELS``)

    def __post_init__(self) -> None:
        if self.payload_bytes <= 0:
            raise ConfigError(f"payload: must be positive, got {self.payload_bytes} bytes")
        if self.compute_s < 0:
            raise ConfigError(f"compute: must be at least 0 s, got {self.compute_s}")
        if self.period is not None and self.period < 1:
            raise ConfigError(f"period: must be at least 1, got {self.period}")
        if self.tcp not in TCP_MODELS:
            raise ConfigError(f"tcp: allowed values: {', '.join(TCP_MODELS)}; got {self.tcp!r}")
        if isinstance(self.cpu, Mapping):      # read back from a plan's JSON (``asdict``)
            object.__setattr__(self, "cpu", CpuRates(**self.cpu))


@dataclass(frozen=True)
class Candidate:
    """One strategy with one set of settings, priced (seconds per training step)."""

    strategy: str
    kwargs: dict[str, Any]
    exact: bool
    period: int              # steps per round (1: it communicates every step)
    overlap: str | None      # the part of the step its sync runs behind (None: it blocks)
    sync_s: float            # its sync per step, amortized over a round
    hidden_s: float          # the compute it can hide behind
    step_s: float            # compute + what is left of the sync
    bound_s: float
    network_bound_s: float
    network_binding: str     # the cut or count that sets the network's bound
    cpu_s: float = 0.0       # the part of ``sync_s`` that is CPU work (0 without ``PlanInputs.cpu``)

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.sync_s - self.hidden_s)

    @property
    def label(self) -> str:
        knobs = " ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.strategy} {knobs}".strip()

    def overrides(self) -> list[str]:
        """The ``train.py`` overrides that run this candidate."""
        return [f"strategy={self.strategy}", *(f"strategy.kwargs.{k}={v}" for k, v in self.kwargs.items())]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "exposed_s": self.exposed_s, "label": self.label}


@dataclass(frozen=True)
class Excluded:
    strategy: str
    kwargs: dict[str, Any]
    reason: str


@dataclass(frozen=True)
class Plan:
    """Candidates ranked by predicted step time (fastest first), and the ones that cannot run."""

    cluster: str
    world_size: int
    inputs: PlanInputs
    candidates: list[Candidate]
    excluded: list[Excluded] = field(default_factory=list)

    def ranked(self, accept: str) -> list[Candidate]:
        """The candidates ``accept`` allows (``exact``: DDP's result only; ``approximate``: any)."""
        check_accept(accept, "accept")
        return [c for c in self.candidates if accepts(accept, c.exact)]

    def best(self, accept: str) -> Candidate:
        """The candidate ``accept`` allows that the plan chooses (``choose_candidate``: the
        fastest, unless ``ddp`` is within ``BASELINE_MARGIN`` of it); a ConfigError listing every
        excluded one and its reason when there is none."""
        ranked = self.ranked(accept)
        if not ranked:
            inexact = sorted({c.strategy for c in self.candidates if not c.exact})
            reasons = "; ".join([*(f"{e.strategy} {_knobs(e.kwargs)}".strip() + f": {e.reason}" for e in self.excluded),
                                 *(f"{name}: approximate (accept=approximate allows it)" for name in inexact)]) \
                or "no strategy was offered"
            raise ConfigError(f"plan: no {accept} candidate can run on this job ({self.world_size} ranks on "
                              f"{self.cluster!r}); excluded: {reasons}")
        return choose_candidate(ranked, lambda c: c.step_s, lambda c: c.strategy)

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "world_size": self.world_size, "inputs": asdict(self.inputs),
                "candidates": [c.to_dict() for c in self.candidates],
                "excluded": [asdict(e) for e in self.excluded]}


T = TypeVar("T")


def choose_candidate(ranked: Sequence[T], step_s: Callable[[T], float], strategy: Callable[[T], str]) -> T:
    """The plan's choice among ``ranked`` (fastest predicted first): the first, unless the
    fastest ``ddp`` among them is predicted within ``BASELINE_MARGIN`` of it: then that one."""
    baseline = next((c for c in ranked if strategy(c) == BASELINE), None)
    if baseline is not None and step_s(ranked[0]) > (1 - BASELINE_MARGIN) * step_s(baseline):
        return baseline
    return ranked[0]


def _knobs(kwargs: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in kwargs.items())


def offered(inputs: PlanInputs) -> list[str]:
    """The strategies a plan prices: the ones given, else every registered strategy."""
    names = strategy_names()
    if inputs.strategies is None:
        return names
    unknown = [n for n in inputs.strategies if n not in names]
    if unknown:
        raise ConfigError(f"strategies: unknown {', '.join(unknown)}; allowed values: {', '.join(names)}")
    return list(inputs.strategies)


def settings_of(family: AlgorithmSpec, name: str, period: int | None) -> list[dict[str, Any]]:
    """Each candidate's ``strategy.kwargs`` for ``name``: its variants (or its defaults), a
    periodic one's period first."""
    head = {family.period_key: period or family.default_period[name]} if family.periodic and family.period_key else {}
    return [{**head, **variant} for variant in family.variants.get(name, ({},))]


def why_not(name: str, kwargs: Mapping[str, Any], profile: ClusterProfile) -> str | None:
    """Why this candidate cannot run on ``profile`` (None: it can): the family's own job
    check, then the exchange it names as ``syncplane.exchanges.choose`` judges it here."""
    job = JobContext.planned(profile.world_size, profile)
    try:
        spec_for(name).check_job(name, kwargs, job)
        if "exchange" in kwargs:
            compression = str(kwargs.get("compression", "none"))
            choose(str(kwargs["exchange"]), JobShape.of_profile(profile), allowed=NAMES[1:],
                   exact=compression == "none", sparse=compression == "sparse")
    except (ConfigError, ValueError) as exc:
        return str(exc)
    return None


def cost_options(name: str, kwargs: Mapping[str, Any], inputs: PlanInputs) -> CostOptions:
    """The cost model's options for one candidate: its period (the settings', else the one
    given, else its default), streams, exchange, codec and PowerSGD's rank."""
    family = spec_for(name)
    period = 1
    if family.periodic:
        period = int(kwargs.get(family.period_key or "", inputs.period or family.default_period[name]))
    return CostOptions(period, family.streams(kwargs), family.pattern(kwargs), str(kwargs.get("compression", "none")),
                       float(kwargs.get("density", CostOptions.density)), int(kwargs.get("bits", CostOptions.bits)),
                       str(kwargs.get("replica", CostOptions.replica)), family.parts(kwargs, inputs.payload_bytes),
                       int(kwargs.get("matrix_approximation_rank", CostOptions.rank)), family.lanes(kwargs))


def cpu_work(profile: ClusterProfile, name: str, kwargs: Mapping[str, Any], inputs: PlanInputs) -> CpuWork:
    """One round's CPU work of a candidate (what its CPU rates must cover: ``calibrate`` it)."""
    return spec_for(name).cpu(name, profile, inputs.payload_bytes, cost_options(name, kwargs, inputs))


def settled_times(model: CostModel, name: str, kwargs: Mapping[str, Any], inputs: PlanInputs) -> StrategyTimes:
    """``strategy_times`` of the settings ``name`` runs with on ``model``'s cluster: those a
    run-time trial settles on (``AlgorithmSpec.trial``, judged by these prices), else ``kwargs``."""
    def steps(settings: Mapping[str, Any]) -> list[float]:
        return step_prices(model, name, inputs.payload_bytes, cost_options(name, settings, inputs))
    settled = spec_for(name).trial(kwargs, steps)
    return strategy_times(model, name, inputs.payload_bytes, cost_options(name, settled, inputs), inputs.cpu)


def price(model: CostModel, name: str, kwargs: Mapping[str, Any], inputs: PlanInputs) -> Candidate:
    """One candidate priced on ``model``'s cluster (module doc), its CPU work at ``inputs.cpu``."""
    family = spec_for(name)
    options = cost_options(name, kwargs, inputs)
    times = settled_times(model, name, kwargs, inputs)
    window = family.overlap.get(name)
    speeds = model.profile.compute_speeds()
    compute = inputs.compute_s * max(speeds) / min(speeds)   # the slowest rank's (module doc)
    hidden = compute_split(window, compute)[1]
    return Candidate(strategy=name, kwargs=dict(kwargs), exact=name in family.exact, period=options.period,
                     overlap=window, sync_s=times.predicted_s, hidden_s=hidden,
                     step_s=compute + max(0.0, times.predicted_s - hidden),
                     bound_s=times.bound_s, network_bound_s=times.network_bound_s,
                     network_binding=times.network_binding, cpu_s=times.cpu_s)


def candidate_settings(profile: ClusterProfile, inputs: PlanInputs) -> list[tuple[str, dict[str, Any], str | None]]:
    """Every offered strategy's settings (``settings_of``), each with why it cannot run on
    ``profile`` (None: it can)."""
    return [(name, kwargs, why_not(name, kwargs, profile)) for name in offered(inputs)
            for kwargs in settings_of(spec_for(name), name, inputs.period)]


def cpu_sharing(mode: str, profile: ClusterProfile, cores: int | None = None) -> float | None:
    """``CpuRates.sharing`` for ``CPU_MODES`` ``mode`` on ``profile``: ranks per core of this
    machine (``cores``, default its usable ones); None for ``none``."""
    if mode not in CPU_MODES:
        raise ConfigError(f"cpu: allowed values: {', '.join(CPU_MODES)}; got {mode!r}")
    if mode == "none":
        return None
    cores = cores or len(os.sched_getaffinity(0))
    ranks = profile.world_size if mode == "emulated" else profile.max_ranks_per_host
    return ranks / cores


def measured_cpu(profile: ClusterProfile, candidates: Sequence[tuple[str, Mapping[str, Any]]], inputs: PlanInputs,
                 sharing: float) -> CpuRates:
    """This machine's CPU rates (``exchanges.cpu.calibrate``: measured on first use, then read
    from its cache) for every operation ``candidates`` run, ``sharing`` ranks per core, and,
    where a host has several ranks, its loopback's (``ddp.timing``)."""
    work = sum((cpu_work(profile, name, kwargs, inputs) for name, kwargs in candidates), CpuWork())
    if profile.max_ranks_per_host > 1:
        work += loopback_work(profile.max_ranks_per_host)
    return calibrate(work, sharing=sharing)


def with_loopback(model: CostModel, cpu: CpuRates | None) -> CostModel:
    """``model`` with its hosts' loopback at the rate ``cpu`` holds for it (measured on the
    machine whose rates they are: ``measured_cpu``), else as it is."""
    rate = cpu.loopback_bytes_per_s(model.profile.max_ranks_per_host) if cpu is not None else None
    return replace(model, loopback_bytes_per_s=rate) if rate and rate != model.loopback_bytes_per_s else model


def plan_cpu(profile: ClusterProfile, inputs: PlanInputs, sharing: float | None) -> PlanInputs:
    """``inputs`` with the CPU rates of every candidate that can run (``measured_cpu``), or
    unchanged when ``sharing`` is None."""
    if sharing is None:
        return inputs
    runnable = [(name, kwargs) for name, kwargs, reason in candidate_settings(profile, inputs) if reason is None]
    return replace(inputs, cpu=measured_cpu(profile, runnable, inputs, sharing))


def make_plan(profile: ClusterProfile, inputs: PlanInputs) -> Plan:
    """Every offered strategy's candidates on ``profile``, priced and ranked (module doc)."""
    model = with_loopback(CostModel(profile, alpha_s=inputs.alpha_s, tcp=link_tcp(inputs.tcp, profile)), inputs.cpu)
    order = {name: i for i, name in enumerate(n for spec in SPECS for n in spec.strategies)}
    candidates, excluded = [], []
    for name, kwargs, reason in candidate_settings(profile, inputs):
        if reason is None:
            try:
                candidates.append(price(model, name, kwargs, inputs))
                continue
            except (ConfigError, ValueError) as exc:    # a pattern this cluster cannot carry
                reason = str(exc)
        excluded.append(Excluded(name, kwargs, reason))
    candidates.sort(key=lambda c: (round(c.step_s, 9), order[c.strategy]))
    return Plan(profile.name, profile.world_size, inputs, candidates, excluded)
