"""``strategy=auto``: the job picks its strategy at start-up by the plan ``syncplane plan`` shows.

On every rank, after the rendezvous and before the strategy is built: the payload is the
model's parameter bytes, the compute per step is ``strategy.kwargs.compute_ms`` or a few
timed steps of a copy of the real model on one real batch (RNG state restored: the run
then trains as if the winner had been named), the network is the emulated cluster the
launcher ran us on, or ``strategy.kwargs.cluster`` (a profile name or path). Measurements
differ from rank to rank, so rank 0's inputs are broadcast and every rank computes the
plan from those (``syncplane.algorithms.plan`` is a pure function of its inputs): one
decision, whatever the noise. The choice and the runner-up are logged with their
predictions and written to ``summary.json`` as ``strategy_details.auto``; then the
chosen strategy runs as if it had been named, with the settings the plan priced.
With ``replan_every_s`` the choice is re-planned while training, on a re-probe of the
network, and switched where that is safe (``syncplane.runtime.replan``).
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from syncplane.algorithms.plan import ACCEPT, PlanInputs, check_accept, make_plan, offered, plan_cpu
from syncplane.cluster.profile import ClusterProfile, load_profile, parse_profile
from syncplane.config import ConfigError, parse_dataclass

log = logging.getLogger(__name__)

#: The strategy name that asks for a plan.
AUTO = "auto"


@dataclass
class AutoSettings:
    """``strategy.kwargs`` of ``strategy=auto``."""

    accept: str = "exact"            # exact (DDP's result only) | approximate (gossip, local SGD, compression too)
    compute_ms: float | None = None  # compute per step; None: a few timed steps of the real model
    time_steps: int = 3              # steps timed when compute_ms is None
    cluster: str | None = None       # the network's profile (name or path) when the job runs on no emulated cluster
    strategies: list[str] | str | None = None   # strategies to choose among, [a,b] or "a,b" (None: every one)
    period: int | None = None        # H of the periodic strategies (None: each one's default)
    replan_every_s: float | None = None   # re-probe and re-price this often while training (None: never)

    def validate(self) -> None:
        check_accept(self.accept, "accept")
        if self.compute_ms is not None and self.compute_ms < 0:
            raise ConfigError(f"compute_ms: must be at least 0, got {self.compute_ms}")
        if self.time_steps < 1:
            raise ConfigError(f"time_steps: must be at least 1, got {self.time_steps}")
        if self.period is not None and self.period < 1:
            raise ConfigError(f"period: must be at least 1, got {self.period}")
        if self.replan_every_s is not None and not self.replan_every_s > 0:
            raise ConfigError(f"replan_every_s: must be a positive number of seconds (leave it unset for no "
                              f"re-planning), got {self.replan_every_s}")

    @property
    def strategy_list(self) -> tuple[str, ...] | None:
        if not self.strategies:
            return None
        names = self.strategies.split(",") if isinstance(self.strategies, str) else self.strategies
        return tuple(s for s in names if s)


def parse_settings(kwargs: Mapping[str, Any], cluster: ClusterProfile | None, world_size: int) -> AutoSettings:
    """Check ``strategy.kwargs`` of ``strategy=auto`` in the launching process: every key by
    name (``accept`` among ``ACCEPT``), and that the job has a network of its size to plan for."""
    settings = parse_dataclass(AutoSettings, kwargs, "strategy.kwargs")
    try:
        offered(PlanInputs(1, strategies=settings.strategy_list))   # unknown names fail here
    except ConfigError as exc:
        raise ConfigError(f"strategy.kwargs.{exc}") from None
    network_of(settings, cluster).check_world_size(world_size, "the job's ranks (strategy.kwargs.cluster)")
    return settings


def network_of(settings: AutoSettings, cluster: ClusterProfile | None) -> ClusterProfile:
    """The network the plan is for: ``strategy.kwargs.cluster``, else the emulated cluster."""
    if settings.cluster is not None:
        return load_profile(settings.cluster)
    if cluster is None:
        raise ConfigError("strategy.kwargs.cluster: strategy=auto plans for a network; run it on an emulated cluster "
                          "(cluster=NAME|PATH) or describe yours (strategy.kwargs.cluster=NAME|PATH)")
    return cluster


def time_steps(module: Any, data: Any, steps: int) -> float:
    """Median seconds of one training step (forward, backward, SGD step) of a copy of
    ``module`` on one batch of ``data``, after one untimed step. Torch's RNG is restored, and
    the module itself is untouched: the run trains as if this had not happened."""
    import torch

    # no Trainer holds the copy: Lightning warns at each self.log in its training_step
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        model = copy.deepcopy(module)
        data.prepare_data()
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        times = []
        for i in range(steps + 1):
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = model.training_step(batch, i)
            (loss["loss"] if isinstance(loss, dict) else loss).backward()
            optimizer.step()
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


#: rank 0's object -> the same object on every rank (``torch.distributed.broadcast_object_list``
#: on a gloo group in a job; the identity in a job of one).
Broadcast = Callable[[Any], Any]


def decide(settings: AutoSettings, profile: ClusterProfile, payload_bytes: int, compute_s: float,
           broadcast: Broadcast, cpu_sharing: float | None = None, rank: int = 0) -> dict[str, Any]:
    """The decision, identical on every rank: rank 0's inputs (its profile, payload, measured
    compute and, with ``cpu_sharing`` ranks per core, this machine's CPU rates for the
    candidates' work: ``plan.plan_cpu``) agreed through ``broadcast``, then the plan from those. Returns
    ``strategy_details.auto``: ``choice`` (strategy and kwargs), ``runner_up``, the
    predictions of every candidate, what was excluded and why, and the inputs."""
    mine = PlanInputs(payload_bytes, compute_s, settings.period, strategies=settings.strategy_list)
    if rank == 0:            # the others' measurements would be discarded: rank 0's are agreed
        mine = plan_cpu(profile, mine, cpu_sharing)
    agreed = broadcast({"profile": profile.to_dict(), "inputs": asdict(mine)})
    inputs = agreed["inputs"]
    plan = make_plan(parse_profile(agreed["profile"]),
                     PlanInputs(**{**inputs, "strategies": tuple(inputs["strategies"]) if inputs["strategies"] else None}))
    choice = plan.best(settings.accept)     # the fastest, or DDP within the plan's margin of it
    runner_up = next((c for c in plan.ranked(settings.accept) if c is not choice), None)
    log.info("strategy=auto (accept=%s): %s, predicted %.3f s/step; runner-up %s", settings.accept, choice.label,
             choice.step_s, f"{runner_up.label}, {runner_up.step_s:.3f} s/step" if runner_up else "none")
    return {"accept": settings.accept, "classes": list(ACCEPT),
            "choice": {"strategy": choice.strategy, "kwargs": choice.kwargs, "step_s": choice.step_s,
                       "sync_s": choice.sync_s, "label": choice.label},
            "runner_up": runner_up.to_dict() if runner_up else None,
            "candidates": [{"label": c.label, "strategy": c.strategy, "kwargs": c.kwargs, "exact": c.exact,
                            "step_s": c.step_s, "sync_s": c.sync_s, "overlap": c.overlap} for c in plan.candidates],
            "excluded": [asdict(e) for e in plan.excluded],
            "inputs": {"cluster": plan.cluster, "world_size": plan.world_size, **inputs}}


def torch_broadcast() -> Broadcast:
    """Rank 0's object to every rank over a gloo group made for it (the default group may be
    NCCL); a job of one keeps its own."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda obj: obj
    group = dist.new_group(backend="gloo")

    def broadcast(obj: Any) -> Any:
        box = [obj if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    return broadcast


def choose_strategy(kwargs: Mapping[str, Any], profile: ClusterProfile | None, module: Any, data: Any,
                    broadcast: Broadcast, cpu_sharing: float | None = None, rank: int = 0) -> dict[str, Any]:
    """What a worker calls for ``strategy=auto``: the inputs measured here, the decision agreed
    (``cpu_sharing``: ranks per core of the CPU work, None on GPUs; see ``decide``)."""
    settings = parse_dataclass(AutoSettings, kwargs, "strategy.kwargs")
    network = network_of(settings, profile)
    payload = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    compute_s = settings.compute_ms / 1000 if settings.compute_ms is not None else \
        time_steps(module, data, settings.time_steps)
    return decide(settings, network, payload, compute_s, broadcast, cpu_sharing, rank)


def replanner(kwargs: Mapping[str, Any], profile: ClusterProfile | None, auto: dict[str, Any],
              broadcast: Broadcast, rank: int) -> Any:
    """The ``syncplane.runtime.replan.Replanner`` callback for ``strategy.kwargs.replan_every_s``
    (None when unset): it re-probes the network the plan was made for over the control group."""
    settings = parse_dataclass(AutoSettings, kwargs, "strategy.kwargs")
    if settings.replan_every_s is None:
        return None
    from syncplane.comm.process_groups import control_group
    from syncplane.runtime.replan import Replanner, Reprobe

    return Replanner(auto, settings.replan_every_s, Reprobe(network_of(settings, profile), control_group), broadcast,
                     rank)
