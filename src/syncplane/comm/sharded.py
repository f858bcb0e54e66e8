"""Sharded multi-stream all-reduce (mean) of a flat fp32 CPU buffer, with commit or discard.

Why several streams: one TCP connection cannot fill a long, lossy path (the DiLoCo
blog measured 116 Mbit/s with one stream, 1.24 Gbit/s with eight), and gloo runs one
collective over one connection bound to one NIC. So the buffer is cut into S shards,
each travelling on its own pair of gloo process groups (own connections, own I/O thread;
one group for messages up the ranks, one down: ``StreamPattern`` says why), and
shard s is bound to NIC ``s mod k`` of the host's k NICs (``GLOO_SOCKET_IFNAME`` lists
them, comma-separated). The groups are built once, up front, from the default group's
store (``dist.ProcessGroupGloo(PrefixStore(...), rank, size, options)``: the
documented way to give a gloo group its own device; measured in ``docs/comm.md``).

The algorithm, per shard: every shard is split into n owner segments; each rank sends
segment j to rank j (reduce-scatter), the owner sums the n contributions **in rank
order** and divides by n, then sends the mean back to everyone (all-gather). Each rank
sends 2(n-1)/n of the payload, like a ring. Because every element is summed in the
same order (rank 0, 1, ..., n-1) whatever the shard boundaries are, the fp32 result is
bit-identical for every S -- unlike gloo's own ring, whose summation order depends on
where an element falls in its chunking. A lossy codec (``codecs``) compresses each
segment once on the way in (with error feedback) and the owner's mean once on the
way out; every rank, owner included, uses the decoded mean, so replicas agree exactly.

Layout ``pieces`` (Canary's mesh exchange, paper 004 §4.4): the buffer is cut into n owner
pieces only (no shard level) and piece j travels on group ``j mod S`` -- so each NIC carries
every S-th piece, and the pieces (hence a lossy codec's per-piece encodings) are the same
whatever S is: one NIC and several give bit-identical results even with the sketch codec.

Commit or discard: every rank reports whether its part succeeded (no timeout, no
closed connection) on a separate control group and the buffer is overwritten only if
*all* did; otherwise every rank keeps its input, undoes its error-feedback update,
aborts the data groups (so peers still waiting fail fast instead of timing out) and
rebuilds them. A failed round is skipped everywhere, never applied on some ranks only.

Another pattern (``pattern``, a ``StreamPattern``): the owner exchange above is blind to
racks and sites -- it puts 2(n−1)/n·M per rank across whatever link lies between. A
caller may bring a topology-aware all-reduce (DiLoCo brings FlexReduce's executor, which
``comm`` may not import: the layers point down) that runs one shard per group; this
class keeps what is around it -- the S groups and NICs, the deadline, commit/discard with
abort and rebuild. Such a pattern carries exact fp32 only (no error feedback).
"""

from __future__ import annotations

import datetime
import os
import time
from contextlib import AbstractContextManager, nullcontext
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from syncplane.comm.codecs import Codec, ErrorFeedback, Fp32
from syncplane.comm.meter import CommMeter, PhaseProfile
from syncplane.comm.process_groups import control_group

_TAG_SCATTER, _TAG_GATHER = 1, 2
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


def interfaces_from_env() -> list[str] | None:
    """The NICs gloo may use, from ``GLOO_SOCKET_IFNAME`` (comma list), or None (gloo's default)."""
    names = [n.strip() for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]
    return names or None


class StreamPattern(Protocol):
    """An all-reduce (mean) that runs one flat fp32 tensor per stream, each on its own groups.

    A stream has two groups, ``(up, down)``: a message from rank x to rank y travels on
    ``up`` when x < y, else on ``down``, so each TCP connection carries data one way only.
    Why: gloo sends a message only once the receiver has said it posted the receive, and
    that notice travels on the same connection as the data going the other way; on a
    shaped link it waits behind up to a queue of it (measured on ``wan_two_sites``: a
    pair's swap of 0.5 MB took 77 ms a tick where the wire needs 42 ms).
    """

    def run_streams(self, tensors: Sequence[torch.Tensor],
                    groups: Sequence[tuple[dist.ProcessGroup, dist.ProcessGroup]],
                    deadline: float | None = None, keep: list[object] | None = None,
                    profile: PhaseProfile | None = None) -> int:
        """Every tensor replaced by its mean over the ranks, tensor s on ``groups[s]``; raise
        ``RuntimeError`` past ``deadline`` (``time.monotonic()``); put in-flight operations in
        ``keep``; add the time of each phase to ``profile`` if given; return the bytes this
        rank sent. Bit-identical on every rank, for any cut."""
        ...

    def bytes_per_rank(self, numel: int, element_size: int) -> int:
        """Bytes this rank sends in one all-reduce of ``numel`` elements."""
        ...


def directed(up: dist.ProcessGroup, down: dist.ProcessGroup, src: int, dst: int) -> dist.ProcessGroup:
    """The group of a stream's pair that carries a message from ``src`` to ``dst``: ``up``
    the ranks, else ``down`` (``StreamPattern`` says why). Sender and receiver both call it
    with the same (src, dst), so they meet on one group."""
    return up if src < dst else down


class ShardedAllReduce:
    """Mean of a flat fp32 CPU tensor over all ranks on ``shards`` concurrent gloo groups.

    Construction is collective (call it on every rank in the same order): it builds
    2 × ``shards`` data groups and one control group on the default group's store.

    Args:
        shards: number of shards, i.e. concurrent streams (1 is the plain path).
        codec: what travels on the wire (default exact fp32; ``Int8Blockwise`` ~1/4).
        interfaces: NIC names; shard s is bound to ``interfaces[s % len]``. Default:
            ``GLOO_SOCKET_IFNAME``, else gloo's default device.
        timeout_s: a round that has not completed after this long counts as failed.
        layout: ``shards`` (S shards, each cut into n owner segments) or ``pieces`` (n
            owner pieces, piece j on group ``j mod S``; see the module docstring).
        pattern: the all-reduce run on the shards (default: the owner exchange); exact fp32
            and the ``shards`` layout only.
    """

    def __init__(self, shards: int = 1, *, codec: Codec | None = None,
                 interfaces: Sequence[str] | None = None, timeout_s: float = 600.0,
                 layout: Literal["shards", "pieces"] = "shards", pattern: StreamPattern | None = None) -> None:
        global _instances
        if not dist.is_initialized():
            raise RuntimeError("ShardedAllReduce needs an initialized default process group")
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if layout not in ("shards", "pieces"):
            raise ValueError(f"layout must be 'shards' or 'pieces', got {layout!r}")
        self.shards, self.layout = shards, layout
        self.codec: Codec = codec if codec is not None else Fp32()
        if pattern is not None and not isinstance(self.codec, Fp32):
            raise ValueError(f"a custom exchange pattern ({type(pattern).__name__}) carries exact fp32 only; "
                             f"codec {type(self.codec).__name__} needs the owner exchange (pattern=None)")
        if pattern is not None and layout != "shards":
            raise ValueError(f"a custom exchange pattern ({type(pattern).__name__}) runs on the 'shards' layout, "
                             f"not {layout!r}")
        self.pattern = pattern
        self.interfaces = list(interfaces) if interfaces is not None else interfaces_from_env()
        self.timeout_s = timeout_s
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.failures = 0
        self.last_error: str | None = None
        self._id, _instances = _instances, _instances + 1
        self._generation = 0
        self._store = distributed_c10d._get_default_store()
        first = self.interfaces[0] if self.interfaces else None
        # the control group outlives a data round that times out: give it room to wait for it
        self._control: dist.ProcessGroupGloo | None = self._group("control", first, 2 * timeout_s + 60)
        self._groups, self._down = self._build_groups()
        self._feedback: tuple[ErrorFeedback, ...] | None = None
        #: set a ``PhaseProfile`` to have each round's phases timed (``syncplane bench --profile``)
        self.profile: PhaseProfile | None = None
        # operations (and their buffers) of the current round: kept alive until the round
        # completes or its groups are aborted, so a late message never lands in freed memory
        self._inflight: list[object] = []
        self._copy = torch.empty(0)    # the pattern's working copy of the buffer

    # ------------------------------------------------------------------ public

    def allreduce_mean_(self, flat: torch.Tensor, meter: CommMeter | None = None, *,
                        offset: int = 0, total: int | None = None) -> bool:
        """Replace ``flat`` by its mean over all ranks; return True if committed.

        On False (some rank failed) ``flat`` is unchanged on every rank. ``flat`` may be
        the slice ``[offset, offset + flat.numel())`` of a logical buffer of ``total``
        values (default: all of it): error feedback is kept per position of that buffer,
        so slices exchanged in turn (Streaming DiLoCo's fragments) keep their own residuals.
        """
        if flat.dtype != torch.float32 or flat.dim() != 1 or flat.device.type != "cpu" \
                or not flat.is_contiguous():
            raise ValueError(f"expected a contiguous 1-D float32 CPU tensor, got {flat.dtype} "
                             f"shape {tuple(flat.shape)} on {flat.device}")
        if self.size == 1:
            return True
        if self._control is None:
            raise RuntimeError("this ShardedAllReduce was closed")
        total = flat.numel() if total is None else total
        if offset < 0 or offset + flat.numel() > total:
            raise ValueError(f"slice [{offset}, {offset + flat.numel()}) is outside a buffer of {total} values")
        feedback = self._error_feedback(total)
        # only the slice this round touches: a round that fails puts it back
        saved = [f.snapshot(offset, flat.numel()) for f in feedback] if not isinstance(self.codec, Fp32) else None
        start = time.perf_counter()
        sent = 0
        try:
            with self._phase("exchange"):
                out, sent = self._exchange(flat, feedback, offset)
            ok = True
        except RuntimeError as exc:        # gloo: timeout, connection closed by a failed peer
            out, ok = None, False
            self.last_error = f"{type(exc).__name__}: {exc}"
        with self._phase("agree"):
            committed = self._agree(ok)
        if meter is not None:
            meter.record(start, time.perf_counter(), sent)
        if committed:
            assert out is not None
            with self._phase("copy-out"):
                flat.copy_(out)
            self._inflight.clear()
            return True
        if saved is not None:
            for f, s in zip(feedback, saved):
                f.restore(s, offset)
        self.failures += 1
        self._rebuild()
        self._inflight.clear()
        self._copy = torch.empty(0)    # a fresh working copy after a failed round
        return False

    def bytes_per_round(self, numel: int) -> int:
        """Bytes this rank sends in one round of ``numel`` values (both phases)."""
        if self.pattern is not None:
            return sum(self.pattern.bytes_per_rank(b - a, 4) for a, b in shard_bounds(numel, self.shards) if b > a)
        total = 0
        for segments in self._segments(numel):
            total += sum(self.codec.nbytes(hi - lo) for o, (lo, hi) in enumerate(segments)
                         if o != self.rank and hi > lo)
            lo, hi = segments[self.rank]
            if hi > lo:
                total += (self.size - 1) * self.codec.nbytes(hi - lo)
        return total

    def state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals (empty for exact fp32). They differ per rank:
        a strategy saves them as per-rank state (``SyncplaneStrategy.rank_state_dict``),
        which the checkpoint gathers from every rank. Not a collective."""
        if isinstance(self.codec, Fp32) or self._feedback is None:
            return {}
        return {"residuals": torch.stack([f.residual for f in self._feedback])}

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
        for group in [*self._groups, *self._down, self._control]:
            _release(group)
        self._groups, self._down, self._control = [], [], None

    # ------------------------------------------------------------------ internals

    def _group(self, name: str, interface: str | None, timeout_s: float) -> dist.ProcessGroupGloo:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        device = (dist.ProcessGroupGloo.create_device(interface=interface) if interface
                  else dist.ProcessGroupGloo.create_default_device())
        options._devices = [device]
        prefix = f"syncplane/sharded/{self._id}/{self._generation}/{name}"
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), self.rank, self.size, options)

    def _build_groups(self) -> tuple[list[dist.ProcessGroupGloo], list[dist.ProcessGroupGloo]]:
        """Each stream's (up, down) groups, stream s on NIC ``s mod k`` (``StreamPattern``)."""
        # A round's deadline is enforced by ``_wait_all``; the groups' own timeout only bounds
        # connecting them, which a short ``timeout_s`` on a loaded machine must not fail.
        nics, connect_s = self.interfaces or [None], max(self.timeout_s, _CONNECT_TIMEOUT_S)
        up, down = ([self._group(f"shard{s}{suffix}", nics[s % len(nics)], connect_s) for s in range(self.shards)]
                    for suffix in ("", "down"))
        return up, down

    def _rebuild(self) -> None:
        for group in [*self._groups, *self._down]:
            _release(group)
        self._generation += 1
        self._groups, self._down = self._build_groups()

    def _link(self, index: int, src: int, dst: int) -> dist.ProcessGroupGloo:
        """Stream ``index``'s connection for a message from ``src`` to ``dst``."""
        return directed(self._groups[index], self._down[index], src, dst)

    def _error_feedback(self, numel: int) -> tuple[ErrorFeedback, ...]:
        """(what this rank sends, what it sends as an owner) -- one residual each."""
        if self._feedback is None or self._feedback[0].residual.numel() != numel:
            self._feedback = (ErrorFeedback(self.codec, numel), ErrorFeedback(self.codec, numel))
        return self._feedback

    def _segments(self, numel: int) -> list[list[tuple[int, int]]]:
        """``[group][owner] -> (start, end)`` in the flat buffer (empty where a group carries
        nothing for that owner)."""
        if self.layout == "pieces":
            pieces = shard_bounds(numel, self.size)
            return [[(lo, hi) if owner % self.shards == s else (lo, lo) for owner, (lo, hi) in enumerate(pieces)]
                    for s in range(self.shards)]
        return [[(a + lo, a + hi) for lo, hi in shard_bounds(b - a, self.size)]
                for a, b in shard_bounds(numel, self.shards)]

    def _exchange(self, flat: torch.Tensor, feedback: tuple[ErrorFeedback, ...], offset: int = 0
                  ) -> tuple[torch.Tensor, int]:
        deadline = time.monotonic() + self.timeout_s
        if self.pattern is not None:   # on a copy: a failed round must leave ``flat`` as it was
            with self._phase("clone"):
                # a buffer kept between rounds: a fresh one each round costs its page faults
                # (measured 40-80 ms for 32 MB on the loaded 2-core machine; the copy ~5 ms)
                if self._copy.numel() != flat.numel():
                    self._copy = torch.empty_like(flat)
                out = self._copy.copy_(flat)
            self._inflight.append(out)
            parts = [out[a:b] for a, b in shard_bounds(flat.numel(), self.shards)]
            groups = list(zip(self._groups, self._down))
            return out, self.pattern.run_streams(parts, groups, deadline, self._inflight, self.profile)
        local_ef, owner_ef = feedback
        segments = self._segments(flat.numel())
        me, n = self.rank, self.size
        out = torch.empty_like(flat)
        sent = 0

        # Everything is posted up front: the scatter sends (segment j of every shard to
        # rank j) and every receive. Each shard's gather starts as soon as that shard's
        # scatter has arrived, so shards pipeline instead of waiting for the slowest one.
        sends: list[dist.Work] = []
        scatter_recvs: list[list[dist.Work]] = [[] for _ in self._groups]
        gather_recvs: list[dist.Work] = []
        own: dict[int, torch.Tensor] = {}
        scattered: dict[tuple[int, int], torch.Tensor] = {}
        gathered: dict[tuple[int, int], torch.Tensor] = {}
        keep = self._inflight
        keep.extend([scattered, gathered])
        posting = time.perf_counter()
        for s in range(len(self._groups)):
            for owner, (lo, hi) in enumerate(segments[s]):
                if hi == lo:        # nothing to send (a codec may still have a header: skip it)
                    continue
                data = local_ef.compress(flat[lo:hi], offset + lo)
                if owner == me:
                    own[s] = data
                else:
                    sends.append(self._link(s, me, owner).send([data], owner, _TAG_SCATTER))
                    keep.append(data)
                    sent += data.numel()
                    gathered[s, owner] = torch.empty(self.codec.nbytes(hi - lo), dtype=torch.uint8)
                    gather_recvs.append(self._link(s, owner, me).recv([gathered[s, owner]], owner, _TAG_GATHER))
            lo, hi = segments[s][me]
            for src in range(n):
                if src != me and hi > lo:
                    scattered[s, src] = torch.empty(self.codec.nbytes(hi - lo), dtype=torch.uint8)
                    scatter_recvs[s].append(self._link(s, src, me).recv([scattered[s, src]], src, _TAG_SCATTER))
        keep.extend(sends + gather_recvs + [w for ws in scatter_recvs for w in ws])
        if self.profile is not None:
            self.profile.add("post", time.perf_counter() - posting)

        # owners: sum in rank order, mean, encode once, send the mean to everyone
        for s in range(len(self._groups)):
            lo, hi = segments[s][me]
            if hi == lo:
                continue
            with self._phase(f"wait/s{s}/scatter"):
                _wait_all(scatter_recvs[s], deadline)
            with self._phase("sum"):
                parts = [own[s] if r == me else scattered[s, r] for r in range(n)]
                acc = self.codec.extract(parts[0], hi - lo).clone()
                for part in parts[1:]:
                    acc += self.codec.extract(part, hi - lo)
                acc /= n
                data = owner_ef.compress(acc, offset + lo)
                out[lo:hi] = self.codec.extract(data, hi - lo)
            keep.append(data)
            for dst in range(n):
                if dst != me:
                    work = self._link(s, me, dst).send([data], dst, _TAG_GATHER)
                    sends.append(work)
                    keep.append(work)
                    sent += data.numel()
        with self._phase("wait/gather"):
            _wait_all(gather_recvs + sends, deadline)
        for (s, owner), data in gathered.items():
            lo, hi = segments[s][owner]
            out[lo:hi] = self.codec.extract(data, hi - lo)
        return out, sent

    def _phase(self, name: str) -> AbstractContextManager[None]:
        return self.profile.time(name) if self.profile is not None else nullcontext()

    def _agree(self, ok: bool) -> bool:
        """Collective: True only if every rank's round succeeded."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        assert self._control is not None
        try:
            self._control.allreduce([flag], options).wait()
        except RuntimeError as exc:
            raise RuntimeError(f"rank {self.rank}: the commit/discard agreement itself failed "
                               f"(a rank is gone?): {exc}") from exc
        return bool(flag.item())


def _release(group: dist.ProcessGroupGloo) -> None:
    """Abort ``group`` so that anything still in flight on it fails now. Newer torch gives gloo
    groups ``abort`` (2.14 has it); torch 2.6, the floor, does not: there the group is only
    dropped, and an operation still in flight keeps its sockets until its own timeout."""
    abort = getattr(group, "abort", None)
    if abort is not None:
        abort()


def _wait_all(works: list[dist.Work], deadline: float) -> None:
    for work in works:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError("sharded all-reduce timed out")
        work.wait(datetime.timedelta(seconds=remaining))
