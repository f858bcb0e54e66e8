"""Strategy names (``docs/architecture.md``) in Lightning's ``StrategyRegistry``.

Registration happens when ``syncplane.strategies`` is imported, before any
``Trainer(...)`` snapshots the registry. ``ddp`` is Lightning's own ``DDPStrategy``,
the baseline; every other name maps to one of our classes. The constructor signature
of each class is its config schema (``strategy.kwargs`` in YAML).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from lightning.fabric.plugins.environments import ClusterEnvironment
from torch.nn.parallel import DistributedDataParallel

from syncplane import algorithms
from syncplane.algorithms.ddp import BASELINE
from syncplane.config import ConfigError, signature_params
from syncplane.job import JobContext
from lightning.pytorch.strategies import DDPStrategy, Strategy, StrategyRegistry

S = TypeVar("S", bound=type[Strategy])

#: Arguments the launcher supplies; a config may not set them.
RESERVED_KWARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                   "precision_plugin", "process_group_backend", "job",
                   "cluster")   # a plain script's argument; a job's cluster is train.py's cluster=

_ours: dict[str, type[Strategy]] = {}


def register(name: str) -> Callable[[S], S]:
    """Class decorator: register ``cls`` under ``name`` here and in Lightning's registry,
    with the description its algorithm package declares (``syncplane.algorithms``)."""

    def decorate(cls: S) -> S:
        if name == BASELINE:
            raise ValueError(f"{name!r} is reserved for Lightning's own DDPStrategy")
        existing = _ours.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"strategy name {name!r} is already taken by {existing.__qualname__}")
        _ours[name] = cls
        StrategyRegistry.register(name, cls, description=algorithms.description(name), override=True)
        return cls

    return decorate


def names() -> list[str]:
    """Every strategy a job can name: the baseline first, then ours in registration order."""
    return [BASELINE, *_ours]


def strategy_class(name: str) -> type[Strategy]:
    if name == BASELINE:
        return DDPStrategy
    try:
        return _ours[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; allowed values: {', '.join(names())}") from None


def accepted_params(name: str) -> dict[str, Any]:
    """Constructor keywords a config may set for ``name`` (the whole class chain).

    Our classes pass ``**kwargs`` up to ``DDPStrategy``; the baseline passes its extra
    keywords on to torch's ``DistributedDataParallel``, so those are accepted for it.
    """
    cls = strategy_class(name)
    params: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if issubclass(klass, DDPStrategy) and "__init__" in vars(klass):
            params.update(signature_params(klass.__init__, skip=RESERVED_KWARGS))
    if cls is DDPStrategy:
        params.update(signature_params(DistributedDataParallel.__init__, skip=("module", "device_ids",
                                                                              "output_device", "process_group")))
    return params


def describe() -> dict[str, str]:
    """Name -> one-line description, for ``syncplane info``."""
    return {name: algorithms.description(name) for name in names()}


def validate(name: str, kwargs: Mapping[str, Any], job: JobContext | None = None) -> None:
    """Construct strategy ``name`` once in the launching process: its config dataclass checks
    every setting there, so a bad value fails before any worker starts (not in every worker
    after the process group is up), with the message naming the key. With the job's context
    as planned (``job``), its family's ``check_job`` also checks what depends on the ranks."""
    try:
        strategy_class(name)(**dict(kwargs))
        if job is not None:
            algorithms.spec_for(name).check_job(name, kwargs, job)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"strategy.kwargs: {exc}") from None


def build(name: str, kwargs: Mapping[str, Any], cluster_environment: ClusterEnvironment,
          process_group_backend: str | None = None, job: JobContext | None = None) -> Strategy:
    """Instantiate strategy ``name`` for a worker (kwargs already validated); ours get the
    job's context (``job``), Lightning's DDP does not take one."""
    cls = strategy_class(name)
    extra = {"job": job} if job is not None and cls is not DDPStrategy and "job" in _init_params(cls) else {}
    return cls(cluster_environment=cluster_environment, process_group_backend=process_group_backend,
               **dict(kwargs), **extra)


def _init_params(cls: type[Strategy]) -> set[str]:
    return {name for klass in cls.__mro__ if issubclass(klass, DDPStrategy) and "__init__" in vars(klass)
            for name in signature_params(klass.__init__)}
