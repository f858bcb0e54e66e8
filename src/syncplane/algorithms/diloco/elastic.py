"""Elastic DiLoCo: membership by torchft quorum around ``DiLoCoEngine``'s own round.

The round (Δ, codec and error feedback, streams, fragments, overlap, outer rule) is the code of
the fixed job; only its exchanges differ: ``QuorumTransport`` hands the engine exchangers
(``QuorumExchanger``) on gloo groups of the current quorum's store, built again at each
membership change. ``Membership`` says where and with whom the replicas meet:

- ``membership="fixed"``: at a **boundary**, where no round is in flight (after the step at
  which a period's first fragment merged: ``done ≡ overlap_steps mod H``), the vote on the
  period's rounds, then the next quorum, where a restarted (or behind) replica heals.
- ``membership="quorum"``: at a **point** before each period's rounds (``done ≡ 0 mod H``), the
  quorum of the replicas that arrived within the grace (``RoundBoard``). Each member's Δ is
  weighted by its steps since it last sent one (``scale``: exactly 1 without a fault, so the
  rounds equal ``fixed``'s bit for bit). A **late** replica trains on until the next point,
  then heals and carries its own work into that round (``DiLoCoEngine.rebase``; why carry, not
  drop: docs/design-notes.md).

Consistency: each fragment round is committed or discarded by the exchange's own agreement
(``StreamRunner``). A member whose agreement broke off does not know what the others did: it
votes no, stays a torchft step behind and heals from one that committed, so every member of a
quorum holds one θ_g. A heal carries ``Membership.state_dict``: the engine's outer state (a
node replica's rank: its own shards, from the same rank of a live node), the position and the
round counts; error-feedback residuals stay the replica's own.

Bad input: ``JobFingerprint`` records the first replica's settings in the job's folder; a
replica with another model, ``sync_every``, outer optimizer or round settings fails before it
contacts the quorum, naming the field (and a heal checks its peer's fingerprint again).
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
from typing import Any, Callable, Mapping, Protocol

import torch

from syncplane.comm.codecs import Codec
from syncplane.comm.meter import CommMeter
from syncplane.algorithms.diloco.transport import GlooTransport
from syncplane.comm.streams import StreamExchange, StreamRunner

log = logging.getLogger(__name__)


class QuorumGroup(Protocol):
    """What ``Membership`` needs from torchft (``syncplane.algorithms.diloco.ft.ReplicaGroup``)."""

    host: str

    def quorum(self) -> Any: ...   # a QuorumView: quorum_id, participants, step, rank, store_addr

    def report_error(self, exc: Exception) -> None: ...

    def commit(self) -> bool: ...

    def gather_floats(self, value: float, view: Any) -> list[float]: ...

    def close(self) -> None: ...


class ReplicaMismatch(ValueError):
    """A replica's settings differ from the job's; names each differing field."""


def fingerprint(n_values: int, sync_every: int, outer_optimizer: str, outer_kwargs: Mapping[str, Any] | None,
                shapes: list[tuple[int, ...]], rounds: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings every replica of one elastic job must share (JSON-able); ``rounds``: the
    round's own (fragments, overlap, codec, streams, exchange: replicas that differ there would
    exchange different pieces)."""
    return {"model_values": int(n_values), "model_shapes": [list(s) for s in shapes], "sync_every": int(sync_every),
            "outer_optimizer": outer_optimizer, "outer_kwargs": None if outer_kwargs is None else _json(outer_kwargs),
            **({"rounds": _json(rounds)} if rounds else {})}


def _json(settings: Mapping[str, Any]) -> Any:
    """``settings`` as they read back from the fingerprint's file (JSON types, sorted keys)."""
    return json.loads(json.dumps(dict(settings), sort_keys=True))


def differences(job: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """One line per field where ``ours`` differs from ``job``."""
    out = []
    for key in sorted(set(job) | set(ours)):
        if job.get(key) != ours.get(key):
            a, b = job.get(key), ours.get(key)
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
    """Where the replicas are, for ``membership="quorum"``: empty files in the job's folder
    (``elastic_rounds/``), read by a replica about to ask for its round's quorum.

    Why: torchft's Lighthouse counts the grace from the *first* request it holds, and forms a
    quorum at once when every member of the previous one has asked. A late or restarted replica
    that asks while the others are in their inner steps would open the next window a round
    early (leaving out whoever is a millisecond behind); one that asks just after them misses
    that fast path. So an on-time replica at round p writes ``arrived-p`` and lets those that
    wrote ``waiting-p-<name>`` ask first (until ``asked-p-<name>``, up to ``hold_s``); a late or
    restarted one targets q = the latest ``formed`` + 1: it writes ``waiting-q-<name>``, waits
    for ``arrived-q``, writes ``asked-q-<name>`` and asks. One that says it waits just after the
    on-time ones looked is taken by their next quorum: one more round late, no more.
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
        """True while a replica at ``position`` is late (its round's quorum formed without it)
        and the next boundary has not opened; says it waits for that boundary, so the on-time
        replicas let it ask first. The replica trains on meanwhile, instead of idling."""
        formed = self.formed()
        if formed < position:
            return False
        self.mark("waiting", formed + 1, self.name)
        return not (self.dir / f"arrived-{formed + 1}").exists()

    def wait_for_next(self, timeout_s: float) -> float:
        """Late or restarted: wait for the next boundary's first on-time arrival; returns the
        seconds waited (gives up after ``timeout_s``: the quorum call then waits)."""
        target = self.formed() + 1
        self.mark("waiting", target, self.name)
        waited = self._until(lambda: (self.dir / f"arrived-{target}").exists(), timeout_s)
        self.mark("asked", target, self.name)
        return waited


class QuorumExchanger:
    """One outer exchange of the engine (``StreamRunner``'s interface) over the current quorum:
    a ``StreamRunner`` on the quorum's store, built at its first round after a membership
    change (a collective of the quorum's members, who all reach that round), never rebuilt
    within a quorum: after a failed round it stays closed (its rounds discarded) until the next.
    Its error-feedback residuals carry over from one quorum's runner to the next."""

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
            runner = self._runner_for(view)
            if runner is None:
                return False
            return runner.allreduce_mean_(flat, meter, offset=offset, total=total)
        except RuntimeError as exc:   # the agreement broke off, or the groups did not connect
            log.warning("elastic: round outcome unknown (%s); this replica will heal at the next quorum", exc)
            self.transport.uncertain = exc
            self.close()
            return False

    def _runner_for(self, view: Any) -> StreamRunner | None:
        if self._built_for == view.quorum_id:
            if self._runner is not None and self._runner.closed:   # closed after a failed round
                self.close()
            return self._runner
        self.close()
        self._built_for = view.quorum_id
        store = self.transport.store(view)
        runner = StreamRunner(self.exchange, place=(store, view.rank, view.participants), key=self.key,
                              rebuild=False, hostname=self.transport.host, **self.options)
        runner.load_state_dict(self._residuals)
        self._runner = runner
        return runner

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
    """The engine's transport in elastic mode (``transport.Transport``): exchangers over the
    current quorum (``view``, set at each boundary); a node replica's own groups (DDP inside it,
    the gather of its θ_g shards) are its job's gloo groups, as without elastic mode.
    ``uncertain``: set when a round's outcome is unknown to this replica (``Membership.boundary``
    reports it)."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self.host, self.timeout_s = host, timeout_s
        self.view: Any = None
        self.uncertain: Exception | None = None
        self.exchangers: list[QuorumExchanger] = []
        self._stores: dict[int, Any] = {}

    def runner(self, exchange: StreamExchange, *, codec: Codec, interfaces: Sequence[str] | None,
               timeout_s: float, error_feedback_beta: float, members: Sequence[int] | None = None,
               key: str | None = None) -> QuorumExchanger:
        """An exchanger over the quorum. ``members``: None (a replica of one rank), or the
        shard's owners in a node replica's own layout -- this rank alone: its peers are the
        quorum's members of its torchft column, the same local rank of every node (``ft``)."""
        if members is not None and len(members) != 1:
            raise ValueError(f"elastic mode exchanges over the quorum's members, not fixed ranks {list(members)}")
        exchanger = QuorumExchanger(self, exchange, f"elastic/{len(self.exchangers)}",
                                    {"codec": codec, "interfaces": interfaces, "error_feedback_beta": error_feedback_beta,
                                     "timeout_s": min(timeout_s, self.timeout_s)})
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
    """One elastic replica's membership: the quorum at each boundary, the vote on the period's
    rounds, the heal of a replica that is behind.

    Args:
        transport: the engine's ``QuorumTransport`` (its ``view`` is set here).
        fingerprint: this replica's ``fingerprint(...)``, checked against a healing peer's.
        total: boundaries in the whole job; the replica stops after the last (a healed joiner
            learns how many are left from its peer).
        outer_state / load_outer_state: the engine's outer state (what a heal carries).
        on_event: called with a JSON-able record for every membership change, heal and
            discarded round (the glue appends them to ``history.jsonl``).
        agree: a node replica's ranks' one call on what the board says (``membership: quorum``:
            late or on time; rank 0's, broadcast over the node), so that they act as one.
    """

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
        self.group: QuorumGroup | None = None
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
        heal = {"event": "heal", "position": self.position, "bytes": _state_bytes(state), **shards,
                "load_s": round(time.perf_counter() - start, 4)}
        self.stats.heals.append(heal)
        self.healed = True

    # ----------------------------------------------------------------- the loop

    @property
    def done(self) -> bool:
        return self.position >= self.total

    def join(self, group: QuorumGroup) -> None:
        """Enter the job: the first quorum (a heal happens here for a late joiner)."""
        self.group = group
        self._next_quorum()

    def record(self, committed: bool, fragment: int = 0, fragments: int = 1) -> None:
        """A fragment round's outcome (the engine's merge), and the local work it took into θ_g:
        a discarded round's stays in θ_local, so the next committed one of that fragment carries
        it (its ``round`` event's ``weight``, in periods: ``scripts/diloco_goodput.py``)."""
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
        """The vote on the rounds since the last quorum (a round whose outcome this replica does
        not know votes no: it stays behind and heals at the next quorum)."""
        assert self.group is not None, "join() first"
        if self.transport.uncertain is not None:
            self.group.report_error(self.transport.uncertain)
            self.transport.uncertain = None
        self.group.commit()
        self.position += 1

    # ------------------------------------------- membership=quorum: the point before a period

    def point(self) -> bool:
        """``quorum``, before a period's rounds (none in flight): the vote on the last period's,
        then this period's quorum: the replicas that arrive within the grace (``RoundBoard``,
        the Lighthouse's join timeout). False: this replica is late, the quorum formed without
        it; it trains on while ``late()`` and then ``rejoin``s."""
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
        """``quorum``: a late (or restarted) replica enters the next point's quorum, behind by one
        commit: it heals θ_g, the outer state and the position from a peer; ``missed`` periods of
        its own work (a restart: 0) stay in its model, carried into its next rounds (``work``)."""
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
        """``quorum``: this member's factor on its Δ before the plain mean, so that the mean is
        weighted: ``weight·n / Σ weight`` over the quorum (exactly 1 when every weight is equal)."""
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


def _state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0
