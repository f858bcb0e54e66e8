"""The decentralized strategies' settings, validated once at construction (a bad value
fails before the first step, naming the key and what it accepts)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from syncplane.algorithms.decentralized.machines import HIERARCHIES, MACHINE_KINDS
from syncplane.algorithms.decentralized.schedule import SCHEDULES
from syncplane.algorithms.late_peers import check_late_peer_options
from syncplane.comm import topology as graphs

#: Graph builders a config may name (``topology: RingGraph``); all take the size first.
TOPOLOGIES = ("ExponentialTwoGraph", "ExponentialGraph", "SymmetricExponentialGraph", "PlusMinusExponentialGraph",
              "RingGraph", "MeshGrid2DGraph", "StarGraph", "FullyConnectedGraph")


@dataclass(frozen=True)
class DecentralizedConfig:
    """Args:
        topology: graph builder from ``syncplane.comm.topology`` (over machines for the
            hierarchical forms), used by ``schedule: static``.
        topology_kwargs: extra builder arguments (e.g. ``{connect_style: 1}``).
        schedule: ``one_peer`` (dynamic one-peer exponential, BlueFog's training
            default: one payload per rank per step) or ``static`` (the graph every step).
        global_every: an exact global average every K steps (0 = never).
        hierarchy: ``atc``/``awc`` only: ``auto`` mixes racks as ``h_atc``/``h_awc`` do (machines
            = racks) where the job's cluster profile has several racks and some rack holds
            several ranks (``machines.mixes_racks``), else ranks; ``none`` always mixes ranks.
        machines: what a machine is for the hierarchical forms: ``host`` (the processes
            started per host), ``rack`` (a rack of the cluster profile / probe) or ``auto``
            (hosts when hosts run several ranks, else racks).
        ranks_per_machine: explicit machine size (overrides ``machines``).
        check_schedule: verify at setup that every step's senders and receivers agree.
        timeout_s: how long a neighbour exchange may wait before failing with the ranks named.
        max_staleness: tolerate a late neighbour (flat ``atc``/``awc`` only): a neighbour whose
            message has not arrived ``late_after_s`` into the combine is mixed with its newest
            arrived value, at most this many of its messages old (0: wait for everyone).
        late_after_s: the grace a neighbour's message gets before the neighbour counts as late.
    """

    topology: str = "ExponentialTwoGraph"
    topology_kwargs: dict[str, Any] = field(default_factory=dict)
    schedule: str = "one_peer"
    global_every: int = 0
    hierarchy: str = "auto"
    machines: str = "auto"
    ranks_per_machine: int | None = None
    check_schedule: bool = True
    timeout_s: float = 300.0
    max_staleness: int = 0
    late_after_s: float = 0.05

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {self.topology!r}; allowed values: {', '.join(TOPOLOGIES)}")
        builder = getattr(graphs, self.topology)
        try:   # the builder's own signature: a misspelt argument fails here, not in every rank's setup
            inspect.signature(builder).bind(1, **self.topology_kwargs)
        except TypeError as exc:
            params = [p for p in inspect.signature(builder).parameters][1:]
            raise ValueError(f"topology_kwargs: {exc} ({self.topology} takes {', '.join(params) or 'none'})") from None
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; allowed values: {', '.join(SCHEDULES)}")
        if self.global_every < 0:
            raise ValueError(f"global_every must be >= 0 (0 = never), got {self.global_every}")
        if self.hierarchy not in HIERARCHIES:
            raise ValueError(f"unknown hierarchy {self.hierarchy!r}; allowed values: {', '.join(HIERARCHIES)}")
        if self.machines not in MACHINE_KINDS:
            raise ValueError(f"unknown machines {self.machines!r}; allowed values: {', '.join(MACHINE_KINDS)}")
        if self.ranks_per_machine is not None and self.ranks_per_machine < 1:
            raise ValueError(f"ranks_per_machine must be >= 1, got {self.ranks_per_machine}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        check_late_peer_options(self.max_staleness, self.late_after_s)
