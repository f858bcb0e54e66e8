"""The heartbeat's bookkeeping, round by round, on torch's in-process store and a hand-moved
clock (no threads, no sleeps); the real thing -- a SIGSTOPped rank in a training job -- is
``tests/e2e/test_failures.py``."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from syncplane.runtime.heartbeat import Heartbeat


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ring(world: int, timeout_s: float = 10.0, startup_s: float = 30.0):
    store, clock, lost = dist.HashStore(), Clock(), []
    beats = [Heartbeat(store, r, world, timeout_s=timeout_s, startup_s=startup_s, clock=clock,
                       on_lost=lambda message, r=r: lost.append((r, message))) for r in range(world)]
    return store, clock, lost, beats


def rounds(beats, clock, seconds: float, skip: tuple[int, ...] = (), step: float = 2.0) -> None:
    end = clock.now + seconds
    while clock.now < end:
        clock.now += step
        for b in beats:
            if b.rank not in skip:
                b.poll()


def test_beating_ranks_are_never_lost():
    _, clock, lost, beats = ring(4)
    rounds(beats, clock, 100)
    assert lost == []


def test_a_silent_rank_is_named_by_its_watcher_then_by_everyone():
    _, clock, lost, beats = ring(4, timeout_s=10)
    rounds(beats, clock, 20)
    rounds(beats, clock, 10, skip=(2,))      # rank 2 hangs: silent for 10 s, not yet lost
    assert lost == []
    # rank 1 (its watcher) saw its last beat one round late: lost at most two rounds after
    # the timeout has passed
    rounds(beats, clock, 4, skip=(2,))
    assert lost and lost[0][0] == 1 and "rank 2 stopped sending heartbeats" in lost[0][1]
    assert "noticed by rank 1" in lost[0][1]
    rounds(beats, clock, 2, skip=(2,))       # the others read the abort key: the same message
    assert sorted(r for r, _ in lost) == [0, 1, 3]
    assert len({message for _, message in lost}) == 1
    rounds(beats, clock, 10, skip=(2,))      # reported once per rank
    assert len(lost) == 3


def test_a_rank_that_never_beats_gets_the_startup_allowance():
    _, clock, lost, beats = ring(3, timeout_s=5, startup_s=30)
    rounds(beats, clock, 28, skip=(0,))
    assert lost == []
    rounds(beats, clock, 4, skip=(0,))
    assert lost[0][0] == 2 and "rank 0 never sent a heartbeat within 30 s" in lost[0][1]


def test_a_rank_that_finished_is_not_lost():
    _, clock, lost, beats = ring(3, timeout_s=5)
    rounds(beats, clock, 10)
    beats[1].stop()                          # marks done; its watcher (rank 0) stops watching
    rounds(beats, clock, 60, skip=(1,))
    assert lost == []
    assert beats[0].watched is None


def test_a_store_that_stops_answering_is_named():
    class Broken(dist.HashStore):
        def set(self, key, value):
            raise RuntimeError("Socket Timeout")

    lost = []
    beat = Heartbeat(Broken(), 3, 4, timeout_s=7, where="10.0.0.1:29500", on_lost=lost.append)
    message = beat.poll()
    assert message == lost[0]
    assert "rank 3: the job's store at 10.0.0.1:29500 did not answer within 7 s" in message


def test_one_rank_has_nothing_to_watch_and_bad_timeouts_are_refused():
    store, clock = dist.HashStore(), Clock()
    alone = Heartbeat(store, 0, 1, timeout_s=1, clock=clock, on_lost=pytest.fail)
    clock.now = 1000
    assert alone.poll() is None and alone.watched is None
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        Heartbeat(store, 0, 2, timeout_s=0)


def test_a_rank_that_failed_is_not_done_and_its_watcher_ends_the_others():
    _, clock, lost, beats = ring(3, timeout_s=5)
    rounds(beats, clock, 10)
    beats[1].stop(done=False)                # it raised: silent, but not marked done
    rounds(beats, clock, 10, skip=(1,))
    assert lost and lost[0][0] == 0 and "rank 1 stopped sending heartbeats" in lost[0][1]


def test_a_rank_whose_collective_broke_reads_the_verdict_it_had_not_polled_yet():
    """Rank 1 finds rank 2 lost and leaves; rank 3's all-reduce breaks before its own next
    poll: ``verdict`` gives it the job's message (whom it lost), not the transport's."""
    _, clock, lost, beats = ring(4, timeout_s=10)
    rounds(beats, clock, 20)
    assert beats[3].verdict() is None                    # nothing lost yet
    rounds(beats, clock, 14, skip=(2, 3))                # rank 3 is inside a collective, not polling
    assert lost[0][0] == 1 and 3 not in [r for r, _ in lost]
    assert beats[3].verdict() == lost[0][1] and "rank 2 stopped sending heartbeats" in lost[0][1]
    assert beats[1].verdict() == lost[0][1]              # the rank that found it: its own message


def census(beats, clock, searcher: int, dead: tuple[int, ...]):
    """Run rank ``searcher``'s ``find_lost`` while the other ranks (but ``dead``) beat on the
    hand-moved clock each time it sleeps, as their heartbeat threads would."""
    def sleep(seconds: float) -> None:
        clock.now += seconds
        for b in beats:
            if b.rank not in dead:
                b.poll()
    return beats[searcher].find_lost(sleep=sleep)


def test_a_killed_rank_is_named_at_once_by_a_rank_whose_collective_broke():
    """Rank 2 is killed; rank 0's all-reduce breaks 2 s later, long before rank 2's watcher
    would time out (10 s): ``find_lost`` names it within two beat intervals, posts the verdict,
    and a second survivor reports the same message."""
    store, clock, lost, beats = ring(4, timeout_s=10)
    rounds(beats, clock, 20)
    started = clock.now
    message = census(beats, clock, 0, dead=(2,))
    assert message is not None and "rank 2 stopped sending heartbeats" in message and "rank 1" not in message
    assert clock.now - started <= 2 * beats[0].interval_s + 0.5
    assert lost == []                                    # nobody's watcher had timed out yet
    assert store.get("syncplane/heartbeat/abort").decode() == message
    assert census(beats, clock, 3, dead=(2,)) == message  # the verdict is read, not searched again


def test_a_rank_whose_store_went_with_a_rank_that_read_its_verdict_reports_the_verdict():
    """Rank 3 finds rank 2 killed and posts the verdict; rank 0 (the store's host) reads it and
    leaves, taking the store: rank 3's next beat fails, and it reports whom the job lost, not
    the store (as the rank that found the verdict, it knows it)."""
    class Leaving(dist.HashStore):
        gone = False

        def set(self, key, value):
            if self.gone:
                raise RuntimeError("Broken pipe")
            return super().set(key, value)

    store, clock, lost = Leaving(), Clock(), []
    beats = [Heartbeat(store, r, 4, timeout_s=10, startup_s=30, clock=clock,
                       on_lost=lambda message, r=r: lost.append((r, message))) for r in range(4)]
    rounds(beats, clock, 20)
    message = census(beats, clock, 3, dead=(2,))
    assert message is not None and message.startswith("rank 2 stopped")
    store.gone = True
    assert beats[3].poll() == message and lost == [(3, message)]
    bystander = Heartbeat(store, 1, 4, timeout_s=10, clock=clock, on_lost=lambda _: None)
    assert "did not answer within 10 s" in bystander.poll()   # a rank that knew no verdict: the store


def test_find_lost_names_every_silent_rank_and_nobody_when_all_beat():
    _, clock, _, beats = ring(6, timeout_s=10)
    rounds(beats, clock, 20)
    assert census(beats, clock, 0, dead=()) is None          # a peer raised: nobody is lost
    beats[5].stop()                                           # finished cleanly: not lost
    message = census(beats, clock, 1, dead=(2, 3, 5))
    assert message is not None and message.startswith("rank 2 and rank 3 stopped")
    assert "rank 5" not in message


def test_find_lost_without_a_store_is_the_rank_own_error():
    class Gone(dist.HashStore):
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")
    beat = Heartbeat(Gone(), 0, 2, timeout_s=5)
    assert beat.find_lost(sleep=lambda _: None) is None


def test_only_a_broken_collective_makes_a_rank_look_for_the_lost():
    from syncplane.runtime.heartbeat_callback import is_transport_error

    assert is_transport_error(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert is_transport_error(dist.DistNetworkError("Connection reset by peer"))
    assert not is_transport_error(RuntimeError("fault injected: rank 2 raised after step 12"))
    assert not is_transport_error(ValueError("bad shape"))


def test_the_rank_holding_the_store_waits_until_every_live_rank_read_the_verdict():
    """Ranks 0-1 and 2-3 are two nodes training apart; rank 2 is killed and rank 3 finds it
    (its node's collective broke). Rank 0 holds the store: leaving on the verdict at once would
    break rank 1's node-local collective with the store already gone, and rank 1's error would
    name nobody. ``settle`` waits until rank 1 has polled (read it), not for rank 2, which the
    verdict names; a rank not holding the store leaves at once."""
    store, clock, lost, beats = ring(4, timeout_s=10)
    rounds(beats, clock, 20)
    message = census(beats, clock, 3, dead=(2,))
    assert message is not None and "rank 2 stopped" in message
    host = Heartbeat(store, 0, 4, timeout_s=10, clock=clock, settles=True, sleep=lambda _: None)
    other = Heartbeat(store, 1, 4, timeout_s=10, clock=clock, sleep=pytest.fail)
    other.settle()                                        # not the store's host: no wait

    def sleep(seconds: float) -> None:                   # ranks 1 and 3 beat while rank 0 waits
        clock.now += seconds
        waited.append(seconds)
        if sum(waited) >= 1.0:                           # rank 1 polls one second in
            beats[1].poll()
        beats[3].poll()
    waited: list[float] = []
    host.sleep = sleep
    host.settle()
    assert (1, message) in lost                           # rank 1 read the verdict before rank 0 left
    assert 1.0 <= sum(waited) < host.interval_s   # rank 2, named lost by the verdict, is not waited for

    # a hung rank never reads it: settle stops waiting once its counter has stood still a beat interval
    waited.clear()
    hung = Heartbeat(store, 0, 4, timeout_s=10, clock=clock, settles=True, sleep=lambda s: waited.append(s))
    store.delete_key("syncplane/heartbeat/read/1")
    hung.settle()
    assert hung.interval_s + 0.5 <= sum(waited) < 2 * hung.interval_s + 0.5


def test_a_rank_that_lost_the_store_leaves_without_settling():
    class Broken(dist.HashStore):
        def set(self, key, value):
            raise RuntimeError("Socket Timeout")
    lost: list[str] = []
    beat = Heartbeat(Broken(), 1, 4, timeout_s=7, on_lost=lost.append, settles=True, sleep=pytest.fail)
    assert beat.poll() is not None and "did not answer" in lost[0]
    beat.settle()                                         # no store: nothing to wait for, no sleep


def test_with_reap_the_watcher_ends_the_lost_ranks_process_on_its_host_and_only_it():
    import os
    import signal
    import socket
    import subprocess
    import sys

    store, clock, lost = dist.HashStore(), Clock(), []
    beats = [Heartbeat(store, r, 3, timeout_s=10, startup_s=30, clock=clock, reap=True,
                       on_lost=lambda message, r=r: lost.append((r, message))) for r in range(3)]
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    other_host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        os.kill(hung.pid, signal.SIGSTOP)     # what a hung rank is
        rounds(beats, clock, 4)
        # where each rank runs, as ``start`` records it: rank 2 is the stopped process here;
        # rank 0 claims another host, so nobody here may end its process
        store.set("syncplane/heartbeat/process/2", f"{socket.gethostname()} {hung.pid}")
        store.set("syncplane/heartbeat/process/0", f"some-other-host {other_host.pid}")
        rounds(beats, clock, 14, skip=(2,))
        assert lost and lost[0][0] == 1 and "rank 2" in lost[0][1]
        assert hung.wait(timeout=10) == -signal.SIGKILL
        assert beats[1].reap_lost([0]) == [] and other_host.poll() is None   # another host's: left alone
        assert Heartbeat(store, 1, 3, timeout_s=10).reap_lost([0]) == []     # without reap: nothing ended
    finally:
        for p in (hung, other_host):
            if p.poll() is None:
                p.kill()
                p.wait()


class KillLog:
    """A stand-in for ``os.kill`` that records, at each SIGKILL, which ranks had read the
    verdict by then (their ``read/<rank>`` keys), instead of ending anything."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.kills = store, []

    def __call__(self, pid: int, sig: int) -> None:
        read = [r for r in range(4) if self.store.check([f"syncplane/heartbeat/read/{r}"])]
        self.kills.append((pid, sig, read))


def reaping_ring(monkeypatch, world: int = 4):
    """A ring whose ranks settle and reap, rank 2 recorded as a process on this host (a pid
    that is not this one), ``os.kill`` replaced by a ``KillLog``."""
    import socket

    from syncplane.runtime import heartbeat

    store, clock, lost = dist.HashStore(), Clock(), []
    beats = [Heartbeat(store, r, world, timeout_s=10, startup_s=30, clock=clock, reap=True, settles=True,
                       on_lost=lambda message, r=r: lost.append((r, message))) for r in range(world)]
    kills = KillLog(store)
    monkeypatch.setattr(heartbeat.os, "kill", kills)
    store.set("syncplane/heartbeat/process/2", f"{socket.gethostname()} {heartbeat.os.getpid() + 100000}")
    return store, clock, lost, beats, kills


def others_beat(beats, clock, ranks: tuple[int, ...], waited: list[float] | None = None):
    """A ``sleep`` during which ``ranks`` poll once, as their heartbeat threads would."""
    def sleep(seconds: float) -> None:
        clock.now += seconds
        if waited is not None:
            waited.append(seconds)
        for rank in ranks:
            beats[rank].poll()
    return sleep


def test_the_watcher_ends_a_hung_rank_only_after_the_others_read_the_verdict(monkeypatch):
    """b33a454: rank 1 finds rank 2 hung. Ending rank 2 at once lets a launcher that stops every
    rank when one dies (Lightning's) end ranks 0 and 3 before they printed whom the job lost;
    so rank 1 settles first -- ranks 0 and 3 poll while it waits -- and only then SIGKILLs."""
    import signal

    _, clock, lost, beats, kills = reaping_ring(monkeypatch)
    rounds(beats, clock, 20)
    beats[1].sleep = others_beat(beats, clock, (0, 3))
    rounds(beats, clock, 14, skip=(2,))
    # ranks 0 and 3 report rank 1's verdict while it settles, before it reports and leaves itself
    assert [r for r, _ in lost] == [0, 3, 1] and all("noticed by rank 1" in m for _, m in lost), lost
    assert len(kills.kills) == 1, kills.kills
    _, sig, read = kills.kills[0]
    assert sig == signal.SIGKILL and read == [0, 1, 3]    # every live rank had read it first


def test_the_rank_that_finds_a_killed_rank_settles_before_ending_its_process(monkeypatch):
    """The same order on ``find_lost``'s path (a collective broke): rank 0 posts the verdict
    naming rank 2, waits for ranks 1 and 3 to read it, then ends rank 2's process."""
    import signal

    _, clock, _, beats, kills = reaping_ring(monkeypatch)
    rounds(beats, clock, 20)
    settling: list[float] = []
    beats[0].sleep = others_beat(beats, clock, (1, 3), settling)
    message = beats[0].find_lost(sleep=others_beat(beats, clock, (1, 3)))
    assert message is not None and "rank 2 stopped" in message
    assert settling, "rank 0 ended rank 2 without settling"
    assert [(sig, read) for _, sig, read in kills.kills] == [(signal.SIGKILL, [0, 1, 3])]


def test_the_lost_rank_is_ended_even_when_the_store_leaves_while_the_others_read(monkeypatch):
    """Under srun nothing else ends a hung task: rank 0, the store's host, reads rank 1's
    verdict and leaves at once, taking the store with it, while rank 1 still settles. Rank 1
    looked the lost rank's process up before settling, so it still ends it (and SLURM's job
    does not wait for the hung task until its time limit)."""
    import signal
    import socket

    from syncplane.runtime import heartbeat

    class Leaving(dist.HashStore):
        gone = False

        def _alive(self) -> None:
            if self.gone:
                raise RuntimeError("Connection reset by peer")

        def set(self, key, value):
            self._alive()
            return super().set(key, value)

        def get(self, key):
            self._alive()
            return super().get(key)

        def check(self, keys):
            self._alive()
            return super().check(keys)

    store, clock, lost = Leaving(), Clock(), []
    beats = [Heartbeat(store, r, 3, timeout_s=10, startup_s=30, clock=clock, reap=True, settles=True,
                       on_lost=lambda message, r=r: lost.append((r, message))) for r in range(3)]
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(heartbeat.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    hung_pid = heartbeat.os.getpid() + 100000
    store.set("syncplane/heartbeat/process/2", f"{socket.gethostname()} {hung_pid}")
    rounds(beats, clock, 20)

    def sleep(seconds: float) -> None:   # rank 0 reads the verdict, then its process (the store) is gone
        clock.now += seconds
        beats[0].poll()
        store.gone = True
    beats[1].sleep = sleep
    rounds(beats, clock, 14, skip=(2,))
    assert [r for r, _ in lost] == [0, 1] and "rank 2 stopped" in lost[0][1]
    assert kills == [(hung_pid, signal.SIGKILL)]
