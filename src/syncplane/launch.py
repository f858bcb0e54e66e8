"""What the launcher told this process, read in one place: torchrun's, SLURM's, torchft's
(an elastic replica's place) and syncplane's own variables. The runtime builds the job's context from it (``syncplane.job.JobContext``);
the BlueFog-compatible API (``syncplane.comm``) takes its documented defaults from it (a
machine is ``LOCAL_WORLD_SIZE`` consecutive ranks unless the program says otherwise). Nothing
else in the product reads the launcher's environment."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
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
#: torchft's own names for a replica group's place (its torchx component sets the last two per
#: group; the user starts ``torchft_lighthouse``): elastic DiLoCo with one ``torchrun`` job per
#: replica, without syncplane's launcher. Each maps to the syncplane variable beside it.
TORCHFT_KEYS = {"REPLICA_GROUP_ID": REPLICA_ENV, "NUM_REPLICA_GROUPS": REPLICAS_ENV, "TORCHFT_LIGHTHOUSE": LIGHTHOUSE_ENV}
#: the folder torchft-launched replicas share when ``SYNCPLANE_ELASTIC_DIR`` is unset (in the working directory)
DEFAULT_ELASTIC_DIR = "syncplane_elastic"


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
    elastic_vars: Mapping[str, str] | None = None   # the elastic variables that are set (syncplane's names)
    torchft: bool = False   # the elastic place comes from torchft's variables (``TORCHFT_KEYS``)

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
        torchft = not elastic.keys() & set(TORCHFT_KEYS.values()) and any(env.get(k) for k in TORCHFT_KEYS)
        if torchft:
            elastic = _torchft_place(env, number)
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
            torchft=torchft,
        )

    @property
    def elastic(self) -> Mapping[str, str] | None:
        """The elastic variables, when all of ``ELASTIC_KEYS`` are set (elastic mode); else None."""
        return self.elastic_vars if not self.missing_elastic() else None

    def missing_elastic(self) -> list[str]:
        """The elastic variables this process lacks (empty in elastic mode): syncplane's launcher's
        when it set some, else torchft's (what a replica started by ``torchrun`` needs)."""
        have = self.elastic_vars or {}
        if have.keys() & set(TORCHFT_KEYS.values()) and not self.torchft:
            return [k for k in ELASTIC_KEYS if k not in have]
        return [name for name, key in TORCHFT_KEYS.items() if key not in have]


def _torchft_place(env: Mapping[str, str], number: Callable[..., int | None]) -> dict[str, str]:
    """torchft's variables in syncplane's names: the replica group's id and count, the
    lighthouse, torchrun's restart count; the shared folder is ``SYNCPLANE_ELASTIC_DIR``'s, else
    ``DEFAULT_ELASTIC_DIR``."""
    place = {key: env[name] for name, key in TORCHFT_KEYS.items() if env.get(name)}
    replica, replicas = number("REPLICA_GROUP_ID"), number("NUM_REPLICA_GROUPS")
    if replica is not None and replicas is not None and not 0 <= replica < replicas:
        raise ValueError(f"REPLICA_GROUP_ID={replica}: expected 0 to {replicas - 1} (NUM_REPLICA_GROUPS={replicas})")
    place[ELASTIC_DIR_ENV] = env.get(ELASTIC_DIR_ENV) or DEFAULT_ELASTIC_DIR
    restarts = number("TORCHELASTIC_RESTART_COUNT")
    if restarts:
        place[RESTART_ENV] = str(restarts)
    if env.get(BIND_ENV):
        place[BIND_ENV] = env[BIND_ENV]
    return place
