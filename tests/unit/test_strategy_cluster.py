"""A strategy's ``cluster`` argument places a plain script's job on a cluster profile (a name, a
path or an object); the launcher's ``SYNCPLANE_CLUSTER`` is only the fallback."""

from __future__ import annotations

import pytest

from syncplane.cluster.profile import load_profile
from syncplane.config import ConfigError
from syncplane.launch import CLUSTER_ENV
from syncplane.strategies.decentralized import ATC
from syncplane.strategies.diloco import DiLoCo
from syncplane.strategies.flexreduce import FlexReduceStrategy


@pytest.mark.parametrize("make", [ATC, DiLoCo, FlexReduceStrategy])
def test_the_argument_wins_over_the_environment(monkeypatch, make):
    monkeypatch.setenv(CLUSTER_ENV, "homogeneous8")
    profile = load_profile("two_racks")
    strategy = make(cluster=profile)
    assert strategy.job.profile is profile and strategy.job.cluster == "two_racks"
    assert make().job.cluster == "homogeneous8"          # no argument: the launcher's


def test_a_path_is_loaded_once_and_a_bad_one_fails_when_built(tmp_path, monkeypatch):
    monkeypatch.delenv(CLUSTER_ENV, raising=False)
    path = tmp_path / "mine.yaml"
    path.write_text((load_profile.__globals__["PROFILE_DIR"] / "two_racks.yaml").read_text())
    strategy = ATC(cluster=path)
    assert strategy.job.cluster == str(path) and strategy.job.profile.to_dict() == load_profile(path).to_dict()
    with pytest.raises(ConfigError, match="no profile file"):
        DiLoCo(cluster=tmp_path / "missing.yaml")
    assert ATC().job.cluster is None
