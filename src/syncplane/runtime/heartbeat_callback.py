"""The heartbeat as a Lightning callback: every rank beats and watches another for the whole of
``fit`` (``syncplane.runtime.heartbeat`` says why and how), and a rank whose collective broke
names the rank the job lost instead of the transport's error.

Used by ``train.py``'s worker and installed by every syncplane strategy in a plain Lightning
script (``install``), under Lightning's own launcher, ``torchrun`` or SLURM alike.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
from collections.abc import Iterator

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from syncplane.runtime import rendezvous
from syncplane.runtime.heartbeat import DEFAULT_TIMEOUT_S, Heartbeat, exit_now

log = logging.getLogger(__name__)


_TRANSPORT = re.compile(r"gloo|nccl|connection|socket|peer|broken pipe|timed out", re.IGNORECASE)


def is_transport_error(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that broke under this rank (torch's ``DistError``
    family, or gloo's plain RuntimeErrors about its connections), rather than this rank's
    own failure, which needs no search for a lost peer."""
    return isinstance(exception, dist.DistError) or (
        isinstance(exception, RuntimeError) and _TRANSPORT.search(str(exception)) is not None)


class HeartbeatCallback(Callback):
    """Beats and watches for the whole of ``fit``, on every rank of a multi-rank job.

    Every syncplane strategy installs one when the Trainer has none (``install``), so a plain
    Lightning script gets it as ``train.py`` does; pass your own to change the timeout
    (``timeout_s=0``: no heartbeat).

    Args:
        timeout_s: how long a rank may stay silent before it counts as lost (``train.py``'s
            ``trainer.heartbeat_timeout_s``, 15 s by default).
        reap: the rank that finds a rank lost ends it when it runs on the same host
            (``Heartbeat``'s ``reap``): on by default, off under syncplane's launcher.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, reap: bool = True) -> None:
        if timeout_s < 0:
            raise ValueError(f"heartbeat timeout_s: must be >= 0 (0 = no heartbeat), got {timeout_s}")
        self.timeout_s, self.reap = timeout_s, reap
        self.heartbeat: Heartbeat | None = None
        self._fits = 0   # fits started in this process: each watches under keys of its own

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.start()

    def start(self) -> None:
        """Start beating and watching, once per fit (a no-op for one rank or ``timeout_s=0``)."""
        if self.heartbeat is not None or self.timeout_s <= 0 or not dist.is_initialized() \
                or dist.get_world_size() < 2:
            return
        try:
            store, where, prefix = rendezvous.heartbeat_store(self.timeout_s)
        except (RuntimeError, ValueError) as exc:   # a process group made on a store of the script's own
            log.warning("heartbeat off: the job's store (MASTER_ADDR/MASTER_PORT, or %s) did not answer (%s); "
                        "a lost rank will not stop this job", rendezvous.FILE_ENV, exc)
            self.timeout_s = 0.0
            return
        self._fits += 1
        self.heartbeat = Heartbeat(store, dist.get_rank(), dist.get_world_size(), timeout_s=self.timeout_s,
                                   where=where, prefix=f"{prefix}/fit{self._fits}", settles=True, reap=self.reap)
        self.heartbeat.start()
        log.info("heartbeat: every %.1f s; a rank silent for %.0f s stops the job",
                 self.heartbeat.interval_s, self.timeout_s)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # a rank that failed is not done: stop beating without saying so, and its watcher
        # ends the others within the timeout if its exit has not already broken their collectives
        if self.heartbeat is None:
            return
        with sigterm_waits():
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



@contextlib.contextmanager
def sigterm_waits() -> Iterator[None]:
    """While a rank looks for the rank the job lost and says so, a SIGTERM waits (on the main
    thread; elsewhere nothing changes). Why: when a rank dies under ``torchrun``, the agent sends
    SIGTERM to the others at once, and Lightning's handler then broadcasts over the broken
    process group: its error, raised wherever the rank was, cut the search short, the rank left
    without a word, and the others, seeing it silent, named it lost too. The rank leaves within
    a few beat intervals anyway (the search's window, ``settle``); a SIGTERM that came meanwhile
    goes to the handler it was meant for afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            log.info("heartbeat: the launcher's SIGTERM arrived while this rank looked for the lost rank")


def install(trainer: pl.Trainer) -> HeartbeatCallback:
    """The Trainer's heartbeat callback, added (and started) if it has none: what a syncplane
    strategy calls at its ``setup``, before its first collective. Added then, the callback
    misses its own ``setup`` hook, not the later ones (``on_exception``, ``teardown``)."""
    for callback in trainer.callbacks:
        if isinstance(callback, HeartbeatCallback):
            callback.start()
            return callback
    callback = HeartbeatCallback()
    trainer.callbacks.append(callback)
    callback.start()
    return callback
