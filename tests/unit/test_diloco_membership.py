"""``membership`` / ``min_replicas`` / ``grace_s``: validated by DiLoCoConfig, refused without
elastic mode, turned into the Lighthouse's settings the launcher starts it with; and the quorum
point and weights against a recording group (the wire: tests/dist/test_elastic_quorum.py)."""

from __future__ import annotations

import pytest
import torch

from syncplane.algorithms.diloco import lighthouse_options
from syncplane.algorithms.diloco.elastic import Membership, QuorumTransport, fingerprint
from syncplane.algorithms.diloco.ft import QuorumView
from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.config import check_mode


@pytest.mark.parametrize("key,value,message", [("membership", "loose", "membership: allowed values"),
                                               ("min_replicas", 0, "min_replicas"), ("grace_s", 0, "grace_s"),
                                               ("grace_s", True, "grace_s")])
def test_bad_membership_settings_name_their_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DiLoCoConfig(**{key: value})


def test_quorum_membership_needs_elastic_mode() -> None:
    config = DiLoCoConfig(membership="quorum")
    with pytest.raises(ValueError, match="membership=quorum .* needs elastic=true"):
        check_mode(config, False, {}, "127.0.0.1")
    check_mode(config, True, {}, "127.0.0.1")


def test_the_lighthouse_waits_join_timeout_when_fixed_and_the_grace_after_min_replicas_with_quorum() -> None:
    assert lighthouse_options({"join_timeout_s": 7, "grace_s": 2}) == {
        "min_replicas": 1, "join_timeout_s": 7.0, "heartbeat_timeout_s": 5.0}
    assert lighthouse_options({"membership": "quorum", "min_replicas": 3, "grace_s": 2, "join_timeout_s": 7}) == {
        "min_replicas": 3, "join_timeout_s": 2.0, "heartbeat_timeout_s": 5.0}
    assert lighthouse_options({"membership": "quorum"})["join_timeout_s"] == DiLoCoConfig.grace_s


class _Group:
    """A torchft group of one replica in a quorum of ``n`` (rank 0) whose peers' weights are
    ``others``: what ``Membership`` asks of it, recorded."""

    host = "127.0.0.1"

    def __init__(self, n: int = 2, others: tuple[float, ...] = (1.0,)) -> None:
        self.n, self.others, self.calls = n, others, []

    def quorum(self) -> object:
        self.calls.append("quorum")
        return QuorumView(quorum_id=1, participants=self.n, step=0)

    def gather_floats(self, value: float, view: object) -> list[float]:
        return [value, *self.others]

    def commit(self) -> bool:
        self.calls.append("commit")
        return True

    def report_error(self, exc: Exception) -> None: ...

    def set_step(self, step: int) -> None: ...

    def close(self) -> None: ...


def _membership(tmp_path=None) -> Membership:
    from syncplane.algorithms.diloco.elastic import RoundBoard

    outer = OuterOptimizer(torch.ones(8), pin=False)
    return Membership(QuorumTransport("127.0.0.1", 5.0), fingerprint(8, 5, "torch.optim.SGD", None, [(8,)]), 10,
                      outer.state_dict, outer.load_state_dict,
                      board=RoundBoard(tmp_path, "replica0") if tmp_path is not None else None, hold_s=0.0)


def test_a_quorum_round_weighs_each_delta_by_the_steps_it_covers() -> None:
    """The factor on Δ before the plain mean is w·n/Σw: exactly 1 when every weight is equal
    (no fault: the fixed round bit for bit), 0 for a restart, more for a carried Δ."""
    membership, group = _membership(), _Group(2, (5.0,))
    membership.join(group)
    assert membership.scale(5) == 1.0
    assert membership.scale(0) == 0.0
    assert membership.scale(9) == pytest.approx(9 * 2 / 14)
    membership.group = _Group(3, (4.0, 4.0))
    membership.transport.view = QuorumView(quorum_id=2, participants=3, step=0)
    assert membership.scale(4) == 1.0


def test_a_quorum_point_votes_then_forms_the_period_quorum_and_a_late_one_is_left_out(tmp_path) -> None:
    from syncplane.algorithms.diloco.elastic import RoundBoard

    membership, group = _membership(tmp_path), _Group()
    events: list[dict] = []
    membership._on_event = events.append
    membership.join(group)
    assert membership.point() and group.calls == ["quorum", "commit", "quorum"] and membership.position == 1
    RoundBoard(tmp_path, "replica1").mark("formed", 2)    # the others' quorum for point 2 formed already
    assert not membership.point() and group.calls[-1] == "commit"   # late: no quorum asked
    assert membership.late()                               # until the next point opens
    RoundBoard(tmp_path, "replica1").mark("arrived", 3)
    assert not membership.late()
    membership.rejoin(0.5)
    assert group.calls[-1] == "quorum"
    membership.work = 1.5   # the carried period's rounds take all its steps into θ_g
    membership.record(True, 0, 2)
    assert events[-1]["weight"] == 0.75


def test_a_late_replica_healed_keeps_its_pending_work_a_restarted_one_does_not() -> None:
    peer, late = _membership(), _membership()
    late._pending = {0: 1.0}
    late.carrying = True
    late.load_state_dict(peer.state_dict())
    assert late._pending == {0: 1.0}
    late.carrying = False
    late.load_state_dict(peer.state_dict())
    assert late._pending == {}


def test_a_late_replica_trains_on_until_the_next_boundary_opens_and_says_it_waits(tmp_path) -> None:
    from syncplane.algorithms.diloco.elastic import RoundBoard

    board, peer = RoundBoard(tmp_path, "replica2"), RoundBoard(tmp_path, "replica0")
    assert not board.late(0)                   # nothing formed: on time
    peer.mark("formed", 0)
    peer.mark("formed", 1)                     # round 1 formed without it
    assert board.late(1) and (board.dir / "waiting-2-replica2").exists()
    assert peer.arrive(2, hold_s=0.2) > 0.1    # an on-time replica holds for the waiter (which has not asked)
    assert not board.late(1)                   # the boundary opened: it asks now
    assert board.wait_for_next(1.0) < 0.5 and (board.dir / "asked-2-replica2").exists()
    assert not board.late(2)


def test_a_healed_late_replica_is_rebased_so_its_next_delta_is_the_one_it_would_have_sent() -> None:
    """``DiLoCoEngine.rebase``: θ_local + (θ_g' − θ_g), so Δ' = θ_g' − θ_local' = θ_g − θ_local
    (two fragments: each outer's piece)."""
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.job import JobContext

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    engine = DiLoCoEngine(model, DiLoCoConfig(sync_every=4, fragments=2), JobContext(rank=0, world_size=1),
                          ReplicaLayout.of_sizes([1]), transport=QuorumTransport("127.0.0.1", 5.0))
    old = engine.params.clone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))   # its local work
    local_before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for fragmented in engine.outers.values():   # a peer's θ_g (the heal): an outer step elsewhere
        for outer in fragmented.outers:
            outer.params.add_(0.5)
    engine.rebase([p.data for p in model.parameters()], old)
    local_after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(engine.params - local_after, old - local_before)
    engine.close()
