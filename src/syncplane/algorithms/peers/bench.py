"""torch's own model averagers as bench steps (real peers for local-SGD-style strategies)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager

from syncplane.comm import CommMeter, ring_allreduce_bytes
from syncplane.job import JobContext


class TorchPeriodicAveraging:
    """torch's ``PeriodicModelAverager``: the parameters are all-reduced every ``period`` steps."""

    def __init__(self, period: int) -> None:
        self.period = period
        self.averager = PeriodicModelAverager(period=period, warmup_steps=0)

    @staticmethod
    def as_parameter(payload: torch.Tensor) -> torch.nn.Parameter:
        """torch's averagers take parameters that have a gradient; a zero-stride view
        stands in for the gradient so the payload is not duplicated in memory."""
        param = torch.nn.Parameter(payload, requires_grad=True)
        param.grad = torch.zeros(1, dtype=payload.dtype).expand_as(payload)
        return param

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        averaging = self.averager.step % self.period == 0
        start = time.perf_counter()
        self.averager.average_parameters([self.as_parameter(payload)])
        if averaging:
            meter.record(start, time.perf_counter(),
                         ring_allreduce_bytes(payload.numel() * payload.element_size(), dist.get_world_size()))


class TorchHierarchicalAveraging(TorchPeriodicAveraging):
    """torch's ``HierarchicalModelAverager``: average inside each host every ``period // 2``
    steps and across all ranks every ``period`` (a host = the job's ``local_world_size`` ranks)."""

    def __init__(self, period: int, job: JobContext) -> None:
        local = job.local_world_size or 1
        world = dist.get_world_size()
        if local <= 1 or world % local or local == world:
            raise ValueError("torch_hierarchical needs several hosts with the same number (>1) of ranks each")
        self.period = period
        inner = max(1, period // 2)
        self.averager = HierarchicalModelAverager(period_group_size_dict={inner: local, period: world},
                                                  warmup_steps=0)

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        start = time.perf_counter()
        self.averager.average_parameters([self.as_parameter(payload)])
        meter.record(start, time.perf_counter(), 0)   # bytes: see the NIC counters
