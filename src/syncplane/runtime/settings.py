"""The validated description of one training job (what ``train.py`` composed).

``parse_job`` turns the composed Hydra config into typed settings and fails with a
``ConfigError`` naming the key; the launcher calls it before starting any worker and
every worker calls it again on the resolved YAML it was handed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from syncplane.job import JobContext
from syncplane.runtime.heartbeat import DEFAULT_TIMEOUT_S
from syncplane.config import ConfigError, check_kwargs, parse_dataclass

if TYPE_CHECKING:
    from syncplane.algorithms.spec import ElasticLaunch, LaunchSettings   # at run time: in parse_job, lazily


@dataclass
class TrainerSettings:
    """The subset of ``lightning.Trainer`` arguments a job may set (``trainer.*``)."""

    accelerator: Literal["cpu", "gpu", "cuda", "auto"] = "cpu"
    devices: int = 2
    max_epochs: int = 20
    max_steps: int = -1
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 10
    check_val_every_n_epoch: int = 1
    gradient_clip_val: float | None = None
    deterministic: bool = False
    threads_per_rank: int = 0  # 0: split this machine's cores evenly between local ranks
    rendezvous_timeout_s: float = 300.0  # how long ranks wait for each other at start before naming the missing
    heartbeat_timeout_s: float = DEFAULT_TIMEOUT_S   # (15 s) a rank silent this long counts as lost and stops the job; 0: no heartbeat
    max_restarts: int = 0   # elastic jobs: times the launcher restarts a failed replica (torchrun's flag, per replica)
    restart_delay_s: float = 0.0   # elastic jobs: wait before a restart (the others go on without it first)
    # an emulated accelerator: every computed batch takes this long at nominal speed, its CPU work
    # included, a timed wait filling the rest (syncplane.runtime.slowdown); 0: off, batches take what the CPU takes
    emulated_step_s: float = 0.0
    # summary.json's time_to_target_s: training seconds until the first validation loss at or below it; null: none
    target_val_loss: float | None = None

    def validate(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"devices: must be at least 1, got {self.devices}")
        if self.max_epochs < 1 and self.max_steps < 1:
            raise ConfigError(f"max_epochs: must be at least 1 (or set max_steps), got {self.max_epochs}")
        if self.max_steps < -1:
            raise ConfigError(f"max_steps: must be -1 (no limit) or >= 0, got {self.max_steps}")
        precisions = lightning_precisions()
        if self.precision not in precisions:
            raise ConfigError(f"precision: got {self.precision!r}, allowed values: {', '.join(precisions)}")
        if self.log_every_n_steps < 1:
            raise ConfigError(f"log_every_n_steps: must be at least 1, got {self.log_every_n_steps}")
        if self.check_val_every_n_epoch < 1:
            raise ConfigError(f"check_val_every_n_epoch: must be at least 1, got {self.check_val_every_n_epoch}")
        if self.gradient_clip_val is not None and self.gradient_clip_val < 0:
            raise ConfigError(f"gradient_clip_val: must be >= 0 (or null), got {self.gradient_clip_val}")
        if self.accumulate_grad_batches < 1:
            raise ConfigError(f"accumulate_grad_batches: must be at least 1, got {self.accumulate_grad_batches}")
        if self.threads_per_rank < 0:
            raise ConfigError(f"threads_per_rank: must be >= 0, got {self.threads_per_rank}")
        if self.rendezvous_timeout_s <= 0:
            raise ConfigError(f"rendezvous_timeout_s: must be positive, got {self.rendezvous_timeout_s}")
        if self.heartbeat_timeout_s < 0:
            raise ConfigError(f"heartbeat_timeout_s: must be >= 0 (0 = no heartbeat), got {self.heartbeat_timeout_s}")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if self.restart_delay_s < 0:
            raise ConfigError(f"restart_delay_s: must be >= 0, got {self.restart_delay_s}")
        if not 0 <= self.emulated_step_s <= 60:
            raise ConfigError(f"emulated_step_s: must be between 0 (off) and 60 seconds, got {self.emulated_step_s}")
        if self.target_val_loss is not None and not self.target_val_loss > 0:
            raise ConfigError(f"target_val_loss: must be positive (or null), got {self.target_val_loss}")


def lightning_precisions() -> tuple[str, ...]:
    """The ``precision`` strings Lightning's Trainer accepts (its own list, aliases included)."""
    from syncplane.lightning_adapter import lightning_precisions as accepted   # imports Lightning: only when asked

    return accepted()


#: fault kinds that take a rank out of the job; ``slow`` only slows one down
FAILING_KINDS = ("kill", "stop", "raise", "netdown")


@dataclass
class FaultSettings:
    """A failure to inject (``fault.*``), to see what a job does when a rank is lost: rank
    ``rank`` kills itself (``kill``, SIGKILL), stops (``stop``, SIGSTOP: what a hung GPU or a
    swapping host looks like), raises (``raise``), or takes its host's NICs down (``netdown``,
    emulated clusters only: the host and every rank on it drop off the network) after
    training step ``step``. ``slow`` loses nothing: from step ``step`` (0: the first) the
    rank's steps take ``factor`` times as long, a straggler such as an older or throttled GPU
    (``syncplane.runtime.slowdown``). A job takes a list of them (``parse_faults``):
    ``syncplane chaos`` fails a whole emulated host as one fault per rank of it."""

    kind: Literal["kill", "stop", "raise", "netdown", "slow"] = "stop"
    rank: int = 1
    step: int = 10
    factor: float | None = None   # kind=slow only: how many times as long each step takes (>= 1)

    def validate(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"rank: must be >= 0, got {self.rank}")
        if self.kind == "slow":
            if self.step < 0:
                raise ConfigError(f"step: must be >= 0 (the first slowed step; 0 = from the start), got {self.step}")
            if self.factor is None or self.factor <= 0:
                raise ConfigError(f"factor: kind=slow needs a factor > 0 (2.0: each step takes twice as long), "
                                  f"got {self.factor}")
            if self.factor < 1:
                raise ConfigError(f"factor: must be >= 1 (a rank can be slowed down, not sped up), got {self.factor}")
            return
        if self.step < 1:
            raise ConfigError(f"step: must be >= 1, got {self.step}")
        if self.factor is not None:
            raise ConfigError(f"factor: only kind=slow takes a factor; kind={self.kind} fails the rank")


@dataclass
class LoggerSettings:
    """Where metrics go: a CSV record always, W&B (offline by default) on request."""

    csv: bool = True
    wandb: bool = False
    project: str = "syncplane"
    group: str | None = None
    mode: Literal["offline", "online", "disabled"] = "offline"


@dataclass
class StrategySpec:
    """A registered strategy name and the keyword arguments for its constructor."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobSpec:
    strategy: StrategySpec
    recipe_name: str
    recipe: Any  # the recipe's own settings dataclass
    trainer: TrainerSettings
    logger: LoggerSettings
    seed: int
    run_dir: str
    job_name: str = "train"
    resume: str | None = None  # a checkpoint to continue from
    cluster: Any = None        # a ClusterProfile: run every rank inside its emulated host
    # failures to inject (testing what the job does): ``fault`` is one mapping or a list of them
    faults: list[FaultSettings] = field(default_factory=list)
    label: str | None = None   # the run's name in comparisons (a variant: ``NAME[key=value,...]``)

    @property
    def elastic(self) -> bool:
        """Independent replicas around a quorum service, not one process group (the strategy's
        ``AlgorithmSpec.elastic`` asks for it: ``elastic_launch``)."""
        return self.elastic_launch is not None

    @property
    def elastic_launch(self) -> ElasticLaunch | None:
        """How the launcher starts this job's replicas when it is elastic (None: one process group)."""
        from syncplane.algorithms import elastic_launch

        return elastic_launch(self.strategy.name, self.strategy.kwargs)


#: what ``seed_everything`` (numpy's generator) accepts
SEED_RANGE = (0, 2**32 - 1)


def parse_job(cfg: Mapping[str, Any], run_dir: str, job_name: str = "train", world: JobContext | None = None) -> JobSpec:
    """Validate a composed config (plain containers, interpolations resolved), including
    what depends on the job's ranks: ``world`` as another launcher started them, by default
    ``trainer.devices`` ranks on this machine or on the emulated ``cluster``."""
    from syncplane import recipes as recipes_registry
    from syncplane.algorithms.spec import LaunchSettings
    from syncplane.strategies import registry as strategy_registry

    allowed_top = {"strategy", "recipe", "trainer", "logger", "seed", "resume", "cluster", "fault", "label"}
    unknown = sorted(set(cfg) - allowed_top)
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed_top))}")

    strategy_cfg = dict(cfg.get("strategy") or {})
    name = strategy_cfg.pop("name", None)
    from syncplane.runtime import autopilot

    registered = [*strategy_registry.names(), autopilot.AUTO]
    if name not in registered:
        raise ConfigError(f"strategy.name: unknown strategy {name!r}; allowed values: {', '.join(registered)}")
    kwargs = strategy_cfg.pop("kwargs", None) or {}
    if strategy_cfg:
        raise ConfigError(f"strategy: unknown key(s) {', '.join(sorted(strategy_cfg))}; allowed keys: kwargs, name")
    if name != autopilot.AUTO:
        if "replan_every_s" in kwargs:
            raise ConfigError(f"strategy.kwargs.replan_every_s: only strategy=auto re-plans while training; "
                              f"strategy={name} runs as named (set strategy=auto, or drop replan_every_s)")
        kwargs = check_kwargs(strategy_registry.accepted_params(name), kwargs, "strategy.kwargs")

    recipe_cfg = dict(cfg.get("recipe") or {})
    recipe_name = recipe_cfg.pop("name", None)
    if recipe_name not in recipes_registry.names():
        raise ConfigError(
            f"recipe.name: unknown recipe {recipe_name!r}; allowed values: {', '.join(recipes_registry.names())}"
        )
    recipe = parse_dataclass(recipes_registry.get(recipe_name).settings, recipe_cfg, "recipe")

    seed = cfg.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed: expected an integer, got {seed!r}")
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ConfigError(f"seed: must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {seed}")
    resume = cfg.get("resume")
    if resume is not None and not (isinstance(resume, str) and Path(resume).is_file()):
        raise ConfigError(f"resume: expected the path of an existing checkpoint file, got {resume!r}")
    trainer = parse_dataclass(TrainerSettings, cfg.get("trainer"), "trainer")
    faults = parse_faults(cfg.get("fault"))
    check_launch(name, kwargs, LaunchSettings(emulated=cfg.get("cluster") is not None, resume=resume,
                                              max_restarts=trainer.max_restarts))
    if any(f.kind == "netdown" for f in faults) and cfg.get("cluster") is None:
        raise ConfigError("fault.kind=netdown takes the rank's host NICs down: only on an emulated cluster "
                          "(cluster=...), never on this machine's own interfaces")
    cluster = None
    if cfg.get("cluster") is not None:
        from syncplane.cluster import parse_profile

        cluster = parse_profile(cfg["cluster"])
        cluster.check_world_size(trainer.devices)
        if trainer.accelerator != "cpu":
            raise ConfigError("cluster: emulated clusters run CPU processes; set trainer.accelerator=cpu")
    if world is None:
        world = JobContext.planned(trainer.devices, cluster)
    if name == autopilot.AUTO:   # the strategy is chosen on the ranks; its settings are checked here
        autopilot.parse_settings(kwargs, cluster, world.world_size)
    else:
        strategy_registry.validate(name, kwargs, world)
    check_fault_ranks(cfg.get("fault"), faults, world.world_size)
    if trainer.accelerator in ("gpu", "cuda") and name != strategy_registry.BASELINE:
        from syncplane import ext

        reason = ext.cuda_unavailable_reason()
        if reason is not None:
            raise ConfigError(f"trainer.accelerator={trainer.accelerator}: strategy {name!r} runs syncplane's CUDA "
                              f"kernels; {reason}")
    return JobSpec(
        strategy=StrategySpec(name=name, kwargs=kwargs),
        recipe_name=recipe_name,
        recipe=recipe,
        trainer=trainer,
        logger=parse_dataclass(LoggerSettings, cfg.get("logger"), "logger"),
        seed=seed,
        run_dir=run_dir,
        job_name=job_name,
        resume=resume,
        cluster=cluster,
        faults=faults,
        label=parse_label(cfg.get("label")),
    )


def check_launch(name: str, kwargs: Mapping[str, Any], launch: LaunchSettings) -> None:
    """The strategy's settings against the launch's, before any rank starts: restarts only for
    an elastic job (the others stop as a group), then the family's own ``check_launch``
    (``strategy=auto`` is checked on the settings it chooses from)."""
    from syncplane import algorithms
    from syncplane.runtime import autopilot

    if launch.max_restarts and algorithms.elastic_launch(name, kwargs) is None:
        raise ConfigError(f"trainer.max_restarts={launch.max_restarts}: only elastic jobs "
                          f"({', '.join(algorithms.elastic_settings())}) restart a failed rank; the others stop "
                          "as a group")
    if name != autopilot.AUTO:
        algorithms.spec_for(name).check_launch(name, kwargs, launch)


def parse_label(value: Any) -> str | None:
    """``label``: a short name for the run in comparisons and summaries (None: the strategy's)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise ConfigError(f"label: a one-line name for the run, got {value!r}")
    return value.strip()


def check_fault_ranks(value: Any, faults: list[FaultSettings], world_size: int) -> None:
    """Every fault names a rank of the job (``value``: the config's ``fault``, for the key)."""
    for i, fault in enumerate(faults):
        if fault.rank >= world_size:
            key = "fault.rank" if isinstance(value, Mapping) else f"fault[{i}].rank"
            raise ConfigError(f"{key}: {fault.rank} is not a rank of this job of {world_size} "
                              f"(ranks 0..{world_size - 1})")


def parse_faults(value: Any) -> list[FaultSettings]:
    """``fault``: null, one mapping (``fault={kind:stop,rank:2,step:15}``) or a list of them
    (``syncplane chaos`` fails a whole host: one entry per rank). A rank fails once: a second
    fault on it could never happen (a stopped or killed rank takes no more steps), so a list
    that names a rank twice is refused rather than silently half-run (a ``slow`` fault may join
    a failing one: a straggler can still crash)."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [parse_dataclass(FaultSettings, value, "fault")]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"fault: expected a mapping or a non-empty list of mappings, got {value!r}")
    faults = [parse_dataclass(FaultSettings, item, f"fault[{i}]") for i, item in enumerate(value)]
    for failing, what in ((True, "a rank fails once"), (False, "a rank is slowed by one factor")):
        ranks = [f.rank for f in faults if (f.kind in FAILING_KINDS) == failing]
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        if twice:
            raise ConfigError(f"fault: rank(s) {', '.join(map(str, twice))} given more than one "
                              f"{'' if failing else 'slow '}fault; {what}")
    return faults
