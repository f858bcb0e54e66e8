"""The network tree FlexReduce plans on: core → racks → hosts → ranks (paper §III).

A leaf is a rank (a learner); a branch is a switch or a host whose children share its
links. A branch with a single child adds no link worth planning for (its one child
already holds everything below it), so it *collapses* into that child: a rack of one
host is that host, a host of one rank is that rank, a cluster of one rack is that rack.
Any shape is allowed -- hosts with different rank counts, racks with different host
counts, leaves at different depths.

Levels are counted bottom-up, as the paper does (level 0 = the lowest branch nodes):
a branch's level is one more than the highest level among its branch children
(``height``). On the balanced trees the paper draws this is exactly its reverse-BFS
order; on uneven trees it puts every host's in-host reduce into level 0 together
instead of delaying a shallow host to its rack's level.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from syncplane.cluster.profile import ClusterProfile
from syncplane.config import ConfigError
from syncplane.job import JobContext


@dataclass(frozen=True)
class Node:
    """A tree node: a leaf (``rank`` set, no children) or a branch (two or more children)."""

    name: str
    children: tuple[Node, ...] = ()
    rank: int | None = None

    @property
    def is_leaf(self) -> bool:
        return self.rank is not None

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        """The ranks under this node, in tree order."""
        if self.is_leaf:
            assert self.rank is not None
            return (self.rank,)
        return tuple(r for c in self.children for r in c.leaves)

    @cached_property
    def height(self) -> int:
        """-1 for a leaf; otherwise one more than the highest child (the node's level)."""
        return -1 if self.is_leaf else 1 + max(c.height for c in self.children)

    @property
    def degree(self) -> int:
        return len(self.children)

    def walk(self) -> Iterator[Node]:
        """Pre-order: this node, then each child's subtree."""
        yield self
        for child in self.children:
            yield from child.walk()


def leaf(rank: int) -> Node:
    return Node(name=f"rank{rank}", rank=rank)


def branch(name: str, children: Sequence[Node]) -> Node:
    """A branch over ``children``; one child collapses into that child. No children: an error
    (an empty host or rack would leave ranks without a place in the tree)."""
    if not children:
        raise ConfigError(f"flexreduce tree: {name!r} has no ranks below it (an empty host or rack)")
    if len(children) == 1:
        return children[0]
    return Node(name=name, children=tuple(children))


@dataclass(frozen=True)
class FlexTree:
    """A validated tree whose leaves are exactly the ranks 0..world_size−1."""

    root: Node
    world_size: int
    branches: tuple[Node, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranks = sorted(self.root.leaves)
        if ranks != list(range(self.world_size)):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            missing = sorted(set(range(self.world_size)) - set(ranks))
            extra = sorted(r for r in set(ranks) if not 0 <= r < self.world_size)
            raise ConfigError(
                f"flexreduce tree: its {len(ranks)} leaves do not cover the world of {self.world_size} ranks"
                + (f"; missing ranks {missing}" if missing else "")
                + (f"; ranks outside 0..{self.world_size - 1}: {extra}" if extra else "")
                + (f"; ranks listed twice: {dup}" if dup else ""))
        object.__setattr__(self, "branches", tuple(n for n in self.root.walk() if not n.is_leaf))

    @property
    def num_levels(self) -> int:
        return self.root.height + 1

    def levels(self) -> list[list[Node]]:
        """Branch nodes by level, bottom (0) to root, each level in tree order."""
        out: list[list[Node]] = [[] for _ in range(self.num_levels)]
        for node in self.branches:
            out[node.height].append(node)
        return out

    def key(self) -> tuple:
        """A hashable description of the shape (plans are cached by it)."""
        def shape(node: Node) -> object:
            return node.rank if node.is_leaf else tuple(shape(c) for c in node.children)
        return (self.world_size, shape(self.root))

    def path(self, rank: int) -> list[Node]:
        """The branches above ``rank``, lowest first (its p_v^0, p_v^1, ... in the paper)."""
        def find(node: Node, trail: list[Node]) -> list[Node] | None:
            if node.is_leaf:
                return trail if node.rank == rank else None
            for child in node.children:
                found = find(child, [node, *trail])
                if found is not None:
                    return found
            return None
        found = find(self.root, [])
        if found is None:
            raise KeyError(f"rank {rank} is not in the tree")
        return found

    def radices(self) -> list[int] | None:
        """The degree of each level, bottom first, when the tree is regular -- every branch
        of a level has the same degree and its children one level below it, the leaves in
        rank order -- so that rank r's place at level ℓ is digit ℓ of r in these radices
        (what Canary's nested exchange addresses ranks by: ``syncplane.exchanges.NestedExchange``); else
        None (an uneven tree, or a single rank)."""
        if self.root.is_leaf or list(self.root.leaves) != list(range(self.world_size)):
            return None
        out = []
        for nodes in self.levels():
            degrees = {n.degree for n in nodes}
            if len(degrees) != 1 or any(c.height != n.height - 1 for n in nodes for c in n.children):
                return None
            out.append(degrees.pop())
        return out

    def describe(self) -> str:
        """One line: the nested shape, e.g. ``core[m0[0,1], m1[2,3,4]]``."""
        def text(node: Node) -> str:
            return str(node.rank) if node.is_leaf else f"{node.name}[{', '.join(text(c) for c in node.children)}]"
        return text(self.root)


def from_nested(groups: Sequence, world_size: int | None = None, name: str = "core") -> FlexTree:
    """A tree from nested lists of ranks, e.g. ``[[0, 1], [2, 3, 4]]`` (two hosts) or
    ``[[[0], [1, 2]], [[3, 4]]]`` (racks of hosts). An empty list is an empty host: an error."""
    def build(item: object, label: str) -> Node:
        if isinstance(item, int):
            return leaf(item)
        if not isinstance(item, Sequence):
            raise ConfigError(f"flexreduce tree: {label} must be a rank or a list, got {item!r}")
        return branch(label, [build(c, f"{label}.{i}") for i, c in enumerate(item)])

    root = build(list(groups), name)
    count = len(root.leaves)
    return FlexTree(root=root, world_size=count if world_size is None else world_size)


def from_profile(profile: ClusterProfile, world_size: int | None = None) -> FlexTree:
    """core → racks → hosts → ranks as the profile declares (ranks numbered rack by rack,
    host by host, as the launcher places them)."""
    if world_size is not None and world_size != profile.world_size:
        raise ConfigError(f"flexreduce tree: cluster profile {profile.name!r} has {profile.world_size} ranks, "
                          f"but the job has {world_size} processes")
    racks = []
    for r, rack in enumerate(profile.racks):
        hosts = [branch(h.name, [leaf(k) for k in h.ranks]) for h in profile.hosts if h.rack == r]
        racks.append(branch(rack.name, hosts))
    return FlexTree(root=branch("core", racks), world_size=profile.world_size)


def from_host_sizes(sizes: Sequence[int], world_size: int | None = None) -> FlexTree:
    """One switch over hosts of the given rank counts (consecutive ranks per host)."""
    bad = [(i, s) for i, s in enumerate(sizes) if s < 1]
    if bad:
        raise ConfigError(f"flexreduce tree: host {bad[0][0]} has {bad[0][1]} ranks (every host needs at least one)")
    groups, first = [], 0
    for s in sizes:
        groups.append(list(range(first, first + s)))
        first += s
    tree = from_nested(groups, world_size)
    return tree


def from_local_world_size(world_size: int, local_world_size: int) -> FlexTree:
    """Hosts of ``local_world_size`` consecutive ranks (torchrun's layout), one switch above them."""
    if local_world_size < 1 or world_size % local_world_size:
        raise ConfigError(f"flexreduce tree: LOCAL_WORLD_SIZE={local_world_size} does not divide the world "
                          f"size {world_size}; give the cluster profile instead")
    return from_host_sizes([local_world_size] * (world_size // local_world_size), world_size)


def from_racks_and_hosts(racks: Sequence[Sequence[int]], hosts: Sequence[Sequence[int]], world_size: int) -> FlexTree:
    """From a probed/declared topology's rank lists (``syncplane.cluster.probe.Topology``)."""
    nested = [[list(h) for h in hosts if set(h) <= set(rack)] for rack in racks]
    return from_nested(nested, world_size)


def job_tree(job: JobContext, topology: str | Sequence[int] = "auto") -> FlexTree:
    """The job's tree: ``auto`` = the cluster profile the job was placed on, else its hosts
    (``JobContext.hosts``); a profile name or YAML path; or ranks per host (a list)."""
    if not isinstance(topology, str):
        return from_host_sizes([int(s) for s in topology], job.world_size)
    profile = job.profile_for(topology)
    if profile is not None:
        return from_profile(profile, job.world_size)
    return from_nested(job.hosts(), job.world_size)


def check_topology(topology: str | Sequence[int], job: JobContext) -> None:
    """A ``topology`` setting (FlexReduce's, DiLoCo's tree) checked before launch: it loads
    and its tree covers the job's ranks; the error names the key."""
    try:
        job_tree(job, topology)
    except ConfigError as exc:
        raise ConfigError(f"topology={topology!r}: {exc}") from None
