"""``python train.py`` started once per rank by ``torchrun`` or ``srun``: run as that rank.

Lightning's own environment classes tell whether a launcher started us and who we are
(``TorchElasticEnvironment`` for torchrun, ``SLURMEnvironment`` for srun: rank, node,
the first node's address, a port from the job id). SLURM's identity is translated into
torchrun's variables, so the worker -- and everything below it -- sees one convention.

Every rank validates the whole config itself (same errors as a local job, before the
first step), then checks what only a launched rank can: that ``trainer.devices`` is the
number of processes the launcher started on this node, and that the run directory is
one every rank agrees on and can write. The run directory comes from ``hydra.run.dir``
when the user gave one, else from the launcher's job id (``SLURM_JOB_ID``, torchrun's
``--rdzv-id``): Hydra's default ``${now:}`` directory differs from rank to rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from syncplane.config import ConfigError


@dataclass(frozen=True)
class ExternalLaunch:
    """Who this process is in a job another launcher started."""

    launcher: str          # "torchrun" | "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str | None     # the launcher's id for the whole job (same on every rank), if any

    def torchrun_env(self) -> dict[str, str]:
        """torchrun's variables for this rank (what the worker and Lightning read)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.node_rank),
                "NODE_RANK": str(self.node_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def detect() -> ExternalLaunch | None:
    """This process's place in an external launch, or None when ``train.py`` runs alone."""
    env = os.environ
    if not {"TORCHELASTIC_RUN_ID", "SLURM_NTASKS"} & env.keys():
        # neither launcher's mark (the variables Lightning's checks below read): answered without
        # importing Lightning, so that a launcher knows it is one before its first slow import
        return None
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    if TorchElasticEnvironment.detect():
        run_id = env.get("TORCHELASTIC_RUN_ID")
        return ExternalLaunch("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                              int(env["LOCAL_WORLD_SIZE"]), int(env["GROUP_RANK"]), env.get("MASTER_ADDR", ""),
                              int(env.get("MASTER_PORT", "0")), None if run_id in (None, "", "none") else run_id)
    if SLURMEnvironment.detect():
        return _from_slurm(SLURMEnvironment(), env)
    return None


def _from_slurm(slurm: object, env: Mapping[str, str]) -> ExternalLaunch:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    assert isinstance(slurm, SLURMEnvironment)
    world, nodes = slurm.world_size(), int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    local_world = int(per_node.split("(")[0]) if per_node[:1].isdigit() else world // max(nodes, 1)
    return ExternalLaunch("slurm", slurm.global_rank(), world, slurm.local_rank(), local_world, slurm.node_rank(),
                          slurm.main_address, slurm.main_port, env.get("SLURM_JOB_ID"))


def check_devices(devices: int, launch: ExternalLaunch) -> None:
    """``trainer.devices`` means processes per node; it must match what the launcher started."""
    if devices != launch.local_world_size:
        raise ConfigError(
            f"trainer.devices: {devices}, but {launch.launcher} started {launch.local_world_size} processes on this "
            f"node (world size {launch.world_size}); set trainer.devices={launch.local_world_size} or start "
            f"{devices} per node (rank {launch.rank})")
    if launch.world_size % launch.local_world_size:
        raise ConfigError(f"{launch.launcher}: world size {launch.world_size} is not a multiple of "
                          f"{launch.local_world_size} processes per node (rank {launch.rank})")


def run_dir_for(launch: ExternalLaunch, user_dir: Path | None, strategy: str) -> Path:
    """The run directory every rank agrees on: the user's, else one named after the job id."""
    if user_dir is not None:
        return user_dir
    if launch.job_id is None:
        raise ConfigError(
            f"hydra.run.dir: under {launch.launcher} without a job id every rank would pick its own time-stamped "
            "directory; give one shared directory (hydra.run.dir=/shared/runs/NAME) or torchrun --rdzv-id "
            f"(rank {launch.rank})")
    return Path("outputs") / f"{launch.launcher}-{launch.job_id}-{strategy}"


def check_writable(run_dir: Path, rank: int) -> None:
    """Every rank writes a marker in the run directory before any rendezvous, so an
    unwritable or missing shared directory fails on the rank that cannot write, by name."""
    marker = run_dir / f".rank{rank}.writable"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text("ok")
        marker.unlink()
    except OSError as exc:
        raise ConfigError(f"hydra.run.dir: rank {rank} cannot write the run directory {run_dir} "
                          f"({exc.strerror or exc}); every rank needs it (a shared filesystem)") from exc


def adopt(launch: ExternalLaunch, environ: MutableMapping[str, str]) -> None:
    """Put torchrun's variables for this rank into ``environ`` (no-op under torchrun)."""
    environ.update(launch.torchrun_env())
    environ.setdefault("PYTHONUNBUFFERED", "1")
