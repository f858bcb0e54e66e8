"""syncplane.strategies: thin Lightning glue, one class per synchronization algorithm.

Importing this package registers every product strategy name in Lightning's
``StrategyRegistry`` (see ``registry``). Each strategy builds on ``SyncplaneStrategy``
(``base``) and delegates the communication itself to ``syncplane.comm``.
"""

from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import build, names, register, strategy_class

# product strategies: importing a module registers its names
from syncplane.strategies import canary  # noqa: E402,F401  (canary)
from syncplane.strategies import decentralized  # noqa: E402,F401  (atc, awc, h_atc, h_awc)
from syncplane.strategies import diloco  # noqa: E402,F401  (diloco)
from syncplane.strategies import diloco_elastic  # noqa: E402,F401  (diloco with elastic=true)
from syncplane.strategies import ds_sync  # noqa: E402,F401  (ds_sync)
from syncplane.strategies import flexreduce  # noqa: E402,F401  (flexreduce)
from syncplane.strategies import torch_hooks  # noqa: E402,F401  (torch_fp16, torch_powersgd)
from syncplane.strategies.auto import Auto  # noqa: E402  (the planner as an object: Lightning's "auto" is its own)

__all__ = ["Auto", "SyncplaneStrategy", "build", "names", "register", "strategy_class"]
