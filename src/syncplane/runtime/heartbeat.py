"""Liveness of the ranks of a job: a heartbeat through the rendezvous store, watched in a ring.

Why: a rank that *dies* is noticed by whoever started it and by the sockets of its peers, but a
rank that *hangs* -- SIGSTOP, a stuck GPU, a swapping host, a NIC that went down -- is noticed by
nobody: every other rank sits inside a collective until the process group's timeout (30 min).
Nothing in torch watches for that on gloo, and on a real cluster the launcher that would see a
dead process is often not its parent. So every rank beats, and watches one other rank.

How:

- every ``interval_s`` each rank writes a counter under ``<prefix>/<rank>``;
- each rank watches its ring successor ``(rank + 1) % world``: if the successor's counter has
  not moved for ``timeout_s`` (measured on the watcher's own monotonic clock, so clocks of
  different hosts never meet), the watcher posts ``<prefix>/abort`` with a message naming it;
- every rank polls ``<prefix>/abort`` and, when it appears, stops with that message (and
  marks ``<prefix>/read/<rank>``). Before leaving, a rank says why, then waits (``settle``, at
  most two beat intervals) until every rank that is not lost has read it: a rank that left
  at once could take the store down with it (rank 0 holds it under syncplane's launcher), or
  start the launcher's stop of the others, under a rank that had not polled yet -- one that
  trains inside its own node, with no collective across to break -- whose error would then
  name nobody.

A ring costs O(world) store operations per interval in all (three per rank), and every rank is
watched by exactly one other. A rank that ends cleanly writes ``done``; its watcher stops
watching. A successor that has not beaten yet gets ``startup_s`` before it counts as lost
(ranks reach the training loop at different times). If the store itself stops answering
within ``timeout_s`` -- its host is the one that hung, or this rank lost the network -- that is
reported the same way, naming the store.

The clock and the reaction are injected, so ``poll`` is tested step by step without threads.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

#: Exit status of a rank stopped because a peer was lost (EX_TEMPFAIL: a retry may succeed).
LOST_PEER_EXIT = 75

#: How long a rank may stay silent before it counts as lost: ``train.py``'s
#: ``trainer.heartbeat_timeout_s`` and a plain script's strategy alike.
DEFAULT_TIMEOUT_S = 15.0

_DONE = b"done"


def exit_now(message: str, before_exit: Callable[[], None] | None = None) -> None:
    """The default reaction: say why on stderr, run ``before_exit`` (``Heartbeat.settle``) and
    leave. The main thread is blocked inside a collective that only the 30-minute process-group
    timeout would end, so there is nothing to unwind; checkpoints are written atomically, so
    none is left half-written."""
    sys.stderr.write(f"syncplane: {message}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if before_exit is not None:
        before_exit()
    os._exit(LOST_PEER_EXIT)


class Heartbeat:
    """Beat, watch the ring successor, and react to a lost rank on every rank.

    Args:
        store: the job's store, or a client of it with a timeout of ``timeout_s``: a store
            operation that outlives it counts as the store being lost.
        rank, world_size: this rank and the job's size.
        timeout_s: how long a successor may stay silent before it counts as lost.
        interval_s: time between beats (default ``timeout_s / 5``).
        startup_s: how long a successor that never beat gets (default ``max(60, 3·timeout_s)``).
        where: how to name the store in messages (its address or file).
        on_lost: called once with the message when a rank is lost (default: ``exit_now``,
            settling first).
        clock: a monotonic clock (tests pass their own).
        settles: ``settle`` waits for the other ranks to read the verdict (else a no-op).
        sleep: how ``settle`` waits (tests pass their own).
        reap: the rank that finds a rank lost SIGKILLs it when it runs on the same host (its
            process, recorded at ``start``): a hung process (SIGSTOP, a stuck driver) ends
            only so, and with no launcher of syncplane's around (torchrun, Lightning's own)
            nothing else would end it. Under syncplane's launcher, which ends the job's
            processes itself, off.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, timeout_s: float,
                 interval_s: float | None = None, startup_s: float | None = None, where: str = "the store",
                 prefix: str = "syncplane/heartbeat", on_lost: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, settles: bool = False,
                 sleep: Callable[[float], None] = time.sleep, reap: bool = False) -> None:
        if timeout_s <= 0:
            raise ValueError(f"heartbeat timeout_s must be positive, got {timeout_s}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = timeout_s
        self.interval_s = timeout_s / 5 if interval_s is None else interval_s
        self.startup_s = max(60.0, 3 * timeout_s) if startup_s is None else startup_s
        self.where, self.prefix, self.clock = where, prefix, clock
        self.on_lost = on_lost or (lambda message: exit_now(message, before_exit=self.settle))
        self.settles, self.sleep, self.reap = settles, sleep, reap
        self.watched: int | None = (rank + 1) % world_size if world_size > 1 else None
        self.beats = 0
        self.lost: str | None = None
        self.known: str | None = None          # a verdict this rank posted or read (``poll`` prefers it)
        self._seen: bytes | None = None        # the watched rank's last value
        self._seen_at = clock()                # when it last changed (or when watching began)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ one round

    def poll(self) -> str | None:
        """Beat once, then check the abort key and the successor. Returns (and reports
        through ``on_lost``, once) the message if a rank is lost."""
        if self.lost is not None:
            return self.lost
        try:
            self.beats += 1
            self.store.set(self._key(self.rank), str(self.beats))
            posted = self._read_abort()
            if posted is not None:
                return self._report(posted)
            message = self._check_successor()
        except RuntimeError as exc:   # torch's store errors (timeouts, resets) are RuntimeErrors
            self.settles = False      # nobody can read a verdict now: leave at once
            if self.known is not None:   # the store went with a rank that left on the job's verdict
                return self._report(self.known)
            message = (f"rank {self.rank}: the job's store at {self.where} did not answer within "
                       f"{self.timeout_s:.0f} s ({exc}); the host holding it (rank 0 under syncplane's "
                       "launcher, node 0's torchrun agent otherwise) is hung or unreachable, or this "
                       "rank lost its network")
            return self._report(message)
        if message is not None:
            lost = self.watched
            try:
                self.store.set(self._key("lost"), str(lost))
                self.store.set(self._key("abort"), message)
                self.known = message
                self.store.set(self._key(f"read/{self.rank}"), "1")
            except RuntimeError:
                pass   # the others will find the lost rank themselves, or the store gone
            if lost is not None:
                self._settle_then_reap([lost])
            return self._report(message)
        return None

    def _check_successor(self) -> str | None:
        if self.watched is None:
            return None
        now = self.clock()
        key = self._key(self.watched)
        value = self.store.get(key) if self.store.check([key]) else None
        if value == _DONE:
            self.watched = None   # it finished cleanly; the end of the run needs no watch
            return None
        if value != self._seen:
            self._seen, self._seen_at = value, now
            return None
        silent = now - self._seen_at
        allowed = self.timeout_s if self._seen is not None else self.startup_s
        if silent <= allowed:
            return None
        if self._seen is None:
            return (f"rank {self.watched} never sent a heartbeat within {allowed:.0f} s of rank "
                    f"{self.rank} starting to watch it (it hangs before training, or is gone)")
        return (f"rank {self.watched} stopped sending heartbeats {silent:.0f} s ago (hung, stopped, or its "
                f"host lost the network; trainer.heartbeat_timeout_s={self.timeout_s:g}); noticed by "
                f"rank {self.rank}")

    def verdict(self) -> str | None:
        """The job's verdict if some rank (this one or another) found a rank lost, else None.
        A rank whose collective broke because its peers left on that verdict reports it, not
        the transport's error ("connection closed by peer" names no one)."""
        if self.lost is not None:
            return self.lost
        try:
            return self._read_abort()
        except RuntimeError:
            return None   # the store is gone with the job: nothing to add to the rank's own error

    def _read_abort(self) -> str | None:
        """The posted verdict (None: none yet), marking that this rank read it (``settle``
        waits for that); a failing store raises its RuntimeError."""
        key = self._key("abort")
        if not self.store.check([key]):
            return None
        verdict = self.known = self.store.get(key).decode()
        self.store.set(self._key(f"read/{self.rank}"), "1")
        return verdict

    def find_lost(self, window_s: float | None = None, sleep: Callable[[float], None] = time.sleep) -> str | None:
        """Name the ranks that stopped beating, now rather than ``timeout_s`` from now.

        Why: a rank that is *killed* breaks its peers' collectives within a second or two, and
        the transport's error ("connection closed by peer") names no one; waiting for its
        watcher's timeout would end the job a quarter-minute later. So a rank whose collective
        broke reads every rank's counter, waits ``window_s`` (default two beat intervals, long
        enough for every live rank to beat at least once) while its own heartbeat thread goes
        on beating, and reads again: the ranks whose counter did not move (and that did not
        finish cleanly) are lost. The first rank to find them posts the verdict, so every rank
        reports the same one. Returns None when every rank still beats (this rank's error was
        its own, or a peer raised) or the store is gone."""
        verdict = self.verdict()
        if verdict is not None or self.world_size < 2:
            return verdict
        window = 2 * self.interval_s + 0.5 if window_s is None else window_s
        try:
            before = self._counters()
            waited = 0.0
            while waited < window:
                step = min(self.interval_s / 2, window - waited)
                sleep(step)
                waited += step
                verdict = self.verdict()
                if verdict is not None:
                    return verdict
            after = self._counters()
        except RuntimeError:
            return None   # the store went with the job: the rank's own error is all there is
        silent = [r for r in range(self.world_size)
                  if r != self.rank and after[r] != _DONE and after[r] == before[r]]
        if not silent:
            return None
        names = " and ".join(f"rank {r}" for r in silent)
        message = (f"{names} stopped sending heartbeats (gone, or hung) while rank {self.rank}'s collective "
                   f"broke; found by rank {self.rank} within {window:.0f} s")
        try:   # atomically: the first rank to post wins, and every rank reports its message
            self.store.compare_set(self._key("lost"), "", ",".join(map(str, silent)))
            posted = self.known = self.store.compare_set(self._key("abort"), "", message).decode()
            self.store.set(self._key(f"read/{self.rank}"), "1")
        except RuntimeError:
            self.known = message
            return message
        if posted == message:   # this rank's verdict: its lost ranks are its to end, once read
            self._settle_then_reap(silent)
        return posted

    def _settle_then_reap(self, lost: Sequence[int]) -> None:
        """The poster of a verdict: let the others read it (``settle``), then end the lost
        ranks' processes here. Why in that order: a launcher that stops every rank when one
        dies (Lightning's) would otherwise end the others before they say whom the job lost.
        The processes are looked up *before* settling: the store's host (rank 0 under srun)
        may leave as soon as it has read the verdict, taking the store with it, and a hung
        rank that nobody ends then holds the job (srun waits for every task)."""
        processes = self.local_processes(lost)
        self.settle()
        self.end_processes(processes)

    def local_processes(self, ranks: Sequence[int]) -> dict[int, int]:
        """With ``reap``: rank -> pid of those of ``ranks`` that run on this host (as each
        recorded at ``start``), this process excepted; a rank with no record is left out."""
        if not self.reap:
            return {}
        found = {}
        for rank in ranks:
            try:
                key = self._key(f"process/{rank}")
                if not self.store.check([key]):
                    continue
                host, pid = self.store.get(key).decode().rsplit(" ", 1)
            except (RuntimeError, ValueError):
                continue
            if host == socket.gethostname() and int(pid) != os.getpid():
                found[rank] = int(pid)
        return found

    def end_processes(self, processes: dict[int, int]) -> list[int]:
        """SIGKILL each rank's process (``local_processes``); returns the ranks ended. A
        process already gone is skipped."""
        ended = []
        for rank, pid in processes.items():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            log.warning("rank %d: ended lost rank %d (pid %d on this host) with SIGKILL", self.rank, rank, pid)
            ended.append(rank)
        return ended

    def reap_lost(self, ranks: Sequence[int]) -> list[int]:
        """With ``reap``: SIGKILL the processes of ``ranks`` that run on this host; returns
        the ranks ended."""
        return self.end_processes(self.local_processes(ranks))

    def settle(self, window_s: float | None = None) -> None:
        """Before this rank leaves on a verdict (with ``settles``): wait until every other rank has read the verdict, finished, was named lost by it (the
        ``lost`` key its poster sets), or has shown itself silent (its counter still after a
        beat interval: gone or hung, it will read nothing), at most ``window_s`` (default two
        beat intervals), beating meanwhile. Elsewhere a no-op. Why: the module docstring."""
        if not self.settles or self.world_size < 2:
            return
        window = 2 * self.interval_s + 0.5 if window_s is None else window_s
        step, waited = self.interval_s / 4, 0.0
        try:
            lost_key = self._key("lost")
            named = self.store.get(lost_key).decode().split(",") if self.store.check([lost_key]) else []
            waiting = {r for r in range(self.world_size) if r != self.rank and str(r) not in named}
            before = self._counters()
            while True:
                waiting = {r for r in waiting if not self.store.check([self._key(f"read/{r}")])
                           and not self._finished(r)}
                if waiting and waited >= self.interval_s + 0.5:   # a live rank has beaten, and so polled
                    now = self._counters()
                    waiting = {r for r in waiting if now[r] != before[r]}
                if not waiting or waited >= window:
                    break
                self.beats += 1
                self.store.set(self._key(self.rank), str(self.beats))
                self.sleep(step)
                waited += step
        except RuntimeError:
            return   # the store is failing anyway: nothing to wait for
        if waiting:
            log.warning("rank %d: leaving before rank(s) %s read the verdict (waited %.1f s)", self.rank,
                        sorted(waiting), waited)

    def _finished(self, rank: int) -> bool:
        key = self._key(rank)
        return self.store.check([key]) and self.store.get(key) == _DONE

    def _counters(self) -> list[bytes | None]:
        keys = [self._key(r) for r in range(self.world_size)]
        return [self.store.get(k) if self.store.check([k]) else None for k in keys]

    def _report(self, message: str) -> str:
        self.lost = message
        self.on_lost(message)
        return message

    def _key(self, name: object) -> str:
        return f"{self.prefix}/{name}"

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        """Beat and watch on a daemon thread until ``stop``."""
        if self._thread is not None:
            return
        if self.reap:
            try:   # where this rank runs, for the rank that may find it lost (``reap_lost``)
                self.store.set(self._key(f"process/{self.rank}"), f"{socket.gethostname()} {os.getpid()}")
            except RuntimeError:
                log.warning("rank %d: could not record its process at %s", self.rank, self.where)
        self._seen_at = self.clock()
        self._thread = threading.Thread(target=self._run, name="syncplane-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.poll() is not None:
                return
            self._stop.wait(self.interval_s)

    def stop(self, done: bool = True) -> None:
        """Stop beating; with ``done``, tell the watcher this rank finished cleanly (not lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + self.interval_s)
            self._thread = None
        if done and self.lost is None:
            try:
                self.store.set(self._key(self.rank), _DONE.decode())
            except RuntimeError:
                log.warning("rank %d: could not mark its heartbeat done (store at %s)", self.rank, self.where)
