"""Every point-to-point exchange posts its receives before its sends.

Under gloo, two ranks that both post their send to each other first swap one direction after
the other: gloo sends a message once the receiver has announced its receive, and that notice
leaves behind the data the receiver already queued (docs/design-notes.md, "Receives before
sends"; measured there at twice the time). These tests record the order in which the
exchanges hand their messages to torch.distributed / the process groups, with fakes in place
of the transport.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist


class _Work:
    def wait(self, *args: Any) -> bool:
        return True


class _Op:
    """Stands in for ``dist.P2POp``: what it does and to whom."""

    def __init__(self, op: Any, tensor: torch.Tensor, group: Any = None, tag: int = 0, group_peer: int = -1) -> None:
        self.kind = "send" if op is dist.isend else "recv"
        self.peer, self.group = group_peer, group


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    order: list[tuple[str, int]] = []

    def batch(ops: list[_Op]) -> list[_Work]:
        order.extend((op.kind, op.peer) for op in ops)
        return [_Work() for _ in ops]

    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    return order


@pytest.mark.parametrize("one_way", [False, True])
def test_exchange_tensors_posts_every_receive_before_any_send(posted: list[tuple[str, int]],
                                                              monkeypatch: pytest.MonkeyPatch, one_way: bool) -> None:
    """Both the one-group exchange (H-ATC's machine-local reduce-scatter) and one whose
    directions ride groups of their own (``context.set_one_way_links``)."""
    from syncplane.comm import context, p2p

    if one_way:
        up, down = object(), object()
        monkeypatch.setattr(p2p, "one_way_link", lambda group, src, dst: up if src < dst else down)
    sends = [(peer, torch.ones(3)) for peer in (1, 2, 3)]
    recvs = [(peer, torch.empty(3)) for peer in (3, 1, 2)]
    handle = p2p.exchange_tensors(sends, recvs, None, lambda: torch.zeros(1), timeout_s=5.0, what="test")
    kinds = [kind for kind, _ in posted]
    assert kinds == ["recv"] * 3 + ["send"] * 3, posted
    assert [peer for kind, peer in posted if kind == "recv"] == [3, 1, 2]
    assert [peer for kind, peer in posted if kind == "send"] == [1, 2, 3]
    assert handle.wait().shape == (1,)
    context.reset()


class _Group:
    """A process group that records the sends and receives handed to it."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Work:
        self.log.append(("send", peer))
        return _Work()

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Work:
        self.log.append(("recv", peer))
        return _Work()


@pytest.mark.parametrize("gather", [False, True])
def test_flexreduce_posts_a_phases_receives_before_its_sends(gather: bool) -> None:
    """A tick of FlexReduce's wavefront (``_post``): the reduce-scatter receives its holders'
    pieces, the all-gather the owners' finished ones, before either sends its own."""
    from syncplane.exchanges.tree.executor import FlexReduce, LevelSchedule, Message

    log: list[tuple[str, int]] = []
    groups = (_Group(log), _Group(log))
    sched = LevelSchedule(sends=(Message(peer=2, lo=0, hi=2), Message(peer=3, lo=2, hi=4)),
                          recvs=(Message(peer=1, lo=0, hi=2, slot=0), Message(peer=5, lo=2, hi=4, slot=2)),
                          combines=(), workspace=4)
    fake = SimpleNamespace(rank=0, world=6, tree=SimpleNamespace(num_levels=2), timeout_s=5.0)
    FlexReduce._post(fake, torch.zeros(4), sched, torch.zeros(4), 0, gather, 7, groups)   # type: ignore[arg-type]
    # the all-gather runs the messages the other way: it receives from those it sent to
    first, then = ((3, 2), (1, 5)) if gather else ((1, 5), (2, 3))
    assert sorted(log[:2]) == sorted(("recv", p) for p in first), log
    assert sorted(log[2:]) == sorted(("send", p) for p in then), log
