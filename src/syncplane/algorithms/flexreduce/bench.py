"""FlexReduce in ``syncplane bench``: its per-step sync, and the 2-level hierarchical peer.

``FlexReduceStep`` is what the strategy's DDP hook does each step: the payload in
DDP-sized buckets, each bucket's mean by the engine, launched when the backward would
launch them (``launch``) and finished before the update (``wait``). ``spec["chunk_mb"]``
overrides the pipeline chunk (0 = the paper's level-by-level run, the
``flexreduce_levelwise`` row).

``HierAllReduceStep`` is the "hierarchical all-reduce / BlueConnect" family the paper
compares with, in its plain 2-level form: reduce to each host's first rank, the leaders
all-reduce (torch's ring), the leaders broadcast back inside their host. It treats every
host alike, whatever its number of ranks -- which is what uneven portions fix.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from syncplane.exchanges.tree.executor import DEFAULT_CHUNK_BYTES, FlexReduce
from syncplane.exchanges.tree.tree import job_tree
from syncplane.job import JobContext
from syncplane.comm.buckets import DEFAULT_BUCKET_BYTES   # torch DDP's, as the bench's DDP row
from syncplane.comm.group_cache import cached_group
from syncplane.comm.meter import CommMeter, ring_allreduce_bytes


class FlexReduceStep:
    """The ``flexreduce`` strategy's gradient all-reduce on the bench payload."""

    def __init__(self, spec: dict, job: JobContext, chunk_bytes: int | None = None) -> None:
        if chunk_bytes is None:
            chunk_bytes = int(float(spec.get("chunk_mb", DEFAULT_CHUNK_BYTES / 2**20)) * 2**20)
        self.engine = FlexReduce(job_tree(job, spec.get("topology", "auto")),
                                 chunk_bytes=chunk_bytes)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexreduce")
        self._pending: list[Future] = []

    def launch(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        per_bucket = DEFAULT_BUCKET_BYTES // payload.element_size()
        self._pending = [self._worker.submit(self.engine.allreduce_mean_, bucket, meter)
                         for bucket in payload.split(per_bucket)]

    def wait(self) -> None:
        for future in self._pending:
            future.result()
        self._pending = []

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        self.launch(payload, step, meter)
        self.wait()

    def describe(self) -> str:
        return f"flexreduce {self.engine.tree.describe()}, chunk {self.engine.chunk_bytes / 2**20:g} MiB"


class HierAllReduceStep:
    """Reduce in the host, all-reduce among host leaders, broadcast in the host (sum → mean)."""

    def __init__(self, job: JobContext) -> None:
        world, me = dist.get_world_size(), dist.get_rank()
        self.hosts = job.hosts()
        self.world = world
        # every rank creates every group, in the same order (new_group is a collective)
        host_groups = [cached_group("hier_host", h) if len(h) > 1 else None for h in self.hosts]
        leaders = [h[0] for h in self.hosts]
        leader_group = cached_group("hier_leaders", leaders) if len(leaders) > 1 else None
        mine = next(i for i, h in enumerate(self.hosts) if me in h)
        self.host, self.host_group = self.hosts[mine], host_groups[mine]
        self.leader_group = leader_group if me == self.host[0] else None

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        start = time.perf_counter()
        leader = self.host[0]
        per_bucket = DEFAULT_BUCKET_BYTES // payload.element_size()
        buckets = payload.split(per_bucket)
        if self.host_group is not None:
            for work in [dist.reduce(b, leader, group=self.host_group, async_op=True) for b in buckets]:
                work.wait()
        if self.leader_group is not None:
            for work in [dist.all_reduce(b, group=self.leader_group, async_op=True) for b in buckets]:
                work.wait()
        if self.host_group is not None:
            for work in [dist.broadcast(b, leader, group=self.host_group, async_op=True) for b in buckets]:
                work.wait()
        payload.div_(self.world)
        nbytes = payload.numel() * payload.element_size()
        sent = ring_allreduce_bytes(nbytes, len(self.hosts)) if self.leader_group is not None else 0
        meter.record(start, time.perf_counter(), sent + (nbytes if dist.get_rank() != leader else 0))
