"""Decentralized strategies (BlueFog §V): ATC, AWC and their hierarchical forms.

Every replica trains on its own data and, once per step, replaces its parameters by a
weighted average of its neighbours' (``syncplane.algorithms.decentralized.engine.NeighborAverager``); no global
all-reduce except, optionally, every ``global_every`` steps.

- ``atc`` (adapt-then-combine): ``xᵢ ← Σⱼ wᵢⱼ (xⱼ − γ dᵢ)``. The local optimizer step
  runs first; then every bucket is launched at once and each one is waited for only
  when the next forward reaches the first layer that uses it (forward pre-hooks), so
  the exchange overlaps the data loading and the start of the next forward.
- ``awc`` (adapt-while-combine): ``xᵢ ← Σⱼ wᵢⱼ xⱼ − γ dᵢ`` with ``dᵢ`` the optimizer's
  update computed at ``xᵢ``. The exchange of ``xᵢ`` starts before the forward and is
  combined after the backward, just before the optimizer applies the update: fully
  overlapped with the forward and backward.
- ``h_atc`` / ``h_awc``: the same, mixing *machines* (``hierarchical_neighbor_allreduce``:
  average inside each machine, mix with the neighbouring machines, each process carrying
  1/L of its machine's exchange) -- one payload per machine crosses the slow links.
- ``atc``/``awc`` on a cluster profile with racks (``hierarchy: auto``, the default) mix racks
  the way ``h_atc``/``h_awc`` do: flat gossip piles flows of the whole payload onto the
  uplinks (``machines.mixes_racks``); ``hierarchy: none`` keeps the ranks.

Hooks used (see ``SyncplaneStrategy``): ``setup_sync`` (schedule, averager, checks),
``before_optimizer_step`` (AWC), ``before_parameter_update`` (AWC: combine; ATC: finish
buckets no forward read, before the optimizer reads them), ``after_optimizer_step``
(ATC, periodic global average), ``training_step`` (ATC: the first step finds reads
outside the owners' forwards, ``strategies/first_reads.py``; later steps wait for those
buckets first), ``finish_pending_sync`` (with ``max_staleness``: also every message still
in flight), ``setup`` (with ``max_staleness``: no per-step SIGTERM broadcast, so a late
neighbour does not hold every rank up through Lightning's own collective). The schedule position is
``trainer.global_step``, so a resumed run continues the dynamic schedule where it stopped.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from syncplane.algorithms.decentralized.config import DecentralizedConfig
from syncplane.algorithms.decentralized.machines import machines_for, mixes_racks
from syncplane.algorithms.decentralized.engine import NEIGHBOR_BUCKET_BYTES, NeighborAverager, release
from syncplane.algorithms.decentralized.schedule import build_graph, build_schedule
from syncplane.algorithms.late_peers import LatePeerMixer
from syncplane.job import JobContext
from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.first_reads import FirstReads
from syncplane.strategies.registry import register

log = logging.getLogger(__name__)

class NeighborAveragingStrategy(SyncplaneStrategy):
    """Shared glue of the four decentralized strategies; subclasses pick when to mix.

    Args: those of ``DecentralizedConfig`` (topology, topology_kwargs, schedule,
    global_every, hierarchy, machines, ranks_per_machine, check_schedule, timeout_s, max_staleness,
    late_after_s), then
    ``consensus_every`` and ``bucket_mb`` (neighbour-exchange buckets: small, so a bucket is
    combined while the next one is still on the wire) and ``SyncplaneStrategy``'s others.
    """

    hierarchical = False
    overlap_with_forward = True        # ATC: wait in forward pre-hooks; AWC: wait before the update
    combine_buffers_after_step = False  # AWC: buffers are mixed after the step (see setup_sync)

    def __init__(self, topology: str = "ExponentialTwoGraph", topology_kwargs: dict[str, Any] | None = None,
                 schedule: str = "one_peer", global_every: int = 0, hierarchy: str = "auto", machines: str = "auto",
                 ranks_per_machine: int | None = None,
                 check_schedule: bool = True, timeout_s: float = 300.0, max_staleness: int = 0,
                 late_after_s: float = 0.05, consensus_every: int = 10,
                 bucket_mb: float = NEIGHBOR_BUCKET_BYTES / 2**20, **kwargs: Any) -> None:
        super().__init__(consensus_every=consensus_every, bucket_mb=bucket_mb, **kwargs)
        self.config = DecentralizedConfig(topology=topology, topology_kwargs=dict(topology_kwargs or {}),
                                          schedule=schedule, global_every=global_every, hierarchy=hierarchy,
                                          machines=machines,
                                          ranks_per_machine=ranks_per_machine, check_schedule=check_schedule,
                                          timeout_s=timeout_s, max_staleness=max_staleness,
                                          late_after_s=late_after_s)
        if max_staleness and self.hierarchical:
            raise ValueError(f"max_staleness={max_staleness}: {type(self).__name__} cannot go on without a late "
                             "machine (its exchange reduces inside each machine with collectives); "
                             "use atc or awc, or max_staleness=0")
        self.averager: NeighborAverager | None = None
        self.buffer_averager: NeighborAverager | None = None
        self._hooks: list[RemovableHandle] = []
        self._covered: dict[torch.nn.Module, frozenset[int]] = {}   # module -> buckets its pre-hook waits for
        self._wait_before_step: frozenset[int] = frozenset()          # buckets read outside every forward
        self._probe_reads = False                                    # watch the next training_step's reads

    @override
    def setup_sync(self, job: JobContext) -> None:
        config = self.config
        machines: list[list[int]] | None = None
        # atc/awc on a profile with racks mix racks, as h_atc/h_awc do (``mixes_racks``)
        by_rack = not self.hierarchical and mixes_racks(config.hierarchy, job.profile, config.max_staleness)
        hierarchical = self.hierarchical or by_rack
        if hierarchical:   # collective on every rank: machines of any sizes (see machines_for)
            used, machines = (machines_for(job, "rack", None, self.world_size) if by_rack else
                              machines_for(job, config.machines, config.ranks_per_machine, self.world_size))
            sizes = [len(ranks) for ranks in machines]
            self.details = {"machines": used, "machine_sizes": sizes}
            if by_rack:
                self.details["hierarchy"] = "racks (hierarchy=auto on a profile with racks)"
            if self.is_global_zero:
                log.info("%s: machines = %s, %d machines of %s ranks%s", type(self).__name__, used, len(sizes), sizes,
                         " (hierarchy=auto: the profile has racks; hierarchy=none mixes ranks)" if by_rack else "")
        participants = len(machines) if machines is not None else self.world_size
        graph = build_graph(config.topology, participants, **config.topology_kwargs)
        schedule = build_schedule(config.schedule, graph)
        # AWC combines the parameters before the update, but the forward changes buffers
        # (BatchNorm running statistics) after its exchange started: those are mixed
        # after the step instead, as ATC does, so the forward's update is not lost.
        params, buffers = self.model_parameters(), self.model_buffers()
        mixed, after_step = (params, buffers) if self.combine_buffers_after_step else (params + buffers, [])

        def averager(part: list[torch.Tensor]) -> NeighborAverager:
            return NeighborAverager(part, schedule, hierarchical=hierarchical, machines=machines,
                                    bucket_bytes=self.bucket_bytes, meter=self.comm_meter, timeout_s=config.timeout_s,
                                    max_staleness=config.max_staleness, late_after_s=config.late_after_s)

        self.averager = averager(mixed)
        self.buffer_averager = averager(after_step) if after_step else None
        if config.check_schedule:
            self.averager.check_schedule()
        if self.overlap_with_forward:
            self._install_forward_waits()

    def _install_forward_waits(self) -> None:
        """Each module with parameters waits, before its forward, for the buckets holding them."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._covered, self._wait_before_step = [], {}, frozenset()
        assert self.averager is not None and self.lightning_module is not None
        for module in self.lightning_module.modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            self._wait_in_forward(module, self.averager.buckets_of(t.data for t in own))
        self._probe_reads = True   # reads outside the owners' forwards: found on the next step

    def _wait_in_forward(self, module: torch.nn.Module, buckets: set[int]) -> None:
        if not buckets:
            return
        assert self.averager is not None
        averager, wanted = self.averager, frozenset(buckets)
        self._covered[module] = self._covered.get(module, frozenset()) | wanted
        self._hooks.append(module.register_forward_pre_hook(lambda _module, _args: averager.wait(wanted)))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.averager is None or not self.overlap_with_forward:
            return super().training_step(*args, **kwargs)
        if not self._probe_reads:
            if self._wait_before_step:
                self.averager.wait(self._wait_before_step)
            return super().training_step(*args, **kwargs)
        # First step after setup: everything is waited for (no overlap this once) while
        # FirstReads finds each bucket read before its owner's pre-hook could wait for it.
        self._probe_reads = False
        self.averager.wait()
        index = {t.data_ptr(): bucket for t in self.model_tensors() for bucket in self.averager.buckets_of([t])}
        with FirstReads(index, self._covered) as reads:
            output = super().training_step(*args, **kwargs)
        for module, buckets in reads.by_module.items():
            self._wait_in_forward(module, buckets)
        self._wait_before_step = frozenset(reads.outside)
        return output

    def mixes_globally(self) -> bool:
        """Whether this step ends with an exact global average instead of neighbour mixing."""
        every = self.config.global_every
        return every > 0 and (self.step + 1) % every == 0

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.config.max_staleness:   # ranks may run up to max_staleness messages apart
            self.skip_per_step_sigterm_broadcast(trainer)

    @override
    def finish_pending_sync(self) -> None:
        for averager in (self.averager, self.buffer_averager):
            if averager is not None:
                averager.drain()   # late-peer mode: every message in flight too
        late = self.averager.late if self.averager is not None else None
        if late is not None:       # summary.json's strategy_details (rank 0's counts)
            self.details["late_peers"] = late.summary()

    def late_mixers(self) -> list[LatePeerMixer]:
        """The late-peer mixers (``max_staleness``): the parameters' and, for AWC, the buffers'."""
        return [a.late for a in (self.averager, self.buffer_averager) if a is not None and a.late is not None]

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        """With ``max_staleness``, this rank's late-peer mixers (drained at the checkpoint: message
        counters, each neighbour's newest message), so a resume makes the same choices."""
        mixers = self.late_mixers()
        return {"late_peers": [mixer.state_dict() for mixer in mixers]} if mixers else {}

    @override
    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        for mixer, saved in zip(self.late_mixers(), state.get("late_peers", [])):
            mixer.load_state_dict(saved)

    @override
    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for averager in (self.averager, self.buffer_averager):
            if averager is not None:
                averager.close()
        release()             # the machine groups and the background worker go with the process groups
        super().teardown()


class AdaptThenCombine(NeighborAveragingStrategy):
    @override
    def before_parameter_update(self, optimizer: Optimizer) -> None:
        assert self.averager is not None
        self.averager.wait()   # buckets no forward read (unused parameters): the update reads them

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        assert self.averager is not None
        if self.mixes_globally():
            self.averager.wait()
            self.average_replicas_()
        else:
            self.averager.launch(self.step)   # waited for by the next forward's pre-hooks


class AdaptWhileCombine(NeighborAveragingStrategy):
    overlap_with_forward = False
    combine_buffers_after_step = True

    @override
    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        assert self.averager is not None
        if not self.mixes_globally():
            self.averager.launch(self.step)   # sends xᵢ as it is before this step's forward

    @override
    def before_parameter_update(self, optimizer: Optimizer) -> None:
        assert self.averager is not None
        self.averager.wait()                  # xᵢ ← Σⱼ wᵢⱼ xⱼ; the optimizer then applies dᵢ(xᵢ)

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if self.mixes_globally():
            self.average_replicas_()
        elif self.buffer_averager is not None:
            self.buffer_averager.launch(self.step)
            self.buffer_averager.wait()


@register("atc")
class ATC(AdaptThenCombine):
    """Adapt-then-combine over ranks."""


@register("awc")
class AWC(AdaptWhileCombine):
    """Adapt-while-combine over ranks."""


@register("h_atc")
class HATC(AdaptThenCombine):
    """Adapt-then-combine over machines."""

    hierarchical = True


@register("h_awc")
class HAWC(AdaptWhileCombine):
    """Adapt-while-combine over machines."""

    hierarchical = True
