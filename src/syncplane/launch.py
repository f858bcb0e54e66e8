"""What the launcher told this process, read in one place: torchrun's, SLURM's and syncplane's
own variables. The runtime builds the job's context from it (``syncplane.job.JobContext``);
the BlueFog-compatible API (``syncplane.comm``) takes its documented defaults from it (a
machine is ``LOCAL_WORLD_SIZE`` consecutive ranks unless the program says otherwise). Nothing
else in the product reads the launcher's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Variables syncplane's own launcher sets for each rank (beside torchrun's).
CLUSTER_ENV = "SYNCPLANE_CLUSTER"            # the cluster profile the ranks were placed on
LIGHTHOUSE_ENV = "SYNCPLANE_LIGHTHOUSE"      # elastic: the quorum service's address
REPLICA_ENV = "SYNCPLANE_REPLICA"            # elastic: this replica's index
REPLICAS_ENV = "SYNCPLANE_REPLICAS"          # elastic: replicas at start
RESTART_ENV = "SYNCPLANE_RESTART_COUNT"      # elastic: how often this replica was restarted
ELASTIC_DIR_ENV = "SYNCPLANE_ELASTIC_DIR"    # elastic: the folder replicas share (barrier, history)
#: The address a replica's servers bind when the launcher places it (an emulated host's NIC).
BIND_ENV = "SYNCPLANE_ELASTIC_BIND"
ELASTIC_KEYS = (REPLICA_ENV, REPLICAS_ENV, LIGHTHOUSE_ENV, ELASTIC_DIR_ENV)


@dataclass(frozen=True)
class Launch:
    """The launcher's variables as typed values; None (or empty) where the launcher set none."""

    rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    local_rank: int | None = None
    node_rank: str | None = None
    interfaces: tuple[str, ...] = ()
    master_addr: str = ""
    cluster: str | None = None
    elastic_vars: Mapping[str, str] | None = None   # the elastic variables that are set

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Launch:
        env = os.environ if environ is None else environ

        def number(*names: str) -> int | None:
            for name in names:
                value = env.get(name)
                if value not in (None, ""):
                    try:
                        return int(value)
                    except ValueError:
                        raise ValueError(f"{name}={value!r}: expected a whole number") from None
            return None

        elastic = {k: env[k] for k in (*ELASTIC_KEYS, RESTART_ENV, BIND_ENV) if env.get(k)}
        return cls(
            rank=number("RANK", "SLURM_PROCID"),
            world_size=number("WORLD_SIZE", "SLURM_NTASKS"),
            local_world_size=number("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"),
            local_rank=number("LOCAL_RANK", "SLURM_LOCALID"),
            node_rank=env.get("GROUP_RANK") or env.get("NODE_RANK") or env.get("SLURM_NODEID") or None,
            interfaces=tuple(n.strip() for n in env.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()),
            master_addr=env.get("MASTER_ADDR", ""),
            cluster=env.get(CLUSTER_ENV) or None,
            elastic_vars=elastic,
        )

    @property
    def elastic(self) -> Mapping[str, str] | None:
        """The elastic variables, when all of ``ELASTIC_KEYS`` are set (elastic mode); else None."""
        return self.elastic_vars if not self.missing_elastic() else None

    def missing_elastic(self) -> list[str]:
        """The elastic variables this process lacks (empty in elastic mode)."""
        return [k for k in ELASTIC_KEYS if k not in (self.elastic_vars or {})]
