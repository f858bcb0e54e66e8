"""Lightning callbacks around a job's liveness: the heartbeat that stops a job whose rank
hangs (``syncplane.runtime.heartbeat`` says why and how), and the fault a user injects to see
what the job does when a rank is lost (``fault.*``)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from syncplane import launch as launch_env
from syncplane.launch import CLUSTER_ENV
from syncplane.runtime.heartbeat import Heartbeat, exit_now
from syncplane.config import ConfigError
from syncplane.runtime import rendezvous
from syncplane.runtime.settings import FaultSettings

log = logging.getLogger(__name__)


_TRANSPORT = re.compile(r"gloo|nccl|connection|socket|peer|broken pipe|timed out", re.IGNORECASE)


def is_transport_error(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that broke under this rank (torch's ``DistError``
    family, or gloo's plain RuntimeErrors about its connections), rather than this rank's
    own failure, which needs no search for a lost peer."""
    return isinstance(exception, dist.DistError) or (
        isinstance(exception, RuntimeError) and _TRANSPORT.search(str(exception)) is not None)


class HeartbeatCallback(Callback):
    """Beats and watches for the whole of ``fit``, on every rank of a multi-rank job."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.heartbeat: Heartbeat | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.timeout_s <= 0 or not dist.is_initialized() or dist.get_world_size() < 2:
            return
        store, where, prefix = rendezvous.heartbeat_store(self.timeout_s)
        self.heartbeat = Heartbeat(store, dist.get_rank(), dist.get_world_size(), timeout_s=self.timeout_s,
                                   where=where, prefix=prefix, settles=True)
        self.heartbeat.start()
        log.info("heartbeat: every %.1f s; a rank silent for %.0f s stops the job",
                 self.heartbeat.interval_s, self.timeout_s)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # a rank that failed is not done: stop beating without saying so, and its watcher
        # ends the others within the timeout if its exit has not already broken their collectives
        if self.heartbeat is not None:
            # a broken collective (a peer killed, or gone on the heartbeat's verdict): say whom
            # the job lost; the heartbeat goes on beating while it looks, so peers doing the
            # same count this rank as alive
            verdict = (self.heartbeat.find_lost() if is_transport_error(exception)
                       else self.heartbeat.verdict())
            heartbeat, self.heartbeat = self.heartbeat, None
            heartbeat.stop(done=False)
            if verdict is not None:   # said first, then the others are given time to read it (``settle``)
                first = str(exception).strip().splitlines()[0][:160] if str(exception).strip() else ""
                exit_now(f"{verdict} (this rank's own error followed: {type(exception).__name__}: {first})",
                         before_exit=heartbeat.settle)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None


class InjectFault(Callback):
    """Rank ``fault.rank`` fails as ``fault.kind`` says after training step ``fault.step``
    (one callback per fault of the job's ``fault`` list; ``syncplane chaos`` reads the line it
    logs, ``fault: rank R fails (KIND) after step S``, to time the job's reaction).

    In an elastic job the rank is the replica (each replica is a Lightning job of one), and a
    replica the launcher restarted does not fail again: the fault happens once per job."""

    def __init__(self, fault: FaultSettings) -> None:
        self.fault = fault
        self.rank: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        replica = os.environ.get(launch_env.REPLICA_ENV)
        self.rank = trainer.global_rank if replica is None else int(replica)
        world = trainer.world_size if replica is None else int(os.environ[launch_env.REPLICAS_ENV])
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
