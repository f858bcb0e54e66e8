"""Global collectives over flat buckets, with communication accounting.

Thin wrappers over ``torch.distributed`` so that every strategy moves parameters the
same way (fused buckets, measured bytes) and nothing above this layer touches the
process-group API directly.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from syncplane.comm.buckets import Bucket, make_buckets
from syncplane.comm.group_cache import cached_group
from syncplane.comm.host_mirror import HostMirror
from syncplane.comm.meter import CommMeter, ring_allreduce_bytes
from syncplane.comm.process_groups import control_group


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    async_op: bool = False) -> dist.Work | None:
    """Gather equal-sized tensors into one flat output: ``all_gather_single`` where torch
    has it (it deprecates ``all_gather_into_tensor``), the older name on the torch floor.
    Looked up per call, so a test may wrap ``torch.distributed``'s functions."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def allreduce_mean_(buckets: Sequence[Bucket], group: dist.ProcessGroup | None = None,
                    meter: CommMeter | None = None) -> None:
    """Average the buckets' tensors across ``group`` in place.

    All buckets are launched asynchronously before the first wait, so the transport
    pipelines them; the 1/n scale is folded into the unpack pass.
    """
    n = world_size(group)
    if n == 1:
        return
    with _measured(meter, sum(ring_allreduce_bytes(b.nbytes, n) for b in buckets)):
        works = []
        for bucket in buckets:
            bucket.pack()
            works.append(dist.all_reduce(bucket.buffer, group=group, async_op=True))
        for bucket, work in zip(buckets, works):
            work.wait()
            bucket.unpack(scale=1.0 / n)


def _measured(meter: CommMeter | None, bytes_sent: int) -> AbstractContextManager[None]:
    return meter.measure(bytes_sent) if meter is not None else nullcontext()


def mean_and_distance(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
                      sketch_buckets: int = 0) -> float:
    """Consensus distance ``mean_i ||x_i - x̄|| / ||x̄||`` over the concatenation of ``tensors``.

    One all-reduce of the float64 flat vector (for x̄), one of a scalar (for the mean).
    With ``sketch_buckets`` smaller than the vector, the vector all-reduced is instead its
    count sketch of that many buckets (``count_sketch``): the sketch is linear, so the
    sketch of ``x_i - x̄`` is this rank's sketch minus the mean sketch, and its norm is an
    unbiased estimate of ``||x_i - x̄||²`` (relative error about ``1/sqrt(buckets)`` on the
    norm), for ``sketch_buckets`` floats on the wire instead of the whole model.
    Returns 0.0 on a single process.
    """
    n = world_size(group)
    if n == 1 or not tensors:
        return 0.0
    host = HostMirror(tensors, dtype=torch.float64)
    host.to_host(tensors)
    local = host.buffer
    if 0 < sketch_buckets < local.numel():
        local = count_sketch(local, sketch_buckets)
    mean = local.clone()
    dist.all_reduce(mean, group=control_group(group))
    mean /= n
    ratio = torch.tensor([(local - mean).norm().item() / max(mean.norm().item(), 1e-30)], dtype=torch.float64)
    dist.all_reduce(ratio, group=control_group(group))
    return float(ratio.item() / n)


#: The seed of ``count_sketch``'s signs: every rank must draw the same ones (the sketch's
#: linearity across ranks depends on it).
SKETCH_SEED = 0x5C7


def count_sketch(vector: torch.Tensor, buckets: int, chunk_rows: int = 64) -> torch.Tensor:
    """``vector``'s count sketch: element ``j`` goes, with a random sign, into bucket
    ``j mod buckets``. Linear in ``vector``; ``||sketch||²`` estimates ``||vector||²`` without
    bias, since the signs are independent. The signs come from a fixed seed, drawn chunk by
    chunk, so that every rank sketches with the same ones and memory stays
    ``chunk_rows × buckets``."""
    if buckets <= 0:
        raise ValueError(f"a count sketch needs a positive number of buckets, got {buckets}")
    flat = vector.reshape(-1)
    sketch = torch.zeros(buckets, dtype=flat.dtype)
    generator = torch.Generator().manual_seed(SKETCH_SEED)
    step = buckets * chunk_rows
    for start in range(0, flat.numel(), step):
        chunk = flat[start:start + step]
        signs = torch.randint(0, 2, (chunk.numel(),), generator=generator, dtype=torch.int8).to(flat.dtype) * 2 - 1
        signed = chunk * signs
        rows, tail = divmod(signed.numel(), buckets)
        if rows:
            sketch += signed[:rows * buckets].view(rows, buckets).sum(0)
        if tail:
            sketch[:tail] += signed[rows * buckets:]
    return sketch


#: Bucket cap of ``broadcast_by_host_``: torch DDP's for its initial broadcast.
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def broadcast_by_host_(tensors: Sequence[torch.Tensor], hosts: Sequence[Sequence[int]],
                       bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Collective: rank 0's values of ``tensors`` written into every rank's, one copy crossing
    into each host: rank 0 sends to the first rank of every host, which sends to the rest of
    its host. A flat broadcast sends a copy per rank, so the slow link into a host of L ranks
    carried L copies (a model's start across a WAN, ``docs/design-notes.md``). ``hosts``: the
    ranks of each host, every rank once. Its groups are made on first use (every rank calls
    it, in the same order)."""
    members = sorted(r for h in hosts for r in h)
    if members != list(range(dist.get_world_size())):
        raise ValueError(f"hosts {[list(h) for h in hosts]} do not hold each of the "
                         f"{dist.get_world_size()} ranks once")
    stages = [sorted(min(h) for h in hosts), *(sorted(h) for h in hosts if len(h) > 1)]
    groups = [cached_group("broadcast_by_host", ranks) for ranks in stages]   # every rank makes each
    rank = dist.get_rank()
    mine = [g for ranks, g in zip(stages, groups) if rank in ranks]   # the first rank of each is its source
    with torch.no_grad():
        for bucket in make_buckets([t.detach() for t in tensors], bucket_bytes):
            # torch's own copies, not ``Bucket.pack``: the kernels pack floating types, and a model's
            # buffers may be integers (BatchNorm's ``num_batches_tracked``)
            flat = torch.cat([t.reshape(-1) for t in bucket.tensors], out=bucket.buffer)
            for group in mine:
                dist.broadcast(flat, group=group, group_src=0)
            for t, piece in zip(bucket.tensors, flat.split([t.numel() for t in bucket.tensors])):
                t.copy_(piece.view_as(t))


def gather_to_rank0(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Collective: rank 0 gets every rank's ``obj`` (picklable; tensors travel on the CPU),
    the others None. For small objects: large per-rank state (a checkpoint's replicas) is
    better written by each rank itself than pulled through rank 0's links."""
    gathered: list[Any] | None = [None] * world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, gathered, group=group, group_dst=0)
    return gathered


def agreed_token(group: dist.ProcessGroup | None = None) -> str:
    """Collective: a fresh random token that rank 0 draws and every rank receives (over
    the control group): names what the ranks write together (one checkpoint save's
    per-rank files), unique also across restarts, where counters repeat."""
    token = [uuid.uuid4().hex[:12] if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(token, group=control_group(group), group_src=0)
    return str(token[0])


def every_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Collective: True when ``flag`` is True on every rank of ``group`` (one integer over
    the control group), so that all ranks take the same branch."""
    votes = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=control_group(group))
    return bool(votes.item())


#: ranks each rank tells per round of ``every_rank_ok``: up to 9 ranks agree in one message delay
AGREE_FANOUT = 8


def every_rank_ok(group: dist.ProcessGroup, rank: int, size: int, ok: bool, fanout: int = AGREE_FANOUT) -> bool:
    """Collective over ``group`` (ranks 0..size-1): True only if every rank passed ``ok``.

    A k-ary dissemination: in each round every rank sends what it knows so far to the
    ``fanout`` ranks 1, 2, ... ``fanout`` spans ahead and hears from as many behind, the span
    growing by ``fanout + 1`` a round, so ⌈log_{fanout+1} size⌉ message delays (one up to
    ``fanout + 1`` ranks). Why not gloo's all-reduce of one flag: its ring takes 2(size - 1)
    delays one after another, and each queues behind the round's bulk data on every NIC it
    crosses (100 ms shaper queues on the emulator): 0.21 s a round of Canary's on
    ``bcube_3_2``, 9 ranks (2026-11-30). ``post_every_rank_ok`` posts the receives ahead."""
    return post_every_rank_ok(group, rank, size, fanout)(ok)


def post_every_rank_ok(group: dist.ProcessGroup, rank: int, size: int,
                       fanout: int = AGREE_FANOUT) -> Callable[[bool], bool]:
    """``every_rank_ok`` in two halves: this call posts every round's receives and returns the
    decision, a call with this rank's ``ok`` (collective: every rank calls both, in the same
    order). Posting them before the work being agreed on takes one message delay off the
    agreement: gloo's TCP transport sends a message only once its receiver has posted the
    receive and said so, and that notice would queue behind the work's bulk data too."""
    spans: list[int] = []
    span = 1
    while span < size:
        spans.append(span)
        span *= fanout + 1
    heard: list[dict[int, torch.Tensor]] = []
    recvs: list[list[dist.Work]] = []
    for tag, span in enumerate(spans):
        sources = sorted({(rank - j * span) % size for j in range(1, fanout + 1)} - {rank})
        heard.append({source: torch.zeros(1, dtype=torch.int32) for source in sources})
        recvs.append([group.recv([heard[tag][source]], source, tag) for source in sources])

    def decide(ok: bool) -> bool:
        known, sends = bool(ok), []
        for tag, span in enumerate(spans):
            targets = sorted({(rank + j * span) % size for j in range(1, fanout + 1)} - {rank})
            mine = torch.tensor([int(known)], dtype=torch.int32)
            sends += [(mine, group.send([mine], target, tag)) for target in targets]
            for work in recvs[tag]:
                work.wait()
            known = known and all(bool(flag.item()) for flag in heard[tag].values())
        for _, work in sends:
            work.wait()
        return known

    return decide


def control_barrier(group: dist.ProcessGroup | None = None) -> None:
    """Collective: wait until every rank of ``group`` reaches it (over the control group,
    so also where the data group is NCCL)."""
    dist.barrier(group=control_group(group))


def rank0_decides(measurement: torch.Tensor, decide: Callable[[torch.Tensor], Sequence[float]], size: int,
                  group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Collective: every rank measures, rank 0 decides, every rank adopts the decision.

    ``measurement`` (same shape on every rank) is gathered; rank 0 calls ``decide`` on the
    stacked measurements (one row per rank) and broadcasts its ``size`` numbers (float64).
    Deciding on one rank, not on each from the same gathered data, is what guarantees that
    every rank switches at the same step to the same choice.
    """
    gathered = [torch.zeros_like(measurement) for _ in range(world_size(group))]
    dist.all_gather(gathered, measurement, group=group)
    decision = torch.zeros(size, dtype=torch.float64)
    if dist.get_rank(group) == 0:
        decision.copy_(torch.as_tensor(decide(torch.stack(gathered)), dtype=torch.float64))
    dist.broadcast(decision, group=group, group_src=0)
    return decision
