"""The communication context: the rank topology and the machine layout.

BlueFog's API is stateful (``set_topology`` then ``neighbor_allreduce``); this module
holds that state per process group, so several groups (e.g. one per NIC) can carry
different graphs. Nothing here communicates except ``set_machine_topology``, which
creates the intra-machine process groups (a collective: call it on every rank).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import networkx as nx
import torch.distributed as dist

from syncplane.comm import topology
from syncplane.comm.group_cache import cached_group
from syncplane.comm.process_groups import new_group
from syncplane.launch import Launch

Group = dist.ProcessGroup | None
log = logging.getLogger(__name__)


@dataclass
class MachineLayout:
    """The machines of the hierarchical operations and their graph.

    ``machines[m]`` lists machine m's ranks in ascending order; a rank's position in that list
    is its local rank (the order of ``dist.new_group``'s group ranks). Machines may differ in
    size and need not hold consecutive ranks: the hierarchical data path shards by the largest
    machine (see ``syncplane.comm.hierarchical``). One intra-machine group per machine of more
    than one rank.
    """

    machines: list[list[int]]
    graph: nx.DiGraph
    groups: list[dist.ProcessGroup | None] = field(default_factory=list)
    _where: dict[int, tuple[int, int]] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._where = {r: (m, local) for m, ranks in enumerate(self.machines) for local, r in enumerate(ranks)}

    def machine_of(self, rank: int) -> int:
        return self._where[rank][0]

    def local_rank(self, rank: int) -> int:
        return self._where[rank][1]

    def size_of(self, machine: int) -> int:
        return len(self.machines[machine])

    @property
    def max_size(self) -> int:
        """Ranks of the largest machine: the number of shards a payload is cut into."""
        return max(len(ranks) for ranks in self.machines)


def consecutive_machines(world_size: int, local_size: int) -> list[list[int]]:
    """Machines of ``local_size`` consecutive ranks (a launcher's homogeneous layout)."""
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"world size {world_size} is not a multiple of local_size {local_size} "
                         "(processes per machine)")
    return [list(range(m * local_size, (m + 1) * local_size)) for m in range(world_size // local_size)]


def check_machines(machines: Sequence[Sequence[int]], world_size: int) -> list[list[int]]:
    """``machines`` as sorted lists, or a ``ValueError`` naming the field unless every rank
    ``0..world_size-1`` is in exactly one non-empty machine."""
    out = [sorted(int(r) for r in ranks) for ranks in machines]
    seen: dict[int, int] = {}
    for m, ranks in enumerate(out):
        if not ranks:
            raise ValueError(f"machines[{m}] is empty; every machine needs at least one rank")
        for r in ranks:
            if not 0 <= r < world_size:
                raise ValueError(f"machines[{m}] names rank {r}, outside a world of size {world_size}")
            if r in seen:
                raise ValueError(f"machines: rank {r} is in machines[{seen[r]}] and machines[{m}]")
            seen[r] = m
    missing = sorted(set(range(world_size)) - set(seen))
    if missing:
        raise ValueError(f"machines: ranks {missing} are in no machine (world size {world_size})")
    return out


@dataclass
class _State:
    topology: nx.DiGraph | None = None
    machines: MachineLayout | None = None
    weighted: bool = True     # static ops use the graph's weights (False: BlueFog's uniform default)
    #: (upward, downward): the groups a message to a higher / lower group rank travels on
    #: (``set_one_way_links``); None: the group's own connections, both ways
    one_way: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None


#: Keyed by the group object itself (None: the default group). An ``id()`` key could be
#: reused by a new group after the old one is garbage-collected and inherit its topology.
_states: dict[Group, _State] = {}
_background: ThreadPoolExecutor | None = None


def state(group: Group = None) -> _State:
    return _states.setdefault(group, _State())


def background_executor() -> ThreadPoolExecutor:
    """The one worker thread that runs chained non-blocking operations (hierarchical
    pipelines) in launch order -- the same order on every rank. Shut down by ``reset``."""
    global _background
    if _background is None:
        _background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncplane-comm")
    return _background


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


#: Callables naming what still depends on the current topology (windows register one), so
#: that this module need not import them (they import it).
_topology_holders: list[Callable[[], list[str]]] = []


def hold_topology_while(names: Callable[[], list[str]]) -> None:
    """Refuse ``set_topology`` while ``names()`` is not empty (``window`` registers its windows)."""
    _topology_holders.append(names)


def set_topology(graph: nx.DiGraph | None = None, group: Group = None, *, is_weighted: bool = True) -> bool:
    """Use ``graph`` for static neighbour operations on ``group`` (default: exponential-2).

    ``is_weighted=False`` makes static operations average uniformly over each rank's
    in-neighbours and itself (BlueFog's default) instead of using the edge weights.
    Returns False, keeping the old topology, while any window exists (as BlueFog does:
    the windows hold one buffer per in-neighbour of the topology they were created on).
    """
    n = size(group)
    graph = topology.ExponentialTwoGraph(n) if graph is None else graph
    _check_graph(graph, n, "the topology")
    for j, i, data in graph.edges(data=True):
        if "weight" not in data:
            raise ValueError(f"edge {j} -> {i} has no 'weight' (use topology.uniform_weights(graph))")
    current = state(group)
    if current.topology is not None and topology.is_topology_equivalent(graph, current.topology) \
            and current.weighted == is_weighted:
        return True
    held = [name for holder in _topology_holders for name in holder()]
    if held:
        log.warning("set_topology refused on rank %d: windows %s exist; win_free them first", rank(group), held)
        return False
    current.topology, current.weighted = graph, is_weighted
    return True


def load_topology(group: Group = None) -> nx.DiGraph:
    current = state(group).topology
    if current is None:
        set_topology(None, group)
        current = state(group).topology
    assert current is not None
    return current


def recv_weights(group: Group = None) -> tuple[float, dict[int, float]]:
    """(self weight, {in-neighbour: weight}) this rank's static operations use."""
    graph, me = load_topology(group), rank(group)
    self_weight, sources, _ = topology.static_weights(graph, me)
    if state(group).weighted:
        return self_weight, sources
    uniform = 1.0 / (len(sources) + 1)
    return uniform, {j: uniform for j in sources}


def in_neighbor_ranks(group: Group = None) -> list[int]:
    me = rank(group)
    return sorted(j for j in load_topology(group).predecessors(me) if j != me)


def out_neighbor_ranks(group: Group = None) -> list[int]:
    me = rank(group)
    return sorted(k for k in load_topology(group).successors(me) if k != me)


def launched_local_size() -> int:
    """Processes per machine as launched (torchrun's ``LOCAL_WORLD_SIZE``), else 1: the BlueFog
    API's default machine (``syncplane.launch`` reads the launcher's variables)."""
    return Launch.read().local_world_size or 1


def set_machine_topology(graph: nx.DiGraph | None = None, local_size: int | None = None,
                         group: Group = None, *, machines: Sequence[Sequence[int]] | None = None) -> None:
    """Machine-level graph for hierarchical operations. ``machines``: each machine's ranks
    (any sizes, any ranks); else ``local_size`` consecutive ranks per machine (default: the
    launch's ``LOCAL_WORLD_SIZE``). Collective: creates one process group per machine of
    several ranks, in the same order on every rank."""
    if group is not None:
        raise NotImplementedError("hierarchical operations run on the default process group")
    n = size()
    if machines is not None and local_size is not None:
        raise ValueError("set_machine_topology takes machines or local_size, not both")
    if machines is None:
        layout = consecutive_machines(n, local_size if local_size is not None else launched_local_size())
    else:
        layout = check_machines(machines, n)
    graph = topology.ExponentialTwoGraph(len(layout)) if graph is None else graph
    _check_graph(graph, len(layout), "the machine topology")
    previous = state().machines
    if previous is not None and previous.machines == layout:
        groups = previous.groups        # groups are per layout; reuse them
    else:
        groups = [new_group(ranks) if len(ranks) > 1 else None for ranks in layout]
    state().machines = MachineLayout(machines=layout, graph=graph, groups=groups)


def machine_layout() -> MachineLayout:
    layout = state().machines
    if layout is None:
        set_machine_topology()
        layout = state().machines
    assert layout is not None
    return layout


def directed(up: dist.ProcessGroup, down: dist.ProcessGroup, src: int, dst: int) -> dist.ProcessGroup:
    """The group of an (up, down) pair that carries a message from ``src`` to ``dst``: ``up`` the
    ranks, else ``down``. Sender and receiver both call it with the same (src, dst), so they
    meet on one group, and each TCP connection carries data one way only. Why: gloo sends a
    message only once the receiver has said it posted the receive, and that notice travels on
    the same connection as the data going the other way; on a shaped link it would wait
    behind a queue of that data. It still leaves by the host's link, behind what the host
    queued there: the exchanges also post their receives first (``p2p.exchange_tensors``)."""
    return up if src < dst else down


def set_one_way_links(group: Group = None) -> None:
    """Carry the point-to-point messages of ``group`` (``p2p.exchange_tensors``) on two groups
    of its members, one per direction (``directed``), as the stream runner's patterns travel.
    Where a link caps each flow, a pair swapping on one connection ran at 0.78 of its bound
    (``docs/design-notes.md``). The first call creates the groups with ``dist.new_group``
    (``group_cache``): call it on every rank of the job, in the same order, even for a
    subgroup. It stays set for ``group`` until ``reset``."""
    members = None if group is None else dist.get_process_group_ranks(group)
    state(group).one_way = (cached_group("one-way-up", members), cached_group("one-way-down", members))


def one_way_link(group: Group, src: int, dst: int) -> Group:
    """The group a message from group rank ``src`` to ``dst`` travels on: upward or downward
    (``set_one_way_links``), else ``group`` itself."""
    links = state(group).one_way
    return group if links is None else directed(*links, src, dst)


def reset() -> None:
    """Forget every topology and stop the background worker after its queued work (tests,
    or after destroying process groups)."""
    global _background
    _states.clear()
    if _background is not None:
        _background.shutdown(wait=True)
        _background = None
