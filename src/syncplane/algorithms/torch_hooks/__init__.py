"""torch's own DDP communication hooks as strategies and bench peers: ``torch_fp16`` and
``torch_powersgd`` -- what a user of torch would pick to cut DDP's traffic, benchmarked
beside ours and trainable through Lightning's ``DDPStrategy(ddp_comm_hook=...)``
(glue: ``strategies/torch_hooks.py``). Files: ``hooks.py`` (validated settings -> torch's
state and hook), ``bench.py`` (the payload through a real DDP with the hook), ``timing.py``
(that step's CPU time on this machine, for the cost model)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from syncplane.job import JobContext
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions
from syncplane.algorithms.torch_hooks.bench import TorchHookStep, payload_shapes, reducer_buckets
from syncplane.algorithms.torch_hooks.hooks import HOOK_NAMES, HookConfig
from syncplane.algorithms.torch_hooks.timing import hook_op, hook_timer, timed_elements, timed_ranks
from syncplane.cluster.cost import Phase, bucket_streams, ring_allreduce
from syncplane.cluster.profile import ClusterProfile
from syncplane.exchanges.cpu import CpuWork


def _buckets(payload_bytes: float) -> list[list[tuple[int, ...]]]:
    """The reducer's buckets of the bench's payload (``payload_shapes``) of that many bytes."""
    return reducer_buckets(payload_shapes(max(1, int(payload_bytes // 4))))


def hook_cost(name: str, profile: ClusterProfile, payload_bytes: float, options: CostOptions) -> list[list[Phase]]:
    """fp16: one ring all-reduce of half the bytes, in the reducer's buckets
    (``reducer_buckets``) spread over the NICs as ``ddp``'s are (``bucket_streams``: the
    ResNet-50 payload's three, not the bench's ``ddp``'s four, so on two NICs one carries two of
    a step's three all-reduces, not two of four); PowerSGD: per bucket of the reducer
    (``reducer_buckets``, one after the other: ``SerializedState``), three ring all-reduces
    chained as torch's hook chains them -- the tensors it does not compress (vectors, small
    matrices), then P (r·rows per compressed matrix of ``payload_shapes``), then Q (r·cols),
    r being ``options.rank`` -- an empty one sends nothing (measured: gloo returns at once)."""
    n, buckets = profile.world_size, _buckets(payload_bytes)
    if name == "torch_fp16":
        return [ring_allreduce(n, payload_bytes / 2, bucket_streams(len(buckets), profile.gloo_nics))]
    config = HookConfig(name=name, matrix_approximation_rank=options.rank)
    phases: list[Phase] = []
    for bucket in buckets:
        compressed = [s for s in bucket if config.compressed_elements(s) < math.prod(s)]
        rest = sum(math.prod(s) for s in bucket) - sum(math.prod(s) for s in compressed)
        factors = [config.factors(s) for s in compressed]
        p, q = sum(f[0] for f in factors), sum(f[1] for f in factors)
        for elements in (rest, p, q):
            if elements:
                phases += ring_allreduce(n, 4 * elements)
    return [phases]


def hook_cpu(name: str, profile: ClusterProfile, payload_bytes: float, options: CostOptions) -> CpuWork:
    """Every element of the payload through torch's DDP step with the hook (``timing``: the
    reducer's copies and the hook's own work, timed as the bench runs them, on the payload's
    own size, PowerSGD's in a group of the profile's size (``timed_ranks``), at ``options.rank``)."""
    rank, ranks = options.rank, timed_ranks(name, profile.world_size)
    elements = max(1, int(payload_bytes // 4))
    op = hook_op(name, rank, timed_elements(elements), ranks)
    return CpuWork(Counter({op: elements}), timers={op: hook_timer(name, rank, ranks)})


def hook_parts(options: Mapping[str, Any], payload_bytes: float) -> int:
    """The reducer's buckets: it hands bucket k to the hook's all-reduce and goes on with
    bucket k+1's copies and the hook's work on it, so the step's CPU runs beside the wire."""
    return len(_buckets(payload_bytes))


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> TorchHookStep:
    return TorchHookStep(name, options)


SPEC = AlgorithmSpec(
    family="torch_hooks",
    strategies={"torch_fp16": "torch's fp16_compress_hook on DDP: gradient buckets all-reduced in fp16",
                "torch_powersgd": "torch's powerSGD_hook on DDP: rank-r PowerSGD with error feedback"},
    bench_step=_step,
    cost=hook_cost,
    cpu=hook_cpu,
    overlap={name: "backward" for name in HOOK_NAMES},   # DDP's reducer: buckets during the backward
    parts=hook_parts,
    # measured (``cluster.cost.EMULATED_TCP``'s queue): on quiet profiles PowerSGD's step costs
    # its CPU work, its chain's latencies hidden; behind a queue, that plus the queue's delays
    alpha_hidden=("torch_powersgd",),
)

__all__ = ["HOOK_NAMES", "SPEC", "HookConfig", "TorchHookStep", "hook_cost", "hook_cpu", "payload_shapes",
           "reducer_buckets"]
