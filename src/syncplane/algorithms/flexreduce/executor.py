"""FlexReduce on torch.distributed (paper Fig. 3a, ``FlexReduce_execute``), pipelined.

The plan's reduce calls become point-to-point messages: a holder sends its partial sum
of a piece to the piece's owner, the owner sums the holders' partials; in the all-gather
the owner sends the finished piece back. Between one holder and one owner a level has
one contiguous message (the holder's range meets the owner's new range in one
interval), however many calls it spans; the owner then sums call by call with the
compiled ``weighted_combine`` kernel, in the holders' child order -- the same order for
every element count and range assignment, so the result depends on the tree alone,
and since each item is finished by exactly one rank and copied to the others, every
rank ends bit-identical. The root level sums with weight 1/world: the mean, in the
same pass. Partial sums accumulate in float32 inside the kernel (bf16 in, bf16 out).

All messages of a level are in flight together (``batch``-style ``isend``/``irecv`` on
a process group of FlexReduce's own, created once up front). Beyond the paper, a bucket
is cut into chunks of ``chunk_bytes`` and the 2L phases (reduce-scatter levels up, all-
gather levels down) run as a wavefront: at tick s chunk k runs phase s − k, so while
chunk k crosses the slow root link, chunk k+1 is being reduced inside its hosts and
chunk k−1 gathered back. On a multi-level tree the levels' times then overlap instead of
adding up; ``chunk_bytes=0`` runs the paper's schedule (one level after the other).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
import torch.distributed as dist

from syncplane import kernels
from syncplane.algorithms.flexreduce.plan import Plan, plan_for
from syncplane.algorithms.flexreduce.tree import FlexTree
from syncplane.comm.group_cache import cached_group
from syncplane.comm.meter import CommMeter, PhaseProfile
from syncplane.comm.errors import TopologyError
from syncplane.comm.p2p import DEFAULT_TIMEOUT_S, Handle
from syncplane.config import ConfigError

log = logging.getLogger(__name__)

#: Pipeline chunk: small enough that the wavefront's fill and drain ((2L − 1) chunks) stay a
#: small share of a 25 MB bucket, large enough that the per-message latency does not dominate.
DEFAULT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Message:
    peer: int
    lo: int
    hi: int
    slot: int = 0          # offset in the receive workspace (reduce-scatter receives only)


@dataclass(frozen=True)
class Combine:
    """Sum a piece: ``sources`` in holder order, -1 = this rank's own data, else a workspace offset."""

    lo: int
    hi: int
    sources: tuple[int, ...]


@dataclass(frozen=True)
class LevelSchedule:
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    combines: tuple[Combine, ...]
    workspace: int


def _messages(plan: Plan, level: int, me: int) -> tuple[list[Message], list[Message], list[Combine], int]:
    """This rank's reduce-scatter messages and sums at ``level``: one message per (holder, owner)."""
    spans_out: dict[int, list[int]] = {}
    spans_in: dict[int, list[int]] = {}
    for c in plan.levels[level]:
        if me in c.senders:
            lo_hi = spans_out.setdefault(c.owner, [c.lo, c.hi])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], c.lo), max(lo_hi[1], c.hi)
        if c.owner == me:
            for h in c.senders:
                lo_hi = spans_in.setdefault(h, [c.lo, c.hi])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], c.lo), max(lo_hi[1], c.hi)
    sends = [Message(peer, lo, hi) for peer, (lo, hi) in sorted(spans_out.items())]
    recvs, slot = [], 0
    for peer, (lo, hi) in sorted(spans_in.items()):
        recvs.append(Message(peer, lo, hi, slot))
        slot += hi - lo
    where = {m.peer: m for m in recvs}
    combines = []
    for c in plan.levels[level]:
        if c.owner == me:
            sources = tuple(-1 if h == me else where[h].slot + (c.lo - where[h].lo) for h in c.holders)
            combines.append(Combine(c.lo, c.hi, sources))
    return sends, recvs, combines, slot


def rank_schedule(plan: Plan, me: int) -> list[LevelSchedule]:
    """Per level, what ``me`` sends, receives and sums in the reduce-scatter (the all-gather
    swaps sends and receives)."""
    out = []
    for level in range(plan.num_levels):
        sends, recvs, combines, workspace = _messages(plan, level, me)
        out.append(LevelSchedule(tuple(sends), tuple(recvs), tuple(combines), workspace))
    return out


class FlexReduce:
    """The FlexReduce all-reduce (mean) of flat tensors over ``tree``'s ranks.

    A collective to construct (it creates FlexReduce's process group); the tree must cover
    exactly the ranks of the job -- checked here, on every rank, before any data moves.
    """

    def __init__(self, tree: FlexTree, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S, own_group: bool = True) -> None:
        world = dist.get_world_size()
        if tree.world_size != world:
            raise ConfigError(f"flexreduce: the tree covers {tree.world_size} ranks ({tree.describe()}), "
                              f"but the job has {world} processes")
        if chunk_bytes < 0:
            raise ConfigError(f"flexreduce: chunk_bytes must be >= 0 (0 = no pipelining), got {chunk_bytes}")
        self.tree, self.chunk_bytes, self.timeout_s = tree, chunk_bytes, timeout_s
        self.rank, self.world = dist.get_rank(), world
        # ``own_group=False``: the caller brings a group per stream to ``run_streams`` (DiLoCo's
        # sharded exchange, whose groups are rebuilt after a discarded round)
        self.group = cached_group("flexreduce") if world > 1 and own_group else None
        self._schedules: dict[int, list[LevelSchedule]] = {}
        self._workspace: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._pool: ThreadPoolExecutor | None = None   # run_streams' stream threads, made on first use
        self._pool_size = 0

    def _schedule(self, numel: int) -> list[LevelSchedule]:
        sched = self._schedules.get(numel)
        if sched is None:
            plan = plan_for(self.tree, numel)
            plan.check(numel)
            sched = self._schedules[numel] = rank_schedule(plan, self.rank)
            log.debug("flexreduce: rank %d, %d elements: %s", self.rank, numel,
                      [(len(s.sends), len(s.recvs), len(s.combines)) for s in sched])
        return sched

    def chunk_sizes(self, numel: int, element_size: int) -> list[int]:
        """Element counts of the pipeline's chunks (one chunk when pipelining is off), as
        ``tensor_split`` cuts them: the first ``numel % count`` are one longer."""
        per = self.chunk_bytes // element_size if self.chunk_bytes else numel
        count = max(1, min(numel, math.ceil(numel / max(per, 1))))
        base, extra = divmod(numel, count)
        return [base + (1 if i < extra else 0) for i in range(count)]

    def chunks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The pipeline's chunks of a flat tensor."""
        return list(tensor.split(self.chunk_sizes(tensor.numel(), tensor.element_size())))

    def allreduce_mean_(self, tensor: torch.Tensor, meter: CommMeter | None = None) -> torch.Tensor:
        """Replace ``tensor`` (1-D, contiguous) by its mean over all ranks; returns it."""
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"flexreduce: expected a flat contiguous tensor, got shape {tuple(tensor.shape)}")
        if self.world == 1:
            return tensor
        if self.group is None:
            raise RuntimeError("flexreduce: built with own_group=False; call run_streams with a group per stream")
        start = time.perf_counter()
        sent = self.run_streams([tensor], [self.group])
        if meter is not None:
            meter.record(start, time.perf_counter(), sent)
        return tensor

    def run_streams(self, tensors: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup],
                    deadline: float | None = None, keep: list[object] | None = None,
                    profile: PhaseProfile | None = None) -> int:
        """The mean of every flat tensor in place, tensor s travelling on ``groups[s]`` (its own
        connections); returns the bytes this rank sent.

        Each stream runs its own wavefront on its own thread (one stream: on the caller's),
        all at once, so S streams put S flows on each link (what a per-flow-capped WAN needs)
        and a slow flow holds back only its own stream. Each stream runs the plan for its own
        length; since an item's sum order depends on the tree only, how the payload is cut
        into streams does not change a single bit of the result.

        ``deadline`` (``time.monotonic()``): a wait past it raises ``TopologyError`` (a
        ``RuntimeError``); the tensors are then partly reduced, so the caller works on copies
        and aborts the groups. ``keep`` receives every in-flight operation, for the caller to
        hold until the round is over. ``profile`` gets, per tick, the time spent posting and
        each stream's wait per phase (``wait/s<stream>/L<level>-rs|ag``, which includes the
        sums, also counted alone as ``sum``).
        """
        if len(tensors) != len(groups):
            raise ValueError(f"flexreduce: {len(tensors)} tensors but {len(groups)} groups (one group per stream)")
        streams = [(s, t, g) for s, (t, g) in enumerate(zip(tensors, groups)) if t.numel()]
        if self.world == 1 or not streams:
            return 0
        levels = self.tree.num_levels
        phases = [(lvl, False) for lvl in range(levels)] + [(lvl, True) for lvl in reversed(range(levels))]
        runs = []
        for s, tensor, group in streams:
            chunks = self.chunks(tensor)
            schedules = [self._schedule(c.numel()) for c in chunks]
            # chunks k and k + 2L are never in flight at the same tick: 2L receive slots suffice
            space = max((lv.workspace for sched in schedules for lv in sched), default=0)
            slots = min(len(chunks), len(phases))
            runs.append((chunks, schedules, space, slots, self._scratch(s, slots * space, tensor.dtype), group))
        if len(runs) == 1:
            return self._wavefront(*runs[0], phases, deadline, keep, profile, stream=0)
        # one thread per stream: a stream's tick waits for its own flows only, so a flow that
        # runs slow for a while (its TCP window, the shaper's share) delays its own stream, not
        # every stream's next tick as a lockstep over all streams did (the waits release the GIL)
        if self._pool is None or self._pool_size < len(runs):
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="syncplane-flexreduce")
            self._pool_size = len(runs)
        futures = [self._pool.submit(self._wavefront, *run, phases, deadline, keep, profile, stream=s)
                   for s, run in enumerate(runs)]
        wait(futures)    # every stream has stopped touching its buffers before anything is raised
        return sum(f.result() for f in futures)

    def _wavefront(self, chunks: list[torch.Tensor], schedules: list[list[LevelSchedule]], space: int, slots: int,
                   workspace: torch.Tensor, group: dist.ProcessGroup, phases: list[tuple[int, bool]],
                   deadline: float | None, keep: list[object] | None, profile: PhaseProfile | None,
                   stream: int) -> int:
        """One stream's pipeline: at tick t, chunk k runs phase t − k; returns the bytes sent."""
        sent = 0
        clock = time.perf_counter
        for tick in range(len(chunks) + len(phases) - 1):
            handles = []
            names = []
            posting = clock()
            for k in range(max(0, tick - len(phases) + 1), min(len(chunks), tick + 1)):
                level, gather = phases[tick - k]
                slot = k % slots
                scratch = workspace[slot * space:(slot + 1) * space]
                handle, nbytes = self._post(chunks[k], schedules[k][level], scratch, level, gather,
                                            tag=k * len(phases) + tick - k, group=group, profile=profile)
                handles.append(handle)
                names.append(f"wait/s{stream}/L{level}-{'ag' if gather else 'rs'}")
                sent += nbytes
            if profile is not None:
                profile.add("post", clock() - posting)
            if keep is not None:
                keep.extend(handles)     # list.extend is atomic: streams may share ``keep``
            for handle, name in zip(handles, names):
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TopologyError(f"rank {self.rank}: flexreduce exchange passed its deadline")
                    handle._timeout_s = remaining
                waiting = clock()
                handle.wait()
                if profile is not None:
                    profile.add(name, clock() - waiting)
            if profile is not None:
                profile.add(f"tick/s{stream}", clock() - posting)
        return sent

    def _post(self, chunk: torch.Tensor, sched: LevelSchedule, scratch: torch.Tensor, level: int,
              gather: bool, tag: int, group: dist.ProcessGroup,
              profile: PhaseProfile | None = None) -> tuple[Handle, int]:
        """Launch one phase of one chunk; the handle's wait completes it (sums included).
        Messages go straight to ``group`` (``ProcessGroup.send``/``recv``): the groups here span
        every rank in rank order, so group ranks are the job's ranks -- and a stream's group
        need not be registered with torch.distributed."""
        works: list[tuple[str, int, dist.Work]] = []
        nbytes = 0
        size = chunk.element_size()
        if gather:   # owners send finished pieces back to the holders, straight into place
            for m in sched.recvs:
                works.append(("sending to", m.peer, group.send([chunk[m.lo:m.hi]], m.peer, tag)))
                nbytes += (m.hi - m.lo) * size
            for m in sched.sends:
                works.append(("receiving from", m.peer, group.recv([chunk[m.lo:m.hi]], m.peer, tag)))
        else:
            for m in sched.sends:
                works.append(("sending to", m.peer, group.send([chunk[m.lo:m.hi]], m.peer, tag)))
                nbytes += (m.hi - m.lo) * size
            for m in sched.recvs:
                works.append(("receiving from", m.peer,
                              group.recv([scratch[m.slot:m.slot + m.hi - m.lo]], m.peer, tag)))
        scale = 1.0 / self.world if level == self.tree.num_levels - 1 else 1.0

        def finish() -> torch.Tensor:
            if not gather:
                summing = time.perf_counter()
                for c in sched.combines:
                    width = c.hi - c.lo
                    parts = [chunk[c.lo:c.hi] if s < 0 else scratch[s:s + width] for s in c.sources]
                    kernels.weighted_combine(parts[0], parts[1:], [scale] * (len(parts) - 1), scale,
                                             out=chunk[c.lo:c.hi])
                if profile is not None:
                    profile.add("sum", time.perf_counter() - summing)
            return chunk

        return Handle(_works=works, _finish=finish, _timeout_s=self.timeout_s,
                      _what=f"flexreduce level {level} {'all-gather' if gather else 'reduce-scatter'}"), nbytes

    def _scratch(self, stream: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (stream, numel, dtype)
        buf = self._workspace.get(key)
        if buf is None:   # one per stream, bucket size and dtype (a model has a few)
            buf = self._workspace[key] = torch.empty(numel, dtype=dtype)
        return buf

    def bytes_per_rank(self, numel: int, element_size: int) -> int:
        """Bytes this rank sends in one all-reduce of ``numel`` elements, every chunk: its
        reduce-scatter sends, and in the all-gather what it received as an owner (on an
        uneven tree the two differ)."""
        return sum((m.hi - m.lo) * element_size for n in self.chunk_sizes(numel, element_size) if n
                   for s in self._schedule(n) for m in (*s.sends, *s.recvs))
