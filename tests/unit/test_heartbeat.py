"""The heartbeat's bookkeeping, round by round, on torch's in-process store and a hand-moved
clock (no threads, no sleeps); the real thing -- a SIGSTOPped rank in a training job -- is
``tests/e2e/test_failures.py``."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from syncplane.comm.heartbeat import Heartbeat


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
