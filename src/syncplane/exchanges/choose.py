"""One vocabulary and one chooser for the ``exchange`` setting of every algorithm that has one.

Names: ``mesh`` (every rank owns 1/n: the owner exchange; carries any codec), ``tree``
(FlexReduce's plan on the job's tree; exact fp32 only), ``nested`` (the digit exchange by
host and rack; carries any codec; the ranks must nest evenly), ``cube`` (BCube's two-stage
exchange; one rank per host of a BCube profile), ``gather`` (every rank gathers every rank's
encoded piece and decodes them all: the only one that carries a sparse payload, whose sums
would be dense), and ``auto``. An algorithm declares which of them it runs (DiLoCo: mesh,
tree, gather; Canary: mesh, nested, cube). ``auto`` takes the gather for a sparse payload,
else the first that can run of cube, tree, nested, then mesh. ``owner``, the old name of the mesh, is accepted
with a deprecation message.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from syncplane.cluster.profile import ClusterProfile
from syncplane.config import ConfigError
from syncplane.exchanges.tree.tree import FlexTree, from_profile, job_tree
from syncplane.job import JobContext

log = logging.getLogger(__name__)

NAMES = ("auto", "mesh", "tree", "nested", "cube", "gather")
#: Old spellings -> today's names.
LEGACY = {"owner": "mesh"}
#: ``auto``'s order of preference: the most topology-aware pattern that can run.
PREFERENCE = ("cube", "tree", "nested")


def normalize(value: str, key: str = "exchange", allowed: Sequence[str] = NAMES) -> str:
    """``value`` in today's vocabulary, one of ``allowed``; an old spelling is translated with a
    deprecation message; anything else raises ``ValueError`` naming the key and what it takes."""
    if value in LEGACY:
        new = LEGACY[value]
        message = f"{key}: {value!r} is deprecated; it is now called {new!r}"
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        log.warning(message)
        value = new
    if value not in allowed:
        old = [k for k, v in LEGACY.items() if v in allowed]
        raise ValueError(f"{key}: allowed values: {', '.join(allowed)}"
                         + (f" (or the old {', '.join(old)})" if old else "") + f"; got {value!r}")
    return value


def offered(value: str | None, allowed: Sequence[str]) -> str:
    """``value`` in today's vocabulary if the algorithm runs it, else ``auto``: what a bench or
    a plan does with the one ``--exchange`` it gives every family."""
    name = normalize(str(value or "auto"))
    return name if name in allowed else "auto"


@dataclass(frozen=True)
class JobShape:
    """What the chooser needs to know of a job: its tree (levels, how its ranks nest) and
    whether it is a BCube with one rank per host."""

    tree: FlexTree | None
    cube: tuple[int, int] | None = None
    cube_problem: str | None = None     # a BCube profile the cube exchange cannot run on, and why

    @property
    def levels(self) -> int:
        return self.tree.num_levels if self.tree is not None else 1

    @property
    def radices(self) -> list[int] | None:
        """How the ranks nest evenly, innermost level first (None: unevenly)."""
        return self.tree.radices() if self.tree is not None else None

    @classmethod
    def of_profile(cls, profile: ClusterProfile) -> JobShape:
        tree = from_profile(profile) if profile.world_size > 1 else None
        return cls(tree, *_cube(profile))

    @classmethod
    def of_job(cls, job: JobContext, topology: str | Sequence[int] = "auto") -> JobShape:
        """The job's shape (``topology`` as the strategies take it); a single-rank job is flat."""
        if job.world_size < 2:
            return cls(None)
        profile = job.profile_for(topology)
        return cls(job_tree(job, topology), *(_cube(profile) if profile is not None else (None, None)))


def cube_shape(profile: ClusterProfile) -> tuple[int, int] | None:
    """(α, β) on a BCube profile, else None. The cube exchange needs what BCube's addressing
    gives it -- β NICs on every host (the profile checks that) and one rank per host
    (checked here, naming the field)."""
    if profile.bcube is None:
        return None
    for h, host in enumerate(profile.hosts):
        if host.spec.ranks != 1:
            raise ConfigError(f"cluster.racks[0].hosts[{h}].ranks: the cube exchange on "
                              f"BCube({profile.bcube.alpha}, {profile.bcube.beta}) runs one rank per host, "
                              f"host {host.name!r} has {host.spec.ranks}")
    return profile.bcube.alpha, profile.bcube.beta


def _cube(profile: ClusterProfile) -> tuple[tuple[int, int] | None, str | None]:
    try:
        return cube_shape(profile), None
    except ConfigError as exc:
        return None, str(exc)


@dataclass(frozen=True)
class Choice:
    """The exchange an algorithm runs, and why (for the log and the summary)."""

    name: str
    reason: str


def _why_not(name: str, shape: JobShape, exact: bool, sparse: bool = False) -> str | None:
    """Why ``name`` cannot run on this job with this payload (None: it can)."""
    if sparse and name != "gather":
        return (f"{name} sums the pieces on the way, and a sum of sparse (top-k) pieces is dense; "
                "compression='sparse' needs exchange='gather' (or 'auto', which picks it)")
    if name == "tree" and not exact:
        return "the tree carries exact fp32 only"
    if name == "nested" and (shape.radices is None or len(shape.radices) < 2):
        return ("nested needs the ranks grouped in hosts or racks of equal size (at least two groups of two); "
                f"this job's tree is {shape.tree.describe() if shape.tree is not None else 'one rank'}")
    if name == "cube" and shape.cube is None:
        return shape.cube_problem or "cube needs a BCube cluster profile with one rank per host"
    return None


def choose(requested: str, shape: JobShape, *, allowed: Sequence[str], exact: bool,
           strict: bool = True, who: str = "exchange", sparse: bool = False) -> Choice:
    """The exchange to run. ``allowed``: the algorithm's exchanges (mesh always among them);
    ``exact``: the payload is exact fp32 (no lossy codec); ``sparse``: it is a sparse
    codec's (only the gather carries it, and ``auto`` picks it). An explicit name that cannot run
    raises ``ConfigError`` naming the key; with ``strict=False`` (a bench or a plan over
    several algorithms, where one ``--exchange`` is given to all) a name the algorithm does
    not run resolves as ``auto`` instead."""
    name = normalize(requested, who)
    if name != "auto":
        if name not in allowed:
            if strict:
                raise ConfigError(f"{who}: {name!r} is not one of this algorithm's exchanges "
                                  f"({', '.join(('auto', *allowed))})")
            fallback = choose("auto", shape, allowed=allowed, exact=exact, who=who, sparse=sparse)
            return Choice(fallback.name, f"{name} not run by this algorithm; auto: {fallback.reason}")
        problem = _why_not(name, shape, exact, sparse)
        if problem is not None:
            raise ConfigError(f"{who}: {problem}")
        return Choice(name, "as configured")
    if sparse and "gather" in allowed:
        return Choice("gather", "auto: a sparse payload needs the gather")
    if "cube" in allowed and shape.cube_problem is not None:
        raise ConfigError(shape.cube_problem)     # a BCube the cube exchange was made for, set up wrong
    for candidate in PREFERENCE:
        if candidate not in allowed or (candidate != "cube" and shape.levels < 2):
            continue
        if _why_not(candidate, shape, exact) is None:
            return Choice(candidate, _auto_reason(candidate, shape))
    if not exact and "tree" in allowed and shape.levels > 1:
        return Choice("mesh", "auto: a lossy codec needs the mesh")
    return Choice("mesh", "auto: no host/rack hierarchy" if shape.levels <= 1 else "auto: the ranks do not nest evenly")


def _auto_reason(name: str, shape: JobShape) -> str:
    if name == "cube":
        alpha, beta = shape.cube or (0, 0)
        return f"auto: BCube({alpha}, {beta})"
    return "auto: a host/rack hierarchy"
