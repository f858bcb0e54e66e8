"""The algorithms, one package per family, each declared once (``AlgorithmSpec``).

Layering: ``syncplane.strategies`` (Lightning glue) → ``syncplane.algorithms`` (the engines,
Lightning-free) → ``syncplane.comm`` (transport) → ``syncplane.kernels``; algorithms may read
``syncplane.cluster`` (profiles, probe, cost model), never the reverse. Held by the
import-linter contracts in ``pyproject.toml``.

This module is the catalogue every tool reads: the registry and ``syncplane info``
(names, descriptions), ``syncplane bench`` (steps, overlap windows) and ``syncplane
simulate`` (cost patterns).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from syncplane.algorithms import canary, ddp, decentralized, diloco, ds_sync, flexreduce, peers, torch_hooks
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions, ElasticLaunch, Switch
from syncplane.cluster.bound import allreduce_network_bound
from syncplane.cluster.cost import IDEAL, CostModel
from syncplane.config import parse_variant
from syncplane.exchanges.cpu import CpuRates

#: Every family, baseline first; peers (from other projects) last.
SPECS: tuple[AlgorithmSpec, ...] = (ddp.SPEC, decentralized.SPEC, ds_sync.SPEC, diloco.SPEC, flexreduce.SPEC,
                                    canary.SPEC, torch_hooks.SPEC, peers.SPEC, flexreduce.PEERS)

#: Names the product promises (``docs/architecture.md``) whose package has not landed yet.
PLANNED: dict[str, str] = {}

_BY_NAME: dict[str, AlgorithmSpec] = {name: spec for spec in SPECS for name in spec.strategies}


def spec_for(name: str) -> AlgorithmSpec:
    """The family that implements ``name`` (a strategy or a peer)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        state = "is planned but not implemented yet" if name in PLANNED else "is unknown"
        raise KeyError(f"{name!r} {state}; implemented: {', '.join(_BY_NAME)}") from None


def is_exact(label: str) -> bool:
    """Whether the strategy of ``label`` (``NAME`` or a ``variant``) gives DDP's result: its
    family's ``AlgorithmSpec.exact`` names it (the plan's exact class)."""
    name = variant(label)[0]
    return name in spec_for(name).exact


def elastic_mode(name: str) -> ElasticLaunch | None:
    """How strategy ``name`` launches in its elastic mode (``AlgorithmSpec.elastic``); None: it
    has none (also for a name no family declares, such as ``strategy=auto``)."""
    spec = _BY_NAME.get(name)
    return None if spec is None else spec.elastic


def elastic_launch(name: str, kwargs: Mapping[str, Any]) -> ElasticLaunch | None:
    """The elastic launch strategy ``name`` asks for with ``kwargs``; None: one process group."""
    launch = elastic_mode(name)
    return launch if launch is not None and launch.enabled(kwargs) else None


def elastic_settings() -> list[str]:
    """How each strategy that has an elastic mode is asked for it (``strategy=NAME SETTING``)."""
    return [f"strategy={name} {spec.elastic.setting}" for spec in SPECS if spec.elastic is not None
            for name in spec.strategies]


def switches() -> dict[str, Switch]:
    """Every strategy whose settings a re-plan may switch while it trains -> its ``Switch``."""
    return {name: spec.switch for spec in SPECS if spec.switch is not None for name in spec.strategies}


def variant(label: str) -> tuple[str, dict[str, Any]]:
    """A bench or simulate row's strategy and settings: ``NAME`` or ``NAME[key=value,...]``
    (``diloco[replica=node,shards=2]``), the values as numbers where they read as one, and
    ``true``/``false`` (any case) as booleans. The keys are the strategy's ``strategy.kwargs``,
    the names the bench's options use too."""
    name, pairs = parse_variant(label)
    return name, {key: _scalar(value) for key, value in pairs}


def _scalar(text: str) -> bool | int | float | str:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def strategy_names() -> list[str]:
    """Every implemented strategy name (peers excluded), baseline first."""
    return [name for spec in SPECS if not spec.peer for name in spec.strategies]


def peer_names() -> list[str]:
    return [name for spec in SPECS if spec.peer for name in spec.strategies]


def all_names() -> list[str]:
    """What ``syncplane bench`` accepts: implemented and planned strategies, then peers."""
    return [*strategy_names(), *PLANNED, *peer_names()]


def description(name: str) -> str:
    return spec_for(name).strategies[name]


@dataclass(frozen=True)
class StrategyTimes:
    """One step's sync of a strategy on a cluster, in seconds (periodic ones amortized).

    ``predicted_s``: its pattern with the per-phase latency; ``bound_s``: its pattern's own
    bandwidth bound (with parts in flight, their phases side by side: ``CostModel.pipelined``);
    ``network_bound_s``: the network's lower bound for an all-reduce of the
    payload (``syncplane.cluster.bound``) once per step that communicates, whatever the
    pattern -- how fast the wire would let the step be; ``network_binding``: the cut or
    count that sets it; ``cpu_s``: the part of ``predicted_s`` that is CPU work (encoding,
    decoding, sums: the family's ``AlgorithmSpec.cpu`` at measured rates; 0 without rates).
    """

    predicted_s: float
    bound_s: float
    network_bound_s: float
    network_binding: str
    cpu_s: float = 0.0


def strategy_times(model: CostModel, name: str, payload_bytes: float, options: CostOptions = CostOptions(),
                   cpu: CpuRates | None = None) -> StrategyTimes:
    """``StrategyTimes`` of ``name`` on ``model``'s cluster: the means over one period of its
    pattern (so periodic algorithms are amortized, their network bound too: it counts the
    steps whose flows leave a host, not those on loopback only); with ``cpu`` rates, the
    prediction adds the family's CPU work per round, overlapped with the wire where the round
    goes in several parts (``overlapped``; the bounds stay the wire's); where the CPU work
    hides the per-message latency (``AlgorithmSpec.alpha_hidden``), the wire without α adds to it."""
    family = spec_for(name)
    steps = family.cost(name, model.profile, payload_bytes, options)
    if not steps:
        return StrategyTimes(0.0, 0.0, 0.0, "no communication")
    # streams 0: one per NIC (Canary's auto)
    network = allreduce_network_bound(model.profile, payload_bytes, options.streams or model.profile.max_nics)
    rounds = sum(1 for step in steps if model.crosses_hosts(step)) / len(steps)
    exchanges = sum(1 for step in steps if step) / len(steps)
    cpu_s = cpu.seconds(family.cpu(name, model.profile, payload_bytes, options)) * exchanges if cpu is not None else 0.0
    hidden = cpu is not None and name in family.alpha_hidden
    # a pattern on loopback only moves its bytes by the kernel's copies, on the cores that run
    # the ranks: where every core runs one (sharing ≥ 1), its CPU work cannot run beside them
    copies = rounds == 0 and cpu is not None and cpu.sharing >= 1
    # parts in flight overlap their phases on different links (``CostModel.pipelined``)
    share = 1.0 / max(1.0, options.parts)
    wire_s = sum(model.pipelined(p, options.lanes, share, 0.0 if hidden else None) for p in steps) / len(steps)
    bound_s = sum(model.pipelined(p, options.lanes, share, 0.0, IDEAL) for p in steps) / len(steps)
    return StrategyTimes(overlapped(wire_s, cpu_s, 1 if hidden or copies else options.parts),
                         bound_s, network.seconds * rounds, network.binding, cpu_s)


def step_prices(model: CostModel, name: str, payload_bytes: float, options: CostOptions = CostOptions()) -> list[float]:
    """The wire's seconds of each step of one period of ``name``'s pattern on ``model``'s
    cluster (what ``AlgorithmSpec.trial`` judges by; ``strategy_times`` is their mean)."""
    return [model.time(phases) for phases in spec_for(name).cost(name, model.profile, payload_bytes, options)]


def periods(names: list[str], period: int | None = None) -> dict[str, int]:
    """Steps per round of each periodic strategy among ``names`` (labels, ``variant``):
    ``period`` where one is given (``--period``), else the one a variant names
    (``diloco[sync_every=4]``), else the strategy's own default (DiLoCo's ``sync_every``)."""
    used = {}
    for label in names:
        name, options = variant(label)
        family = spec_for(name) if name not in PLANNED else None
        if family is not None and family.periodic:
            own = options.get(family.period_key or "", family.default_period[name])
            used[label] = period if period is not None else int(own)
    return used


def describe_periods(periods_used: dict[str, int], period: int | None = None) -> str:
    """The periods of ``periods``, in words for a table's title ('' when none is periodic)."""
    if not periods_used:
        return ""
    if period is not None:
        return f"period {period} (--period)"
    return "period " + ", ".join(f"{name} {p}" for name, p in periods_used.items()) + " (their defaults; --period sets one for all)"


def overlapped(wire_s: float, cpu_s: float, parts: float = 1) -> float:
    """A round's time when it goes in parts, each part's CPU work running while the previous
    part is on the wire (a two-stage pipeline), ``parts`` the round over its first part (equal
    parts: their count): the longer stage plus the first part's share of the shorter (filling
    it); with one part the two add up."""
    if parts <= 1:
        return wire_s + cpu_s
    return max(wire_s, cpu_s) + min(wire_s, cpu_s) / parts


def strategy_time(model: CostModel, name: str, payload_bytes: float, options: CostOptions = CostOptions()
                  ) -> tuple[float, float]:
    """(predicted seconds, bound seconds) of ``strategy_times``."""
    times = strategy_times(model, name, payload_bytes, options)
    return times.predicted_s, times.bound_s


__all__ = ["PLANNED", "SPECS", "AlgorithmSpec", "CostOptions", "StrategyTimes", "all_names", "describe_periods",
           "description", "peer_names", "periods",
           "spec_for", "strategy_names", "strategy_time", "strategy_times", "variant"]
