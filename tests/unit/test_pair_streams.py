"""The pair-stream setting and the rule that picks a stream count from measured syncs."""

from __future__ import annotations

import pytest

from syncplane.comm.groups import GroupSet
from syncplane.algorithms.ds_sync.pair_streams import check_pair_streams, choose_pair_streams


@pytest.mark.parametrize("bad", [0, -2, "four", 2.5, True])
def test_pair_streams_must_be_auto_or_a_positive_count(bad):
    with pytest.raises(ValueError, match="pair_streams must be 'auto' or an integer >= 1"):
        check_pair_streams(bad)


def test_valid_settings_pass_and_a_group_set_needs_a_stream():
    assert check_pair_streams("auto") == "auto" and check_pair_streams(3) == 3
    with pytest.raises(ValueError, match="pair_streams must be >= 1, got 0"):
        GroupSet([[0, 1]], max_pair_streams=0)


def test_several_streams_are_kept_only_when_the_syncs_in_all_gain_enough():
    assert choose_pair_streams([16.0, 19.0], [10.0, 11.0], 4) == 4      # a contended uplink: 1.7x
    assert choose_pair_streams([8.8, 16.1], [11.1, 10.2], 4) == 1       # a link of its own: 1.17x
    assert choose_pair_streams([10.0], [8.5], 4) == 1                   # below 1.25x: keep one
    assert choose_pair_streams([10.0], [7.9], 4) == 4
    assert choose_pair_streams([10.0], [8.0], 4) == 4                   # exactly 1.25x keeps them
    assert choose_pair_streams([], [7.9], 4) == 1                       # nothing measured: one
    assert choose_pair_streams([10.0, 9.0], [7.9], 4) == 1              # unmatched: one


def test_a_pair_slowed_most_is_not_outvoted_by_the_median():
    """Beside a greedy flow the pairs gain unevenly; the median pair's 1.08x would keep one
    stream, and the run would pay the slow pair's 30 s every period (69 s against 48 in all)."""
    assert choose_pair_streams([13.0, 13.0, 13.0, 30.0], [12.0, 12.0, 12.0, 12.0], 4) == 4
