"""syncplane.strategies: thin Lightning glue, one class per synchronization algorithm.

Importing this package registers every product strategy name in Lightning's
``StrategyRegistry`` (see ``registry``). Each strategy builds on ``SyncplaneStrategy``
(``base``) and delegates the communication itself to ``syncplane.comm``.
"""

from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import build, names, register, strategy_class

__all__ = ["SyncplaneStrategy", "build", "names", "register", "strategy_class"]
