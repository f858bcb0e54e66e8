"""An elastic replica's place (``JobContext.elastic``): from syncplane's launcher, or from torchft's
own variables for a replica group that ``torchrun`` started (a plain Lightning script)."""

from __future__ import annotations

from pathlib import Path

import pytest

from syncplane.config import ConfigError
from syncplane.job import JobContext, missing_elastic

TORCHFT = {"TORCHFT_LIGHTHOUSE": "http://10.0.0.1:29510", "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3"}


def test_torchfts_variables_place_a_torchrun_replica(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    place = JobContext.from_environment({**TORCHFT, "TORCHELASTIC_RESTART_COUNT": "2"}).elastic
    assert place is not None
    assert (place.replica, place.replicas, place.lighthouse) == (1, 3, "http://10.0.0.1:29510")
    assert place.restarts == 2 and place.bind is None
    assert place.folder == tmp_path / "syncplane_elastic"      # the working directory's, made absolute
    shared = JobContext.from_environment({**TORCHFT, "SYNCPLANE_ELASTIC_DIR": "/shared/job7"}).elastic
    assert shared is not None and shared.folder == Path("/shared/job7") and shared.restarts == 0


def test_syncplanes_launcher_wins_over_torchfts_variables():
    ours = {"SYNCPLANE_REPLICA": "0", "SYNCPLANE_REPLICAS": "2", "SYNCPLANE_LIGHTHOUSE": "http://127.0.0.1:1",
            "SYNCPLANE_ELASTIC_DIR": "/runs/a", "SYNCPLANE_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "5"}
    place = JobContext.from_environment({**TORCHFT, **ours}).elastic
    assert place is not None and (place.replica, place.replicas, place.restarts) == (0, 2, 1)
    assert place.lighthouse == "http://127.0.0.1:1"


def test_the_missing_variables_are_named_in_the_users_convention():
    assert missing_elastic({}) == ["REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"]
    lighthouse_only = {"TORCHFT_LIGHTHOUSE": "http://h:29510"}
    assert missing_elastic(lighthouse_only) == ["REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"]
    assert JobContext.from_environment(lighthouse_only).elastic is None
    assert missing_elastic({"SYNCPLANE_REPLICA": "0"}) == ["SYNCPLANE_REPLICAS", "SYNCPLANE_LIGHTHOUSE",
                                                           "SYNCPLANE_ELASTIC_DIR"]
    assert missing_elastic(TORCHFT) == []


@pytest.mark.parametrize(("variables", "message"), [
    ({"REPLICA_GROUP_ID": "3"}, r"REPLICA_GROUP_ID=3: expected 0 to 2 \(NUM_REPLICA_GROUPS=3\)"),
    ({"NUM_REPLICA_GROUPS": "two"}, r"NUM_REPLICA_GROUPS='two': expected a whole number"),
])
def test_a_bad_replica_group_is_refused_by_name(variables, message):
    with pytest.raises(ConfigError, match=message):
        JobContext.from_environment({**TORCHFT, **variables})


def test_an_elastic_strategy_without_a_place_says_what_to_set():
    pytest.importorskip("torchft")
    from syncplane.strategies.diloco import DiLoCo

    strategy = DiLoCo(elastic=True, job=JobContext())
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE unset.*torchrun"):
        strategy.distributed_sampler_kwargs
