"""Point-to-point exchange with a handle, a deadline and an error that names peers.

Every neighbour operation reduces to "send these (scaled) tensors to these ranks,
receive one tensor from each of those, then combine". Sends and receives are launched
together with ``batch_isend_irecv`` (grouped send/recv under NCCL, individual async
ops under gloo), so a rank never blocks on one peer while another waits on it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from syncplane.comm.context import Group, one_way_link
from syncplane.comm.errors import TopologyError
from syncplane.comm.meter import CommMeter
from syncplane.comm.process_groups import is_gloo

#: How long a neighbour operation may wait for its peers before raising TopologyError.
DEFAULT_TIMEOUT_S = 60.0


#: One launched message: what it does ("sending to", "receiving from", ...), the peer, its work.
Posted = tuple[str, int, dist.Work]


def wait_works(works: Sequence[Posted], *, what: str, timeout_s: float = DEFAULT_TIMEOUT_S,
               deadline: float | None = None) -> None:
    """Wait for every launched message, each within ``timeout_s`` and all before ``deadline``
    (``time.monotonic()``), whichever comes first; raise ``TopologyError`` (a ``RuntimeError``)
    naming the message and peer that did not complete. The one post/wait/deadline loop of every
    exchange: neighbour operations, the stream runner's patterns and the tree's wavefront."""
    for kind, peer, work in works:
        who = f"rank {peer}" if peer >= 0 else "the group"
        remaining = timeout_s if deadline is None else min(timeout_s, deadline - time.monotonic())
        if remaining <= 0:
            raise TopologyError(f"rank {dist.get_rank()}: {what} passed its deadline ({kind} {who} not done)")
        try:
            work.wait(datetime.timedelta(seconds=remaining))
        except RuntimeError as exc:
            first_line = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            if not _is_timeout(exc):
                # a local failure (unsupported dtype, closed connection, ...): say what it was
                raise TopologyError(f"rank {dist.get_rank()}: {what} failed while {kind} {who}: "
                                    f"{first_line}") from exc
            raise TopologyError(
                f"rank {dist.get_rank()}: {what} did not complete within {remaining:.0f} s "
                f"({kind} {who} never finished: {first_line}). "
                "Do the senders' and receivers' plans agree? (enable_topo_check=True names the ranks)"
            ) from exc


@dataclass
class Handle:
    """A launched operation; ``wait()`` returns its result (once; later calls return it again).
    Build one with ``Handle.launched`` (or ``completed`` for a result already there)."""

    _works: list[Posted] = field(default_factory=list)
    _finish: Callable[[], torch.Tensor] | None = None
    _timeout_s: float = DEFAULT_TIMEOUT_S
    _what: str = "neighbor operation"
    _result: torch.Tensor | None = None
    _meter: CommMeter | None = None
    _start: float = 0.0
    _bytes_sent: int = 0

    @classmethod
    def launched(cls, works: Sequence[Posted], finish: Callable[[], torch.Tensor], *, what: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S, meter: CommMeter | None = None,
                 start: float = 0.0, bytes_sent: int = 0) -> Handle:
        """A handle over messages already posted: ``wait()`` waits for them, then runs ``finish``
        (and records ``bytes_sent`` since ``start`` in ``meter``)."""
        return cls(_works=list(works), _finish=finish, _timeout_s=timeout_s, _what=what, _meter=meter,
                   _start=start, _bytes_sent=bytes_sent)

    def poll(self) -> bool:
        """Whether ``wait()`` would return without blocking (BlueFog's ``poll``)."""
        return self._result is not None or all(work.is_completed() for _, _, work in self._works)

    def wait(self, deadline: float | None = None) -> torch.Tensor:
        """The result, once every message is done; ``deadline`` (``time.monotonic()``) caps the
        wait below the handle's own timeout."""
        if self._result is not None:
            return self._result
        wait_works(self._works, what=self._what, timeout_s=self._timeout_s, deadline=deadline)
        self._works = []
        assert self._finish is not None
        self._result = self._finish()
        if self._meter is not None:
            self._meter.record(self._start, time.perf_counter(), self._bytes_sent)
        return self._result

#: dtypes gloo's collectives (broadcast, all-reduce, all-gather) accept; measured on torch 2.14.
#: Point-to-point sends move raw bytes and take every dtype.
GLOO_COLLECTIVE_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
})


#: dtypes gloo's collectives refuse, each carried as a wider integer dtype they accept that
#: holds every value exactly (widened before, narrowed after). BlueFog broadcasts and gathers
#: int16; uint64 and float8 have no exact carrier and are refused.
GLOO_CARRIERS = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def collective_dtype(tensor: torch.Tensor, what: str, group: Group = None) -> torch.dtype:
    """The dtype ``tensor`` travels as in a collective: its own, or under gloo the exact
    carrier of ``GLOO_CARRIERS``.

    Any other dtype gloo refuses raises ``TypeError`` before anything is sent: gloo fails
    it with "Invalid scalar type" and can leave the process group unusable; every rank
    calls with the same dtype, so every rank raises at once.
    """
    if not is_gloo(group) or tensor.dtype in GLOO_COLLECTIVE_DTYPES:
        return tensor.dtype
    if tensor.dtype in GLOO_CARRIERS:
        return GLOO_CARRIERS[tensor.dtype]
    allowed = ", ".join(sorted(str(d).removeprefix("torch.") for d in {*GLOO_COLLECTIVE_DTYPES, *GLOO_CARRIERS}))
    raise TypeError(f"{what}: dtype {tensor.dtype} is not supported by the gloo backend's collectives "
                    f"(supported: {allowed}); cast the tensor first")


def _is_timeout(exc: BaseException) -> bool:
    """Whether a backend error is a deadline (the peer never came), not a local failure."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or "deadline" in text


def completed(result: torch.Tensor) -> Handle:
    """A handle whose result is already there (single process, nothing to exchange)."""
    return Handle(_result=result)


def exchange(tensor: torch.Tensor, sends: Mapping[int, float], recvs: Sequence[int], group: Group,
             finish: Callable[[list[torch.Tensor]], torch.Tensor], *, timeout_s: float, what: str,
             meter: CommMeter | None = None, recv_buffers: Sequence[torch.Tensor] | None = None,
             tag: int = 0) -> Handle:
    """Send ``tensor × sends[k]`` to each group rank k, receive one tensor from each of ``recvs``.

    ``finish(received)`` runs in ``wait()``; ranks are ranks *in the group*. Scaled
    copies are made once per distinct scale (a plain list of destinations sends
    ``tensor`` itself, no copy). ``recv_buffers`` (one per source, like ``tensor``) lets a
    caller that exchanges every step reuse its buffers instead of faulting in fresh pages.
    ``tag``: as ``exchange_tensors``'s.
    """
    start = time.perf_counter()
    tensor = tensor.contiguous()
    scaled: dict[float, torch.Tensor] = {}
    outgoing: list[tuple[int, torch.Tensor]] = []
    for peer, scale in sends.items():
        if scale not in scaled:
            scaled[scale] = tensor if scale == 1.0 else tensor * scale
        outgoing.append((peer, scaled[scale]))
    if recv_buffers is not None and len(recv_buffers) != len(recvs):
        raise ValueError(f"{len(recv_buffers)} receive buffers for {len(recvs)} sources")
    received = list(recv_buffers) if recv_buffers is not None else [torch.empty_like(tensor) for _ in recvs]
    return exchange_tensors(outgoing, list(zip(recvs, received)), group, lambda: finish(received),
                            timeout_s=timeout_s, what=what, meter=meter, start=start, tag=tag)


def exchange_tensors(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                     group: Group, finish: Callable[[], torch.Tensor], *, timeout_s: float, what: str,
                     meter: CommMeter | None = None, start: float | None = None,
                     tag: int | Callable[[int, int], int] = 0) -> Handle:
    """Send each ``(group rank, contiguous tensor)`` of ``sends`` and receive into each buffer of
    ``recvs``, all launched at once; ``finish()`` runs in ``wait()``. The general form of
    ``exchange``, for callers that send different tensors to different peers (the
    hierarchical operation on machines of different sizes). Each message travels on the
    group of its direction where ``context.set_one_way_links`` set them, with ``tag`` (the
    same on both ends; or a function of the sender's and receiver's group ranks, the tag of
    each message): under gloo a group on several NICs sends tag t's messages on NIC t mod k
    (``GLOO_SOCKET_IFNAME``'s order), so callers spread concurrent messages over a host's
    NICs by giving them consecutive tags; NCCL ignores it. The receives are posted before the
    sends: under gloo, two ranks that both post their send to each other first swap on their
    connection one direction after the other, in twice the time (``docs/design-notes.md``,
    "Receives before sends")."""
    start = time.perf_counter() if start is None else start
    me = dist.get_rank(group)

    def tag_of(src: int, dst: int) -> int:
        return tag(src, dst) if callable(tag) else tag

    batches: dict[Group, list[tuple[dist.P2POp, tuple[str, int]]]] = {}   # one batch per group
    for peer, buffer in recvs:
        link = one_way_link(group, peer, me)
        op = dist.P2POp(dist.irecv, buffer, group=link, tag=tag_of(peer, me), group_peer=peer)
        batches.setdefault(link, []).append((op, ("receiving from", peer)))
    for peer, tensor in sends:
        link = one_way_link(group, me, peer)
        op = dist.P2POp(dist.isend, tensor, group=link, tag=tag_of(me, peer), group_peer=peer)
        batches.setdefault(link, []).append((op, ("sending to", peer)))
    labels = [label for batch in batches.values() for _, label in batch]
    try:
        works = [work for batch in batches.values() for work in dist.batch_isend_irecv([op for op, _ in batch])]
    except RuntimeError as exc:   # a peer's connection is already gone (it crashed or exited)
        peers = ", ".join(f"{kind} rank {peer}" for kind, peer in labels)
        raise TopologyError(f"rank {dist.get_rank()}: {what} could not start ({peers}): "
                            f"{str(exc).splitlines()[0][:200]}") from exc
    return Handle.launched([(kind, peer, work) for (kind, peer), work in zip(labels, works)], finish,
                           what=what, timeout_s=timeout_s, meter=meter, start=start,
                           bytes_sent=sum(t.numel() * t.element_size() for _, t in sends))
