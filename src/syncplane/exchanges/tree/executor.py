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
two process groups of FlexReduce's own, created once up front: a message from rank x to y
goes on the first when x < y, else on the second -- one connection per direction, see
``syncplane.comm.context.directed``). Beyond the paper, a bucket
is cut into chunks of ``chunk_bytes`` and the 2L phases (reduce-scatter levels up, all-
gather levels down) run as a wavefront: at tick s chunk k runs phase s − k, so while
chunk k crosses the slow root link, chunk k+1 is being reduced inside its hosts and
chunk k−1 gathered back. On a multi-level tree the levels' times then overlap instead of
adding up; ``chunk_bytes=0`` runs the paper's schedule (one level after the other).

A root of two children (two racks, two sites: the common top of a tree) is a *swap*:
each holder sends its partial of the pair's range to the other and both sum it, in child
order, in one phase -- the bytes each way of its reduce-scatter plus all-gather, one
phase instead of two. That takes a tick off the wavefront's fill and drain across the
slowest link (a quarter of the cross time with 4 chunks per stream), and it leaves one
message per pair and tick on that link where the wavefront had a reduce-scatter and an
all-gather sharing one connection. The sums are the same kernel calls in the same order,
so the result is bit-identical to the paper's root (``swap_root=False``).
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
from syncplane.exchanges.tree.plan import Plan, pairwise_root, plan_for
from syncplane.exchanges.tree.tree import FlexTree
from syncplane.comm.group_cache import cached_group
from syncplane.comm.meter import CommMeter, PhaseProfile
from syncplane.comm.p2p import DEFAULT_TIMEOUT_S, Handle
from syncplane.comm.context import directed
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
    swap: bool = False     # the root's swap: sends and receives are one exchange, no all-gather


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


def _swap_messages(plan: Plan, level: int, me: int) -> tuple[list[Message], list[Message], list[Combine], int]:
    """The root's swap for ``me``: to the other holder of each of its pieces, its partial of
    them (one message: the two holders' ranges meet in one interval), and every piece it
    holds summed in child order."""
    mine = [c for c in plan.levels[level] if me in c.holders]
    spans: dict[int, list[int]] = {}
    for c in mine:
        peer = c.holders[1] if c.holders[0] == me else c.holders[0]
        lo_hi = spans.setdefault(peer, [c.lo, c.hi])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], c.lo), max(lo_hi[1], c.hi)
    sends = [Message(peer, lo, hi) for peer, (lo, hi) in sorted(spans.items())]
    recvs, slot = [], 0
    for m in sends:
        recvs.append(Message(m.peer, m.lo, m.hi, slot))
        slot += m.hi - m.lo
    where = {m.peer: m for m in recvs}
    combines = [Combine(c.lo, c.hi, tuple(-1 if h == me else where[h].slot + (c.lo - where[h].lo) for h in c.holders))
                for c in mine]
    return sends, recvs, combines, slot


def rank_schedule(plan: Plan, me: int, swap_root: bool = False) -> list[LevelSchedule]:
    """Per level, what ``me`` sends, receives and sums in the reduce-scatter (the all-gather
    swaps sends and receives); with ``swap_root`` (see ``pairwise_root``) the last level is
    the root's swap."""
    out = []
    for level in range(plan.num_levels):
        swap = swap_root and level == plan.num_levels - 1
        sends, recvs, combines, workspace = (_swap_messages if swap else _messages)(plan, level, me)
        out.append(LevelSchedule(tuple(sends), tuple(recvs), tuple(combines), workspace, swap))
    return out


class FlexReduce:
    """The FlexReduce all-reduce (mean) of flat tensors over ``tree``'s ranks.

    A collective to construct (it creates FlexReduce's process group); the tree must cover
    exactly the ranks of the job -- checked here, on every rank, before any data moves.
    """

    def __init__(self, tree: FlexTree, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S, own_group: bool = True, swap_root: bool = True) -> None:
        world = dist.get_world_size()
        if tree.world_size != world:
            raise ConfigError(f"flexreduce: the tree covers {tree.world_size} ranks ({tree.describe()}), "
                              f"but the job has {world} processes")
        if chunk_bytes < 0:
            raise ConfigError(f"flexreduce: chunk_bytes must be >= 0 (0 = no pipelining), got {chunk_bytes}")
        self.tree, self.chunk_bytes, self.timeout_s = tree, chunk_bytes, timeout_s
        self.rank, self.world = dist.get_rank(), world
        #: the root runs as a swap (module doc) where the tree allows; False: the paper's root
        self.swap_root = swap_root and pairwise_root(tree)
        # ``own_group=False``: the caller brings a group per stream to ``run_streams`` (DiLoCo's
        # sharded exchange, whose groups are rebuilt after a discarded round)
        self.groups = ((cached_group("flexreduce"), cached_group("flexreduce/down"))
                       if world > 1 and own_group else None)
        self._schedules: dict[int, list[LevelSchedule]] = {}
        self._workspace: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._pool: ThreadPoolExecutor | None = None   # run_streams' stream threads, made on first use
        self._pool_size = 0

    def _schedule(self, numel: int) -> list[LevelSchedule]:
        sched = self._schedules.get(numel)
        if sched is None:
            plan = plan_for(self.tree, numel)
            plan.check(numel)
            sched = self._schedules[numel] = rank_schedule(plan, self.rank, self.swap_root)
            log.debug("flexreduce: rank %d, %d elements: %s", self.rank, numel,
                      [(len(s.sends), len(s.recvs), len(s.combines)) for s in sched])
        return sched

    def phases(self) -> list[tuple[int, bool]]:
        """(level, all-gather?) of each phase: levels up, then down; the root's swap is its
        one phase (its all-gather is part of it)."""
        levels = self.tree.num_levels
        down = levels - 1 if self.swap_root else levels
        return [(lvl, False) for lvl in range(levels)] + [(lvl, True) for lvl in reversed(range(down))]

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
        if self.groups is None:
            raise RuntimeError("flexreduce: built with own_group=False; call run_streams with groups per stream")
        start = time.perf_counter()
        sent = self.run_streams([tensor], [self.groups])
        if meter is not None:
            meter.record(start, time.perf_counter(), sent)
        return tensor

    def run_streams(self, tensors: Sequence[torch.Tensor], groups: Sequence[tuple[dist.ProcessGroup, dist.ProcessGroup]],
                    deadline: float | None = None, keep: list[object] | None = None,
                    profile: PhaseProfile | None = None) -> int:
        """The mean of every flat tensor in place, tensor s travelling on ``groups[s]`` (its own
        connections: the (up, down) pair of ``syncplane.comm.context.directed``); returns the
        bytes this rank sent.

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
            raise ValueError(f"flexreduce: {len(tensors)} tensors but {len(groups)} group pairs (one per stream)")
        streams = [(s, t, g) for s, (t, g) in enumerate(zip(tensors, groups)) if t.numel()]
        if self.world == 1 or not streams:
            return 0
        phases = self.phases()
        runs = []
        for s, tensor, group in streams:
            chunks = self.chunks(tensor)
            schedules = [self._schedule(c.numel()) for c in chunks]
            # chunks k and k + len(phases) are never in flight at the same tick: that many slots suffice
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
                   workspace: torch.Tensor, groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
                   phases: list[tuple[int, bool]],
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
                sched = schedules[k][level]
                handle, nbytes = self._post(chunks[k], sched, scratch, level, gather,
                                            tag=k * len(phases) + tick - k, groups=groups, profile=profile)
                handles.append(handle)
                names.append(f"wait/s{stream}/L{level}-{'swap' if sched.swap else 'ag' if gather else 'rs'}")
                sent += nbytes
            if profile is not None:
                profile.add("post", clock() - posting)
            if keep is not None:
                keep.extend(handles)     # list.extend is atomic: streams may share ``keep``
            for handle, name in zip(handles, names):
                waiting = clock()
                handle.wait(deadline)
                if profile is not None:
                    profile.add(name, clock() - waiting)
            if profile is not None:
                profile.add(f"tick/s{stream}", clock() - posting)
        return sent

    def _post(self, chunk: torch.Tensor, sched: LevelSchedule, scratch: torch.Tensor, level: int,
              gather: bool, tag: int, groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
              profile: PhaseProfile | None = None) -> tuple[Handle, int]:
        """Launch one phase of one chunk; the handle's wait completes it (sums included). The
        root's swap runs as a reduce-scatter whose sends and receives mirror each other: a
        holder's own range goes out and is summed over in place once its send is done (the
        handle waits for every message before ``finish``).
        Messages go straight to the groups (``ProcessGroup.send``/``recv``), ``groups[0]`` up
        the ranks and ``groups[1]`` down: the groups here span every rank in rank order, so
        group ranks are the job's ranks -- and a stream's group need not be registered with
        torch.distributed."""
        me = self.rank

        def send(peer: int, data: torch.Tensor) -> dist.Work:
            return directed(*groups, me, peer).send([data], peer, tag)

        def recv(peer: int, data: torch.Tensor) -> dist.Work:
            return directed(*groups, peer, me).recv([data], peer, tag)

        works: list[tuple[str, int, dist.Work]] = []
        nbytes = 0
        size = chunk.element_size()
        if gather:   # owners send finished pieces back to the holders, straight into place
            for m in sched.sends:
                works.append(("receiving from", m.peer, recv(m.peer, chunk[m.lo:m.hi])))
            for m in sched.recvs:
                works.append(("sending to", m.peer, send(m.peer, chunk[m.lo:m.hi])))
                nbytes += (m.hi - m.lo) * size
        else:
            for m in sched.recvs:
                works.append(("receiving from", m.peer, recv(m.peer, scratch[m.slot:m.slot + m.hi - m.lo])))
            for m in sched.sends:
                works.append(("sending to", m.peer, send(m.peer, chunk[m.lo:m.hi])))
                nbytes += (m.hi - m.lo) * size
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

        return Handle.launched(works, finish, timeout_s=self.timeout_s,
                               what=f"flexreduce level {level} {'all-gather' if gather else 'reduce-scatter'}"), nbytes

    def _scratch(self, stream: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (stream, numel, dtype)
        buf = self._workspace.get(key)
        if buf is None:   # one per stream, bucket size and dtype (a model has a few)
            buf = self._workspace[key] = torch.empty(numel, dtype=dtype)
        return buf

    def bytes_per_rank(self, numel: int, element_size: int) -> int:
        """Bytes this rank sends in one all-reduce of ``numel`` elements, every chunk: its
        reduce-scatter sends, and in the all-gather what it received as an owner (on an
        uneven tree the two differ); at the root's swap, its sends."""
        return sum((m.hi - m.lo) * element_size for n in self.chunk_sizes(numel, element_size) if n
                   for s in self._schedule(n) for m in (*s.sends, *(() if s.swap else s.recvs)))
