"""Neighbour mixing that goes on without a late neighbour, within a bound (``max_staleness``).

Both ends of an edge know the schedule, so both number the messages a source sends to a
receiver the same way. At step t a rank waits up to ``late_after_s`` for step t's message of
each source j of t's plan; a source still missing then is *late*, and the rank combines j's
newest message that has arrived instead -- blocking only while that one is more than
``max_staleness`` messages behind step t's (and always for j's first message). The weights
are step t's plan, applied to the value j sent (already scaled by j's send weight):

    y_i = a·x_i + Σ_j r_ij · s_ij · x_j(t_j),   t − (steps of max_staleness messages) ≤ t_j ≤ t

so with every message on time the result is bit for bit that of the blocking exchange
(same kernel, same operands, same order). A stale ``x_j`` breaks mass conservation for that
step: the ranks' mean moves by ``r_ij·s_ij·(x_j(t_j) − x_j(t))/n``, at most ``max_staleness``
of j's messages' worth of its updates (bounded-delay gossip, as in Lian et al., ICML 2018).

A send outlives its step (the late peer takes it when it gets there), so it is a copy, and
at most ``max_staleness + 1`` are in flight per destination (the oldest is waited for
first): memory stays bounded and no rank runs more than that ahead of a destination. A
rank held back for longer than a bound therefore still sets its neighbours' pace, after
``max_staleness`` messages of slack.

Shared by two families (a module of ``syncplane.algorithms``, not of either, so they stay
independent): ``atc``/``awc`` mix with their schedule's plan; ``ds_sync`` mixes each step's
group as a clique, ``group_plan``: weights ``1/|g|`` on every member, the group mean.

Arrival is watched by threads, one blocking ``wait`` per message: under gloo a point-to-point
work's ``is_completed()`` stays False until someone waits for it, and a ``wait`` that times out
closes the connection, so it cannot be polled.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from syncplane import kernels
from syncplane.comm.meter import CommMeter
from syncplane.comm.p2p import exchange_tensors

#: Threads that watch messages; enough for every message in flight at ``max_staleness`` ≤ 8 on
#: an exponential graph of a few hundred ranks (a queued watcher only reports arrival later).
WATCHERS = 32

#: Steps whose message choices ``LatePeerMixer.used`` keeps (for tests and debugging; bounded so a
#: long run does not grow).
USED_KEPT = 1024


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of one mixing step: ``y = self_weight·x + Σ src_weights[j]·x_j``."""

    self_weight: float
    src_weights: dict[int, float]
    dst_weights: dict[int, float]


def group_plan(group: Sequence[int], rank: int) -> RankPlan:
    """``rank``'s plan for averaging ``group`` (which holds it) as a clique: every member's
    value, sent unscaled, weighs ``1/|g|`` -- a group average as a neighbour mix."""
    if rank not in group:
        raise ValueError(f"rank {rank} is not in group {list(group)}")
    weight = 1.0 / len(group)
    peers = [r for r in group if r != rank]
    return RankPlan(weight, {r: weight for r in peers}, {r: 1.0 for r in peers})


def check_late_peer_options(max_staleness: int, late_after_s: float) -> None:
    """The settings' rules, for every strategy that offers them (raises ``ValueError`` naming the key)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 (0 = wait for every neighbour), got {max_staleness}")
    if late_after_s < 0:
        raise ValueError(f"late_after_s must be >= 0, got {late_after_s}")


@dataclass
class Message:
    """One rank's payload to one peer at one step (every bucket); ``arrived`` completes when
    the backend finished moving it (raises ``TopologyError`` past the timeout)."""

    step: int
    index: int                      # the n-th message between this pair, in this direction
    buffers: list[torch.Tensor]
    arrived: Future[object]


class LatePeerMixer:
    """The per-peer message queues of one ``NeighborAverager`` in flat mode (or of ``DSSync``).

    ``launch`` posts one step's sends and receives and returns the function that combines
    them; ``used`` records, per combined step, the step of each source's message it took
    (what a test compares against the dense reference)."""

    def __init__(self, max_staleness: int, late_after_s: float, *, timeout_s: float,
                 meter: CommMeter | None = None) -> None:
        check_late_peer_options(max_staleness, late_after_s)
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for late-peer mixing, got {max_staleness}")
        self.max_staleness, self.late_after_s = max_staleness, late_after_s
        self.timeout_s, self.meter = timeout_s, meter
        self._watch = ThreadPoolExecutor(max_workers=WATCHERS, thread_name_prefix="syncplane-late-peer")
        self._inbox: dict[int, deque[Message]] = defaultdict(deque)     # posted receives, oldest first
        self._latest: dict[int, Message] = {}                            # newest arrived, per source
        self._outbox: dict[int, deque[Message]] = defaultdict(deque)    # sends in flight, oldest first
        self._received: dict[int, int] = defaultdict(int)                # receives posted per source
        self._sent: dict[int, int] = defaultdict(int)                    # sends posted per destination
        self._spare: dict[int, list[list[torch.Tensor]]] = defaultdict(list)   # reusable receive buffers
        #: (step, {source: the step of the message combined}) for the last USED_KEPT steps
        self.used: deque[tuple[int, dict[int, int]]] = deque(maxlen=USED_KEPT)
        self.values = 0           # neighbour values combined so far
        self.stale_values = 0     # of which were not the step's own (a late neighbour)

    def _post(self, peer: int, step: int, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> Future[object]:
        handle = exchange_tensors([(peer, t) for t in sends], [(peer, t) for t in recvs], None, lambda: sends,
                                  timeout_s=self.timeout_s, what=f"neighbor_allreduce (step {step}, late-peer mode)")
        return self._watch.submit(handle.wait)

    def launch(self, step: int, plan: RankPlan, flats: Sequence[torch.Tensor]) -> Callable[[], None]:
        """Post step ``step``'s messages; the returned function combines into ``flats`` in place."""
        for peer, scale in plan.dst_weights.items():
            queue = self._outbox[peer]
            while len(queue) > self.max_staleness:   # the bound: at most max_staleness + 1 in flight
                queue.popleft().arrived.result()
            copies = [f.clone() if scale == 1.0 else f * scale for f in flats]
            queue.append(Message(step, self._sent[peer], copies, self._post(peer, step, copies, [])))
            self._sent[peer] += 1
        wanted = {}
        for peer in plan.src_weights:
            spare = self._spare[peer]
            buffers = spare.pop() if spare else [torch.empty_like(f) for f in flats]
            message = Message(step, self._received[peer], buffers, self._post(peer, step, [], buffers))
            self._inbox[peer].append(message)
            wanted[peer] = message.index
            self._received[peer] += 1
        sent = len(plan.dst_weights) * sum(f.numel() * f.element_size() for f in flats)
        return lambda: self._combine(step, plan, flats, wanted, sent)

    def _freshest(self, peer: int, index: int, deadline: float) -> Message:
        """The newest arrived message of ``peer``: message ``index`` if it arrives before
        ``deadline`` (``time.monotonic()``), else waiting for those up to ``index - max_staleness``
        (and for the first one ever: there is no older value to use)."""
        need = max(index - self.max_staleness, 0)
        inbox = self._inbox[peer]
        if inbox and inbox[-1].index == index:   # a future's timeout, not the backend's: nothing closes
            wait([inbox[-1].arrived], timeout=max(deadline - time.monotonic(), 0.0))
        while inbox and inbox[0].index <= index and (inbox[0].index <= need or inbox[0].arrived.done()):
            message = inbox.popleft()
            message.arrived.result()
            previous = self._latest.get(peer)
            if previous is not None:
                self._spare[peer].append(previous.buffers)
            self._latest[peer] = message
        return self._latest[peer]

    def _combine(self, step: int, plan: RankPlan, flats: Sequence[torch.Tensor], wanted: dict[int, int],
                 sent: int) -> None:
        """Combine step ``step``; the meter gets the bytes sent and the seconds this blocked (the
        seconds a late peer holds a send in flight are not the link's)."""
        start = time.perf_counter()
        deadline = time.monotonic() + self.late_after_s
        chosen = [self._freshest(peer, wanted[peer], deadline) for peer in plan.src_weights]
        self.used.append((step, {peer: m.step for peer, m in zip(plan.src_weights, chosen)}))
        self.values += len(chosen)
        self.stale_values += sum(m.step != step for m in chosen)
        weights = list(plan.src_weights.values())
        for i, flat in enumerate(flats):
            kernels.weighted_combine(flat, [m.buffers[i] for m in chosen], weights, plan.self_weight, out=flat)
        if self.meter is not None:
            self.meter.record(start, time.perf_counter(), sent)

    def summary(self) -> dict[str, float]:
        """The settings and counts a run reports (summary.json's ``strategy_details.late_peers``)."""
        return {"max_staleness": self.max_staleness, "late_after_s": self.late_after_s,
                "neighbour_values": self.values, "stale_values": self.stale_values}

    def drain(self) -> None:
        """Wait for every message in flight (checkpoints, validation, the end of a fit: every
        rank is at the same step there, so every posted message has its match)."""
        for queue in [*self._outbox.values(), *self._inbox.values()]:
            for message in queue:
                message.arrived.result()
        self._outbox.clear()
        for peer, inbox in self._inbox.items():
            if inbox:
                self._latest[peer] = inbox[-1]
            inbox.clear()

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to go on exactly as without the stop (call after ``drain``: no
        message is in flight then, so the per-peer counters of both ends agree): the messages
        posted per peer (the numbering the bound counts in), each source's newest message (the
        value a late source counts with), the counts and the recent choices. Tensors and
        containers only (``torch.load(weights_only=True)``)."""
        if any(self._inbox.values()) or any(self._outbox.values()):
            raise RuntimeError("late-peer state with messages in flight: drain() first (every rank at the same step)")
        return {"sent": dict(self._sent), "received": dict(self._received),
                "latest": {peer: {"step": m.step, "index": m.index, "buffers": [b.detach().cpu().clone()
                                                                             for b in m.buffers]}
                           for peer, m in self._latest.items()},
                "values": self.values, "stale_values": self.stale_values,
                "used": [[step, dict(by_peer)] for step, by_peer in self.used]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s state into a fresh mixer (nothing posted yet)."""
        if any(self._received.values()) or any(self._sent.values()):
            raise RuntimeError("load_state_dict on a late-peer mixer that already exchanged messages")
        self._sent.update({int(k): int(v) for k, v in state["sent"].items()})
        self._received.update({int(k): int(v) for k, v in state["received"].items()})
        for peer, saved in state["latest"].items():
            arrived: Future[object] = Future()
            arrived.set_result(None)
            self._latest[int(peer)] = Message(int(saved["step"]), int(saved["index"]), list(saved["buffers"]),
                                              arrived)
        self.values, self.stale_values = int(state["values"]), int(state["stale_values"])
        self.used.extend((int(step), {int(k): int(v) for k, v in by_peer.items()}) for step, by_peer in state["used"])

    def close(self) -> None:
        """Stop watching; call ``drain`` first unless the job failed (a watcher still blocked in
        the backend ends with the process group)."""
        self._watch.shutdown(wait=False, cancel_futures=True)
