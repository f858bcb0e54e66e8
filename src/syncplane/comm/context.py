"""The communication context: the rank topology and the machine layout.

BlueFog's API is stateful (``set_topology`` then ``neighbor_allreduce``); this module
holds that state per process group, so several groups (e.g. one per NIC) can carry
different graphs. Nothing here communicates except ``set_machine_topology``, which
creates the intra-machine process groups (a collective: call it on every rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import networkx as nx
import torch.distributed as dist

from syncplane.comm import topology
from syncplane.comm.process_groups import control_group

Group = dist.ProcessGroup | None


@dataclass
class MachineLayout:
    """Ranks ``[m·L, (m+1)·L)`` form machine m; one intra-machine group per machine."""

    local_size: int
    graph: nx.DiGraph
    groups: list[dist.ProcessGroup | None] = field(default_factory=list)

    def machine_of(self, rank: int) -> int:
        return rank // self.local_size

    def leader_of(self, machine: int) -> int:
        return machine * self.local_size


@dataclass
class _State:
    topology: nx.DiGraph | None = None
    machines: MachineLayout | None = None


_states: dict[int, _State] = {}


def _key(group: Group) -> int:
    return 0 if group is None else id(group)


def state(group: Group = None) -> _State:
    return _states.setdefault(_key(group), _State())


def rank(group: Group = None) -> int:
    return dist.get_rank(group)


def size(group: Group = None) -> int:
    return dist.get_world_size(group)


def _check_graph(graph: nx.DiGraph, n: int, what: str) -> None:
    if not isinstance(graph, nx.DiGraph):
        raise TypeError(f"{what} must be a networkx.DiGraph, got {type(graph).__name__}")
    nodes = set(graph.nodes)
    if nodes != set(range(n)):
        missing = sorted(set(range(n)) - nodes)
        extra = sorted(nodes - set(range(n)))
        raise ValueError(f"{what} must have nodes 0..{n - 1}; missing {missing}, unexpected {extra}")


def set_topology(graph: nx.DiGraph | None = None, group: Group = None) -> None:
    """Use ``graph`` for static neighbour operations on ``group`` (default: exponential-2)."""
    n = size(group)
    graph = topology.ExponentialTwoGraph(n) if graph is None else graph
    _check_graph(graph, n, "the topology")
    for j, i, data in graph.edges(data=True):
        if "weight" not in data:
            raise ValueError(f"edge {j} -> {i} has no 'weight' (use topology.uniform_weights(graph))")
    state(group).topology = graph


def load_topology(group: Group = None) -> nx.DiGraph:
    current = state(group).topology
    if current is None:
        set_topology(None, group)
        current = state(group).topology
    assert current is not None
    return current


def in_neighbor_ranks(group: Group = None) -> list[int]:
    me = rank(group)
    return sorted(j for j in load_topology(group).predecessors(me) if j != me)


def out_neighbor_ranks(group: Group = None) -> list[int]:
    me = rank(group)
    return sorted(k for k in load_topology(group).successors(me) if k != me)


def local_size_from_env() -> int:
    """Processes per machine as launched (torchrun's LOCAL_WORLD_SIZE), else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


MACHINE_KINDS = ("host", "rack")


def machine_size(kind: str = "host") -> int:
    """Processes per "machine" for hierarchical operations.

    ``host``: the processes started per host (``LOCAL_WORLD_SIZE``). ``rack``: the ranks of
    one rack of the cluster the job runs on (the launcher's profile, else a bandwidth
    probe -- a collective); racks must be equal-sized and hold consecutive ranks.
    """
    if kind == "host":
        return local_size_from_env()
    if kind != "rack":
        raise ValueError(f"unknown machine kind {kind!r}; allowed values: {', '.join(MACHINE_KINDS)}")
    from syncplane.cluster.probe import resolve_topology

    racks = resolve_topology("auto", group=control_group()).racks
    size = len(racks[0])
    expected = [list(range(k * size, (k + 1) * size)) for k in range(len(racks))]
    if [sorted(r) for r in racks] != expected:
        raise ValueError(f"machines=rack needs equal-sized racks of consecutive ranks, got racks {racks}")
    return size


def set_machine_topology(graph: nx.DiGraph | None = None, local_size: int | None = None,
                         group: Group = None) -> None:
    """Machine-level graph for hierarchical operations. Collective: creates one process
    group per machine, in the same order on every rank."""
    if group is not None:
        raise NotImplementedError("hierarchical operations run on the default process group")
    n = size()
    local = local_size if local_size is not None else local_size_from_env()
    if local < 1 or n % local:
        raise ValueError(f"world size {n} is not a multiple of local_size {local} (processes per machine)")
    machines = n // local
    graph = topology.ExponentialTwoGraph(machines) if graph is None else graph
    _check_graph(graph, machines, "the machine topology")
    previous = state().machines
    if previous is not None and previous.local_size == local:
        groups = previous.groups        # groups are per layout; reuse them
    else:
        groups = [dist.new_group(list(range(m * local, (m + 1) * local))) if local > 1 else None
                  for m in range(machines)]
    state().machines = MachineLayout(local_size=local, graph=graph, groups=groups)


def machine_layout() -> MachineLayout:
    layout = state().machines
    if layout is None:
        set_machine_topology()
        layout = state().machines
    assert layout is not None
    return layout


def reset() -> None:
    """Forget every topology (tests, or after destroying process groups)."""
    _states.clear()
