"""The job's shape as one process sees it: ``JobContext``, built once per process and handed down.

Where the ranks are (hosts and racks, ranks per host, this rank's node), the cluster profile
the launcher placed them on, the NICs a host may use, the run directory and, for elastic
DiLoCo, the replica's place in the quorum. The runtime builds it from the config and the
launcher (``from_environment``, over ``syncplane.launch``); strategies, algorithms and
exchanges read it as an argument and never look at ``os.environ`` for the job's shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from syncplane.cluster.profile import ClusterProfile, load_profile
from syncplane.config import ConfigError
from syncplane.launch import BIND_ENV, ELASTIC_DIR_ENV, LIGHTHOUSE_ENV, REPLICA_ENV, REPLICAS_ENV, RESTART_ENV, Launch

@dataclass(frozen=True)
class ElasticPlace:
    """An elastic replica's place in the job: set by the launcher's elastic mode, or by torchft's
    variables for a replica that ``torchrun`` started (``syncplane.launch.TORCHFT_KEYS``;
    ``restarts`` is then torchrun's restart count)."""

    replica: int
    replicas: int
    lighthouse: str
    folder: Path
    restarts: int = 0
    bind: str | None = None


@dataclass(frozen=True)
class JobContext:
    """The job's shape (module docstring). Every field has the value of a one-process job by
    default, so a unit test builds what it needs: ``JobContext(world_size=4, local_world_size=2)``.

    Attributes:
        rank, world_size: this process and the job's size.
        local_world_size: ranks on this host as launched (torchrun's ``LOCAL_WORLD_SIZE``);
            None when no launcher said.
        local_rank: this process's index on its host.
        node_rank: the launcher's node id (``GROUP_RANK`` / ``NODE_RANK``); None without one.
        cluster: the cluster profile (a shipped name or a YAML path) the ranks were placed on.
        interfaces: the NICs this host's gloo groups may bind (stream s on NIC s mod k).
        run_dir: the run's output folder.
        elastic: the elastic replica's place, in elastic mode.
        master_addr: the rendezvous address (part of the probe cache's key).
    """

    rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None
    local_rank: int | None = None
    node_rank: str | None = None
    cluster: str | None = None
    interfaces: tuple[str, ...] = ()
    run_dir: Path | None = None
    elastic: ElasticPlace | None = field(default=None, compare=False)
    master_addr: str = ""

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, *, rank: int | None = None,
                         world_size: int | None = None, run_dir: Path | str | None = None) -> JobContext:
        """The context of a process started by torchrun, ``srun`` or syncplane's launcher (or of
        a plain process: one rank, no hosts known). ``rank``/``world_size`` default to the
        launcher's ``RANK``/``WORLD_SIZE``."""
        try:
            launch = Launch.read(environ)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cls(
            rank=rank if rank is not None else launch.rank or 0,
            world_size=world_size if world_size is not None else launch.world_size or 1,
            local_world_size=launch.local_world_size,
            local_rank=launch.local_rank,
            node_rank=launch.node_rank,
            cluster=launch.cluster,
            interfaces=launch.interfaces,
            run_dir=Path(run_dir) if run_dir is not None else None,
            elastic=_elastic_place(launch.elastic),
            master_addr=launch.master_addr,
        )

    @classmethod
    def planned(cls, world_size: int, profile: ClusterProfile | None = None) -> JobContext:
        """The job as the launching process plans it before any rank starts: ``world_size``
        ranks on this machine, or on the emulated cluster ``profile`` (already loaded)."""
        job = cls(world_size=world_size, cluster=profile.name if profile is not None else None)
        if profile is not None:
            job.__dict__["profile"] = profile     # the cached_property's slot: no second load
        return job

    def on_cluster(self, cluster: str | Path | ClusterProfile) -> JobContext:
        """The same job placed on ``cluster`` (a shipped profile name, a YAML path, or a profile
        object): what a strategy's ``cluster`` argument gives, in place of the launcher's
        ``SYNCPLANE_CLUSTER`` (the fallback). The profile is loaded here, once: a bad one
        fails when the strategy is built, naming it."""
        profile = cluster if isinstance(cluster, ClusterProfile) else load_profile(cluster)
        name = str(cluster) if not isinstance(cluster, ClusterProfile) else profile.name
        job = replace(self, cluster=name)
        job.__dict__["profile"] = profile     # the cached_property's slot: no second load
        return job

    def with_size(self, rank: int, world_size: int) -> JobContext:
        """The same job seen by ``rank`` of ``world_size`` (what the process group says)."""
        job = replace(self, rank=rank, world_size=world_size)
        if "profile" in self.__dict__:
            job.__dict__["profile"] = self.__dict__["profile"]   # loaded once, kept
        return job

    @cached_property
    def profile(self) -> ClusterProfile | None:
        """The cluster profile the ranks were placed on, loaded once; None without one."""
        return load_profile(self.cluster) if self.cluster else None

    def profile_for(self, topology: str | Sequence[int] = "auto") -> ClusterProfile | None:
        """The profile a strategy's ``topology`` setting names: ``auto`` = the job's own; a
        shipped name or YAML path = that one; ranks per host (a list) = none."""
        if not isinstance(topology, str):
            return None
        return self.profile if topology == "auto" else load_profile(topology)

    def hosts(self) -> list[list[int]]:
        """The ranks of each host: the profile's hosts, else blocks of ``local_world_size``
        consecutive ranks (torchrun and ``srun`` number a node's ranks together), else one
        host of every rank."""
        profile = self.profile
        if profile is not None:
            profile.check_world_size(self.world_size, where="world size")
            return [list(h.ranks) for h in profile.hosts]
        local = self.local_world_size or self.world_size
        if local < 1 or self.world_size % local:
            raise ConfigError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {self.world_size}")
        return [list(range(first, first + local)) for first in range(0, self.world_size, local)]


def _elastic_place(elastic: Mapping[str, str] | None) -> ElasticPlace | None:
    if elastic is None:
        return None
    return ElasticPlace(replica=int(elastic[REPLICA_ENV]), replicas=int(elastic[REPLICAS_ENV]),
                        lighthouse=elastic[LIGHTHOUSE_ENV], folder=Path(elastic[ELASTIC_DIR_ENV]).absolute(),
                        restarts=int(elastic.get(RESTART_ENV) or 0), bind=elastic.get(BIND_ENV) or None)


def missing_elastic(environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables an elastic replica lacks (empty when it has them all): torchft's, unless
    syncplane's launcher set some of its own."""
    return Launch.read(environ).missing_elastic()
