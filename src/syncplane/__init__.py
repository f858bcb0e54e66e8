"""syncplane: data-parallel synchronization strategies for PyTorch Lightning.

Layers (``docs/architecture.md``): ``syncplane.comm`` (collectives on torch.distributed, no
Lightning), ``syncplane.kernels``/``syncplane.ext`` (compiled hot loops),
``syncplane.strategies`` (thin Lightning glue), ``syncplane.recipes`` (model + data),
``syncplane.training`` (job config, launcher side, worker side).
"""

__version__ = "0.1.0"
