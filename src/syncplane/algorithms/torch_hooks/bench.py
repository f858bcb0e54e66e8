"""torch's DDP comm hooks timed by ``syncplane bench``: the payload goes through a real
``DistributedDataParallel`` with the hook registered, so the bench measures torch's own
reducer and hook, not a re-implementation."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from syncplane.algorithms.torch_hooks.hooks import HookConfig
from syncplane.comm import DEFAULT_BUCKET_BYTES, CommMeter, ring_allreduce_bytes

#: gradients of the flat payload: full DDP buckets reshaped to this many rows (a matrix,
#: so PowerSGD compresses it as it would a layer's weight); see ``payload_shapes``
ROWS = 2560


def payload_shapes(numel: int) -> list[tuple[int, ...]]:
    """The payload as DDP-bucket-sized ``ROWS``-row matrices, the rest as one more matrix
    and a vector of what does not fill a row."""
    per_bucket = DEFAULT_BUCKET_BYTES // 4
    shapes: list[tuple[int, ...]] = []
    left = numel
    while left >= per_bucket:
        shapes.append((ROWS, per_bucket // ROWS))
        left -= ROWS * (per_bucket // ROWS)
    if left >= ROWS:
        shapes.append((ROWS, left // ROWS))
        left -= ROWS * (left // ROWS)
    if left:
        shapes.append((left,))
    return shapes


def reducer_buckets(shapes: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """The buckets torch's reducer hooks, warm: DDP's own assignment
    (``dist._compute_bucket_assignment_by_size``, what its reducer calls when it rebuilds its
    buckets) of the gradients in the order the backward produced them (``_Payload``'s in
    reverse), sized on meta tensors, with the bench's cap. A bucket closes once it holds the
    cap, so 97.5 MB goes in three, not four, the first with the vector and two matrices."""
    produced = list(reversed(shapes))
    assignment, _ = dist._compute_bucket_assignment_by_size(
        [torch.empty(s, device="meta") for s in produced], [DEFAULT_BUCKET_BYTES])
    return [[produced[i] for i in bucket] for bucket in assignment]


class _Payload(torch.nn.Module):
    """Parameters shaped by ``payload_shapes``; forward(g) = Σ p·g, so the gradient of each
    parameter is exactly its slice of g."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((w * g).sum() for w, g in zip(self.weights, grads))  # type: ignore[return-value]


class TorchHookStep:
    """A backward through DDP with torch's hook: its buckets are reduced as the backward
    produces them; ``launch`` starts the backward on a thread, ``wait`` joins it, so the
    bench overlaps it with the emulated backward as it does DDP's."""

    def __init__(self, name: str, options: Mapping[str, Any]) -> None:
        self.config = HookConfig.of(name, options)
        # untimed steps: torch's DDP rebuilds its buckets after its first step, and PowerSGD's
        # first compressed step allocates its error feedback and its P and Q; the timed steps
        # are warm ones
        self.warmup = (self.config.start_powerSGD_iter if name == "torch_powersgd" else 1) + 1
        self._model: DistributedDataParallel | None = None
        self._numel = -1
        # one long-lived thread (not one per step: the soak counts threads)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-hook")
        self._running: Future[None] | None = None
        self._pending: tuple[torch.Tensor, float, CommMeter] | None = None

    def describe(self) -> str:
        rank = f", rank {self.config.matrix_approximation_rank}" if self.config.name == "torch_powersgd" else ""
        return f"{self.config.name}: torch's DDP comm hook{rank}, {ROWS}-row matrices of 25 MiB buckets"

    def _ddp(self, numel: int) -> DistributedDataParallel:
        if self._model is None or self._numel != numel:
            self._numel = numel
            self._model = DistributedDataParallel(_Payload(payload_shapes(numel)),
                                                  bucket_cap_mb=DEFAULT_BUCKET_BYTES / 2**20)
            self._model.register_comm_hook(*self.config.hook())
        return self._model

    def _backward(self, payload: torch.Tensor) -> None:
        model = self._ddp(payload.numel())
        grads = [g.view(w.shape) for g, w in zip(payload.split([w.numel() for w in model.module.weights]),
                                                 model.module.weights)]
        model.zero_grad(set_to_none=False)
        model(grads).backward()
        torch.cat([w.grad.reshape(-1) for w in model.module.weights], out=payload)

    def launch(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        self._pending = (payload, time.perf_counter(), meter)
        self._running = self._worker.submit(self._backward, payload)

    def wait(self) -> None:
        if self._running is None or self._pending is None:
            raise RuntimeError("wait() without launch()")
        running, (payload, start, meter) = self._running, self._pending
        self._running = self._pending = None
        running.result()   # re-raises what the backward raised
        elements = sum(self.config.compressed_elements(s) for s in payload_shapes(payload.numel()))
        width = 2 if self.config.name == "torch_fp16" else 4
        meter.record(start, time.perf_counter(), ring_allreduce_bytes(elements * width, dist.get_world_size()))

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        self.launch(payload, step, meter)
        self.wait()
