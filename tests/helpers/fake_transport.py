"""An in-process fake of DiLoCo's transport (``syncplane.algorithms.diloco.transport``): n ranks'
engines run in n threads of one process and meet on a shared ``Wire``, with real tensor math,
so that the round logic (layouts, fragments, overlap, codecs and their error feedback, commit or
discard, the outer rule) is tested without processes, as torchft's tests mock its Manager.

``run_ranks(fn, world, *args)`` calls ``fn(transport, rank, world, *args)`` on every rank and
returns the results in rank order (the first rank's exception re-raised). What the fake does:

- an exchange is its pattern's arithmetic. The mesh (``syncplane.exchanges.mesh``): each member
  encodes each owner's segment with its own error feedback, the owner decodes the segments in
  member order, divides once and encodes the mean again with a second residual, and every
  member decodes every owner's mean (two quantizations a round, as on the wire). Any other
  pattern plays the gather's (``syncplane.exchanges.gather``): each member encodes its slice
  once (values from the pattern's ``exact_from`` on as fp32), every member decodes all pieces
  in member order into zeros and divides once. Either way the same mean on every member;
  ``Wire.fail`` discards chosen rounds on every member (residuals restored).
- ``groups``/``all_gather``/``all_reduce``: the members' tensors, in group order.
- ``wrap``: the module itself for a DDP node (the driver keeps a node's ranks alike, as DDP's
  gradient mean would); FSDP2 is not played (real gloo tests cover it).

What crosses the wire (gloo streams, NICs, deadlines, the patterns' routes) is not here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from syncplane.comm.codecs import Codec, ErrorFeedback, Fp32, Undo, add_extracted_
from syncplane.comm.meter import CommMeter
from syncplane.comm.streams import StreamExchange
from syncplane.exchanges.mesh import MeshExchange


class Wire:
    """Where n threads' collectives meet: the k-th call of each member on a set of ranks is one
    collective. ``fail(members, round)``: True discards that exchange round (0-based, per set)."""

    def __init__(self, world: int, timeout_s: float = 60.0) -> None:
        self.world, self.timeout_s = world, timeout_s
        self.fail: Callable[[tuple[int, ...], int], bool] = lambda members, round_: False
        self._cond = threading.Condition()
        self._slots: dict[tuple[Any, ...], dict[int, Any]] = {}
        self.broken: BaseException | None = None

    def meet(self, key: tuple[Any, ...], members: tuple[int, ...], rank: int, value: Any) -> list[Any]:
        """Every member's ``value`` under ``key``, in member order (blocks until all gave theirs)."""
        with self._cond:
            slot = self._slots.setdefault(key, {})
            slot[rank] = value
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(slot) == len(members) or self.broken is not None,
                                       timeout=self.timeout_s):
                raise TimeoutError(f"rank {rank}: {key} waited {self.timeout_s} s for ranks "
                                   f"{sorted(set(members) - set(slot))}")
            if self.broken is not None:
                raise RuntimeError(f"rank {rank}: another rank failed") from self.broken
            return [slot[m] for m in members]


class FakeGroup:
    """A set of ranks and its count of collectives so far on this rank."""

    def __init__(self, members: Sequence[int]) -> None:
        self.members, self.calls = tuple(members), 0
        self.members_key: tuple[Any, ...] = self.members

    def key(self, kind: str) -> tuple[Any, ...]:
        self.calls += 1
        return (kind, self.members_key, self.calls)


class FakeRunner:
    """``StreamRunner``'s interface over a ``Wire`` (the patterns' arithmetic: module doc)."""

    def __init__(self, wire: Wire, rank: int, group: FakeGroup, exchange: StreamExchange, codec: Codec,
                 error_feedback_beta: float) -> None:
        exchange.check(len(group.members))
        self.wire, self.me, self.group, self.codec, self.beta = wire, rank, group, codec, error_feedback_beta
        self.exchange = exchange
        self.exact_from: int | None = getattr(exchange, "exact_from", None)
        self.feedback: tuple[ErrorFeedback, ...] = ()
        self.rounds = 0
        self.streams = exchange.streams

    def _error_feedback(self, total: int) -> tuple[ErrorFeedback, ...]:
        """One residual of ``total`` values per slot the pattern declares (none kept for exact fp32)."""
        if not self.feedback or self.feedback[0].residual.numel() not in (0, total):
            size = 0 if isinstance(self.codec, Fp32) else total
            slots = max(1, self.exchange.feedback_slots)
            self.feedback = tuple(ErrorFeedback(self.codec, size, self.beta) for _ in range(slots))
        return self.feedback

    def allreduce_mean_(self, flat: torch.Tensor, meter: CommMeter | None = None, *,
                        offset: int = 0, total: int | None = None) -> bool:
        members = self.group.members
        if len(members) == 1:
            return True
        undo = Undo()
        feedback = [undo.recording(f) for f in self._error_feedback(flat.numel() if total is None else total)]
        if isinstance(self.exchange, MeshExchange):
            mean, sent = self._mesh(flat, offset, feedback)
        else:
            mean, sent = self._gather(flat, offset, feedback[0])
        failed = self.wire.fail(members, self.rounds)
        self.rounds += 1
        if meter is not None:
            meter.record(0.0, 0.0, sent)
        if failed:
            undo.restore()
            return False
        flat.copy_(mean)
        return True

    def _gather(self, flat: torch.Tensor, offset: int, feedback: Any) -> tuple[torch.Tensor, int]:
        members = self.group.members
        cut = flat.numel() if self.exact_from is None else min(flat.numel(), max(0, self.exact_from - offset))
        coded = feedback.compress(flat[:cut], offset).clone() if cut else None
        mine = (coded, flat[cut:].clone())
        pieces = self.wire.meet(self.group.key("exchange"), members, self.me, mine)
        out = torch.zeros_like(flat)
        for data, exact in pieces:
            if data is not None:
                out[:cut].add_(self.codec.extract(data, cut))
            out[cut:].add_(exact)
        return out.div_(len(members)), sum(p.numel() * p.element_size() for p in mine if p is not None)

    def _mesh(self, flat: torch.Tensor, offset: int, feedback: list[Any]) -> tuple[torch.Tensor, int]:
        """``MeshExchange.run``'s arithmetic: segments encoded on the way in, the owner's mean
        summed in member order and encoded once more on the way out."""
        members, codec = self.group.members, self.codec
        n, me = len(members), members.index(self.me)
        local, owner = feedback
        segments = [seg for stream in self.exchange.segments(flat.numel(), n) for seg in enumerate(stream)]
        mine = {(i, o): local.compress(flat[lo:hi], offset + lo).clone()
                for i, (o, (lo, hi)) in enumerate(segments) if hi > lo}
        scattered = self.wire.meet(self.group.key("scatter"), members, self.me, mine)
        means = {}
        for i, (o, (lo, hi)) in enumerate(segments):
            if o != me or hi == lo:
                continue
            acc = codec.extract(scattered[0][i, o], hi - lo).clone()
            for part in scattered[1:]:
                add_extracted_(codec, part[i, o], acc)
            means[i] = owner.compress(acc.div_(n), offset + lo).clone()
        gathered = self.wire.meet(self.group.key("gather"), members, self.me, means)
        out = torch.empty_like(flat)
        for i, (o, (lo, hi)) in enumerate(segments):
            if hi > lo:
                codec.extract(gathered[o][i], hi - lo, out=out[lo:hi])
        return out, self.exchange.bytes_per_round(flat.numel(), codec, me, n)

    def state_dict(self) -> dict[str, Any]:
        if not self.feedback or not self.feedback[0].residual.numel():
            return {}
        return {"residuals": torch.stack([f.residual.clone() for f in self.feedback])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "residuals" in state:
            for feedback, saved in zip(self._error_feedback(state["residuals"].shape[1]), state["residuals"]):
                feedback.restore(saved)

    def close(self) -> None:
        pass


class FakeTransport:
    """One rank's view of the ``Wire`` (``transport.Transport``)."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank = wire, rank
        self._groups: dict[tuple[int, ...], FakeGroup] = {}
        self._runners: dict[tuple[int, ...], int] = {}   # runners built over each set of members

    def _group(self, members: Sequence[int]) -> FakeGroup:
        members = tuple(members)
        return self._groups.setdefault(members, FakeGroup(members))

    def runner(self, exchange: StreamExchange, *, codec: Codec, error_feedback_beta: float,
               members: Sequence[int] | None = None, **_: Any) -> FakeRunner:
        group = FakeGroup(range(self.wire.world) if members is None else members)
        built = self._runners[group.members] = self._runners.get(group.members, 0) + 1
        group.members_key = (group.members, built)   # a runner's own rounds, apart from earlier runners'
        return FakeRunner(self.wire, self.rank, group, exchange, codec, error_feedback_beta)

    def groups(self, sets: Sequence[Sequence[int]], backend: str) -> dict[int, FakeGroup]:
        return {i: self._group(sorted(s)) for i, s in enumerate(sets) if self.rank in s}

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: FakeGroup) -> None:
        parts = self.wire.meet(group.key("all_gather"), group.members, self.rank, tensor.clone())
        torch.cat(parts, out=out)

    def all_reduce(self, tensor: torch.Tensor, group: FakeGroup) -> None:
        parts = self.wire.meet(group.key("all_reduce"), group.members, self.rank, tensor.clone())
        tensor.copy_(sum(parts[1:], parts[0].clone()))

    def wrap(self, module: torch.nn.Module, group: FakeGroup, sharded: bool, device: str,
             device_ids: list[int] | None) -> torch.nn.Module:
        if sharded:
            raise NotImplementedError("the in-process fake does not play FSDP2 (inner='fsdp'): use real gloo ranks")
        return module


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """``fn(transport, rank, world, *args)`` on ``world`` threads meeting on one ``Wire``."""
    wire = Wire(world, timeout_s)
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def body(rank: int) -> None:
        try:
            results[rank] = fn(FakeTransport(wire, rank), rank, world, *args)
        except BaseException as exc:   # re-raised below, in the caller's thread
            errors[rank] = exc
            with wire._cond:
                wire.broken = wire.broken or exc
                wire._cond.notify_all()

    threads = [threading.Thread(target=body, args=(r,), name=f"fake-rank{r}") for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s * 4)
    first = next((e for e in errors if e is not None and not isinstance(e.__cause__, BaseException)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks {[r for r, t in enumerate(threads) if t.is_alive()]} did not finish")
    return results
