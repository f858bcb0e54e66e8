"""Which exchange carries Canary's sketched pieces on this job, and the transport that runs it:
the piece mesh, the nested exchange by host and rack, or BCube's cube (``syncplane.exchanges``),
on ``syncplane.comm.StreamRunner``'s streams, one per NIC. The choice is pure
(``plan_exchange``), so the launching process makes it -- and refuses what the ranks would --
before any rank starts (``check_job``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from syncplane.algorithms.canary.config import CanaryConfig
from syncplane.comm import CommMeter, PhaseProfile, StreamExchange, StreamRunner
from syncplane.config import ConfigError
from syncplane.exchanges import CubeExchange, JobShape, MeshExchange, NestedExchange, choose
from syncplane.job import JobContext

log = logging.getLogger(__name__)


#: The exchanges Canary runs (``syncplane.exchanges.NAMES`` is the vocabulary).
EXCHANGES = ("mesh", "nested", "cube")


def nic_count(nics: int | str, job: JobContext) -> int:
    """``auto``: one stream per NIC the job's hosts may use (1 if none named)."""
    if nics == "auto":
        return max(1, len(job.interfaces))
    return int(nics)


def innermost_is_host(radices: list[int] | None, ranks_per_host: int) -> bool:
    """Whether the nested exchange's level 0 is the ranks of one host (its hop then goes
    through memory, raw): the transport and the cost model decide it here, alike."""
    return bool(radices) and ranks_per_host > 1 and radices[0] == ranks_per_host


def plan_exchange(config: CanaryConfig, job: JobContext) -> tuple[StreamExchange, str]:
    """The exchange pattern ``syncplane.exchanges.choose`` picks from ``config.exchange`` on this
    job, and a line for the log; pure (no process group), so the launching process makes the
    same choice -- and refuses the same settings -- before any rank starts. On a BCube profile
    the two-stage cube all-reduce (one stream per level, i.e. per NIC; ``config.nics`` must
    then be auto or β); where the ranks are grouped in hosts or racks the nested exchange
    (one stream per NIC); else the piece-level mesh, one stream per NIC."""
    shape = JobShape.of_job(job)
    chosen = choose(config.exchange, shape, allowed=EXCHANGES, exact=False)
    streams = nic_count(config.nics, job)
    if chosen.name == "cube":
        alpha, beta = shape.cube or (0, 0)
        if config.nics != "auto" and config.nics != beta:
            raise ConfigError(f"nics: BCube({alpha}, {beta}) gives every host {beta} NICs and the cube exchange "
                              f"uses one per level; set nics=auto or {beta}, got {config.nics}")
        return CubeExchange(alpha, beta), f"two-stage cube exchange on BCube({alpha}, {beta}) ({chosen.reason})"
    if chosen.name == "nested":
        radices = shape.radices or []
        exact = [0] if innermost_is_host(radices, len(job.hosts()[0])) and not config.compress_in_host else []
        if exact and config.nics == "auto":
            # two streams per NIC: one stream's in-host fp32 hop (memory) then overlaps the
            # other's wire hop (docs/strategies/canary.md); with no in-host hop a second stream
            # only adds flows
            streams *= 2
        tree = shape.tree.describe() if shape.tree is not None else "-"
        return (NestedExchange(radices, streams=streams, exact_levels=exact),
                f"nested exchange, levels {radices} (innermost first)"
                f"{' (in-host level exact fp32)' if exact else ''}, {streams} stream(s), tree {tree} ({chosen.reason})")
    return MeshExchange(streams, layout="pieces"), f"piece-level mesh exchange, {streams} stream(s) ({chosen.reason})"


class Lanes:
    """The transport of colayers in flight at once: one ``StreamRunner`` per lane, each on its
    own gloo groups (every stream, one per NIC), so colayer k+1's encoding and in-host hop run
    while colayer k is on the wire. Colayer i always travels on lane ``i mod lanes`` (the
    engine's choice, the same on every rank), and every lane updates the first lane's
    error-feedback residuals (disjoint positions), so the result and the residuals are those
    of one runner taking the colayers one after another, bit for bit. Each lane commits or
    discards its own rounds."""

    def __init__(self, runners: Sequence[StreamRunner]) -> None:
        if not runners:
            raise ValueError("lanes: at least one runner")
        self.runners = list(runners)
        for runner in self.runners[1:]:
            runner.share_residuals(self.runners[0])

    @property
    def lanes(self) -> int:
        return len(self.runners)

    @property
    def exchange(self) -> StreamExchange:
        return self.runners[0].exchange

    @property
    def streams(self) -> int:
        return self.runners[0].streams

    @property
    def profile(self) -> PhaseProfile | None:
        """Where every lane times its rounds' phases (``StreamRunner.profile``), if set."""
        return self.runners[0].profile

    @profile.setter
    def profile(self, profile: PhaseProfile | None) -> None:
        for runner in self.runners:
            runner.profile = profile

    @property
    def failures(self) -> int:
        return sum(r.failures for r in self.runners)

    @property
    def last_error(self) -> str | None:
        return next((r.last_error for r in self.runners if r.last_error), None)

    def allreduce_mean_(self, flat: torch.Tensor, meter: CommMeter | None = None, *, offset: int = 0,
                        total: int | None = None, lane: int = 0) -> bool:
        """``StreamRunner.allreduce_mean_`` on lane ``lane`` (one caller per lane at a time)."""
        return self.runners[lane].allreduce_mean_(flat, meter, offset=offset, total=total)

    def bytes_per_round(self, numel: int) -> int:
        return self.runners[0].bytes_per_round(numel)

    def state_dict(self) -> dict[str, Any]:
        return self.runners[0].state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.runners[0].load_state_dict(state)

    def close(self) -> None:
        for runner in self.runners:
            runner.close()


def make_transport(config: CanaryConfig, job: JobContext) -> Lanes:
    """The exchange ``plan_exchange`` picks, on its streams, ``config.colayers_in_flight``
    lanes of them (a collective; every rank decides alike from the same context)."""
    pattern, what = plan_exchange(config, job)
    if isinstance(pattern, CubeExchange) and job.interfaces and len(job.interfaces) != pattern.beta:
        log.warning("cube exchange: %d levels but %d NIC(s) named (%s); levels share NICs",
                    pattern.beta, len(job.interfaces), ",".join(job.interfaces))
    log.info("canary: %s, %d colayer(s) in flight", what, config.colayers_in_flight)
    return Lanes([StreamRunner(pattern, codec=config.codec(), interfaces=job.interfaces,
                               timeout_s=config.sync_timeout_s) for _ in range(config.colayers_in_flight)])


def check_job(name: str, kwargs: Mapping[str, Any], job: JobContext) -> None:
    """``plan_exchange``'s choice made in the launching process, so that what it would refuse
    on every rank (``exchange: nested`` on ranks that do not nest, the cube's NIC count, a
    BCube host of several ranks) is refused before any rank starts."""
    keys = ("exchange", "nics", "compress_in_host", "colayers_in_flight")
    plan_exchange(CanaryConfig(**{k: kwargs[k] for k in keys if k in kwargs}), job)
