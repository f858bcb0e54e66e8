"""syncplane: data-parallel synchronization strategies for PyTorch Lightning.

Layers (``docs/architecture.md``), each importing only the ones below it:
``syncplane.strategies`` (thin Lightning glue) → ``syncplane.algorithms`` (the engines,
Lightning-free) → ``syncplane.exchanges`` (every all-reduce pattern, with its cost) →
``syncplane.comm`` (transport on torch.distributed) → ``syncplane.kernels``/``syncplane.ext``
(compiled hot loops). Beside them: ``syncplane.cluster`` (profiles, emulator, probe, cost
model), ``syncplane.job`` (the job's shape, handed down as an argument), ``syncplane.runtime``
(launcher, worker, liveness, reports), ``syncplane.recipes`` (model + data),
``syncplane.bench`` and ``syncplane.experiments`` (tools that use the product).
"""

from typing import Any

__version__ = "0.1.0"

#: What a plain Lightning script uses, importable from ``syncplane`` itself (loaded on first
#: use: ``import syncplane`` alone imports neither torch nor Lightning).
_PUBLIC = {"Auto": "syncplane.strategies.auto", "HeartbeatCallback": "syncplane.runtime.heartbeat_callback",
           "RunReport": "syncplane.runtime.report"}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'syncplane' has no attribute {name!r}")
