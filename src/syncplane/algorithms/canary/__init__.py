"""Canary (Zhou et al., paper 004): the gradient sketch and the piece-level exchange (the
paper's mesh; its cube on BCube; nested by host and rack where the ranks are grouped).

Files: ``config.py`` (validated settings), ``engine.py`` (colayers through the piece-level
exchange, error feedback in the rank state), ``gei.py`` (bounded staleness), ``compensation.py`` (what staleness does to momentum
and the synchronous warm-up before it starts), ``bench.py``. The codec is
``syncplane.comm.GradientSketch`` (compiled kernels in ``csrc``); the exchange is the
exchange layer's piece mesh, nested or cube exchange (``syncplane.exchanges``; ``exchange.make_transport``
picks through ``syncplane.exchanges.choose``), run by ``syncplane.comm.StreamRunner``.
Glue: ``strategies/canary.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from syncplane.algorithms.canary.bench import CanaryStep, colayer_config, sketch_ratio
from syncplane.algorithms.canary.exchange import EXCHANGES, check_job, innermost_is_host
from syncplane.algorithms.canary.config import CanaryConfig
from syncplane.algorithms.canary.gei import GEI, check_bounds
from syncplane.algorithms.canary.compensation import MomentumCompensation, compensated_momentum
from syncplane.algorithms.canary.engine import BackwardPipeline, CanaryEngine, ExchangeFailed
from syncplane.job import JobContext
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions
from syncplane.cluster.cost import Phase
from syncplane.exchanges import JobShape, choose, digit, mesh
from syncplane.cluster.profile import ClusterProfile
from syncplane.exchanges.cpu import CpuWork


def canary_cost(name: str, profile: ClusterProfile, payload_bytes: float,
                options: CostOptions) -> list[list[Phase]]:
    """One exchange per step of the sketched payload (~0.27 of fp32), as training would pick it
    (``options.pattern`` through ``syncplane.exchanges.choose``): on a BCube profile the
    two-stage cube exchange (β pieces per rank, one-hop links only, every NIC at once); where
    the ranks are grouped in hosts or racks the nested exchange, over ``streams``; else the
    flat piece mesh."""
    n = profile.world_size
    shape = JobShape.of_profile(profile)
    chosen = choose(options.pattern, shape, allowed=EXCHANGES, exact=False, strict=False)
    if chosen.name == "cube" and profile.bcube is not None:
        ratio = sketch_ratio(max(1, int(payload_bytes // 4)), max(1, n * profile.bcube.beta))
        return [digit.cube_cost(profile, payload_bytes * ratio)]
    radices = shape.radices
    streams = options.streams or profile.max_nics     # 0: nics=auto, one per NIC
    if chosen.name == "nested" and radices is not None:
        exact = [0] if innermost_is_host(radices, profile.hosts[0].spec.ranks) else []   # as make_transport picks
        streams *= 2 if exact and not options.streams else 1                  # as plan_exchange doubles auto
        ratio = sketch_ratio(max(1, int(payload_bytes // 4)), max(1, n * streams))
        return [digit.nested_cost(radices, payload_bytes * ratio, streams, exact, payload_bytes)]
    ratio = sketch_ratio(max(1, int(payload_bytes // 4)), max(1, n))
    return [mesh.cost(n, payload_bytes * ratio, streams)]


def canary_streams(options: Mapping[str, Any]) -> int:
    """The streams Canary's transport opens: ``nics`` (one gloo group each); 0 for ``auto``,
    which ``canary_cost`` resolves to one per NIC of the profile's hosts, as ``nic_count``
    does with the job's interfaces (the bench's ``shards`` is DiLoCo's, not Canary's)."""
    nics = options.get("nics") or "auto"
    return 0 if nics == "auto" else int(nics)


def canary_cpu(name: str, profile: ClusterProfile, payload_bytes: float, options: CostOptions) -> CpuWork:
    """One step's CPU work for the exchange ``canary_cost`` prices: sketching, decoding and
    summing pieces (``syncplane.exchanges.cpu``; the colayers' work adds up to the payload's;
    with colayers in flight it overlaps the wire, ``canary_parts``); each exchange decodes the
    mean into the colayer itself (no runner's copy, ``syncplane.comm.streams.Result``)."""
    shape = JobShape.of_profile(profile)
    chosen = choose(options.pattern, shape, allowed=EXCHANGES, exact=False, strict=False)
    codec, numel = CanaryConfig().codec(), max(1, int(payload_bytes // 4))
    if chosen.name == "cube" and profile.bcube is not None:
        work = digit.cube_cpu_work(profile.bcube.alpha, profile.bcube.beta, numel, codec)
    elif chosen.name == "nested" and shape.radices is not None:
        exact = [0] if innermost_is_host(shape.radices, profile.hosts[0].spec.ranks) else []
        work = digit.nested_cpu_work(shape.radices, numel, codec, exact)
    else:
        work = mesh.cpu_work(profile.world_size, numel, codec)
    return work


def canary_parts(options: Mapping[str, Any], payload_bytes: float) -> float:
    """The payload over its first colayer when several are in flight (``colayers_in_flight``):
    colayer k+1 is sketched while colayer k is on the wire, so what stands outside the
    pipeline is the first colayer's share; with one in flight, 1 (CPU and wire add up)."""
    config = colayer_config(options)
    if config.colayers_in_flight < 2:
        return 1
    return max(1.0, payload_bytes / config.first_bucket_bytes)


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> CanaryStep:
    return CanaryStep(options, job)


SPEC = AlgorithmSpec(
    family="canary",
    strategies={"canary": "Canary: 8-bit gradient sketch (exact outliers, error feedback), piece-level "
                          "exchange over one gloo group per NIC"},
    bench_step=_step,
    cost=canary_cost,
    streams=canary_streams,
    pattern=lambda options: str(options.get("exchange") or "auto"),
    check_job=check_job,
    variants={"canary": tuple({"exchange": e} for e in EXCHANGES)},
    cpu=canary_cpu,
    parts=canary_parts,
    lanes=lambda options: colayer_config(options).colayers_in_flight,
)

__all__ = ["SPEC", "BackwardPipeline", "CanaryConfig", "CanaryEngine", "CanaryStep", "ExchangeFailed", "GEI", "MomentumCompensation", "check_bounds", "compensated_momentum", "canary_cost", "canary_cpu", "sketch_ratio"]
