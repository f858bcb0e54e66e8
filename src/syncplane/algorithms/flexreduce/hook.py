"""FlexReduce as a DDP communication hook: every gradient bucket's mean by the tree all-reduce
(``syncplane.exchanges.tree``), computed off the backward's thread so DDP's next buckets keep
coming. What the ``flexreduce`` strategy registers on torch's DDP."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from syncplane.comm.meter import CommMeter
from syncplane.exchanges.tree.executor import DEFAULT_CHUNK_BYTES, FlexReduce
from syncplane.exchanges.tree.plan import describe, plan_for
from syncplane.exchanges.tree.tree import job_tree
from syncplane.job import JobContext

__all__ = ["DEFAULT_CHUNK_BYTES", "FlexReduceHook"]


class FlexReduceHook:
    """A collective to construct (the executor's process groups). ``topology``: ``auto`` (the
    job's cluster profile, else its hosts), a profile name / YAML path, or ranks per host."""

    def __init__(self, job: JobContext, topology: str | Sequence[int], chunk_bytes: int, meter: CommMeter) -> None:
        self.tree = job_tree(job, topology)
        self.engine = FlexReduce(self.tree, chunk_bytes=chunk_bytes)
        self.meter = meter
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexreduce")

    def describe(self, numel: int) -> str:
        """The tree, the chunking and the plan for ``numel`` gradient values (for the log)."""
        return (f"flexreduce: tree {self.tree.describe()}, chunks of {self.engine.chunk_bytes / 2**20:g} MiB\n"
                + describe(self.tree, plan_for(self.tree, numel), 4))

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """DDP communication hook (``dist.GradBucket`` -> ``Future[Tensor]``): the bucket's mean
        gradient. Unannotated on purpose: torch compares the annotations with the real classes."""
        assert self._worker is not None, "flexreduce: the hook was closed"
        buffer, engine, meter = bucket.buffer(), self.engine, self.meter
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run() -> None:
            try:
                future.set_result(engine.allreduce_mean_(buffer, meter))
            except BaseException as exc:   # surfaces in the backward, on this rank, with its message
                future.set_exception(exc)

        self._worker.submit(run)
        return future

    def close(self) -> None:
        """Finish what is in flight and stop the worker thread. Idempotent."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
