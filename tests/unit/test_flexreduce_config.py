"""FlexReduce's configuration: the job's tree from the environment, and bad strategy kwargs
rejected with the field and value named (at construction: before any process starts work)."""

from __future__ import annotations

import pytest

from syncplane.exchanges.tree.tree import job_tree
from syncplane.job import JobContext
from syncplane.config import ConfigError


def test_job_tree_from_launcher_profile() -> None:
    job = JobContext.from_environment({"SYNCPLANE_CLUSTER": "asymmetric_3_2_4"}, rank=0, world_size=9)
    assert job_tree(job).describe() == "r0[m0[0, 1, 2], m1[3, 4], m2[5, 6, 7, 8]]"
    assert job.hosts() == [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    with pytest.raises(ConfigError, match="has 9 ranks, but the job has 5 processes"):
        job_tree(job.with_size(0, 5))


def test_job_tree_from_local_world_size() -> None:
    job = JobContext.from_environment({"LOCAL_WORLD_SIZE": "2"}, rank=0, world_size=6)
    assert job_tree(job).describe() == "core[core.0[0, 1], core.1[2, 3], core.2[4, 5]]"
    assert job_tree(job.with_size(0, 4), [1, 3]).describe() == "core[0, core.1[1, 2, 3]]"
    assert job_tree(job.with_size(0, 8), "two_racks").num_levels == 2
    job = JobContext.from_environment({"LOCAL_WORLD_SIZE": "4"}, rank=0, world_size=6)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=4 does not divide the world size 6"):
        job_tree(job)


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
