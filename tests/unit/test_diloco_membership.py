"""``membership`` / ``min_replicas`` / ``grace_s``: validated by DiLoCoConfig, refused without
elastic mode, turned into the Lighthouse's settings the launcher starts it with; and the quorum
round's weights against a recording transport (the wire: tests/dist/test_elastic_quorum.py)."""

from __future__ import annotations

import pytest
import torch

from syncplane.algorithms.diloco import lighthouse_options
from syncplane.algorithms.diloco.elastic import ElasticOuter, fingerprint
from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.rounds import check_mode


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


class _RecordingTransport:
    """One replica's transport that records what a quorum round sends: the weight, and
    whether the flat was all zeros; ``fail`` makes the next average fail (a lost peer)."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, bool]] = []
        self.fail = False

    def quorum(self) -> object:
        class View:
            quorum_id, participants, step = 1, 2, 0
        return View()

    def allreduce_weighted_(self, flat: torch.Tensor, weight: float) -> float:
        self.sent.append((weight, bool((flat == 0).all())))
        if self.fail:
            self.fail = False
            return 0.0
        return weight or 1.0

    def commit(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _quorum_engine(events: list[dict]) -> ElasticOuter:
    n = 8
    return ElasticOuter(OuterOptimizer(torch.ones(n), pin=False), fingerprint(n, 5, "torch.optim.SGD", None, [(n,)]),
                        total_rounds=10, on_event=events.append, membership="quorum")


def test_a_quorum_round_weighs_the_rounds_of_work_its_delta_covers() -> None:
    """1 per round; 2 after a discarded round (the local model was kept, so Δ covers both);
    the round events carry the weight that went into θ_g (0 for the discarded one)."""
    events: list[dict] = []
    engine, transport = _quorum_engine(events), _RecordingTransport()
    engine.join(transport)                    # a first start: no quorum, nothing sent
    assert transport.sent == []
    engine.round_(torch.zeros(8))
    transport.fail = True
    assert not engine.round_(torch.zeros(8))
    assert engine.round_(torch.zeros(8))
    assert [w for w, _ in transport.sent] == [1.0, 1.0, 2.0]
    assert [(e["committed"], e["weight"]) for e in events if e["event"] == "round"] == [(True, 1.0), (False, 0.0),
                                                                                        (True, 2.0)]


def test_a_restarted_replica_takes_part_in_the_round_it_joins_with_nothing() -> None:
    events: list[dict] = []
    engine, transport = _quorum_engine(events), _RecordingTransport()
    flat = torch.full((8,), 3.0)
    assert engine.join(transport, flat)
    assert transport.sent == [(0.0, True)] and engine.position == 1


def test_a_fixed_replica_healed_from_a_peer_starts_its_count_again() -> None:
    events: list[dict] = []
    peer = _quorum_engine(events)
    fixed = ElasticOuter(OuterOptimizer(torch.ones(8), pin=False), peer.fingerprint, 10)
    fixed.pending = 3.0
    fixed.load_state_dict(peer.state_dict())
    assert fixed.pending == 0.0
