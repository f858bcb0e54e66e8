"""``scripts/posting_order.py``'s cases (its measurements need the emulator: docs/design-notes.md,
"Receives before sends"): which messages each case sends, and in which order each end posts."""

from __future__ import annotations

import pytest

from tests.helpers.scripts import load_script


def test_each_swap_case_is_one_message_each_way_with_each_ends_own_order() -> None:
    cases = load_script("posting_order").cases(7, 0, 8)
    swaps = {name: messages for name, messages in cases.items() if name.startswith("swap")}
    assert len(swaps) == 4
    assert {tuple(f for *_, f in m) for m in swaps.values()} == {("s", "s"), ("r", "r"), ("s", "r"), ("r", "s")}
    for messages in swaps.values():
        assert [(src, dst, share) for src, dst, share, _ in messages] == [(7, 0, 1.0), (0, 7, 1.0)]


@pytest.mark.parametrize("peers", [3, 7])
def test_an_all_to_all_case_moves_the_payload_each_way_through_its_rank_in_one_order(peers: int) -> None:
    cases = load_script("posting_order").cases(7, 0, 8)
    for first in ("send", "receive"):
        messages = cases[f"all-to-all of {peers} peers, {first} first"]
        out = [(dst, share) for src, dst, share, _ in messages if src == 7]
        back = [(src, share) for src, dst, share, _ in messages if dst == 7]
        assert sorted(out) == sorted(back) and len(out) == peers and 0 in dict(out)
        assert sum(share for _, share in out) == pytest.approx(1.0)
        assert {f for *_, f in messages} == {first[0]}
