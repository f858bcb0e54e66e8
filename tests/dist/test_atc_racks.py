"""``atc``/``awc``'s default on a cluster profile with racks (``hierarchy: auto``): they mix racks
as ``h_atc`` does, on real gloo processes, against float64 dense references built from the
definitions -- rack means mixed by the one-peer schedule over racks (two racks: each rank ends
with ½ its rack's mean + ½ the other rack's), while ``hierarchy: none`` is flat one-peer
gossip over the ranks (step t: ½ its own + ½ that of rank r − 2^t); the decision itself is
pure and the same from the launcher's profile."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist.test_canary_nested import _profile
from tests.helpers.distributed import run_distributed

NUMEL = 5003
STEPS = 2


def _payload(seed: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + step * 131 + rank)
    return torch.randn(NUMEL, generator=g) * (rank + 1)


def _run(rank: int, world: int, profile_path: str, seed: int):
    os.environ["SYNCPLANE_CLUSTER"] = profile_path
    from syncplane.algorithms.decentralized import SPEC
    from syncplane.comm import CommMeter
    from syncplane.job import JobContext

    job = JobContext.from_environment()
    out = {}
    for name, options in (("atc", {}), ("awc", {}), ("atc", {"hierarchy": "none"})):
        step_fn = SPEC.bench_step(name, {**options, "bucket_mb": 0.004}, job)   # several buckets
        got = []
        for step in range(STEPS):
            payload = _payload(seed, step, rank)
            step_fn(payload, step, CommMeter())
            got.append(payload.clone())
        out[name, options.get("hierarchy", "auto")] = (got, step_fn.hierarchical)
    return out


@pytest.mark.timeout(240)
def test_atc_mixes_racks_on_a_profile_with_racks_and_ranks_with_hierarchy_none(tmp_path, test_seed):
    world = 4
    profile = tmp_path / "racks.yaml"
    profile.write_text(_profile(2, 2, 1))          # 2 racks of 2 hosts of 1 rank: ranks 0, 1 | 2, 3
    results = run_distributed(_run, world, str(profile), test_seed, timeout=200)
    racks = [[0, 1], [2, 3]]
    for step in range(STEPS):
        x = [_payload(test_seed, step, r).double() for r in range(world)]
        means = [torch.stack([x[r] for r in ranks]).mean(0) for ranks in racks]
        for rank in range(world):
            mine = 0 if rank < 2 else 1
            by_rack = 0.5 * means[mine] + 0.5 * means[1 - mine]
            flat = 0.5 * x[rank] + 0.5 * x[(rank - 2 ** (step % 2)) % world]
            for key in (("atc", "auto"), ("awc", "auto")):
                got, hierarchical = results[rank][key]
                assert hierarchical
                torch.testing.assert_close(got[step].double(), by_rack, rtol=1e-6, atol=1e-5)
            got, hierarchical = results[rank]["atc", "none"]
            assert not hierarchical
            torch.testing.assert_close(got[step].double(), flat, rtol=1e-6, atol=1e-5)


def test_the_decision_is_the_profiles():
    from syncplane.algorithms.decentralized.machines import mixes_racks
    from syncplane.cluster import load_profile, parse_profile

    import yaml

    def profile(racks: int, hosts: int, ranks: int):
        return parse_profile(yaml.safe_load(_profile(racks, hosts, ranks)))

    assert mixes_racks("auto", load_profile("two_racks"))
    assert mixes_racks("auto", profile(2, 1, 2))                 # one host of two ranks per rack
    assert not mixes_racks("auto", profile(1, 4, 1))             # one rack: nothing to respect
    assert not mixes_racks("auto", profile(2, 1, 1))             # one rank per rack: racks are ranks
    assert not mixes_racks("auto", None)                         # no profile (one machine, torchrun)
    assert not mixes_racks("none", load_profile("two_racks"))
    assert not mixes_racks("auto", load_profile("two_racks"), max_staleness=2)
    with pytest.raises(ValueError, match="unknown hierarchy 'pod'"):
        mixes_racks("pod", load_profile("two_racks"))


def _train_on_racks(rank: int, world: int, tmp_dir: str, profile_path: str):
    os.environ["SYNCPLANE_CLUSTER"] = profile_path
    from tests.dist.test_decentralized import _train

    return {label: _train(rank, world, tmp_dir, name, kwargs, 3, 0.9)[0]
            for label, name, kwargs in (("atc", "atc", {}), ("h_atc", "h_atc", {"machines": "rack"}),
                                        ("flat", "atc", {"hierarchy": "none"}))}


@pytest.mark.timeout(300)
def test_the_atc_strategy_on_racks_trains_as_h_atc_on_racks(tmp_path):
    """Through Lightning: the default ``atc`` on a profile with racks ends with h_atc's
    parameters (machines = racks) bit for bit, and ``hierarchy: none`` with other ones."""
    profile = tmp_path / "racks.yaml"
    profile.write_text(_profile(2, 2, 1))
    for result in run_distributed(_train_on_racks, 4, str(tmp_path), str(profile), timeout=280):
        assert torch.equal(result["atc"], result["h_atc"])
        assert not torch.equal(result["atc"], result["flat"])
