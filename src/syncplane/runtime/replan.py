"""Re-planning while ``strategy=auto`` trains (``strategy.kwargs.replan_every_s``).

At each round boundary rank 0 asks its clock whether ``replan_every_s`` has passed since the
last plan, and broadcasts the answer: every rank takes the same branch. When it has, the
ranks re-probe the network together (``Reprobe``: every pair once and the per-flow caps,
short transfers, racks and hosts as the job's profile declares them), rank 0 re-prices the candidates it may switch
to on what was measured with the same pure plan function as at start-up
(``syncplane.algorithms.plan.make_plan``), and broadcasts its decision: switch when one is
at least ``FASTER`` times faster than the current one on the new measurements. Every rank then
switches at the same step, and the switch is logged and recorded in
``strategy_details.auto.replans``.

What can be switched, and why only that: a switch must leave the parameters and the
optimizer state the same on every rank.

- **Between the hooked strategies** (``HOOKED``: ``syncplane.strategies.switching.MEMBERS``), at
  any step boundary: they are one torch DDP with another comm hook, none keeps state across
  steps, and each leaves the same gradient on every rank. A job that chose one of them and
  re-plans runs ``syncplane.strategies.switching.SwitchableDDP``, which swaps the hook. Its
  candidates are those of its accuracy class (``accept``: ``exact`` leaves the approximate
  hooks out).
- **A family's own settings** (its ``AlgorithmSpec.switch``: the keys, the settings that refuse
  a switch, the collective that applies one) at a round boundary; the family's package says
  why those keys, and which state is carried over.

A switch between those groups, or to any other strategy (a periodic one -> DDP: each
replica's inner optimizer state differs; a compressed hook: its error feedback), is not
offered; a job whose chosen strategy has nothing to switch says so at start-up (log and
``strategy_details.auto.replan``) and keeps its choice.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from lightning.pytorch.callbacks import Callback

from syncplane.algorithms import spec_for, switches
from syncplane.algorithms.plan import Candidate, PlanInputs, accepts, make_plan
from syncplane.cluster.probe import Topology, from_profile, measure_flow_caps, measure_pairs
from syncplane.cluster.profile import ClusterProfile, parse_profile
from syncplane.strategies.switching import MEMBERS, SwitchableDDP

log = logging.getLogger(__name__)

#: the strategies a re-plan may switch between (module doc)
HOOKED: tuple[str, ...] = tuple(MEMBERS)
#: a candidate replaces the current one when its predicted step is at least this many times faster
FASTER = 1.2
#: bytes each pair exchanges in a re-probe (short: it runs inside the training)
REPROBE_BYTES = 256 * 1024
#: streams of the per-flow cap test in a re-probe (a link that caps each flow shows it at 4)
REPROBE_STREAMS = 4

Probe = Callable[[], ClusterProfile]


def reachable(strategy: str) -> tuple[str, ...]:
    """The strategies a job running ``strategy`` may switch to (itself included)."""
    return HOOKED if strategy in HOOKED else (strategy,)


def switchable(strategy: str) -> tuple[str, ...] | None:
    """The ``strategy.kwargs`` a re-plan may change while ``strategy`` trains (module doc);
    None: it cannot switch at all."""
    if strategy in MEMBERS:
        return MEMBERS[strategy]
    switch = switches().get(strategy)
    return None if switch is None else switch.keys


def not_switchable(strategy: str, kwargs: Mapping[str, Any]) -> str | None:
    """Why a job running ``strategy`` with ``kwargs`` cannot re-plan (None: it can)."""
    if switchable(strategy) is None:
        settings = ", ".join(f"{name}'s {'/'.join(switch.keys)}" for name, switch in switches().items())
        return (f"{strategy} cannot be switched while it trains (only between {', '.join(HOOKED)} at a step "
                f"boundary, and {settings} at a round boundary)")
    switch = switches().get(strategy)
    return None if switch is None else switch.refuse(kwargs)


def fixed_part(strategy: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a switch keeps (everything but ``switchable``'s keys)."""
    keys = switchable(strategy) or ()
    return {k: v for k, v in kwargs.items() if k not in keys}


def choose_switch(candidates: list[Candidate], strategy: str, kwargs: Mapping[str, Any],
                  accept: str = "approximate") -> dict[str, Any]:
    """Pure: the current candidate and the fastest one it may switch to (``reachable``, with
    the same fixed settings, of ``accept``'s class), both as priced in ``candidates`` (one
    plan, fastest first); ``switch`` is True when the latter is at least ``FASTER`` times
    faster. The current one must be among ``candidates``."""
    fixed = fixed_part(strategy, kwargs)
    same = [c for c in candidates if c.strategy in reachable(strategy) and fixed_part(c.strategy, c.kwargs) == fixed
            and accepts(accept, c.exact)]
    current = next((c for c in candidates if c.strategy == strategy and c.kwargs == dict(kwargs)), None)
    if current is None:
        raise ValueError(f"the running {strategy} {dict(kwargs)} is not among the plan's candidates")
    best = same[0] if same else current
    moves = (best.strategy, best.kwargs) != (current.strategy, current.kwargs)
    return {"switch": moves and best.step_s * FASTER <= current.step_s,
            "current": _priced(current), "best": _priced(best)}


def _priced(c: Candidate) -> dict[str, Any]:
    return {"label": c.label, "strategy": c.strategy, "kwargs": dict(c.kwargs), "step_s": c.step_s,
            "sync_s": c.sync_s}


class Reprobe:
    """The network now (a collective: every rank calls it at the same step): ``profile``'s
    racks and hosts with their rates and per-flow caps measured again, cheaply. Every pair
    exchanges ``nbytes`` once, pairs across the declared racks again with one pair per rack at
    a time (``measure_pairs``), and one pair per rack and per pair of racks over one stream and
    over ``streams`` (``measure_flow_caps``, on lanes made once, at the first re-probe);
    compute speeds stay as declared. ``group``: the gloo group to probe over (called then)."""

    def __init__(self, profile: ClusterProfile, group: Callable[[], Any], nbytes: int = REPROBE_BYTES,
                 streams: int = REPROBE_STREAMS) -> None:
        self.profile, self.group, self.nbytes, self.streams = profile, group, nbytes, streams
        self.lanes: list[Any] | None = None

    def __call__(self) -> ClusterProfile:
        import torch.distributed as dist

        group = self.group()
        if self.lanes is None:
            self.lanes = [group] + [dist.new_group(backend="gloo") for _ in range(self.streams - 1)]
        declared = from_profile(self.profile)
        bw, lat = measure_pairs(self.profile.world_size, declared.hosts, self.nbytes, group, declared.racks)
        np.fill_diagonal(bw, np.inf)
        topo = Topology(racks=declared.racks, hosts=declared.hosts, bandwidth=bw, latency=lat, source="re-probe")
        if self.streams > 1:
            topo.host_caps, topo.rack_caps = measure_flow_caps(topo, self.nbytes, self.streams, group, self.lanes)
        return keep_speeds(topo.to_profile(name=f"{self.profile.name} re-probed"), self.profile)


def keep_speeds(probed: ClusterProfile, declared: ClusterProfile) -> ClusterProfile:
    """``probed`` with ``declared``'s compute speeds (same racks and hosts)."""
    data = probed.to_dict()
    for rack, rack_was in zip(data["racks"], declared.to_dict()["racks"]):
        for host, host_was in zip(rack["hosts"], rack_was["hosts"]):
            host["compute_speed"] = host_was.get("compute_speed", 1.0)
    return parse_profile(data)


def apply_switch(running: str, strategy: Any, name: str, kwargs: Mapping[str, Any]) -> None:
    """Collective: the trainer's ``strategy``, running ``running``, runs ``name`` with ``kwargs``
    from the next step on: ``SwitchableDDP`` swaps its hook (a hook's own groups are made the
    first time); a family's own switch (``AlgorithmSpec.switch``) rebuilds what its keys change."""
    if running in HOOKED:
        strategy.switch_to(name, kwargs)
    else:
        switches()[running].apply(strategy, kwargs)


class Replanner(Callback):
    """Re-plans ``strategy=auto``'s choice every ``every_s`` seconds, at round boundaries
    (module doc). ``auto``: ``strategy_details.auto`` (its choice and the agreed inputs; the
    record of each switch is appended to its ``replans``); ``probe``: the network now, a
    collective (``Reprobe``); ``broadcast``: rank 0's object to every rank; ``clock``: rank 0's
    seconds."""

    def __init__(self, auto: dict[str, Any], every_s: float, probe: Probe, broadcast: Callable[[Any], Any],
                 rank: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.auto, self.every_s, self.probe, self.broadcast = auto, every_s, probe, broadcast
        self.rank, self.clock = rank, clock
        self.strategy: str = auto["choice"]["strategy"]
        self.kwargs: dict[str, Any] = dict(auto["choice"]["kwargs"])
        self.refused = not_switchable(self.strategy, self.kwargs)
        auto["replan"] = {"every_s": every_s, "faster": FASTER, "refused": self.refused, "checks": 0,
                          "strategies": list(self._offered()) if self.refused is None else [],
                          "switchable": list(switchable(self.strategy) or ()) if self.refused is None else []}
        auto["replans"] = []
        if self.refused is not None:
            log.warning("strategy=auto: replan_every_s=%s: no re-planning: %s", every_s, self.refused)
        self._last = clock()
        self._seen = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer_strategy = trainer.strategy     # what a resume switches (``load_state_dict``)

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the running strategy and settings, the record of checks and
        switches, and the seconds since the last plan (the clock itself does not survive a restart)."""
        return {"strategy": self.strategy, "kwargs": dict(self.kwargs), "checks": self.auto["replan"]["checks"],
                # plain JSON types, so that the checkpoint loads with weights_only=True
                "replans": json.loads(json.dumps(self.auto["replans"], default=float)),
                "since_s": self.clock() - self._last, "seen": self._seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume where the checkpoint left off. Lightning restores callbacks after the strategy
        built its exchange from the start-up choice and before the strategy's own state (outer
        optimizer, residuals) is loaded: a checkpoint written after a switch therefore rebuilds
        the exchange with the switched settings here (a collective: every rank restores), so
        that state lands in the exchange it was written by, instead of silently going back."""
        strategy, kwargs = str(state_dict.get("strategy", self.strategy)), dict(state_dict["kwargs"])
        if (strategy, kwargs) != (self.strategy, self.kwargs):
            if self.refused is not None or strategy not in reachable(self.strategy) or \
                    fixed_part(strategy, kwargs) != fixed_part(self.strategy, self.kwargs):
                raise ValueError(f"strategy=auto: the checkpoint ran {strategy} {kwargs}, this job chose "
                                 f"{self.strategy} {self.kwargs}: a resume may differ only in what a re-plan "
                                 f"switches ({self.refused or self._switches()}); resume with "
                                 f"strategy={strategy} and those settings, or start anew")
            apply_switch(self.strategy, self._trainer_strategy, strategy, kwargs)
            log.info("strategy=auto: resumed with the choice of the last re-plan: %s %s", strategy, kwargs)
            self.strategy, self.kwargs = strategy, kwargs
        self.auto["replan"]["checks"] = int(state_dict["checks"])
        self.auto["replans"][:] = list(state_dict["replans"])
        self._last = self.clock() - float(state_dict["since_s"])
        self._seen = int(state_dict["seen"])

    def build(self, cluster_environment: Any, job: Any, **kwargs: Any) -> Any:
        """The Lightning strategy to run the choice with, when a re-plan may switch it to
        another strategy (``SwitchableDDP``, starting with the choice; ``kwargs``: Lightning's
        ``DDPStrategy``'s); None: build the choice as named (``syncplane.strategies.registry.build``)."""
        if self.refused is not None or self.strategy not in HOOKED:
            return None
        return SwitchableDDP(self.strategy, self.kwargs, job=job, cluster_environment=cluster_environment, **kwargs)

    def _offered(self) -> tuple[str, ...]:
        """The strategies a re-plan prices: those the running one can reach, of the job's own
        list if it named one, and of its accuracy class (``exact``: DDP's result only)."""
        from syncplane.algorithms import is_exact

        allowed = self.auto.get("inputs", {}).get("strategies")
        accept = self.auto.get("accept", "approximate")
        return tuple(s for s in reachable(self.strategy) if (not allowed or s in allowed)
                     and accepts(accept, is_exact(s)))

    def _switches(self) -> str:
        return (f"strategies {', '.join(reachable(self.strategy))}, settings "
                f"{', '.join(switchable(self.strategy) or ()) or 'none'}")

    @property
    def period(self) -> int:
        """Steps per round of the running choice (a switch happens only at their end)."""
        key = spec_for(self.strategy).period_key
        return int(self.kwargs.get(key, 1)) if key is not None else 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.refused is not None or step == self._seen or step % self.period:
            return          # not a round boundary (or a micro-batch of an accumulated step)
        self._seen = step
        if not self.broadcast(self.clock() - self._last >= self.every_s):
            return
        self.replan(trainer.strategy, step)
        self._last = self.clock()

    def replan(self, strategy: Any, step: int) -> dict[str, Any]:
        """Collective: re-probe, rank 0 decides, every rank applies its decision; returns it."""
        start = time.perf_counter()
        profile = self.probe()
        decision = self.broadcast(self.decide(profile, step) if self.rank == 0 else None)
        self.auto["replan"]["checks"] += 1
        if decision["switch"]:
            best = decision["best"]
            apply_switch(self.strategy, strategy, best["strategy"], best["kwargs"])
            self.strategy, self.kwargs = best["strategy"], dict(best["kwargs"])
            decision["seconds"] = time.perf_counter() - start
            self.auto["replans"].append(decision)
            log.info("strategy=auto: re-planned at step %d on %s: %s (predicted %.3f s/step) -> %s (%.3f s/step)",
                     step, decision["cluster"], decision["current"]["label"], decision["current"]["step_s"],
                     decision["best"]["label"], decision["best"]["step_s"])
        return decision

    def decide(self, profile: ClusterProfile, step: int) -> dict[str, Any]:
        """Rank 0's decision on ``profile``: the agreed start-up inputs, the candidates the
        running strategy can reach only, priced by the plan."""
        inputs = {**self.auto["inputs"], "strategies": self._offered()}
        inputs.pop("cluster"), inputs.pop("world_size")
        plan = make_plan(profile, PlanInputs(**inputs))
        return {"step": step, "cluster": profile.name,
                **choose_switch(plan.candidates, self.strategy, self.kwargs, self.auto.get("accept", "approximate"))}
