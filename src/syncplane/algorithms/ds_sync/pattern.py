"""DS-Sync's divide-and-shuffle group pattern (pure: numpy only, no processes).

Every iteration partitions the ranks into non-overlapping groups that each average
their parameters (DS-Sync, Wang et al., §III-B). The pattern is periodic and a
deterministic function of (racks, slow ranks, slow racks), so every rank builds the
same one without talking to the others:

- **Static topology** (§III-B1): the ranks of a rack form an intra-rack group, minus
  one *representative* per rack; the representatives form the inter-rack group, so
  each rack uplink carries exactly one of our flows. Representatives rotate through
  the rack every iteration.
- **Slow NIC** (§III-B3): a slow rank stays inside its rack, in a group of two with a
  regular partner; the partner rotates, so the rack's large group works as the hub
  that swaps members with the pair and with the inter-rack group.
- **Slow rack uplink** (§III-B2, three or more racks): the slow rack's representative
  pairs with one regular representative, rotating over the regular racks; the other
  representatives form the large inter-rack group.

Why the period product matters: iteration k applies the averaging matrix ``W_k``
(``1/|g|`` inside each group). Each ``W_k`` is an orthogonal projection, so the product
``P`` of one period contracts every disagreement vector, ``‖P − 11ᵀ/n‖₂ < 1``, exactly
when the union of the period's groups connects all ranks (Lemma IV.1's ρ < 1).
``λ₂`` here is that norm -- the second largest singular value of ``P``, an upper
bound on its second largest eigenvalue modulus -- checked when a pattern is built.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import chain
from dataclasses import dataclass
from functools import cached_property

import networkx as nx
import numpy as np

Group = tuple[int, ...]
MAX_PERIOD = 5040            # lcm of rack sizes; beyond this the pattern is unreasonable to precompute
LAMBDA2_TOLERANCE = 1e-9


class PatternError(ValueError):
    """A group pattern that is not a partition, or whose period does not mix all ranks."""


def check_partition(groups: Iterable[Sequence[int]], world_size: int, where: str = "groups") -> None:
    """Raise PatternError unless ``groups`` cover ranks 0..world_size-1 exactly once each."""
    members = list(chain.from_iterable(groups))
    if sorted(members) == list(range(world_size)):
        return
    seen: dict[int, int] = {}
    for r in members:
        seen[r] = seen.get(r, 0) + 1
    missing = sorted(set(range(world_size)) - set(seen))
    duplicated = sorted(r for r, c in seen.items() if c > 1)
    outside = sorted(r for r in seen if not 0 <= r < world_size)
    if missing or duplicated or outside:
        parts = [f"missing ranks {missing}" if missing else "", f"ranks in more than one group {duplicated}"
                 if duplicated else "", f"ranks outside 0..{world_size - 1}: {outside}" if outside else ""]
        raise PatternError(f"{where} do not partition the {world_size} ranks: " + "; ".join(p for p in parts if p))


@dataclass(frozen=True)
class GroupPattern:
    """One period of groups: ``iterations[k]`` is the partition used at steps ≡ k (mod period)."""

    world_size: int
    iterations: tuple[tuple[Group, ...], ...]

    def __post_init__(self) -> None:
        if not self.iterations:
            raise PatternError("a pattern needs at least one iteration")
        for k, groups in enumerate(self.iterations):
            check_partition(groups, self.world_size, where=f"iteration {k}'s groups")

    @property
    def period(self) -> int:
        return len(self.iterations)

    def groups_at(self, step: int) -> tuple[Group, ...]:
        return self.iterations[step % self.period]

    def group_of(self, rank: int, step: int) -> Group:
        return next(g for g in self.groups_at(step) if rank in g)

    def communicating_groups(self) -> list[Group]:
        """Every group of two or more ranks the pattern uses, in a fixed order (process groups)."""
        return sorted({g for groups in self.iterations for g in groups if len(g) > 1})

    def mixing_matrix(self, k: int) -> np.ndarray:
        w = np.zeros((self.world_size, self.world_size))
        for g in self.iterations[k]:
            w[np.ix_(g, g)] = 1.0 / len(g)
        return w

    def period_product(self) -> np.ndarray:
        """``P = W_{T−1}⋯W_0``, each ``W_k`` applied as the row averages of its groups (O(n²) per
        iteration, not the O(n³) of a dense product)."""
        return self._applied_to(np.eye(self.world_size))

    def _applied_to(self, x: np.ndarray) -> np.ndarray:
        """``P x``: every iteration's row averages, in order."""
        for groups in self.iterations:
            x = _average_rows(x, groups)
        return x

    @cached_property
    def lambda2(self) -> float:
        """``‖P − 11ᵀ/n‖₂`` of the period product ``P = W_{T−1}⋯W_0``: < 1 iff one period
        mixes all ranks."""
        n = self.world_size
        if n == 1:
            return 0.0
        # P − 11ᵀ/n repeats a row for every rank of a last-iteration group and a column for
        # every rank of a first-iteration group: A = E_r C E_cᵀ with E the group indicators,
        # so ‖A‖₂ = ‖D_r^½ C D_c^½‖₂ (D: group sizes) -- a groups × groups SVD, not n × n.
        # C needs P's columns only for one rank of each first-iteration group: P applied to
        # those unit vectors (O(n) per column per iteration, not the O(n²) of the whole product).
        rows, cols = self.iterations[-1], self.iterations[0]
        units = np.zeros((n, len(cols)))
        units[[g[0] for g in cols], np.arange(len(cols))] = 1.0
        reduced = self._applied_to(units)[[g[0] for g in rows]] - 1.0 / n
        reduced *= np.sqrt([len(g) for g in rows])[:, None] * np.sqrt([len(g) for g in cols])[None, :]
        return float(np.linalg.norm(reduced, 2))

    def check_mixing(self) -> None:
        if self.lambda2 >= 1.0 - LAMBDA2_TOLERANCE:
            parts = _components(self.world_size, self.communicating_groups())
            raise PatternError(f"the group pattern never mixes all ranks (λ₂ of the period product = "
                               f"{self.lambda2:.6f} ≥ 1): ranks stay in separate components {parts}")


def _average_rows(x: np.ndarray, groups: Sequence[Group]) -> np.ndarray:
    """``W x`` for the averaging matrix ``W`` of ``groups`` (a partition of x's rows): every
    row replaced by its group's mean, in a few whole-array operations rather than one per
    group."""
    sizes = np.array([len(g) for g in groups], dtype=np.intp)
    order = np.fromiter(chain.from_iterable(groups), dtype=np.intp, count=len(x))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    out = np.empty_like(x)
    out[order] = np.repeat(np.add.reduceat(x[order], starts, axis=0) / sizes[:, None], sizes, axis=0)
    return out


def _components(n: int, groups: Iterable[Group]) -> list[list[int]]:
    """Ranks that ever average together (transitively), as sorted components."""
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    for g in groups:
        graph.add_edges_from((g[0], r) for r in g[1:])
    return sorted(sorted(c) for c in nx.connected_components(graph))


def build_pattern(racks: Sequence[Sequence[int]], slow_ranks: Iterable[int] = (),
                  slow_racks: Iterable[int] = ()) -> GroupPattern:
    """The DS-Sync pattern for ``racks`` (rank lists) with the given bottlenecks.

    A slow rank is split off only when its rack has enough regular ranks (a partner per
    slow rank, a representative, and one more); a slow rack only when there are at least
    as many regular racks. Otherwise that bottleneck stays where it is (nothing smaller
    exists to put it in). The period mixes all ranks by construction, for any racks of
    any sizes: where the rotations alone do not connect every rank, two connecting
    iterations are appended (``_with_connector``). Raises PatternError only if the racks
    do not partition the ranks or a slow rack does not exist.
    """
    racks = [sorted(r) for r in racks]
    world = sum(len(r) for r in racks)
    check_partition(racks, world, where="racks")
    multi = len(racks) > 1
    slow = set(slow_ranks)
    regular: list[list[int]] = []
    split: list[list[int]] = []
    for members in racks:
        s = [r for r in members if r in slow]
        reg = [r for r in members if r not in slow]
        if s and len(reg) >= len(s) + (1 if multi else 0) + 1:
            regular.append(reg)
            split.append(s)
        else:
            regular.append(members)
            split.append([])
    slow_r = sorted(set(slow_racks)) if multi else []
    unknown = [k for k in slow_r if not 0 <= k < len(racks)]
    if unknown:
        raise PatternError(f"slow racks {unknown} do not exist (racks 0..{len(racks) - 1})")
    fast_r = [k for k in range(len(racks)) if k not in slow_r]
    if len(fast_r) < len(slow_r) or len(racks) < 3:
        slow_r, fast_r = [], list(range(len(racks)))
    pairing = len(fast_r) if slow_r else 1
    base = math.lcm(*(len(reg) for reg in regular), pairing)
    if base > MAX_PERIOD:
        # Rack sizes with a huge lcm (9, 13, 5, ...): a shorter period in which every rank
        # still takes every role (representative, partner) at least once.
        base = max(len(reg) for reg in regular) * pairing
    pattern = _pattern(world, regular, split, slow_r, fast_r, base, shift=False)
    longest = max(len(r) for r in regular)
    if pattern.lambda2 >= 1.0 - LAMBDA2_TOLERANCE and multi and base * longest <= MAX_PERIOD:
        # Racks of ≤ 2 regular ranks have no intra-rack group to mix through, and reps that
        # rotate in lockstep always meet the same partners: shift rack k's rotation by k
        # every period so the representatives meet every combination.
        pattern = _pattern(world, regular, split, slow_r, fast_r, base * longest, shift=True)
    if pattern.lambda2 >= 1.0 - LAMBDA2_TOLERANCE:
        pattern = _with_connector(pattern, racks)
    pattern.check_mixing()
    return pattern


def _with_connector(pattern: GroupPattern, racks: list[list[int]]) -> GroupPattern:
    """``pattern`` with two iterations appended that connect every rank by themselves, so
    the period mixes by construction (its union of groups is connected, Lemma IV.1):
    every rack averages as a whole (no uplink used), then one representative per rack
    averages across racks while the rest of each rack averages inside it (one flow per
    uplink). Needed only where the rotations alias -- racks of one or two regular ranks
    whose representative turns come up exactly when their rack is paired off, say; costs
    two of the period's iterations (the slow members' splits do not apply in them)."""
    whole = tuple(sorted(tuple(r) for r in racks))
    reps = tuple(sorted(r[0] for r in racks))
    rests = [tuple(r[1:]) for r in racks if len(r) > 1]
    across = tuple(sorted([reps, *rests])) if len(racks) > 1 else whole
    connector = (whole,) if across == whole else (whole, across)
    return GroupPattern(pattern.world_size, pattern.iterations + connector)


def _pattern(world: int, regular: list[list[int]], split: list[list[int]], slow_r: list[int], fast_r: list[int],
             period: int, shift: bool) -> GroupPattern:
    if period > MAX_PERIOD:
        raise PatternError(f"pattern period {period} exceeds {MAX_PERIOD} (regular ranks per rack "
                           f"{[len(r) for r in regular]})")
    multi = len(regular) > 1
    base = period // max(len(r) for r in regular) if shift else period
    iterations = []
    for t in range(period):
        groups: list[Group] = []
        reps = []
        for k, (reg, s) in enumerate(zip(regular, split)):
            pos = t + (t // base) * k if shift else t
            rep = reg[pos % len(reg)] if multi else None
            offset = 1 if multi else 0
            partners = [reg[(pos + offset + i) % len(reg)] for i in range(len(s))]
            groups += [tuple(sorted((a, b))) for a, b in zip(s, partners)]
            groups.append(tuple(r for r in reg if r != rep and r not in partners))
            reps.append(rep)
        if multi:
            paired = {fast_r[(t + i) % len(fast_r)]: k for i, k in enumerate(slow_r)}
            groups += [tuple(sorted((reps[k], reps[f]))) for f, k in paired.items()]
            groups.append(tuple(sorted(reps[k] for k in fast_r if k not in paired)))
        iterations.append(tuple(sorted(g for g in groups if g)))
    return GroupPattern(world, tuple(iterations))


@dataclass(frozen=True)
class Candidates:
    """The patterns adjustment may switch between, all known at setup (so are their groups):
    the initial one and, for every rank or rack that could become a new bottleneck, the
    initial one with that bottleneck split off."""

    keys: tuple[str, ...]
    patterns: tuple[GroupPattern, ...]

    def index(self, key: str) -> int:
        return self.keys.index(key)

    def communicating_groups(self) -> list[Group]:
        return sorted({g for p in self.patterns for g in p.communicating_groups()})


def candidate_patterns(racks: Sequence[Sequence[int]], slow_ranks: Iterable[int] = (),
                       slow_racks: Iterable[int] = ()) -> Candidates:
    slow_ranks, slow_racks = sorted(set(slow_ranks)), sorted(set(slow_racks))
    base = build_pattern(racks, slow_ranks, slow_racks)
    keys, patterns = ["base"], [base]
    world = base.world_size
    for r in range(world):
        if r not in slow_ranks:
            p = build_pattern(racks, [*slow_ranks, r], slow_racks)
            if p != base:
                keys.append(f"rank{r}")
                patterns.append(p)
    for k in range(len(racks)):
        if k not in slow_racks:
            p = build_pattern(racks, slow_ranks, [*slow_racks, k])
            if p != base:
                keys.append(f"rack{k}")
                patterns.append(p)
    return Candidates(tuple(keys), tuple(patterns))


def ring_time_s(group: Group, payload_bytes: float, bandwidth: np.ndarray) -> float:
    """α-free time of a ring all-reduce over ``group`` with the pairwise ``bandwidth`` (bytes/s):
    every ring link carries 2(n−1)/n of the payload; the slowest link decides."""
    n = len(group)
    if n < 2:
        return 0.0
    slowest = min(bandwidth[group[i], group[(i + 1) % n]] for i in range(n))
    return 2 * (n - 1) / n * payload_bytes / slowest
