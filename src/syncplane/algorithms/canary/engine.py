"""Canary's piece-level gradient exchange (paper 004, §4.3.3 and the mesh algorithm of §4.4).

Each colayer (a group of gradients, in backward order) is cut into n pieces for n ranks;
piece j of every rank goes, compressed, to rank j; rank j decodes the n contributions,
sums them in rank order, averages, re-encodes the reduced piece and sends it to every
rank. Error feedback on both compressions: each rank keeps what its own pieces lost, each
owner what its re-encoded piece lost (residuals per position of the whole gradient, so
every colayer keeps its own). All of that is the transport's piece layout
(``syncplane.comm.StreamRunner`` over ``syncplane.exchanges.MeshExchange(layout="pieces")``: piece j travels on the gloo group
of NIC ``j mod k``); the engine owns the colayers, their positions and their residuals.

Colayers in flight: a transport with ``lanes`` > 1 (``exchange.Lanes``) runs that many
colayers at once, each lane on its own gloo groups and its own worker thread; colayer i
always takes lane ``i mod lanes``, so every rank runs the same sequence of exchanges on each
lane, and colayer k+1 is encoded (and takes its in-host hop) while colayer k is on the wire.

Lightning-free, and the transport is injected, so tests run it on any exchange that has
``allreduce_mean_(flat, meter, offset=, total=)`` (and ``lane=`` with ``lanes`` > 1),
``state_dict`` and ``load_state_dict``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import torch

from syncplane.algorithms.canary.gei import GEI
from syncplane.comm import CommMeter
from syncplane.config import ConfigError

log = logging.getLogger(__name__)


class Transport(Protocol):
    """What the engine needs from the piece-level mesh exchange."""

    def allreduce_mean_(self, flat: torch.Tensor, meter: CommMeter | None = None, *,
                        offset: int = 0, total: int | None = None) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class ExchangeFailed(RuntimeError):
    """A colayer's exchange was discarded on every rank (a peer failed or timed out). Canary
    does not step on a local gradient (replicas would drift apart): the step fails."""


class CanaryEngine:
    """Averages colayers of a fixed layout through the piece-level exchange.

    Args:
        colayer_sizes: element count of every colayer, in exchange (backward) order.
        pieces: pieces per colayer (the world size: piece j is owned by rank j).
        transport: the exchange (``MeshExchange(layout="pieces")`` on a ``StreamRunner`` in production).
    """

    def __init__(self, colayer_sizes: Sequence[int], pieces: int, transport: Transport) -> None:
        if pieces < 1:
            raise ConfigError(f"pieces: must be at least 1, got {pieces}")
        # the cube and nested exchanges cut a colayer into one piece per rank and part
        needed = int(getattr(getattr(transport, "exchange", None), "parts", 1)) * pieces
        for i, size in enumerate(colayer_sizes):
            if size < needed:
                raise ConfigError(f"pieces: {needed} pieces per colayer exceed colayer {i}'s "
                                  f"{size} elements; give it more parameters (a larger bucket_cap_mb) or use "
                                  f"fewer ranks")
        self.sizes = list(colayer_sizes)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self.pieces = pieces
        self.transport = transport
        self.rounds = 0
        self.lanes = max(1, int(getattr(transport, "lanes", 1)))
        self._workers: list[ThreadPoolExecutor] = []

    def submit(self, index: int, fn: Callable[..., torch.Tensor], *args: Any) -> Future[torch.Tensor]:
        """Run ``fn(*args)`` -- colayer ``index``'s exchange -- on the worker of its lane
        (``index mod lanes``): a lane takes its colayers in the order they are submitted."""
        if not self._workers:
            self._workers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"canary-lane{lane}")
                             for lane in range(self.lanes)]
        return self._workers[index % self.lanes].submit(fn, *args)

    def shutdown(self) -> None:
        """Wait for the exchanges submitted so far and stop the lane workers (a later
        ``submit`` starts new ones)."""
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.shutdown(wait=True)

    def exchange_(self, index: int, flat: torch.Tensor, meter: CommMeter | None = None) -> None:
        """Replace colayer ``index``'s flat fp32 CPU gradient by its mean over all ranks
        (through the compressed pieces); raises ``ExchangeFailed`` if it was discarded."""
        if flat.numel() != self.sizes[index]:
            raise ValueError(f"colayer {index} has {self.sizes[index]} elements, got a buffer of {flat.numel()}")
        lane = {"lane": index % self.lanes} if self.lanes > 1 else {}
        if not self.transport.allreduce_mean_(flat, meter, offset=self.offsets[index], total=self.total, **lane):
            detail = getattr(self.transport, "last_error", None)
            raise ExchangeFailed(f"canary: the exchange of colayer {index} was discarded on every rank"
                                 + (f" ({detail})" if detail else ""))

    def exchange_all_(self, colayers: Sequence[torch.Tensor], meter: CommMeter | None = None) -> None:
        """Every colayer in order (one step), ``lanes`` of them in flight at once; raises the
        first failed colayer's error once every exchange is over."""
        if len(colayers) != len(self.sizes):
            raise ValueError(f"expected {len(self.sizes)} colayers, got {len(colayers)}")
        if self.lanes == 1:
            for index, flat in enumerate(colayers):
                self.exchange_(index, flat, meter)
        else:
            futures = [self.submit(index, self._exchanged, index, flat, meter) for index, flat in enumerate(colayers)]
            wait(futures)
            for future in futures:
                future.result()
        self.rounds += 1

    def _exchanged(self, index: int, flat: torch.Tensor, meter: CommMeter | None) -> torch.Tensor:
        self.exchange_(index, flat, meter)
        return flat

    def state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals (per-rank state: each rank saves its own)."""
        return {"sizes": list(self.sizes), "exchange": self.exchange, "transport": self.transport.state_dict()}

    @property
    def exchange(self) -> str:
        """The exchange's shape, e.g. ``NestedExchange[4, 2]``: residuals are kept per
        position of the buffer and per hop of one shape (own pieces, relayed sums, owned
        means), and mean nothing to another shape; the stream or NIC count does not matter."""
        pattern = getattr(self.transport, "exchange", self.transport)
        radices = getattr(pattern, "radices", None)
        return type(pattern).__name__ + (f"{radices}" if radices is not None else "")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state.get("sizes", self.sizes)) != self.sizes:
            log.warning("canary: the checkpoint's colayers %s differ from this model's %s; "
                        "error-feedback residuals start from zero", state.get("sizes"), self.sizes)
            return
        if state.get("exchange", self.exchange) != self.exchange:
            log.warning("canary: the checkpoint was written with the exchange %s, this job runs %s; "
                        "error-feedback residuals start from zero", state.get("exchange"), self.exchange)
            return
        self.transport.load_state_dict(state.get("transport", {}))


class BackwardPipeline:
    """Exchanges colayers on the engine's lane workers while the backward goes on.

    The glue calls ``begin()`` when a step starts, ``ready(i)`` when colayer i's gradients
    are all produced; colayers are handed to the worker strictly in index order (a colayer
    that completes early waits for the ones before it), so every rank runs the same
    sequence of exchanges whatever the timing. ``end_backward()`` hands over whatever is
    left of the step (unused parameters never report ready).

    Synchronous (no ``gei``): ``finish()`` ends the backward and returns every colayer's
    averaged values. Bounded staleness (a ``GEI``): ``settle()`` returns the aggregate due
    at this step -- that of step ``k - s``, only the colayers the GEI agreed on -- while
    later steps' exchanges go on; what this rank sent in a dropped colayer is added to that
    colayer's next exchange.

    Args:
        engine: the exchange (colayer layout, transport).
        pack: colayer index -> its flat fp32 CPU gradient (may return the same buffer
            every step). Synchronous: called on the worker thread; stale: when the colayer
            is handed over (copied, since the next backward overwrites the gradients).
        meter: where the exchanges are counted.
        gei: the staleness bookkeeping (None: synchronous).
    """

    def __init__(self, engine: CanaryEngine, pack: Callable[[int], torch.Tensor],
                 meter: CommMeter | None = None, gei: GEI | None = None) -> None:
        self.engine, self._pack, self._meter, self.gei = engine, pack, meter, gei
        self._lock = threading.Lock()
        self._done: set[int] = set()
        self._next = 0
        self._step = -1
        self._futures: list[Future[torch.Tensor]] = []
        self._results: dict[tuple[int, int], torch.Tensor] = {}
        self._sent: dict[tuple[int, int], torch.Tensor] = {}
        self._settled = -1                  # every step up to this one has been settled
        self._late: set[tuple[int, int]] = set()   # dropped before this rank had sent them
        self.carry: dict[int, torch.Tensor] = {}   # colayer -> what dropped exchanges did not deliver
        self.early = 0   # colayers handed over during the backward (before the end), in total

    @property
    def stale(self) -> bool:
        return self.gei is not None and self.gei.staleness_bound > 0

    def begin(self) -> int:
        """A step starts (publishes it on the GEI's board); returns its index."""
        with self._lock:
            self._step = self.gei.enter() if self.gei is not None else self._step + 1
            return self._step

    def ready(self, index: int) -> None:
        """Colayer ``index`` is complete (thread-safe; autograd may call it from its threads)."""
        with self._lock:
            self._done.add(index)
            self._submit_in_order(stop_at_gap=True)

    def end_backward(self) -> None:
        """Hand over the rest of this step's colayers."""
        with self._lock:
            self._submit_in_order(stop_at_gap=False)
            self._done.clear()
            self._next = 0

    def finish(self) -> list[torch.Tensor]:
        """Synchronous: every colayer's averaged values, in order (submits the rest, waits)."""
        if self.gei is not None:
            raise RuntimeError("a pipeline with a GEI is settled with settle()")
        self.end_backward()
        with self._lock:
            futures, self._futures = self._futures, []
        return [f.result() for f in futures]

    def settle(self) -> tuple[int, dict[int, torch.Tensor]] | None:
        """The aggregate due at this step: (its step, colayer -> averaged values), or None
        in the first s steps (nothing produced s steps ago yet)."""
        assert self.gei is not None, "settle() needs a GEI"
        due = self.gei.due(self._step)
        if due is None:
            return None
        decided = self.gei.settle(due)
        with self._lock:
            self._settled = due
            out = {i: self._results.pop((due, i)) for i in range(len(self.engine.sizes)) if decided >> i & 1}
            for i in range(len(self.engine.sizes)):
                self._results.pop((due, i), None)
                sent = self._sent.pop((due, i), None)
                if not decided >> i & 1:
                    if sent is not None:
                        self._keep(i, sent)
                    else:
                        self._late.add((due, i))
            self._futures = [f for f in self._futures if not f.done()]
        return due, out

    def unapplied(self) -> dict[tuple[int, int], torch.Tensor]:
        """(step, colayer) -> averaged values that arrived but are not settled yet (after
        ``close``: the last s steps, whose aggregates training never applies)."""
        with self._lock:
            return dict(self._results)

    def drain(self) -> None:
        """Wait for every exchange handed over so far (a collective in effect: every rank
        handed over the same ones), without applying anything: a checkpoint then holds
        every aggregate in flight, and the residuals no worker is still writing."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.result()

    def unsettled(self) -> dict[int, dict[int, torch.Tensor]]:
        """After ``drain``, between steps: the aggregates exchanged but not applied yet, by how
        many steps before the next one they were made (0: the last step's) -> colayer ->
        averaged values. The same on every rank (what a resume must apply first)."""
        with self._lock:
            out: dict[int, dict[int, torch.Tensor]] = {}
            for (step, index), values in sorted(self._results.items()):
                out.setdefault(self._step - step, {})[index] = values.clone()
            return out

    def restore_unsettled(self, pending: Mapping[int, Mapping[int, torch.Tensor]]) -> None:
        """Before the first step after a resume: the checkpoint's ``unsettled`` aggregates
        become this pipeline's steps -1, -2, ..., which the GEI makes due first, exactly when
        the run that wrote the checkpoint would have applied them."""
        assert self.gei is not None, "only a stale pipeline leaves aggregates unsettled"
        with self._lock:
            if self._step != -1:
                raise RuntimeError("restore_unsettled() must come before the first step")
            for back, colayers in pending.items():
                step = -1 - int(back)
                mask = 0
                for index, values in colayers.items():
                    self._results[step, int(index)] = values
                    mask |= 1 << int(index)
                self.gei.restored(step, mask)

    def _keep(self, index: int, sent: torch.Tensor) -> None:
        """A dropped colayer: what this rank sent goes out again with its next exchange."""
        self.carry[index] = self.carry[index] + sent if index in self.carry else sent

    def close(self) -> None:
        """Wait for the exchanges in flight (every rank submitted the same ones) and stop."""
        self.engine.shutdown()

    def _submit_in_order(self, stop_at_gap: bool) -> None:
        while self._next < len(self.engine.sizes) and (self._next in self._done or not stop_at_gap):
            # stale: pack now -- the gradients are overwritten by the next step's backward
            # before the worker may reach this exchange
            packed = self._pack(self._next).clone() if self.stale else None
            self._futures.append(self.engine.submit(self._next, self._exchange, self._step, self._next, packed))
            self._next += 1
            self.early += stop_at_gap

    def _exchange(self, step: int, index: int, packed: torch.Tensor | None) -> torch.Tensor:
        flat = self._pack(index) if packed is None else packed
        with self._lock:
            carried = self.carry.pop(index, None)
        if carried is not None:
            flat += carried
        if self.stale and self.gei is not None and self.gei.proportion_bound is not None:
            with self._lock:
                self._sent[step, index] = flat.clone()   # re-sent if the colayer is dropped
        try:
            self.engine.exchange_(index, flat, self._meter)
        except BaseException as exc:
            if self.gei is not None:
                self.gei.fail(step, exc)
            raise
        if self.gei is not None:
            with self._lock:
                if step > self._settled:
                    self._results[step, index] = flat
                elif (step, index) in self._late:        # dropped while still queued here
                    self._late.discard((step, index))
                    self._keep(index, self._sent.pop((step, index)))
            self.gei.arrived(step, index)
        return flat
