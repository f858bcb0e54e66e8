"""The stream runner: an all-reduce (mean) of a flat fp32 CPU buffer on several gloo streams,
with a deadline and commit or discard. The pattern that moves the bytes is brought by the
caller (``syncplane.exchanges``: the owner mesh, the tree, the cube and nested exchanges).

Why several streams: one TCP connection cannot fill a long, lossy path, and gloo runs one
collective over one connection bound to one NIC. So an exchange declares how many streams
it runs on; each stream travels on its own pair of gloo process groups (own connections,
own I/O thread; one group for messages up the ranks, one down: ``directed`` says why), and
stream s is bound to NIC ``s mod k`` of the ``interfaces`` the caller names. The groups are
built once, up front, from the default group's store (``dist.ProcessGroupGloo(PrefixStore(...),
rank, size, options)``: the documented way to give a gloo group its own device).

Commit or discard: every rank reports whether its part succeeded (no timeout, no closed
connection) on a separate control group (``post_every_rank_ok``: its receives posted before
the exchange, then one message delay up to nine ranks) and the buffer is overwritten only if
*all* did;
otherwise every rank keeps its input, undoes its error-feedback update, aborts the data
groups (so peers still waiting fail fast instead of timing out) and rebuilds them. A failed
round is skipped everywhere, never applied on some ranks only.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from syncplane.comm.codecs import Codec, ErrorFeedback, Feedback, Fp32, Undo, add_extracted_
from syncplane.comm.collectives import post_every_rank_ok
from syncplane.comm.context import directed
from syncplane.comm.meter import CommMeter, PhaseProfile
from syncplane.comm.p2p import wait_works

_CONNECT_TIMEOUT_S = 60.0   # floor of the time a data group may take to connect
_instances = 0   # advanced identically on every rank (construction is collective)


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous ``[start, end)`` ranges covering ``[0, numel)`` without gap or
    overlap; sizes differ by at most one (the first ``numel % shards`` are longer), and
    some are empty when ``numel < shards``."""
    if numel < 0:
        raise ValueError(f"numel must be non-negative, got {numel}")
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    base, extra = divmod(numel, shards)
    bounds, start = [], 0
    for i in range(shards):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def kept(workspace: dict[object, torch.Tensor], key: object, numel: int,
         dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``Round.kept``'s buffer in ``workspace``: the front of the one kept under ``key``, a
    new one where that is smaller or of another dtype."""
    buffer = workspace.get(key)
    if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
        buffer = workspace[key] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


@dataclass
class Round:
    """One round of an exchange, as the runner hands it over: the input, the codec and this
    rank's error-feedback residuals, the stream groups, the deadline, and where in-flight
    operations are kept until the round is over."""

    flat: torch.Tensor
    offset: int                  # where ``flat`` starts in the logical buffer (error feedback positions)
    codec: Codec
    feedback: tuple[Feedback, ...]
    rank: int
    size: int
    groups: list[tuple[dist.ProcessGroup, dist.ProcessGroup]]
    deadline: float              # ``time.monotonic()``
    profile: PhaseProfile | None = None
    keep: list[object] = field(default_factory=list)
    #: buffers the runner keeps between rounds (``kept``), by the pattern's own keys
    workspace: dict[object, torch.Tensor] = field(default_factory=dict)

    def link(self, stream: int, src: int, dst: int) -> dist.ProcessGroup:
        """Stream ``stream``'s connection for a message from ``src`` to ``dst`` (``directed``)."""
        return directed(*self.groups[stream], src, dst)

    def wait(self, works: Sequence[dist.Work]) -> None:
        """Wait for ``works`` within the round's deadline (``RuntimeError`` past it)."""
        wait_works([("exchanging with", -1, w) for w in works], what="stream exchange", timeout_s=math.inf,
                   deadline=self.deadline)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Time a phase of the round into the profile, when one is set."""
        return self.profile.time(name) if self.profile is not None else nullcontext()

    def kept(self, key: object, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """An uninitialised buffer of ``numel`` ``dtype`` values that the runner keeps between
        rounds under ``key`` (one per key: a pattern names each buffer it needs at once; the
        front of a larger one kept before, so that buffers of several sizes in turn, Canary's
        colayers, reuse the largest). A buffer of the payload's size allocated afresh every
        round costs its page faults: 36 ms per 97.5 MB on a 2-core EPYC (2026-11-29), against
        9 ms for the copy into it."""
        return kept(self.workspace, key, numel, dtype)

    def add_decoded(self, acc: torch.Tensor, first: bool, codec: Codec, data: torch.Tensor, key: object) -> None:
        """Add ``data``'s values into the sum ``acc`` (``first``: they start it, decoded
        straight into it); a later term through ``add_extracted_`` (the sketch's decoded into
        the sum in one pass, exact fp32's a view of its bytes), a codec that needs a decoded
        buffer given the kept buffer ``key`` (no allocation per piece)."""
        numel = acc.numel()
        if first:
            codec.extract(data, numel, out=acc)
        else:
            add_extracted_(codec, data, acc, scratch=lambda: self.kept(key, numel, torch.float32))

    def decoded_later(self, pieces: Sequence[tuple[int, int, torch.Tensor]]) -> Result:
        """The round's mean as encoded ``(lo, hi, data)`` pieces: a ``Result`` that decodes
        each into ``[lo, hi)`` of the buffer it is given, once the runner has committed."""

        def deliver(into: torch.Tensor) -> None:
            with self.phase("decode/out"):
                for lo, hi, data in pieces:
                    self.codec.extract(data, hi - lo, out=into[lo:hi])
        return deliver

    def working_copy(self) -> torch.Tensor:
        """``flat`` copied into a kept buffer: a pattern that reduces in place works on it, so
        that a failed round leaves ``flat`` as it was."""
        return self.kept("working copy", self.flat.numel(), self.flat.dtype).copy_(self.flat)


#: The mean a ``StreamExchange.run`` returns: the values, or a function that writes them into
#: the buffer it is given. The runner calls it only once every rank has committed, so an
#: exchange that ends by decoding its pieces decodes them straight into the caller's buffer
#: (no copy of the mean), and a discarded round leaves that buffer as it was.
Result = torch.Tensor | Callable[[torch.Tensor], None]


class StreamExchange(Protocol):
    """An all-reduce (mean) pattern that the runner runs on its streams.

    ``streams``: stream groups it uses; ``feedback_slots``: error-feedback residuals it keeps per
    rank (0: it carries exact fp32 only); ``check(size)`` raises ``ValueError`` when it cannot
    run on ``size`` ranks; ``run`` returns the mean (bit-identical on every rank; a ``Result``)
    and the bytes this rank sent, raising ``RuntimeError`` on a timeout or lost peer;
    ``bytes_per_round`` counts what ``run`` sends."""

    streams: int
    feedback_slots: int

    def check(self, size: int) -> None: ...

    def run(self, round: Round) -> tuple[Result, int]: ...

    def bytes_per_round(self, numel: int, codec: Codec, rank: int, size: int) -> int: ...


class StreamRunner:
    """Runs an exchange (mean of a flat fp32 CPU tensor over all ranks) on its own gloo streams.

    Construction is collective (call it on every rank in the same order): it builds
    2 × ``exchange.streams`` data groups and one control group on the default group's store.

    Args:
        exchange: the pattern (``syncplane.exchanges``).
        codec: what travels on the wire (default exact fp32; ``Int8Blockwise`` ~1/4); only an
            exchange with error-feedback slots carries a lossy codec.
        interfaces: NIC names; stream s is bound to ``interfaces[s % len]``. Default: gloo's
            default device.
        timeout_s: a round that has not completed after this long counts as failed.
        error_feedback_beta: β of every residual, ``e ← β·e + x`` (1: keep all that was
            dropped; SparseLoCo decays it, ``ErrorFeedback``).
        members: the global ranks the exchange runs over, in group-rank order (default: all);
            only they construct it. Several runners over different members (DiLoCo's
            shard groups across node replicas) need the same ``key`` on their members:
            take it from ``reserve_key`` on every rank.
        key: the store prefix of a runner over ``members`` or ``place`` (required with them).
        place: ``(store, rank, size)`` of a group that is not the default one (an elastic
            quorum's: its store, this member's rank in it, its size); no default group needed.
        hostname: the address the groups bind where no ``interfaces`` are given (default: gloo's
            default device).
        rebuild: after a failed round, build the data groups again (a fixed set of ranks);
            False: close them instead (a quorum's runner is replaced at the next quorum, and
            rebuilding with a lost member would wait for it).
    """

    def __init__(self, exchange: StreamExchange, *, codec: Codec | None = None,
                 interfaces: Sequence[str] | None = None, timeout_s: float = 600.0,
                 error_feedback_beta: float = 1.0, members: Sequence[int] | None = None,
                 key: str | None = None, place: tuple[dist.Store, int, int] | None = None,
                 hostname: str | None = None, rebuild: bool = True) -> None:
        global _instances
        if place is None and not dist.is_initialized():
            raise RuntimeError("StreamRunner needs an initialized default process group (or a place)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.codec: Codec = codec if codec is not None else Fp32()
        if exchange.feedback_slots == 0 and not isinstance(self.codec, Fp32):
            raise ValueError(f"the {type(exchange).__name__} carries exact fp32 only; codec "
                             f"{type(self.codec).__name__} needs an exchange that compresses (the mesh)")
        if place is not None:
            if key is None:
                raise ValueError("a StreamRunner on a place needs a key (its store prefix)")
            self.rank, self.size, self._id = place[1], place[2], key
        elif members is None:
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self._id, _instances = str(_instances), _instances + 1
        else:
            if key is None or dist.get_rank() not in members:
                raise ValueError(f"a StreamRunner over ranks {list(members)} needs a key and is built by "
                                 f"those ranks only (rank {dist.get_rank()})")
            self.rank, self.size, self._id = list(members).index(dist.get_rank()), len(members), key
        exchange.check(self.size)
        self.exchange = exchange
        self.interfaces = list(interfaces) if interfaces else None
        self.timeout_s = timeout_s
        self.beta = error_feedback_beta
        self.failures = 0
        self.last_error: str | None = None
        self._generation = 0
        self._rebuilds, self._hostname = rebuild, hostname
        self._store = place[0] if place is not None else distributed_c10d._get_default_store()
        first = self.interfaces[0] if self.interfaces else None
        # the control group outlives a data round that times out: give it room to wait for it
        self._control: dist.ProcessGroupGloo | None = self._group("control", first, 2 * timeout_s + 60)
        self._groups = self._build_groups()
        self._feedback: tuple[ErrorFeedback, ...] | None = None
        self._feedback_numel = -1     # the buffer length the residuals are for
        self._residuals: StreamRunner = self   # whose residuals this runner updates (``share_residuals``)
        self._feedback_lock = threading.Lock()
        #: set a ``PhaseProfile`` to have each round's phases timed (``syncplane bench --profile``)
        self.profile: PhaseProfile | None = None
        # operations (and their buffers) of the current round: kept alive until the round
        # completes or its groups are aborted, so a late message never lands in freed memory
        self._inflight: list[object] = []
        self._workspace: dict[object, torch.Tensor] = {}    # the patterns' buffers, kept between rounds

    @property
    def streams(self) -> int:
        return self.exchange.streams

    @property
    def closed(self) -> bool:
        """Closed (``close``, or a failed round of a runner that does not rebuild)."""
        return self._control is None

    # ------------------------------------------------------------------ public

    def allreduce_mean_(self, flat: torch.Tensor, meter: CommMeter | None = None, *,
                        offset: int = 0, total: int | None = None) -> bool:
        """Replace ``flat`` by its mean over all ranks; return True if committed.

        On False (some rank failed) ``flat`` is unchanged on every rank. ``flat`` may be
        the slice ``[offset, offset + flat.numel())`` of a logical buffer of ``total``
        values (default: all of it): error feedback is kept per position of that buffer,
        so slices exchanged in turn (fragments of a model) keep their own residuals.
        """
        if flat.dtype != torch.float32 or flat.dim() != 1 or flat.device.type != "cpu" \
                or not flat.is_contiguous():
            raise ValueError(f"expected a contiguous 1-D float32 CPU tensor, got {flat.dtype} "
                             f"shape {tuple(flat.shape)} on {flat.device}")
        if self.size == 1:
            return True
        if self._control is None:
            raise RuntimeError("this StreamRunner was closed")
        total = flat.numel() if total is None else total
        if offset < 0 or offset + flat.numel() > total:
            raise ValueError(f"slice [{offset}, {offset + flat.numel()}) is outside a buffer of {total} values")
        # the residuals this round overwrites are saved as it goes: a round that fails puts them back
        undo = Undo(lambda i, numel: kept(self._workspace, ("undo", i), numel, torch.float32))
        feedback = tuple(undo.recording(f) for f in self._error_feedback(total))
        round_ = Round(flat, offset, self.codec, feedback, self.rank, self.size, list(self._groups),
                       time.monotonic() + self.timeout_s, self.profile, self._inflight, self._workspace)
        start = time.perf_counter()
        sent = 0
        decide = self._post_agreement()      # its receives before the exchange's bulk data
        refused: Exception | None = None
        try:
            with round_.phase("exchange"):
                out, sent = self.exchange.run(round_)
            ok = True
        except Exception as exc:
            # gloo's RuntimeError (timeout, connection closed by a failed peer) discards the
            # round; anything else (the pattern refusing its input) too, and is raised once
            # every rank has agreed, so no receive this round posted is left for the next
            out, ok = None, False
            self.last_error = f"{type(exc).__name__}: {exc}"
            refused = None if isinstance(exc, RuntimeError) else exc
        with round_.phase("agree"):
            try:
                committed = decide(ok)
            except RuntimeError:   # the outcome is unknown here: the residuals go back, the caller decides
                undo.restore()
                self._inflight.clear()
                raise
        if meter is not None:
            meter.record(start, time.perf_counter(), sent)
        if committed:
            assert out is not None
            if callable(out):
                out(flat)
            else:
                with round_.phase("copy-out"):
                    flat.copy_(out)
            self._inflight.clear()
            return True
        undo.restore()
        self.failures += 1
        if self._rebuilds:
            self._rebuild()
        else:
            self.close()
        self._inflight.clear()
        self._workspace = {}     # fresh buffers after a failed round: a late message may still land in the old
        if refused is not None:
            raise refused
        return False

    def share_residuals(self, owner: StreamRunner) -> None:
        """Update ``owner``'s error-feedback residuals instead of keeping its own: runners that
        exchange disjoint slices of one logical buffer at the same time (Canary's colayers in
        flight on their own groups) then hold exactly the residuals one runner would, and
        ``owner``'s ``state_dict`` holds them all. Not a collective."""
        if owner.exchange.feedback_slots != self.exchange.feedback_slots or type(owner.codec) is not type(self.codec):
            raise ValueError("share_residuals: the runners keep different residuals (exchange or codec differ)")
        self._residuals = owner._residuals

    def bytes_per_round(self, numel: int) -> int:
        """Bytes this rank sends in one round of ``numel`` values."""
        return self.exchange.bytes_per_round(numel, self.codec, self.rank, self.size)

    def state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals (empty for exact fp32). They differ per rank:
        a strategy saves them as per-rank state, which the checkpoint gathers from every rank.
        Not a collective."""
        owner = self._residuals
        if isinstance(self.codec, Fp32) or owner._feedback is None:
            return {}
        return {"residuals": torch.stack([f.residual for f in owner._feedback])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back this rank's residuals (what ``state_dict`` returned on this rank)."""
        mine = state.get("residuals")
        if mine is None:
            return
        for feedback, saved in zip(self._error_feedback(mine.shape[1]), mine):
            feedback.restore(saved)

    def close(self) -> None:
        """Abort every group (no further exchanges; ``state_dict`` still works). Idempotent."""
        if self._control is None:
            return
        for group in [*(g for pair in self._groups for g in pair), self._control]:
            _release(group)
        self._groups, self._control = [], None

    # ------------------------------------------------------------------ internals

    def _group(self, name: str, interface: str | None, timeout_s: float) -> dist.ProcessGroupGloo:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        if interface:
            device = dist.ProcessGroupGloo.create_device(interface=interface)
        elif self._hostname:
            device = dist.ProcessGroupGloo.create_device(hostname=self._hostname)
        else:
            device = dist.ProcessGroupGloo.create_default_device()
        options._devices = [device]
        prefix = f"syncplane/sharded/{self._id}/{self._generation}/{name}"
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), self.rank, self.size, options)

    def _build_groups(self) -> list[tuple[dist.ProcessGroupGloo, dist.ProcessGroupGloo]]:
        """Each stream's (up, down) groups, stream s on NIC ``s mod k`` (``directed``)."""
        # A round's deadline is enforced by ``Round.wait``; the groups' own timeout only bounds
        # connecting them, which a short ``timeout_s`` on a loaded machine must not fail.
        nics, connect_s = self.interfaces or [None], max(self.timeout_s, _CONNECT_TIMEOUT_S)
        up = [self._group(f"shard{s}", nics[s % len(nics)], connect_s) for s in range(self.streams)]
        down = [self._group(f"shard{s}down", nics[s % len(nics)], connect_s) for s in range(self.streams)]
        return list(zip(up, down))

    def _rebuild(self) -> None:
        for pair in self._groups:
            for group in pair:
                _release(group)
        self._generation += 1
        self._groups = self._build_groups()

    def _error_feedback(self, numel: int) -> tuple[ErrorFeedback, ...]:
        """One residual of ``numel`` values per slot the exchange declares; none for exact fp32,
        which has nothing to remember (a model-sized buffer per slot would be host memory for
        nothing). Thread-safe: runners sharing residuals may ask at once."""
        owner = self._residuals
        if owner is not self:
            return owner._error_feedback(numel)
        with self._feedback_lock:
            if self._feedback is None or self._feedback_numel != numel:
                slots = max(1, self.exchange.feedback_slots)
                size = 0 if isinstance(self.codec, Fp32) else numel
                self._feedback = tuple(ErrorFeedback(self.codec, size, self.beta) for _ in range(slots))
                self._feedback_numel = numel
            return self._feedback

    def _post_agreement(self) -> Callable[[bool], bool]:
        """Collective: the commit/discard agreement's receives posted; returns the decision
        (``post_every_rank_ok``): True only if every rank's round succeeded."""
        assert self._control is not None
        with self._agreement_failures():
            decide = post_every_rank_ok(self._control, self.rank, self.size)

        def agreed(ok: bool) -> bool:
            with self._agreement_failures():
                return decide(ok)

        return agreed

    @contextmanager
    def _agreement_failures(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:
            raise RuntimeError(f"rank {self.rank}: the commit/discard agreement itself failed "
                               f"(a rank is gone?): {exc}") from exc


def reserve_key(name: str) -> str:
    """A store key for runners built over subsets of the ranks (``StreamRunner(members=...)``):
    call it on every rank, in the same order, once per set of such runners."""
    global _instances
    key, _instances = f"{_instances}/{name}", _instances + 1
    return key


def _release(group: dist.ProcessGroupGloo) -> None:
    """Abort ``group`` so that anything still in flight on it fails now. Newer torch gives gloo
    groups ``abort`` (2.14 has it); torch 2.6, the floor, does not: there the group is only
    dropped, and an operation still in flight keeps its sockets until its own timeout."""
    abort = getattr(group, "abort", None)
    if abort is not None:
        abort()


__all__ = ["Round", "StreamExchange", "StreamRunner", "directed", "reserve_key", "shard_bounds"]
