"""DDP whose gradient all-reduce can change while it trains: what ``strategy=auto`` runs when
it chose ``ddp``, ``flexreduce`` or ``torch_fp16`` and re-plans (``replan_every_s``).

The three are one torch ``DistributedDataParallel`` with a different communication hook (DDP's
own all-reduce, FlexReduce's tree all-reduce, torch's fp16 all-reduce); none keeps state from
one step to the next, and each leaves the same gradient on every rank. So a switch between them
at a step boundary, on every rank at the same step, keeps the replicas one model and the
optimizer state as it is: only the data path (and for fp16 the rounding) changes. DDP takes one
comm hook and keeps it, so the hook registered is a dispatcher to the running member's hook.
FlexReduce's engine (its process groups: a collective) is built when it is first switched to,
on every rank at once, and kept for a switch back. ``torch_powersgd`` is not a member: its error
feedback and warm start are state that a switch would drop.

Overridden hook, and why: ``configure_ddp`` (Lightning registers comm hooks on CUDA only)
registers the dispatcher once the model is wrapped, on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from syncplane.algorithms.ddp import BASELINE
from syncplane.algorithms.ddp.hook import metered_allreduce
from syncplane.algorithms.flexreduce.hook import DEFAULT_CHUNK_BYTES, FlexReduceHook
from syncplane.algorithms.replicas import CommMeter
from syncplane.algorithms.torch_hooks import HookConfig
from syncplane.algorithms.torch_hooks.hooks import metered
from syncplane.config import ConfigError
from syncplane.job import JobContext
from syncplane.strategies.base import JobAware, Watched

#: member -> the ``strategy.kwargs`` it may run with here (the DDP wrapper's own are fixed)
MEMBERS: dict[str, tuple[str, ...]] = {BASELINE: (), "flexreduce": ("topology", "chunk_mb"), "torch_fp16": ()}


def check_member(name: str, settings: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` unless ``name`` with ``settings`` can run as a member."""
    if name not in MEMBERS:
        raise ConfigError(f"{name} cannot run as a switchable DDP hook (only {', '.join(MEMBERS)})")
    extra = sorted(set(settings) - set(MEMBERS[name]))
    if extra:
        raise ConfigError(f"{name}: {', '.join(extra)} cannot be set on a switchable DDP hook "
                          f"(only {', '.join(MEMBERS[name]) or 'nothing'})")


class SwitchableDDP(JobAware, Watched, DDPStrategy):
    """Args:
        choice: the member to start with (``MEMBERS``), and ``settings`` its ``strategy.kwargs``.
        other keywords: Lightning's ``DDPStrategy`` (fixed for the whole run).
    """

    def __init__(self, choice: str, settings: Mapping[str, Any] | None = None, job: JobContext | None = None,
                 **kwargs: Any) -> None:
        check_member(choice, settings or {})
        super().__init__(**kwargs)
        self._job = job
        self.current, self.settings = choice, dict(settings or {})
        self.comm_meter = CommMeter()
        self.details: dict[str, Any] = {}
        self._hook: Callable[..., Any] | None = None
        self._flexreduce: dict[tuple[str | tuple[int, ...], float], FlexReduceHook] = {}

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()   # the DDP wrapper; Lightning registers no hook (none was given)
        assert self.model is not None
        self.switch_to(self.current, self.settings)
        self.model.register_comm_hook(None, self._dispatch)   # type: ignore[operator]

    def _dispatch(self, state, bucket):  # type: ignore[no-untyped-def]
        # Unannotated on purpose: DDP compares a hook's annotations with the real classes.
        assert self._hook is not None
        return self._hook(state, bucket)

    def switch_to(self, name: str, settings: Mapping[str, Any]) -> None:
        """Collective when FlexReduce's engine is first built: every rank, at the same step
        boundary (no bucket in flight). From the next backward on, buckets run ``name``'s hook."""
        check_member(name, settings)
        if name == "flexreduce":
            topology = settings.get("topology", "auto")
            chunk_mb = float(settings.get("chunk_mb", DEFAULT_CHUNK_BYTES / 2**20))
            key = (topology if isinstance(topology, str) else tuple(topology), chunk_mb)
            if key not in self._flexreduce:
                self._flexreduce[key] = FlexReduceHook(self.job, topology, int(chunk_mb * 2**20), self.comm_meter)
                assert self.model is not None
                rank_zero_info(self._flexreduce[key].describe(sum(p.numel() for p in self.model.parameters())))
            self._hook = self._flexreduce[key].hook
        elif name == "torch_fp16":
            config = HookConfig(name="torch_fp16")
            self._hook = metered(config.hook()[1], config, self.comm_meter, self.world_size)
        else:
            self._hook = metered_allreduce(self.comm_meter)
        self.current, self.settings = name, dict(settings)

    @override
    def teardown(self) -> None:
        for engine in self._flexreduce.values():
            engine.close()
        super().teardown()
