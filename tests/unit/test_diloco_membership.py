"""``membership`` / ``min_replicas`` / ``grace_s``: validated by DiLoCoConfig, refused without
elastic mode, and turned into the Lighthouse's settings the launcher starts it with."""

from __future__ import annotations

import pytest

from syncplane.algorithms.diloco import lighthouse_options
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
