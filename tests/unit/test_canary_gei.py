"""Canary's GEI (paper 004, §5.2-5.3) on an in-memory board: what is due at each step,
the bound (wait for the first arrival of step k - s), the proportion rule (drop the late
colayers when fewer than p arrived, the first proposal wins so every rank agrees), and
bad bounds rejected by name; the synchronous warm-up before the staleness starts (the
same global switch step after a resume, never a drop while synchronous)."""

from __future__ import annotations

import threading

import pytest

from syncplane.algorithms.canary import GEI, CanaryConfig
from syncplane.config import ConfigError


class MemoryBoard:
    """Several ranks' boards sharing one dict (the store), as ``StoreBoard`` does."""

    def __init__(self, shared: dict, rank: int, world: int) -> None:
        self.shared, self.rank, self.world = shared, rank, world
        self.lock = shared.setdefault("lock", threading.Lock())

    def advance(self) -> int:
        with self.lock:
            self.shared[self.rank] = self.shared.get(self.rank, 0) + 1
            return self.shared[self.rank]

    def entered(self) -> list[int]:
        with self.lock:
            return [self.shared.get(r, 0) for r in range(self.world)]

    def agree(self, key: str, proposal: str) -> str:
        with self.lock:
            return self.shared.setdefault(("agree", key), proposal)


def _geis(world: int, colayers: int, s: int, p: float | None, warmup_steps: int = 0) -> list[GEI]:
    shared: dict = {}
    return [GEI(colayers, s, p, MemoryBoard(shared, r, world), timeout_s=5, warmup_steps=warmup_steps)
            for r in range(world)]


def test_due_step_and_staleness_value() -> None:
    fast, slow = _geis(2, 3, 2, None)
    assert [fast.enter() for _ in range(3)] == [0, 1, 2]
    assert [fast.due(k) for k in range(4)] == [None, None, 0, 1]
    slow.enter()
    assert slow.staleness() == 2 and fast.staleness() == 0     # ζ - own step


def test_warmup_is_synchronous_then_stale_from_the_same_global_step_after_a_resume() -> None:
    (gei,) = _geis(1, 2, 2, None, warmup_steps=3)
    # steps 0-2 apply their own aggregate, 3-4 nothing (0-2 are applied already), then k - 2
    assert [gei.due(k) for k in range(8)] == [0, 1, 2, None, None, 3, 4, 5]
    assert [gei.stale_at(k) for k in range(5)] == [False, False, False, True, True]
    (resumed,) = _geis(1, 2, 2, None, warmup_steps=3)
    resumed.resume_at(1)               # a checkpoint at global step 1: two warm-up steps left
    assert [resumed.due(k) for k in range(6)] == [0, 1, None, None, 2, 3]   # = global 1-2, -, -, 3, 4
    assert resumed.stale_at(2) and not resumed.stale_at(1)                    # switch at global step 3
    (late,) = _geis(1, 2, 2, None, warmup_steps=3)
    late.resume_at(10)                 # past the warm-up: stale at once
    assert late.sync_until == 0 and [late.due(k) for k in range(3)] == [None, None, 0]
    late.enter()
    with pytest.raises(RuntimeError, match="before the first step"):
        late.resume_at(0)


def test_steps_restored_from_a_checkpoint_are_due_first_and_never_dropped() -> None:
    """A resume past the warm-up with s = 2: the checkpoint's two unsettled steps become
    steps -2 and -1 and are applied at steps 0 and 1, as the interrupted run would have;
    a proportion bound does not drop them (they arrived whole before the checkpoint)."""
    (gei,) = _geis(1, 3, 2, 1.0, warmup_steps=3)
    gei.resume_at(10)
    gei.restored(-2, 0b111)
    gei.restored(-1, 0b111)
    assert [gei.due(k) for k in range(4)] == [-2, -1, 0, 1]
    gei.enter()
    assert gei.settle(-2) == 0b111 and gei.due(0) is None     # settled once
    with pytest.raises(ValueError, match="before this GEI's first step"):
        gei.restored(0, 0b1)


def test_warmup_never_drops_even_below_the_proportion() -> None:
    a, b = _geis(2, 2, 1, 1.0, warmup_steps=1)
    for g in (a, b):
        g.enter()
        g.arrived(0, 0)            # 1/2 < p at the bound: a stale step would drop colayer 1
    threading.Timer(0.1, lambda: [g.arrived(0, 1) for g in (a, b)]).start()
    assert a.settle(0) == 0b11 and b.settle(0) == 0b11 and a.dropped == b.dropped == 0
    assert not any(isinstance(key, tuple) for key in a.board.shared)   # nothing was put to a vote


def test_synchronous_waits_for_every_colayer() -> None:
    (gei,) = _geis(1, 3, 0, None)
    gei.enter()
    gei.arrived(0, 0)
    gei.arrived(0, 1)
    done: list[int] = []
    waiter = threading.Thread(target=lambda: done.append(gei.settle(0)))
    waiter.start()
    waiter.join(0.2)
    assert not done                                   # colayer 2 is still missing: it waits
    gei.arrived(0, 2)
    waiter.join(5)
    assert done == [0b111] and gei.dropped == 0


def test_late_colayers_are_dropped_below_the_proportion_and_every_rank_agrees() -> None:
    a, b = _geis(2, 4, 1, 0.75)
    for g in (a, b):
        g.enter()
    a.arrived(0, 0)                 # on a, only colayer 0 arrived at the bound: 1/4 < 0.75
    assert a.settle(0) == 0b0001 and a.dropped == 3
    for i in range(4):              # on b everything arrived, but a's proposal came first
        b.arrived(0, i)
    assert b.settle(0) == 0b0001 and b.dropped == 3


def test_enough_arrived_waits_for_the_rest() -> None:
    (gei,) = _geis(1, 4, 1, 0.5)
    gei.enter()
    for i in range(3):
        gei.arrived(0, i)           # 3/4 >= 0.5: wait for colayer 3 rather than drop it
    threading.Timer(0.1, gei.arrived, (0, 3)).start()
    assert gei.settle(0) == 0b1111 and gei.dropped == 0


def test_failure_and_timeout_raise_instead_of_hanging() -> None:
    (gei,) = _geis(1, 2, 1, None)
    gei.enter()
    gei.fail(0, RuntimeError("peer lost"))
    with pytest.raises(RuntimeError, match="peer lost"):
        gei.settle(0)
    quick = GEI(2, 1, None, MemoryBoard({}, 0, 1), timeout_s=0.05)
    with pytest.raises(TimeoutError, match="step 3"):
        quick.settle(3)


@pytest.mark.parametrize("field,value", [("staleness", -1), ("staleness", 1.5), ("proportion", 0.0),
                                         ("proportion", 1.2), ("proportion", -0.1), ("warmup_steps", -1),
                                         ("warmup_steps", 2.5), ("warmup_steps", True)])
def test_bad_bounds_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        CanaryConfig(**{field: value})
    with pytest.raises(ConfigError, match=field):
        GEI(2, **{"staleness": 0, "proportion": None, field: value}, board=MemoryBoard({}, 0, 1))
