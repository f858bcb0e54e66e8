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

__version__ = "0.1.0"
