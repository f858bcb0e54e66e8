"""FlexReduce: DDP whose gradient all-reduce is FlexReduce (Lee et al.; docs/strategies/flexreduce.md).

The result is exactly DDP's -- the mean of all ranks' gradients every step -- only the
data path changes: an uneven reduce-scatter/all-gather planned on the network tree
(``syncplane.algorithms.flexreduce``), so the bottleneck link at every level carries the
least. Everything else is Lightning's ``DDPStrategy``: the DDP wrapper, its buckets
overlapping the backward, ``no_sync`` under gradient accumulation, buffers broadcast.

Overridden hook, and why:

- ``configure_ddp``: Lightning's ``DDPStrategy`` registers DDP communication hooks only on
  CUDA; once it has wrapped the model (given no hook), FlexReduce's hook is registered
  with torch's ``register_comm_hook``, on every device. The tree is resolved and the engine built here (a collective: its process group), on
  every rank before the first step, so a tree that does not fit the job fails there.

The hook hands each bucket to one worker thread and returns a future, so buckets are
reduced in DDP's order while the backward goes on (as DDP's own async all-reduce).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from syncplane.algorithms.flexreduce.hook import DEFAULT_CHUNK_BYTES, FlexReduceHook
from syncplane.algorithms.replicas import CommMeter
from syncplane.config import ConfigError
from syncplane.cluster.profile import ClusterProfile
from syncplane.job import JobContext
from syncplane.strategies.base import JobAware, Watched
from syncplane.strategies.registry import register


@register("flexreduce")
class FlexReduceStrategy(JobAware, Watched, DDPStrategy):
    """Args:
        topology: ``auto`` (the launcher's cluster profile, else hosts of
            ``LOCAL_WORLD_SIZE`` ranks), a cluster profile name / YAML path, or a list of
            ranks per host such as ``[2, 3]``.
        chunk_mb: pipeline chunk (levels of consecutive chunks overlap); 0 runs the
            paper's schedule, one level after the other.
        bucket_cap_mb: torch DDP's bucket size (each bucket is one FlexReduce all-reduce).
        cluster: the cluster (a profile name, YAML path or ``ClusterProfile``; ``JobAware``).
        other keywords: Lightning's ``DDPStrategy``.
    """

    def __init__(self, topology: str | list[int] = "auto", chunk_mb: float = DEFAULT_CHUNK_BYTES / 2**20,
                 bucket_cap_mb: float = 25.0, job: JobContext | None = None,
                 cluster: str | Path | ClusterProfile | None = None, **kwargs: Any) -> None:
        if kwargs.get("ddp_comm_hook") is not None:
            raise ConfigError("flexreduce: ddp_comm_hook is FlexReduce itself; it cannot be set")
        if chunk_mb < 0:
            raise ConfigError(f"chunk_mb: must be >= 0 (0 = no pipelining), got {chunk_mb}")
        if not isinstance(topology, str) and (not isinstance(topology, (list, tuple)) or not topology
                                              or any(not isinstance(s, int) or s < 1 for s in topology)):
            raise ConfigError(f"topology: expected auto, a profile name / path, or a list of ranks per host "
                              f"(each >= 1), got {topology!r}")
        if bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb: must be positive, got {bucket_cap_mb}")
        super().__init__(bucket_cap_mb=bucket_cap_mb, **kwargs)   # on to torch DDP
        self.topology, self.chunk_bytes, self._job = topology, int(chunk_mb * 2**20), job
        self.use_cluster(cluster)
        self.comm_meter = CommMeter()
        self.engine: FlexReduceHook | None = None

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()   # the DDP wrapper; Lightning registers no hook (none was given)
        assert self.model is not None
        self.engine = FlexReduceHook(self.job, self.topology, self.chunk_bytes, self.comm_meter)
        rank_zero_info(self.engine.describe(sum(p.numel() for p in self.model.parameters())))
        self.model.register_comm_hook(None, self.engine.hook)   # type: ignore[operator]

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
        super().teardown()
