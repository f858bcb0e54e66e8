"""FlexReduce's configuration: the job's tree from the environment, and bad strategy kwargs
rejected with the field and value named (at construction: before any process starts work)."""

from __future__ import annotations

import pytest

from syncplane.algorithms.flexreduce.tree import job_hosts, job_tree
from syncplane.config import ConfigError


def test_job_tree_from_launcher_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCPLANE_CLUSTER", "asymmetric_3_2_4")
    assert job_tree("auto", 9).describe() == "r0[m0[0, 1, 2], m1[3, 4], m2[5, 6, 7, 8]]"
    assert job_hosts(9) == [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    with pytest.raises(ConfigError, match="has 9 ranks, but the job has 5 processes"):
        job_tree("auto", 5)


def test_job_tree_from_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SYNCPLANE_CLUSTER", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert job_tree("auto", 6).describe() == "core[core.0[0, 1], core.1[2, 3], core.2[4, 5]]"
    assert job_tree([1, 3], 4).describe() == "core[0, core.1[1, 2, 3]]"
    assert job_tree("two_racks", 8).num_levels == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=4 does not divide the world size 6"):
        job_tree("auto", 6)


@pytest.mark.parametrize("kwargs, message", [
    ({"topology": 5}, "topology: expected auto.*got 5"),
    ({"topology": [2, 0]}, r"topology: .*got \[2, 0\]"),
    ({"chunk_mb": -1}, "chunk_mb: must be >= 0.*got -1"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb: must be positive, got 0"),
    ({"ddp_comm_hook": print}, "ddp_comm_hook is FlexReduce itself"),
])
def test_bad_strategy_kwargs(kwargs: dict, message: str) -> None:
    from syncplane.strategies.flexreduce import FlexReduceStrategy

    with pytest.raises(ConfigError, match=message):
        FlexReduceStrategy(**kwargs)
