"""Neighbour averaging of a fixed set of tensors (a model), launched without blocking.

``NeighborAverager`` is the engine behind the decentralized strategies (ATC, AWC and
their hierarchical forms): at step ``t`` it packs the tensors into fused buckets,
launches one neighbour all-reduce per bucket with the schedule's weights for ``t``, and
writes each bucket back when someone waits for it. Waiting per bucket is what lets a
strategy overlap communication with compute: ATC waits for a layer's bucket only when
that layer's forward needs it.

Flat mode mixes ranks (``neighbor_allreduce``); hierarchical mode mixes machines
(``hierarchical_neighbor_allreduce_tensors``: reduce-scatter inside a machine, each local
rank exchanges its shard with the neighbour machines, all-gather; buckets pipelined on a
background thread) with the schedule defined over machines.

With ``max_staleness`` > 0 (flat mode only) a late neighbour does not hold the step up:
its newest arrived value is used, within that bound (``late_peers.py`` has the rule).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from syncplane import kernels
from syncplane.comm import context
from syncplane.comm.buckets import make_buckets
from syncplane.comm.check import check_plan
from syncplane.comm.hierarchical import hierarchical_neighbor_allreduce_nonblocking, machine_peers
from syncplane.comm.meter import CommMeter
from syncplane.comm.neighbor import neighbor_allreduce_nonblocking
from syncplane.comm.p2p import DEFAULT_TIMEOUT_S, Handle
from syncplane.algorithms.late_peers import LatePeerMixer
from syncplane.algorithms.decentralized.schedule import Schedule


#: Default bucket for neighbour averaging. Smaller than DDP's 25 MB on purpose: buckets are
#: waited for in order, so bucket i is combined (a CPU pass over it) while bucket i+1 is
#: still on the wire (the measurement that chose 4 MB: ``docs/design-notes.md``).
NEIGHBOR_BUCKET_BYTES = 4 * 2**20


class NeighborAverager:
    """Mix ``tensors`` in place with the neighbours ``schedule`` names for each step.

    Args:
        tensors: dense tensors (any memory format), in the order their consumers need them (buckets
            follow this order, so the first layers' bucket is launched first).
        schedule: over ranks (flat) or over machines (``hierarchical=True``).
        hierarchical: mix machines (``machines``, else ranks ``[m·L, (m+1)·L)`` form machine m).
        local_size: processes per machine for ``hierarchical`` (default: the launch's
            ``LOCAL_WORLD_SIZE``). Creating the machine groups is a collective.
        machines: each machine's ranks, of any sizes (``machines_for``); replaces ``local_size``.
        max_staleness: combine a late neighbour's newest arrived value when it is at most this
            many of its messages behind (0: wait for every neighbour, the exact exchange).
        late_after_s: with ``max_staleness``, how long a step waits for a neighbour's message
            before the neighbour counts as late.
        one_way_links: on gloo, send each direction of a pair's traffic on a connection of its
            own (``comm.context.set_one_way_links``: two process groups, a collective), so no
            connection carries a swap both ways (slow where a link caps each flow). It is set
            for the default group of the process: False does not undo an earlier averager's.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], schedule: Schedule, *, hierarchical: bool = False,
                 local_size: int | None = None, machines: Sequence[Sequence[int]] | None = None,
                 bucket_bytes: int = NEIGHBOR_BUCKET_BYTES,
                 meter: CommMeter | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_staleness: int = 0, late_after_s: float = 0.05, one_way_links: bool = True) -> None:
        if max_staleness and hierarchical:
            raise ValueError("max_staleness: late-peer mixing is for flat neighbour averaging (atc, awc); "
                             "the hierarchical exchange reduces inside each machine with collectives")
        self.schedule, self.hierarchical = schedule, hierarchical
        self.meter, self.timeout_s = meter, timeout_s
        self.rank = dist.get_rank()
        if one_way_links and dist.get_backend() == "gloo":
            context.set_one_way_links()
        if hierarchical:
            context.set_machine_topology(local_size=local_size, machines=machines)
            self.layout = context.machine_layout()
            self.me = self.layout.machine_of(self.rank)
            participants = len(self.layout.machines)
        else:
            self.me = self.rank
            participants = dist.get_world_size()
        if schedule.size != participants:
            unit = "machines" if hierarchical else "ranks"
            raise ValueError(f"the schedule is over {schedule.size} participants but there are {participants} {unit}")
        self.buckets = make_buckets(tensors, bucket_bytes)
        self._bucket_of = {t.data_ptr(): i for i, b in enumerate(self.buckets) for t in b.tensors}
        self._pending: dict[int, Handle] = {}
        self._receive: dict[tuple[int, int], torch.Tensor] = {}   # (bucket, k-th source) -> reused buffer
        self.late = (LatePeerMixer(max_staleness, late_after_s, timeout_s=timeout_s, meter=meter)
                     if max_staleness else None)

    # ------------------------------------------------------------------ queries

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def buckets_of(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """Indices of the buckets holding any of ``tensors`` (others are ignored)."""
        return {self._bucket_of[t.data_ptr()] for t in tensors if t.data_ptr() in self._bucket_of}

    # ------------------------------------------------------------------ operations

    def check_schedule(self) -> None:
        """Verify on every rank, once per distinct step of a period, that senders and
        receivers agree (a collective per step). The hot path then runs unchecked; a
        later mismatch still ends in ``TopologyError`` after ``timeout_s``."""
        for step in range(self.schedule.period):
            plan = self.schedule.plan(step, self.me)
            if self.hierarchical:
                check_plan(machine_peers(self.layout, self.rank, plan.dst_weights),
                           machine_peers(self.layout, self.rank, plan.src_weights),
                           what="hierarchical_neighbor_allreduce")
            else:
                check_plan(plan.dst_weights, plan.src_weights)

    def launch(self, step: int) -> None:
        """Start mixing every bucket with step ``step``'s weights (waits out a previous round first)."""
        self.wait()
        plan = self.schedule.plan(step, self.me)
        # a bucket of one tensor is sent and combined in place: no pack/unpack copies
        flats = [kernels.flat_view(b.tensors[0]) if len(b.tensors) == 1 else b.pack() for b in self.buckets]
        if self.late is not None:   # one combine for every bucket, whichever is waited for first
            combine = _once(self.late.launch(step, plan, flats))
            handles = [Handle(_finish=lambda flat=flat: (combine(), flat)[1]) for flat in flats]
        elif self.hierarchical:   # one pipeline over all buckets (see hierarchical_neighbor_allreduce_tensors)
            handles = hierarchical_neighbor_allreduce_nonblocking(
                flats, plan.self_weight, plan.src_weights, plan.dst_weights, enable_topo_check=False,
                timeout_s=self.timeout_s, meter=self.meter)
        else:
            handles = [neighbor_allreduce_nonblocking(
                flat, plan.self_weight, plan.src_weights, plan.dst_weights, enable_topo_check=False,
                timeout_s=self.timeout_s, meter=self.meter, out=flat,
                recv_buffers=[self._receive_buffer(index, k, flat) for k in range(len(plan.src_weights))],
                tag=index)      # bucket i on a host's NIC i mod k (gloo)
                for index, flat in enumerate(flats)]
        self._pending = dict(enumerate(handles))

    def _receive_buffer(self, bucket: int, source: int, like: torch.Tensor) -> torch.Tensor:
        buffer = self._receive.get((bucket, source))
        if buffer is None:
            buffer = self._receive[(bucket, source)] = torch.empty_like(like)
        return buffer

    def wait(self, indices: Iterable[int] | None = None) -> None:
        """Finish the given buckets (default: all pending) and write them back, in bucket order."""
        chosen = sorted(self._pending if indices is None else set(indices) & set(self._pending))
        for index in chosen:
            result = self._pending.pop(index).wait()
            bucket = self.buckets[index]
            if len(bucket.tensors) > 1 or self.hierarchical:
                bucket.unpack(result)


    def drain(self) -> None:
        """Finish every bucket, and in late-peer mode every message still in flight."""
        self.wait()
        if self.late is not None:
            self.late.drain()

    def close(self) -> None:
        """Stop the late-peer watchers (nothing to stop otherwise); ``drain`` first to finish."""
        if self.late is not None:
            self.late.close()


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, run on the first call only."""
    done = [False]

    def run() -> None:
        if not done[0]:
            done[0] = True
            fn()

    return run


def release() -> None:
    """Drop the neighbour operations' per-job state (machine groups, the background worker):
    they go with the process groups at the end of a fit."""
    context.reset()
