"""Elastic DiLoCo: membership by torchft quorum around ``DiLoCoEngine``'s own round, the fixed
job's code; only its exchanges differ: ``QuorumTransport`` hands the engine exchangers on gloo
groups of the current quorum's store, built again at each membership change. ``Membership``
says where and with whom the replicas meet:

- ``membership="fixed"``: at a **boundary**, where no round is in flight (after the step at
  which a period's first fragment merged: ``done ≡ overlap_steps mod H``), the vote on the
  period's rounds, then the next quorum, where a restarted (or behind) replica heals.
- ``membership="quorum"``: at a **point** before each period's rounds (``done ≡ 0 mod H``), the
  replicas that arrived within the grace (``RoundBoard``), each Δ weighted by its steps since it
  last sent one (``scale``: exactly 1 without a fault, so the rounds equal ``fixed``'s bit for
  bit). A **late** replica trains on until the next point, then heals and carries its own work
  into that round (``DiLoCoEngine.rebase``; why carry, not drop: docs/design-notes.md).

A member whose round's agreement broke off (``StreamRunner``) does not know what the others did:
it votes no, stays a torchft step behind and heals from one that committed, so every member of a
quorum holds one θ_g (error-feedback residuals stay each replica's own).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch.utils._pytree import tree_leaves

from syncplane.comm.codecs import Codec
from syncplane.comm.meter import CommMeter
from syncplane.algorithms.diloco.transport import GlooTransport
from syncplane.comm.streams import StreamExchange, StreamRunner

if TYPE_CHECKING:
    from syncplane.algorithms.diloco.ft import ReplicaGroup

log = logging.getLogger(__name__)


class ReplicaMismatch(ValueError):
    """A replica's settings differ from the job's; names each differing field."""


def fingerprint(n_values: int, sync_every: int, outer_optimizer: str, outer_kwargs: Mapping[str, Any] | None,
                shapes: list[tuple[int, ...]], rounds: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings every replica of one elastic job must share, as they read back from the
    fingerprint's file (JSON types); ``rounds``: the round's own (replicas that differ there would
    exchange different pieces)."""
    settings = {"model_values": int(n_values), "model_shapes": [list(s) for s in shapes],
                "sync_every": int(sync_every), "outer_optimizer": outer_optimizer,
                "outer_kwargs": None if outer_kwargs is None else dict(outer_kwargs),
                **({"rounds": dict(rounds)} if rounds else {})}
    return json.loads(json.dumps(settings, sort_keys=True))


def differences(job: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """One line per field where ``ours`` differs from ``job``."""
    out = []
    for key in sorted(set(job) | set(ours)):
        a, b = job.get(key), ours.get(key)
        if a != b:
            if key == "model_shapes":
                a, b = f"{len(a or [])} tensors {str(a)[:80]}", f"{len(b or [])} tensors {str(b)[:80]}"
            out.append(f"{key}: the job has {a}, this replica has {b}")
    return out


class JobFingerprint:
    """The job's settings in ``<folder>/elastic_fingerprint.json``, written by the first replica
    (``O_EXCL``: exactly one writer wins) and compared by every later one."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.path = Path(folder) / "elastic_fingerprint.json"

    def check(self, ours: Mapping[str, Any], replica: str) -> None:
        """Record ``ours`` if first, else raise ``ReplicaMismatch`` naming what differs."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.path.open("x") as f:   # O_EXCL
                f.write(json.dumps(dict(ours), sort_keys=True))
        except FileExistsError:
            diff = differences(self._read(), ours)
            if diff:
                raise ReplicaMismatch(f"{replica} cannot join this elastic DiLoCo job (it was not admitted; the "
                                      f"running replicas go on): " + "; ".join(diff)) from None

    def _read(self) -> dict[str, Any]:
        for _ in range(100):   # the winner may still be writing
            text = self.path.read_text()
            if text:
                return json.loads(text)
            time.sleep(0.02)
        raise RuntimeError(f"{self.path} stays empty")


@dataclass
class ElasticStats:
    """What the summary reports about membership."""

    committed: int = 0
    discarded: int = 0
    heals: list[dict[str, Any]] = field(default_factory=list)
    replicas: list[list[int]] = field(default_factory=list)   # [round position, quorum size] at each change

    def as_dict(self) -> dict[str, Any]:
        return {"rounds_committed": self.committed, "rounds_discarded": self.discarded,
                "replicas_over_time": self.replicas, "heals": self.heals}


class RoundBoard:
    """Where the replicas are, for ``membership="quorum"``: empty files in ``<folder>/elastic_rounds/``.

    Why: torchft's Lighthouse counts the grace from the *first* request it holds, and forms a
    quorum at once when every member of the previous one has asked. A late or restarted replica
    asking during the others' inner steps would open the next window a round early; one asking
    just after them misses that fast path. So an on-time replica at round p writes ``arrived-p``
    and lets those that wrote ``waiting-p-<name>`` ask first (until ``asked-p-<name>``, up to
    ``hold_s``); a late one targets q = the latest ``formed`` + 1: writes ``waiting-q-<name>``,
    waits for ``arrived-q``, writes ``asked-q-<name>`` and asks. One that says it waits just
    after the on-time ones looked is taken by their next quorum: one more round late, no more.
    """

    def __init__(self, folder: str | os.PathLike[str], name: str, poll_s: float = 0.02) -> None:
        self.dir = Path(folder) / "elastic_rounds"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name, self.poll_s = name, poll_s

    def formed(self) -> int:
        """The latest round whose quorum formed (-1: none yet)."""
        return max((int(p.name.split("-")[1]) for p in self.dir.glob("formed-*")), default=-1)

    def mark(self, kind: str, position: int, name: str = "") -> None:
        (self.dir / (f"{kind}-{position}-{name}" if name else f"{kind}-{position}")).touch()

    def _until(self, done: Callable[[], bool], timeout_s: float) -> float:
        start = time.monotonic()
        while not done() and time.monotonic() - start < timeout_s:
            time.sleep(self.poll_s)
        return time.monotonic() - start

    def arrive(self, position: int, hold_s: float) -> float:
        """On time at ``position``: say so, and let the replicas waiting for it ask first."""
        self.mark("arrived", position)
        waiting = {p.name.split("-", 2)[2] for p in self.dir.glob(f"waiting-{position}-*")}
        if not waiting:
            return 0.0
        held = self._until(lambda: all((self.dir / f"asked-{position}-{n}").exists() for n in waiting), hold_s)
        time.sleep(self.poll_s)   # the waiters' requests reach the Lighthouse first
        return held

    def late(self, position: int) -> bool:
        """True while a replica at ``position`` is late (its round's quorum formed without it) and
        the next boundary has not opened; says it waits for that one, so it may ask first there."""
        formed = self.formed()
        if formed < position:
            return False
        self.mark("waiting", formed + 1, self.name)
        return not (self.dir / f"arrived-{formed + 1}").exists()

    def wait_for_next(self, timeout_s: float) -> float:
        """Late or restarted: the seconds waited for the next boundary's first on-time arrival
        (at most ``timeout_s``: the quorum call then waits)."""
        target = self.formed() + 1
        self.mark("waiting", target, self.name)
        waited = self._until(lambda: (self.dir / f"arrived-{target}").exists(), timeout_s)
        self.mark("asked", target, self.name)
        return waited


class QuorumExchanger:
    """One outer exchange of the engine over the current quorum: a ``StreamRunner`` on the
    quorum's store, built at its first round (a collective of its members, who all reach it);
    after a failed round it stays closed (its rounds discarded) until the next quorum. The
    error-feedback residuals carry over from one quorum's runner to the next."""

    def __init__(self, transport: "QuorumTransport", exchange: StreamExchange, key: str,
                 options: Mapping[str, Any]) -> None:
        self.transport, self.exchange, self.key, self.options = transport, exchange, key, dict(options)
        self._runner: StreamRunner | None = None
        self._built_for: int | None = None    # the quorum id the runner is on
        self._residuals: dict[str, Any] = {}

    def allreduce_mean_(self, flat: torch.Tensor, meter: CommMeter | None = None, *,
                        offset: int = 0, total: int | None = None) -> bool:
        view = self.transport.view
        if view is None or view.participants <= 1:
            return view is not None   # alone in the quorum: Δ is the mean
        try:
            if self._built_for != view.quorum_id:   # the quorum's first round: its runner
                self.close()
                self._built_for = view.quorum_id
                place = (self.transport.store(view), view.rank, view.participants)
                self._runner = StreamRunner(self.exchange, place=place, key=self.key, rebuild=False,
                                            hostname=self.transport.host, **self.options)
                self._runner.load_state_dict(self._residuals)
            elif self._runner is not None and self._runner.closed:   # closed after a failed round
                self.close()
            return self._runner is not None and self._runner.allreduce_mean_(flat, meter, offset=offset, total=total)
        except RuntimeError as exc:   # the agreement broke off, or the groups did not connect
            log.warning("elastic: round outcome unknown (%s); this replica will heal at the next quorum", exc)
            self.transport.uncertain = exc
            self.close()
            return False

    def close(self) -> None:
        """Close this quorum's runner, keeping its residuals for the next one's."""
        if self._runner is not None:
            self._residuals = self._runner.state_dict()
            self._runner.close()
            self._runner = None

    def state_dict(self) -> dict[str, Any]:
        return self._runner.state_dict() if self._runner is not None else dict(self._residuals)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._residuals = dict(state)
        if self._runner is not None:
            self._runner.load_state_dict(state)


class QuorumTransport(GlooTransport):
    """The engine's transport in elastic mode: exchangers over the current quorum (``view``, set
    at each boundary); a node replica's own groups are its job's gloo groups, as without elastic
    mode. ``uncertain``: a round whose outcome this replica does not know (``Membership.vote``)."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self.host, self.timeout_s = host, timeout_s
        self.view: Any = None
        self.uncertain: Exception | None = None
        self.exchangers: list[QuorumExchanger] = []
        self._stores: dict[int, Any] = {}

    def runner(self, exchange: StreamExchange, *, codec: Codec, interfaces: Sequence[str] | None,
               timeout_s: float, error_feedback_beta: float, members: Sequence[int] | None = None,
               key: str | None = None) -> QuorumExchanger:
        """An exchanger over the quorum. ``members`` (a node replica's shard owners) is this rank
        alone: its peers are the same local rank of the quorum's nodes (``ft``)."""
        if members is not None and len(members) != 1:
            raise ValueError(f"elastic mode exchanges over the quorum's members, not fixed ranks {list(members)}")
        options = {"codec": codec, "interfaces": interfaces, "error_feedback_beta": error_feedback_beta,
                   "timeout_s": min(timeout_s, self.timeout_s)}
        exchanger = QuorumExchanger(self, exchange, f"elastic/{len(self.exchangers)}", options)
        self.exchangers.append(exchanger)
        return exchanger

    def store(self, view: Any) -> Any:
        """A client of the quorum's store, under a prefix of our own."""
        if view.quorum_id not in self._stores:
            from torchft.process_group import create_store_client

            self._stores = {view.quorum_id: create_store_client(f"{view.store_addr}/syncplane",
                                                                timedelta(seconds=self.timeout_s))}
        return self._stores[view.quorum_id]


class Membership:
    """One replica's membership: the quorum at each boundary, the vote on the period's rounds,
    the heal of a replica that is behind. ``fingerprint`` is checked against a healing peer's;
    ``total``: boundaries in the job (the replica stops after the last); ``on_event``: a JSON-able
    record per membership change, heal and discarded round; ``agree``: a node replica's ranks'
    one answer (rank 0's) on what the board says, so that they act as one."""

    def __init__(self, transport: QuorumTransport, fingerprint: Mapping[str, Any], total: int,
                 outer_state: Callable[[], dict[str, Any]], load_outer_state: Callable[[Mapping[str, Any]], None],
                 on_event: Callable[[dict[str, Any]], None] | None = None, board: RoundBoard | None = None,
                 hold_s: float = 5.0, boundary_timeout_s: float = 120.0,
                 agree: Callable[[bool], bool] | None = None) -> None:
        self.transport, self.fingerprint, self.total = transport, dict(fingerprint), int(total)
        self.board, self.hold_s, self.boundary_timeout_s = board, hold_s, boundary_timeout_s
        self.carrying = False       # quorum: a late replica's heal keeps its work since its last commit
        self._outer_state, self._load_outer_state = outer_state, load_outer_state
        self.position = 0           # boundaries the job has passed, shared by the quorum
        self.stats = ElasticStats()
        self.healed = False         # set by a heal; the caller copies θ_g into its model, then clears it
        self.group: ReplicaGroup | None = None   # torchft's side (tests: a fake)
        self._quorum_id: int | None = None
        self._size = 0
        self._on_event = on_event or (lambda record: None)
        self._agree = agree or (lambda value: value)
        self._pending: dict[int, float] = {}   # periods of local work per fragment not yet in θ_g
        self.work = 1.0             # periods of local work this period's rounds add (quorum: the caller's count)

    # ----------------------------------------------------- what a healing peer receives

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self._outer_state(), "position": self.position, "fingerprint": self.fingerprint,
                "committed": self.stats.committed, "discarded": self.stats.discarded}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Heal from a live peer's state; refuses a peer with other settings."""
        start = time.perf_counter()
        diff = differences(state["fingerprint"], self.fingerprint)
        if diff:
            raise ReplicaMismatch("this replica cannot heal from its peer: " + "; ".join(diff))
        self._load_outer_state(state["outer"])
        if not self.carrying:   # it starts again from θ_g: its own work since its last commit is gone
            self._pending = {}
        self.position = int(state["position"])
        self.stats.committed, self.stats.discarded = int(state["committed"]), int(state["discarded"])
        outer = state["outer"]
        shards = {"shards": list(outer["shards"])} if isinstance(outer, Mapping) and "shards" in outer else {}
        size = sum(t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor))
        heal = {"event": "heal", "position": self.position, "bytes": size, **shards,
                "load_s": round(time.perf_counter() - start, 4)}
        self.stats.heals.append(heal)
        self.healed = True

    # ----------------------------------------------------------------- the loop

    @property
    def done(self) -> bool:
        return self.position >= self.total

    def join(self, group: ReplicaGroup) -> None:
        """Enter the job: the first quorum (a heal happens here for a late joiner)."""
        self.group = group
        self._next_quorum()

    def record(self, committed: bool, fragment: int = 0, fragments: int = 1) -> None:
        """A fragment round's outcome and the local work it took into θ_g (a discarded round's
        stays in θ_local for the next committed one of that fragment): the ``round`` event's
        ``weight``, in periods (``scripts/diloco_goodput.py``)."""
        self._pending[fragment] = self._pending.get(fragment, 0.0) + self.work / fragments
        weight = self._pending.pop(fragment) if committed else 0.0
        self._on_event({"event": "round", "position": self.position, "committed": committed, "weight": weight,
                        "replicas": self._size})
        if committed:
            self.stats.committed += 1
        else:
            self.stats.discarded += 1
            self._on_event({"event": "discarded", "position": self.position, "quorum_id": self._quorum_id,
                            "replicas": self._size})

    def boundary(self) -> None:
        """The vote on the period's rounds, then the next quorum unless the job is done."""
        self.vote()
        if not self.done:
            self._next_quorum()

    def vote(self) -> None:
        """The vote on the rounds since the last quorum (an unknown outcome votes no: heal next)."""
        assert self.group is not None, "join() first"
        if self.transport.uncertain is not None:
            self.group.report_error(self.transport.uncertain)
            self.transport.uncertain = None
        self.group.commit()
        self.position += 1

    # ------------------------------------------- membership=quorum: the point before a period

    def point(self) -> bool:
        """``quorum``, before a period's rounds: the vote on the last period's, then this period's
        quorum of those within the grace. False: late, the quorum formed without this replica; it
        trains on while ``late()`` and then ``rejoin``s."""
        self.vote()
        if self.board is not None:
            if self._agree(self.board.formed() >= self.position):
                self._on_event({"event": "late", "position": self.position})
                return False
            self.board.arrive(self.position, self.hold_s)
        self._next_quorum()
        if self.board is not None:
            self.board.mark("formed", self.position)
        return True

    def late(self) -> bool:
        """``quorum``: True while this late replica waits for the next point to open."""
        return self.board is not None and self._agree(self.board.late(self.position))

    def rejoin(self, missed: float) -> None:
        """``quorum``: a late (or restarted) replica enters the next point's quorum and heals from a
        peer; ``missed`` periods of its own work (a restart: 0) stay in its model for its next rounds."""
        waited = self.board.wait_for_next(self.boundary_timeout_s) if self.board is not None else 0.0
        self.carrying = True
        try:
            self._next_quorum()
        finally:
            self.carrying = False
        if missed:
            self._on_event({"event": "carried", "position": self.position, "weight": missed,
                            "waited_s": round(waited, 3)})
        if self.board is not None:
            self.board.mark("formed", self.position)

    def scale(self, weight: float) -> float:
        """``quorum``: this member's factor on its Δ, making the plain mean a weighted one:
        ``weight·n / Σ weight`` over the quorum (exactly 1 when every weight is equal)."""
        view = self.transport.view
        if self.group is None or view is None or view.participants <= 1:
            return 1.0
        total = sum(self.group.gather_floats(float(weight), view))
        return float(weight) * view.participants / total if total > 0 else 1.0

    def _next_quorum(self) -> None:
        assert self.group is not None
        start = time.perf_counter()
        view = self.group.quorum()
        waited = time.perf_counter() - start
        self.transport.view = view
        if self.healed:
            heal = self.stats.heals[-1]
            heal["quorum_s"] = round(waited, 3)
            self._on_event({**heal, "quorum_id": int(view.quorum_id), "replicas": int(view.participants)})
        if view.participants != self._size:
            self.stats.replicas.append([self.position, int(view.participants)])
            self._on_event({"event": "membership", "position": self.position, "quorum_id": int(view.quorum_id),
                            "replicas": int(view.participants), "was": self._size, "quorum_wait_s": round(waited, 3)})
        self._quorum_id, self._size = int(view.quorum_id), int(view.participants)

    def close(self) -> None:
        for exchanger in self.transport.exchangers:
            exchanger.close()
        if self.group is not None:
            self.group.close()
            self.group = None

