"""FlexReduce's planner (paper §III-B, Fig. 3: ``FlexReduce_plan``/``assign_range``): a pure
function of the tree and the element count, no torch.distributed.

Every leaf (rank) starts with portion 1 (all n items) and range [0, n). The branch
nodes are visited level by level, bottom-up; at a branch x every leaf below x has its
portion divided by x's degree, then ``assign_range`` gives the leaves new contiguous,
non-overlapping ranges: leaves sorted by their current range's end, then its start,
then their name (rank), each takes ``[progress, progress + portion)``. The new range
is cut wherever the set of leaves that currently hold the data changes; each piece is
one *reduce call*: its holders (exactly one per child of x: each child's subtree
partitions [0, n) after the levels below) send their partial sums to the new owner.
The all-gather is the same calls in reverse, owners broadcasting to the holders.

Portions are exact fractions of n (``Fraction``); a boundary q maps to the element
``floor(q·n)``. The map is monotone, so ranges still partition [0, n), holders stay
holders, and a piece that rounds to nothing is dropped -- tiny element counts give
correct, merely emptier plans.

What a rank sums, and in which order, depends only on the tree (the holders are one
per child, summed in child order), never on where the ranges fall: the result is the
same for any element count and any range assignment.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise

from syncplane.exchanges.tree.tree import FlexTree, Node

Interval = tuple[int, int]
_CACHE_LIMIT = 64    # plans (and fractional plans) kept per process


@dataclass(frozen=True)
class Call:
    """One reduce (reduce-scatter) / broadcast (all-gather) call of a level: items [lo, hi)."""

    level: int
    lo: int
    hi: int
    holders: tuple[int, ...]   # ranks with a partial sum of [lo, hi), one per child of the branch, in child order
    owner: int                 # the rank that owns [lo, hi) after this level

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def participants(self) -> tuple[int, ...]:
        """Every rank taking part (the owner may hold no partial sum of the piece itself)."""
        return tuple(sorted({*self.holders, self.owner}))

    @property
    def senders(self) -> tuple[int, ...]:
        """Holders other than the owner: they send [lo, hi) up (reduce) and receive it back (broadcast)."""
        return tuple(h for h in self.holders if h != self.owner)


@dataclass(frozen=True)
class Plan:
    """The planner's output for one (tree, numel): calls per level, ranges per level and rank."""

    tree_key: tuple
    numel: int
    world_size: int
    levels: tuple[tuple[Call, ...], ...]          # reduce-scatter order; the all-gather runs it reversed
    ranges: tuple[tuple[Interval, ...], ...]      # ranges[l][r]: what rank r owns after level l
    branch_names: tuple[tuple[str, ...], ...]     # the branch nodes of each level (for descriptions)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def check(self, numel: int) -> None:
        """A plan is for one element count; using it for another would read past its ranges."""
        if numel != self.numel:
            raise ValueError(f"flexreduce: this plan was made for {self.numel} elements, the tensor has {numel} "
                             f"(plan again with plan_for(tree, {numel}))")

    def final_range(self, rank: int) -> Interval:
        return self.ranges[-1][rank] if self.ranges else (0, self.numel)

    def rank_view(self, rank: int) -> list[list[tuple[Interval, tuple[int, ...], int]]]:
        """Per level, the (range, participants, owner) of every call ``rank`` takes part in."""
        return [[((c.lo, c.hi), c.participants, c.owner) for c in calls if rank in c.participants]
                for calls in self.levels]

    def reduce_calls(self, rank: int) -> list[int]:
        """Per level, how many reduce calls ``rank`` owns (the paper's N_calls(v, l), Fig. 4c)."""
        return [sum(1 for c in calls if c.owner == rank) for calls in self.levels]

    def flows(self, level: int, element_size: int = 1, gather: bool = False) -> list[tuple[int, int, int]]:
        """(src, dst, bytes) of one level: holders → owner (reduce) or owner → holders (broadcast)."""
        out = []
        for c in self.levels[level]:
            for h in c.senders:
                out.append((c.owner, h, c.size * element_size) if gather else (h, c.owner, c.size * element_size))
        return out


def _assign_ranges(node: Node, level: int, portion: dict[int, Fraction],
                   current: dict[int, tuple[Fraction, Fraction]],
                   following: dict[int, tuple[Fraction, Fraction]]) -> list[tuple[Fraction, Fraction, tuple[int, ...], int]]:
    """``assign_range`` for branch ``node``: new ranges for its leaves and the pieces (calls)."""
    leaves = node.leaves
    # The invariant the whole algorithm rests on: each child's leaves partition [0, 1), so
    # a piece has exactly one holder per child -- found by bisection in that child's sorted
    # ranges (a scan over all leaves per piece is O(leaves²): minutes at 1,024 ranks).
    children = []
    for child in node.children:
        spans = sorted((current[u][0], current[u][1], u) for u in child.leaves)
        if spans[0][0] != 0 or spans[-1][1] != 1 or any(x[1] != y[0] for x, y in pairwise(spans)):
            raise AssertionError(f"flexreduce planner: the ranges of {child.name}'s leaves at level {level} do not "
                                 f"partition [0, 1): {[(x[0], x[1]) for x in spans]}")
        children.append(([x[0] for x in spans], spans))
    order = sorted(leaves, key=lambda v: (current[v][1], current[v][0], v))
    bounds = sorted({b for u in leaves for b in current[u]})
    pieces = []
    progress = Fraction(0)
    for v in order:
        lo, hi = progress, progress + portion[v]
        progress = hi
        following[v] = (lo, hi)
        cuts = [lo, *bounds[bisect_right(bounds, lo):bisect_left(bounds, hi)], hi]
        for a, b in pairwise(cuts):
            holders = []
            for starts, spans in children:
                start, end, u = spans[bisect_right(starts, a) - 1]
                if not (start <= a and b <= end):
                    raise AssertionError(f"flexreduce planner: items [{a}, {b}) of {node.name} at level {level} "
                                         f"have no holder in one child, expected one per child ({node.degree})")
                holders.append(u)
            pieces.append((a, b, tuple(holders), v))
    if progress != 1:
        raise AssertionError(f"flexreduce planner: {node.name}'s portions sum to {progress}, not 1")
    return pieces


FractionalPlan = tuple[list[list[tuple[Fraction, Fraction, tuple[int, ...], int]]],
                       list[dict[int, tuple[Fraction, Fraction]]], list[dict[int, Fraction]]]
_FRACTIONAL: dict[tuple, FractionalPlan] = {}


def fractional_plan(tree: FlexTree) -> FractionalPlan:
    """The plan on [0, 1): per level its pieces, the ranges after it and the portions after it.
    Cached per tree shape (exact fractions: seconds at 1,024 ranks, and every element count's
    plan, the executor and the cost model start from it); callers read it, never change it."""
    key = tree.key()
    cached = _FRACTIONAL.get(key)
    if cached is None:
        if len(_FRACTIONAL) >= _CACHE_LIMIT:
            _FRACTIONAL.pop(next(iter(_FRACTIONAL)))
        cached = _FRACTIONAL[key] = _fractional_plan(tree)
    return cached


def pairwise_root(tree: FlexTree) -> bool:
    """True when the root can be a swap (``executor``): every piece of its level has two
    holders, one of which owns it -- a root of two children on an even enough tree. From
    the fractions, so it holds for every element count."""
    levels, _, _ = fractional_plan(tree)
    return bool(levels) and all(len(holders) == 2 and owner in holders for _, _, holders, owner in levels[-1])


def _fractional_plan(tree: FlexTree) -> FractionalPlan:
    portion = {r: Fraction(1) for r in range(tree.world_size)}
    current = {r: (Fraction(0), Fraction(1)) for r in range(tree.world_size)}
    levels, ranges, portions = [], [], []
    for level, nodes in enumerate(tree.levels()):
        following = dict(current)
        pieces = []
        for node in nodes:
            for v in node.leaves:
                portion[v] /= node.degree
            pieces += _assign_ranges(node, level, portion, current, following)
        levels.append(pieces)
        ranges.append(following)
        portions.append(dict(portion))
        current = following
    return levels, ranges, portions


def make_plan(tree: FlexTree, numel: int) -> Plan:
    """Plan the all-reduce of ``numel`` elements on ``tree`` (uncached; see ``plan_for``)."""
    if numel < 0:
        raise ValueError(f"flexreduce: numel must be >= 0, got {numel}")

    def at(q: Fraction) -> int:
        return (q.numerator * numel) // q.denominator

    frac_levels, frac_ranges, _ = fractional_plan(tree)
    levels = []
    for level, pieces in enumerate(frac_levels):
        calls = [Call(level, at(a), at(b), holders, owner) for a, b, holders, owner in pieces]
        levels.append(tuple(c for c in calls if c.size > 0))
    ranges = tuple(tuple((at(rng[r][0]), at(rng[r][1])) for r in range(tree.world_size)) for rng in frac_ranges)
    names = tuple(tuple(n.name for n in nodes) for nodes in tree.levels())
    return Plan(tree_key=tree.key(), numel=numel, world_size=tree.world_size, levels=tuple(levels), ranges=ranges,
                branch_names=names)


_CACHE: dict[tuple[tuple, int], Plan] = {}


def plan_for(tree: FlexTree, numel: int) -> Plan:
    """``make_plan``, cached per (tree shape, numel): planning is serial work (paper §III-B)
    that every bucket of every step would otherwise repeat."""
    key = (tree.key(), numel)
    plan = _CACHE.get(key)
    if plan is None:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.pop(next(iter(_CACHE)))
        plan = _CACHE[key] = make_plan(tree, numel)
    return plan


# ----------------------------------------------------------------------------- analysis


def calls_bound(tree: FlexTree, rank: int, level: int) -> int:
    """The paper's upper bound on ``rank``'s reduce calls at ``level`` (Eq. 12; "Eq. 8" in
    its §V text): Σ over the children m of the rank's branch at this level of
    ⌈portion_v(level) / min_{u ∈ leaves(m)} portion_u(level−1)⌉, plus one. 0 when the rank
    has no branch at this level (it keeps its range)."""
    node = next((n for n in tree.levels()[level] if rank in n.leaves), None)
    if node is None:
        return 0
    _, _, portions = fractional_plan(tree)
    before = portions[level - 1] if level > 0 else {r: Fraction(1) for r in range(tree.world_size)}
    mine = portions[level][rank]
    return 1 + sum(math.ceil(mine / min(before[u] for u in child.leaves)) for child in node.children)


def link_bytes(tree: FlexTree, plan: Plan, level: int, element_size: int = 1,
               gather: bool = False) -> dict[str, tuple[int, int]]:
    """Per tree edge (named by its lower node): (bytes up, bytes down) one level moves."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    nodes = [n for n in tree.root.walk() if n is not tree.root]
    for src, dst, nbytes in plan.flows(level, element_size, gather):
        for node in nodes:
            inside_src, inside_dst = src in node.leaves, dst in node.leaves
            if inside_src and not inside_dst:
                out[node.name][0] += nbytes
            elif inside_dst and not inside_src:
                out[node.name][1] += nbytes
    return {k: (v[0], v[1]) for k, v in out.items()}


def describe(tree: FlexTree, plan: Plan, element_size: int = 4) -> str:
    """A readable plan: per level its branches, reduce calls per learner, bytes per link."""
    def mb(n: int) -> str:
        return f"{n / 1e6:.2f} MB" if n >= 10_000 else f"{n} B"

    lines = [f"flexreduce plan: {tree.describe()}, {plan.numel} elements × {element_size} B, "
             f"{plan.num_levels} level(s)"]
    for level, calls in enumerate(plan.levels):
        owned = Counter(c.owner for c in calls)
        per_rank = [owned.get(r, 0) for r in range(plan.world_size)]
        lines.append(f"  level {level} ({', '.join(plan.branch_names[level])}): {len(calls)} reduce calls; "
                     f"per learner {per_rank}")
        for name, (up, down) in sorted(link_bytes(tree, plan, level, element_size).items()):
            lines.append(f"    {name:>10}: up {mb(up)}, down {mb(down)} (reduce-scatter; the all-gather reverses)")
    final = [plan.final_range(r) for r in range(plan.world_size)]
    lines.append("  owned after reduce-scatter: " + ", ".join(f"{r}:[{lo},{hi})" for r, (lo, hi) in enumerate(final)))
    return "\n".join(lines)
