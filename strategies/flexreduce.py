"""FlexReduce: DDP whose gradient all-reduce is FlexReduce (Lee et al.; docs/strategies/flexreduce.md).

The result is exactly DDP's -- the mean of all ranks' gradients every step -- only the
data path changes: an uneven reduce-scatter/all-gather planned on the network tree
(``syncplane.algorithms.flexreduce``), so the bottleneck link at every level carries the
least. Everything else is Lightning's ``DDPStrategy``: the DDP wrapper, its buckets
overlapping the backward, ``no_sync`` under gradient accumulation, buffers broadcast.

Overridden hook, and why:

- ``_register_ddp_hooks``: Lightning's ``DDPStrategy._register_ddp_hooks`` registers DDP
  communication hooks only on CUDA; we register FlexReduce's hook ourselves on every
  device. The tree is resolved and the engine built here (a collective: its process group), on
  every rank before the first step, so a tree that does not fit the job fails there.

The hook hands each bucket to one worker thread and returns a future, so buckets are
reduced in DDP's order while the backward goes on (as DDP's own async all-reduce).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from syncplane.algorithms.flexreduce.executor import DEFAULT_CHUNK_BYTES, FlexReduce
from syncplane.algorithms.flexreduce.plan import describe, plan_for
from syncplane.algorithms.flexreduce.tree import job_tree
from syncplane.comm import CommMeter
from syncplane.config import ConfigError
from syncplane.strategies.registry import register


@register("flexreduce")
class FlexReduceStrategy(DDPStrategy):
    """Args:
        topology: ``auto`` (the launcher's cluster profile, else hosts of
            ``LOCAL_WORLD_SIZE`` ranks), a cluster profile name / YAML path, or a list of
            ranks per host such as ``[2, 3]``.
        chunk_mb: pipeline chunk (levels of consecutive chunks overlap); 0 runs the
            paper's schedule, one level after the other.
        bucket_cap_mb: torch DDP's bucket size (each bucket is one FlexReduce all-reduce).
        other keywords: Lightning's ``DDPStrategy``.
    """

    def __init__(self, topology: str | list[int] = "auto", chunk_mb: float = DEFAULT_CHUNK_BYTES / 2**20,
                 bucket_cap_mb: float = 25.0, **kwargs: Any) -> None:
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
        self.topology, self.chunk_bytes = topology, int(chunk_mb * 2**20)
        self.comm_meter = CommMeter()
        self.engine: FlexReduce | None = None
        self._worker: ThreadPoolExecutor | None = None

    @override
    def _register_ddp_hooks(self) -> None:
        assert self.model is not None
        tree = job_tree(self.topology, self.world_size)
        self.engine = FlexReduce(tree, chunk_bytes=self.chunk_bytes)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexreduce")
        rank_zero_info(f"flexreduce: tree {tree.describe()}, chunks of {self.chunk_bytes / 2**20:g} MiB\n"
                       + describe(tree, plan_for(tree, sum(p.numel() for p in self.model.parameters())), 4))
        self.model.register_comm_hook(None, self._hook)   # type: ignore[operator]

    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """DDP communication hook (``dist.GradBucket`` -> ``Future[Tensor]``): the bucket's mean
        gradient, computed off the backward's thread. Unannotated on purpose: torch compares
        the annotations with the real classes, and this module's are strings."""
        assert self.engine is not None and self._worker is not None
        buffer, engine, meter = bucket.buffer(), self.engine, self.comm_meter
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run() -> None:
            try:
                future.set_result(engine.allreduce_mean_(buffer, meter))
            except BaseException as exc:   # surfaces in the backward, on this rank, with its message
                future.set_exception(exc)

        self._worker.submit(run)
        return future

    @override
    def teardown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        super().teardown()
