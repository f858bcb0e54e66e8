"""The fault a user injects to see what the job does when a rank is lost (``fault.*``); the
heartbeat that stops such a job is ``syncplane.runtime.heartbeat_callback``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from syncplane import launch as launch_env
from syncplane.launch import CLUSTER_ENV
from syncplane.config import ConfigError
from syncplane.runtime.settings import FaultSettings

log = logging.getLogger(__name__)


class InjectFault(Callback):
    """Rank ``fault.rank`` fails as ``fault.kind`` says after training step ``fault.step``
    (one callback per fault of the job's ``fault`` list; ``syncplane chaos`` reads the line it
    logs, ``fault: rank R fails (KIND) after step S``, to time the job's reaction).

    In an elastic job the rank is the rank's place in the job of replicas, ``replica·L + local
    rank`` (each replica a Lightning job of L processes, one or a host's), and a replica the
    launcher restarted does not fail again: the fault happens once per job."""

    def __init__(self, fault: FaultSettings) -> None:
        self.fault = fault
        self.rank: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        replica = os.environ.get(launch_env.REPLICA_ENV)
        size = trainer.world_size   # an elastic replica's ranks
        self.rank = trainer.global_rank if replica is None else int(replica) * size + trainer.global_rank
        world = size if replica is None else int(os.environ[launch_env.REPLICAS_ENV]) * size
        if self.fault.rank >= world:
            raise ConfigError(f"fault.rank: {self.fault.rank} is not a rank of this job of {world}")
        if self.fault.kind == "netdown" and CLUSTER_ENV not in os.environ:
            raise ConfigError("fault.kind=netdown: this rank does not run inside an emulated host")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        fault = self.fault
        if self.rank != fault.rank or trainer.global_step != fault.step or os.environ.get(launch_env.RESTART_ENV, "0") != "0":
            return
        log.warning("fault: rank %d fails (%s) after step %d, as fault.* asked", fault.rank, fault.kind, fault.step)
        if fault.kind == "raise":
            raise RuntimeError(f"fault injected: rank {fault.rank} raised after step {fault.step}")
        if fault.kind == "netdown":
            # inside the emulated host's namespace (the config refuses netdown elsewhere):
            # the NICs gloo was given are the host's
            for nic in os.environ.get("GLOO_SOCKET_IFNAME", "").split(","):
                subprocess.run(["ip", "link", "set", "dev", nic, "down"], check=True)
            return
        os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
