"""``streams: auto``: DiLoCo's stream count from the job's cluster profile, by the cost model.

What each shipped profile needs: a per-flow-capped WAN (``wan_two_sites``: 1 Gbit site
link, 100 Mbit per TCP flow, two cross-site pairs) as many streams as fill the link (8:
4 leave it at 0.8); two NICs per host (``multi_nic``) one stream per NIC; one NIC and no
cap (``two_racks``) one stream (more only add connections); a link shared with a greedy
flow (``two_racks_contended``) more streams for a larger fair share. Without a profile, or
with one for another job size, 1, said in the log.
"""

from __future__ import annotations

import logging

import pytest

from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.cost import auto_streams, resolve_streams
from syncplane.cluster import load_profile
from syncplane.job import JobContext
from syncplane.launch import CLUSTER_ENV


@pytest.mark.parametrize(("profile", "streams"), [("wan_two_sites", 8), ("multi_nic", 2), ("two_racks", 1),
                                                  ("two_racks_contended", 4)])
def test_auto_picks_the_fewest_streams_near_the_best_bound(profile: str, streams: int) -> None:
    chosen, bounds = auto_streams(load_profile(profile))
    assert chosen == streams, bounds
    assert bounds[chosen] <= 1.1 * min(bounds.values())
    assert all(bounds[s] > 1.1 * min(bounds.values()) for s in bounds if s < chosen)


def test_owner_exchange_and_int8_are_priced_as_they_run() -> None:
    """int8 runs the owner exchange (auto): on the WAN it too needs several streams."""
    chosen, bounds = auto_streams(load_profile("wan_two_sites"), compression="int8")
    assert chosen > 1 and bounds[1] > 2 * bounds[chosen]


def test_resolve_uses_the_topology_profile_then_the_jobs(caplog: pytest.LogCaptureFixture) -> None:
    plain = JobContext(world_size=4)
    assert resolve_streams(3, plain) == 3                                  # an integer is kept
    with caplog.at_level(logging.INFO, logger="syncplane.algorithms.diloco.cost"):
        assert resolve_streams("auto", plain) == 1
    assert "no cluster profile" in caplog.text
    assert resolve_streams("auto", plain, "wan_two_sites") == 8            # topology names the profile
    assert resolve_streams("auto", plain, [2, 2]) == 1                     # ranks per host: no profile
    placed = JobContext.from_environment({CLUSTER_ENV: "multi_nic"}, rank=0, world_size=4)   # the launcher's
    assert resolve_streams("auto", placed) == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="syncplane.algorithms.diloco.cost"):
        assert resolve_streams("auto", placed.with_size(0, 8)) == 1        # a profile of another size
    assert "multi_nic has 4 ranks, the job 8" in caplog.text


@pytest.mark.parametrize("bad", [0, -2, "many", 1.5, True])
def test_config_refuses_what_is_neither_a_count_nor_auto(bad: object) -> None:
    with pytest.raises(ValueError, match="streams must be an integer of at least 1, or 'auto'"):
        DiLoCoConfig(streams=bad)  # type: ignore[arg-type]
    assert DiLoCoConfig(streams="auto").streams == "auto"


def test_the_old_name_shards_still_sets_the_streams_with_a_deprecation_warning():
    from syncplane.strategies.diloco import DiLoCo

    with pytest.warns(DeprecationWarning, match="'shards' is now called 'streams'"):
        assert DiLoCo(shards=4).config.streams == 4
    assert DiLoCo(streams=2).config.streams == 2
