"""torch's own DDP communication hooks as strategies and bench peers: ``torch_fp16`` and
``torch_powersgd`` -- what a user of torch would pick to cut DDP's traffic, benchmarked
beside ours and trainable through Lightning's ``DDPStrategy(ddp_comm_hook=...)``
(glue: ``strategies/torch_hooks.py``). Files: ``hooks.py`` (validated settings -> torch's
state and hook), ``bench.py`` (the payload through a real DDP with the hook)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from syncplane.job import JobContext
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions
from syncplane.algorithms.torch_hooks.bench import TorchHookStep, payload_shapes
from syncplane.algorithms.torch_hooks.hooks import HOOK_NAMES, HookConfig
from syncplane.cluster.cost import Phase, ring_allreduce
from syncplane.cluster.profile import ClusterProfile


def hook_cost(name: str, profile: ClusterProfile, payload_bytes: float, options: CostOptions) -> list[list[Phase]]:
    """fp16: one ring all-reduce of half the bytes; PowerSGD: ring all-reduces of P then Q
    (r·(rows + cols) values per matrix of ``payload_shapes``, vectors uncompressed)."""
    n = profile.world_size
    if name == "torch_fp16":
        return [ring_allreduce(n, payload_bytes / 2)]
    config = HookConfig(name=name)
    shapes = payload_shapes(max(1, int(payload_bytes // 4)))
    p = sum(s[0] * config.matrix_approximation_rank if len(s) == 2 else s[0] for s in shapes)
    q = sum(config.compressed_elements(s) for s in shapes) - p
    return [ring_allreduce(n, 4 * p) + ring_allreduce(n, 4 * q)]


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> TorchHookStep:
    return TorchHookStep(name, options)


SPEC = AlgorithmSpec(
    family="torch_hooks",
    strategies={"torch_fp16": "torch's fp16_compress_hook on DDP: gradient buckets all-reduced in fp16",
                "torch_powersgd": "torch's powerSGD_hook on DDP: rank-r PowerSGD with error feedback"},
    bench_step=_step,
    cost=hook_cost,
    overlap={name: "backward" for name in HOOK_NAMES},   # DDP's reducer: buckets during the backward
)

__all__ = ["HOOK_NAMES", "SPEC", "HookConfig", "TorchHookStep", "hook_cost", "payload_shapes"]
