"""Every all-reduce pattern syncplane runs, each with its α-β cost beside it, behind one
protocol (``syncplane.comm.StreamExchange``, run by ``syncplane.comm.StreamRunner``: streams
per NIC, deadline, commit/discard) and one chooser (``choose``):

- ``mesh``: the owner exchange (``MeshExchange``, ``mesh.cost``);
- ``tree``: FlexReduce's planner and pipelined executor on the network tree
  (``syncplane.exchanges.tree``; ``TreeExchange`` runs it on streams, ``tree.exchange.cost``);
- ``nested`` and ``cube``: the digit exchanges by host and rack, and on BCube
  (``NestedExchange``, ``CubeExchange``, ``digit.nested_cost``, ``digit.cube_cost``);
- ``gather``: every rank gathers every rank's encoded piece and decodes them in rank order
  (``GatherExchange``, ``gather.cost``): what a sparse payload needs.

Algorithms share patterns through this layer and never import each other.
"""

from __future__ import annotations

from syncplane.exchanges.choose import NAMES, Choice, JobShape, choose, cube_shape, normalize, offered
from syncplane.exchanges.digit import CubeExchange, DigitExchange, NestedExchange
from syncplane.exchanges.gather import GatherExchange
from syncplane.exchanges.mesh import MeshExchange
from syncplane.exchanges.tree.exchange import TreeExchange

__all__ = ["NAMES", "Choice", "CubeExchange", "DigitExchange", "GatherExchange", "JobShape", "MeshExchange",
           "NestedExchange", "TreeExchange", "choose", "cube_shape", "normalize", "offered"]
